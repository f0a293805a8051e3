"""A GEM-like ranking model: a jagged user-history tower, pooling, interaction, two task heads.

Reading ``forward`` top to bottom:

1. **Embeddings.** History events (item, action, category, time bucket) become one vector per
   token, concatenated and projected to ``d_model``. The candidate ad's three features (ad,
   ad category, advertiser) become three tokens projected likewise. User id and segments are
   pooled bags.
2. **Sequence tower.** ``n_layers`` pre-norm blocks of jagged causal self-attention with a
   relative bias (or BlockAttention) and a SwiGLU or MoE feed-forward; the history is never
   padded unless ``model.attention=padded``. With ``model.attention=flex`` (the native anchor)
   the tower's forward builds the batch's FlexAttention masks once and hands them to every layer.
3. **Pooling.** PMA: ``S`` learned seeds attend over the final history with GDPA; and the
   candidate's tokens cross-attend to the history with GDPA, which is where the model can tell
   whether this ad matches what the user has been doing.
4. **Interaction.** Everything is concatenated, projected, and crossed by DCN-v2 layers
   (``x_{l+1} = x_0 ⊙ (W_l x_l + b_l) + x_l``), then an MLP.
5. **Heads.** CTR and CVR logits, trained with binary cross-entropy on click and conversion.

``GemModel`` = the two embedding collections + ``DenseTower`` (steps 1's projections to 5). The
split is where parallelism attaches: ``gem_parallel.shard_embeddings`` replaces the collections,
``gem_parallel.apply_dense_parallel`` shards the tower with FSDP2 (each block and pooling layer a
unit). The model itself holds no parallelism.
"""

import torch
import torch.nn.functional as F
from gem_jagged import JaggedBatch
from torch import nn

from gem_train.config import ModelConfig
from gem_train.data.batch import CANDIDATE_FEATURES, SEQUENCE_FEATURES, Batch
from gem_train.model.attention import CandidateCrossAttention, PMAPooling
from gem_train.model.blocks import Block
from gem_train.model.embeddings import build_embeddings, lookup
from gem_train.model.flex import FlexMasks
from gem_train.model.norm import RMSNorm

TASKS = ("ctr", "cvr")
LABEL_OF = {"ctr": "click", "cvr": "conversion"}


class CrossLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x0, x):
        return x0 * self.linear(x) + x


class InputProjection(nn.Module):
    """History tokens ``[T, 4E]`` → ``[T, D]``; candidate tokens ``[B, C, E]`` → ``[B, C, D]``."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.tokens = nn.Linear(len(SEQUENCE_FEATURES) * m.emb_dim, m.d_model)
        self.candidate = nn.Linear(m.emb_dim, m.d_model)

    def forward(self, tokens_TF, candidate_BCE):
        return self.tokens(tokens_TF), self.candidate(candidate_BCE)


class Interaction(nn.Module):
    """Concatenated features → DCN-v2 cross layers → MLP → one logit per task ``[B, tasks]``."""

    def __init__(self, m: ModelConfig, in_features: int):
        super().__init__()
        self.project = nn.Linear(in_features, m.mlp_hidden)
        self.crosses = nn.ModuleList(CrossLayer(m.mlp_hidden) for _ in range(m.interaction_layers))
        self.mlp = nn.Sequential(nn.Linear(m.mlp_hidden, m.mlp_hidden), nn.SiLU())
        self.heads = nn.ModuleDict({task: nn.Linear(m.mlp_hidden, 1) for task in TASKS})

    def forward(self, features_BF):
        x0 = h = self.project(features_BF)
        for layer in self.crosses:
            h = layer(x0, h)
        h = self.mlp(h)
        return torch.cat([self.heads[task](h) for task in TASKS], dim=1)  # [B, tasks]


class DenseTower(nn.Module):
    """Everything after the embedding lookups; what FSDP shards and AutoAC plans."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        d, e, n_cand = m.d_model, m.emb_dim, len(CANDIDATE_FEATURES)
        self.config = m
        self.inputs = InputProjection(m)
        self.blocks = nn.ModuleList(Block(m) for _ in range(m.n_layers))
        self.final_norm = RMSNorm(d)
        self.pma = PMAPooling(d, m.n_heads, m.pma_seeds, kind=m.pooling_attention)
        self.cross = CandidateCrossAttention(d, m.n_heads, kind=m.pooling_attention)
        self.interaction = Interaction(m, m.pma_seeds * d + n_cand * d + n_cand * e + 2 * e)

    def flex_masks(self, layout: JaggedBatch, *, total: int, candidates: int) -> FlexMasks | None:
        """The batch's FlexAttention masks, built once for every layer that uses flex (one
        ``create_block_mask`` per mask), or None when no layer does."""
        m = self.config
        pooling = m.pooling_attention == "flex"
        if m.attention != "flex" and not pooling:
            return None
        return FlexMasks(
            layout.offsets, total=total, seeds=m.pma_seeds if pooling else 0,
            candidates=candidates if pooling else 0, history=m.attention == "flex",
            backend=m.flex_backend, bwd_stages=m.flex_bwd_stages,
        )  # fmt: skip

    def forward(self, seq: dict, pooled: dict, layout: JaggedBatch, max_len: int) -> torch.Tensor:
        """Logits ``[B, len(TASKS)]`` (a fresh tensor, not a view: FSDP hooks its output).
        ``layout`` is the history's ``JaggedBatch``, shared by every attention layer."""
        history = torch.cat([seq[f] for f in SEQUENCE_FEATURES], dim=-1)  # [T, 4E]
        candidate = torch.stack([seq[f] for f in CANDIDATE_FEATURES], dim=1)  # [B, C, E]
        x, cand = self.inputs(history, candidate)
        masks = self.flex_masks(layout, total=x.shape[0], candidates=candidate.shape[1])
        for block in self.blocks:
            x = block(x, layout, max_len, masks)
        x = self.final_norm(x)
        pma = self.pma(x, layout, max_len, masks)  # [B, S, D]
        cross = self.cross(cand, x, layout, max_len, masks)  # [B, C, D]
        features = torch.cat(
            [
                pma.flatten(1),
                cross.flatten(1),
                candidate.flatten(1),
                pooled["user"],
                pooled["segments"],
            ],
            dim=-1,
        )
        return self.interaction(features)


class GemModel(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.config = m
        self.sequence_embeddings, self.pooled_embeddings, self.embedding_backend = build_embeddings(
            m
        )
        self.dense = DenseTower(m)

    def embed(self, batch: Batch) -> tuple[dict, dict]:
        """``({feature: [T or B, E]}, {"user": [B, E], "segments": [B, E]})``."""
        per_sample = torch.arange(batch.num_samples + 1, device=batch.offsets.device)
        seq = lookup(
            self.sequence_embeddings,
            self.embedding_backend,
            {f: (getattr(batch, f), batch.offsets) for f in SEQUENCE_FEATURES}
            | {f: (getattr(batch, f), per_sample) for f in CANDIDATE_FEATURES},
            pooled=False,
        )
        pooled = lookup(
            self.pooled_embeddings,
            self.embedding_backend,
            {"user": (batch.user, per_sample), "segments": (batch.segments, batch.segment_offsets)},
            pooled=True,
        )
        return seq, pooled

    def forward(self, batch: Batch, max_len: int | None = None) -> dict[str, torch.Tensor]:
        """Logits ``{"ctr": [B], "cvr": [B]}``. ``max_len`` (the longest history) saves a sync."""
        if max_len is None:
            max_len = int(batch.lengths.max()) if batch.num_samples else 0
        seq, pooled = self.embed(batch)
        layout = batch.layout
        if layout is None:  # a batch that was not moved with Batch.to: check it here
            layout = JaggedBatch(batch.offsets, max_len=max_len)
        logits = self.dense(seq, pooled, layout, max_len)
        return {task: logits[:, i] for i, task in enumerate(TASKS)}


def loss_of(
    logits: dict[str, torch.Tensor], batch: Batch
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of the tasks' mean BCE losses, and each task's loss (detached).

    Labels beyond the logits' length (padding samples the caller sliced off) are ignored.
    """
    per_task = {
        task: F.binary_cross_entropy_with_logits(
            logits[task].float(), getattr(batch, LABEL_OF[task])[: logits[task].shape[0]]
        )
        for task in TASKS
    }
    return sum(per_task.values()), {t: v.detach() for t, v in per_task.items()}

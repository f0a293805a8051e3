"""The model's three attentions over the jagged history, each in a jagged, a flex and a padded form.

- ``HistorySelfAttention``: causal softmax attention of the history over itself with a learned
  relative-position bias (``gem_jagged.jagged_flash_attention``), or BlockAttention with RoPE for
  long histories (``gem_jagged.block_attention``, no bias: RoPE carries position).
- ``PMAPooling``: ``S`` learned seeds attend over each history with GDPA (SiLU in place of
  softmax; ``gem_jagged.gdpa(..., broadcast_q=True)``), giving ``S`` pooled vectors per sample.
- ``CandidateCrossAttention``: the candidate ad's tokens attend over the history with GDPA.

Each takes the history's ``gem_jagged.JaggedBatch`` (``layout``): the jagged ops share its checks
and work lists; the padded forms read its offsets.

Two forms are built from PyTorch-native pieces, the benchmark's two anchors:

- ``flex``: ``torch.nn.attention.flex_attention`` on the packed history with a document (+ causal)
  ``BlockMask`` and the relative bias as a ``score_mod`` (``gem_train.model.flex``): what a careful
  torchtitan user builds. The history attention is the jagged model's function (tests compare
  them); PMA and the cross-attention are *softmax* attention there, since flex cannot apply
  GDPA's SiLU in place of the softmax, so the flex pooling is a different (native) model.
- ``padded``: pad every history to the batch's longest, then ``scaled_dot_product_attention``
  with an additive mask (the causal mask plus the relative bias), or the GDPA formula on padded
  tensors. It computes the jagged model's function exactly (tests compare the two) and is the
  baseline of the benchmark's ablation.

``gem_jagged`` picks its reference backend on CPU tensors and its Triton kernels on CUDA.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from gem_train.model.flex import FlexMasks, relative_bias_score_mod
from gem_train.model.norm import RMSNorm


def _jagged():
    try:
        import gem_jagged

        return gem_jagged
    except ImportError as exc:  # pragma: no cover - gem_jagged is a declared dependency
        raise RuntimeError("attention 'jagged' needs the gem_jagged package") from exc


def _op(name: str):
    """A public gem_jagged op, or a clear error if this build of gem_jagged lacks it."""
    try:
        return getattr(_jagged(), name)
    except (AttributeError, ImportError) as exc:
        raise RuntimeError(
            f"gem_jagged.{name} is not available in the installed gem_jagged ({exc}); "
            "use the padded attention instead (model.attention=padded / model.pooling_attention=padded)"
        ) from exc


# The most score entries (samples × heads × L²) one padded SDPA call may span; see ``_padded``.
SDPA_CALL_ELEMENTS = 2**30


def pad(
    x_TD: torch.Tensor, offsets: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged ``[T, ...]`` → padded ``[B, max_len, ...]`` (zeros) and the validity mask ``[B, L]``."""
    lengths = offsets[1:] - offsets[:-1]
    batch = lengths.numel()
    valid_BL = torch.arange(max_len, device=x_TD.device)[None, :] < lengths[:, None]
    out = x_TD.new_zeros(batch, max_len, *x_TD.shape[1:])
    out[valid_BL] = x_TD
    return out, valid_BL


def _need_masks(masks: FlexMasks | None, flag: str) -> FlexMasks:
    if masks is None:
        raise ValueError(
            f"{flag}=flex needs the batch's FlexMasks as the layer's last argument "
            "(DenseTower.forward builds them once per batch)"
        )
    return masks


def rel_bias_matrix(rel_bias_NR: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, L, L]``: ``rel_bias[n, clamp(j − i, −R, R) + R]``, looked up as T5 does (an
    embedding of the bucket) in ``dtype``. Its backward is the embedding's segment reduction;
    the plain gather ``rel_bias_NR[:, bucket]`` had an ``index_put_`` backward that adds the L²
    entries of each bucket one after another (1.3 s per call at gem-small's L on an H200). The
    result is made contiguous: SDPA's fused kernels want a mask with unit stride along keys."""
    radius = (rel_bias_NR.shape[1] - 1) // 2
    pos = torch.arange(length, device=rel_bias_NR.device)
    bucket = (pos[None, :] - pos[:, None]).clamp(-radius, radius) + radius
    return F.embedding(bucket, rel_bias_NR.t().to(dtype)).permute(2, 0, 1).contiguous()


class HistorySelfAttention(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kind: str,
        rel_bias_radius: int,
        block_size: int,
        rope_theta: float,
        schedule: str = "per_sequence",
        sdpa_call_elements: int = SDPA_CALL_ELEMENTS,
    ):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.kind, self.block_size, self.rope_theta = kind, block_size, rope_theta
        self.schedule = schedule
        self.sdpa_call_elements = sdpa_call_elements
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        # R = 0 would add one constant per head to every score, which softmax ignores: no bias
        # then, so the kernels take their no-bias paths.
        learned = kind != "block" and rel_bias_radius > 0
        self.rel_bias = (
            nn.Parameter(torch.zeros(n_heads, 2 * rel_bias_radius + 1)) if learned else None
        )

    def forward(
        self, x_TD: torch.Tensor, layout, max_len: int, masks: FlexMasks | None = None
    ) -> torch.Tensor:
        """``[T, D]`` → ``[T, D]``. ``layout``: the history's ``JaggedBatch``; ``masks``: the
        batch's ``FlexMasks`` (needed by ``kind="flex"`` only)."""
        total = x_TD.shape[0]
        q, k, v = self.qkv(x_TD).view(total, 3, self.n_heads, self.head_dim).unbind(1)
        if self.kind == "flex":
            masks = _need_masks(masks, "model.attention")
            bias = None if self.rel_bias is None else relative_bias_score_mod(self.rel_bias)
            o = masks.attend("history", q, k, v, score_mod=bias)
        elif self.kind == "jagged":
            o = _op("jagged_flash_attention")(
                q, k, v, layout, causal=True, rel_bias=self.rel_bias,
                config=self._jagged_config(q, k, layout),
            )  # fmt: skip
        elif self.kind == "block":
            o = _op("block_attention")(
                q,
                k,
                v,
                layout,
                block_size=self.block_size,
                causal=True,
                rope_theta=self.rope_theta,
            )
        else:
            o = self._padded(q, k, v, layout.offsets, max_len)
        return self.out(o.reshape(total, -1))

    def _jagged_config(self, q, k, layout):
        """None (the op's own choice) for ``per_sequence``; for ``token_tiles`` the op's choice
        with that schedule, made once per batch and kept in its ``layout``."""
        if self.schedule == "per_sequence":
            return None
        from gem_jagged.ops.jagged_flash_attention.config import Schedule, config_for_inputs

        def build():
            chosen = config_for_inputs(q, k, layout.offsets, rel_bias=self.rel_bias is not None)
            return dataclasses.replace(chosen, schedule=Schedule.TOKEN_TILES)

        key = ("gem_train.token_tiles", q.dtype, self.head_dim, self.rel_bias is not None)
        return layout.memo(key, build)

    def _padded(self, q, k, v, offsets, max_len):
        """SDPA on the batch padded to its longest history, with the causal + relative-bias mask.

        The call is split over samples and heads so that no call spans more than
        ``sdpa_call_elements`` score entries. The memory-efficient kernel (the fused one that
        takes a float mask) materialises the mask's gradient per sample and head,
        ``[B, N, L, L]``: 97 GB for one gem-small batch (80 × 8 × 8704²) in a single call, which
        died on the H200 with an illegal memory access; a call of 4 × 8 × 8704² ran clean there,
        and the split keeps every call under 2 GiB of mask gradient.
        """
        length = -(-max_len // 16) * 16  # fused kernels want 16-element-aligned mask rows
        if length == 0:
            return torch.zeros_like(q)
        (q_B, valid_BL), (k_B, _), (v_B, _) = (pad(t, offsets, length) for t in (q, k, v))
        q_B, k_B, v_B = (t.transpose(1, 2) for t in (q_B, k_B, v_B))  # [B, N, L, H]
        batch, heads = q_B.shape[:2]
        square = max(1, length * length)
        heads_per_call = max(1, min(heads, self.sdpa_call_elements // square))
        samples_per_call = max(1, self.sdpa_call_elements // (heads_per_call * square))
        causal_LL = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        causal = torch.zeros(length, length, dtype=q.dtype, device=q.device)
        causal = causal.masked_fill(~causal_LL, float("-inf"))
        by_heads = []
        for h in range(0, heads, heads_per_call):
            n = slice(h, h + heads_per_call)
            mask = causal[None]
            if self.rel_bias is not None:
                mask = mask + rel_bias_matrix(self.rel_bias[n], length, q.dtype)
            # Padding sits after the real tokens: with the causal mask no real query sees a pad key.
            by_heads.append(torch.cat([
                F.scaled_dot_product_attention(
                    q_B[b : b + samples_per_call, n], k_B[b : b + samples_per_call, n],
                    v_B[b : b + samples_per_call, n], attn_mask=mask[None],
                )
                for b in range(0, batch, samples_per_call)
            ]))  # fmt: skip
        return torch.cat(by_heads, dim=1).transpose(1, 2)[valid_BL]


def padded_gdpa(q_B, k_B, v_B, valid_q_BL, valid_k_BL, *, activation: str, scale: float):
    """GDPA on padded ``[B, L, N, H]`` tensors: ``(act(scale·QKᵀ) ⊙ mask) V``."""
    scores = torch.einsum("bqnh,bknh->bnqk", q_B, k_B) * scale
    act = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "sigmoid": torch.sigmoid}[activation]
    mask = (valid_q_BL[:, None, :, None] & valid_k_BL[:, None, None, :]).to(scores.dtype)
    return torch.einsum("bnqk,bknh->bqnh", act(scores) * mask, v_B)


class PMAPooling(nn.Module):
    """``S`` learned seeds attend over each history (GDPA, SiLU; softmax for ``kind="flex"``):
    ``[T, D]`` → ``[B, S, D]``."""

    def __init__(self, d_model: int, n_heads: int, seeds: int, *, kind: str):
        super().__init__()
        self.n_heads, self.head_dim, self.seeds, self.kind = (
            n_heads,
            d_model // n_heads,
            seeds,
            kind,
        )
        self.seed_q = nn.Parameter(torch.randn(seeds, n_heads, self.head_dim) * 0.02)
        self.kv = nn.Linear(d_model, 2 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.norm = RMSNorm(d_model)

    def forward(self, x_TD, layout, max_len, masks: FlexMasks | None = None):
        k, v = self.kv(x_TD).view(x_TD.shape[0], 2, self.n_heads, self.head_dim).unbind(1)
        offsets = layout.offsets
        batch = layout.num_seqs
        q = self.seed_q.to(k.dtype)
        if self.kind == "flex":  # softmax over each history's keys (seed row r: sample r // S)
            q_QNH = q[None].expand(batch, -1, -1, -1).reshape(batch * self.seeds, *q.shape[1:])
            o = _need_masks(masks, "model.pooling_attention").attend("pma", q_QNH, k, v)
        elif self.kind == "jagged":
            o = _op("gdpa")(q, k, v, layout, activation="silu", broadcast_q=True)
        else:
            (k_B, valid_BL), (v_B, _) = pad(k, offsets, max_len), pad(v, offsets, max_len)
            q_B = q[None].expand(batch, -1, -1, -1)
            valid_q = torch.ones(batch, self.seeds, dtype=torch.bool, device=q.device)
            o = padded_gdpa(
                q_B,
                k_B,
                v_B,
                valid_q,
                valid_BL,
                activation="silu",
                scale=1 / math.sqrt(self.head_dim),
            )
        # GDPA sums over the history without normalising; the norm keeps long and short histories
        # on one scale.
        return self.norm(self.out(o.reshape(batch, self.seeds, -1)))


class CandidateCrossAttention(nn.Module):
    """The candidate's ``C`` tokens attend over the history (GDPA, SiLU; softmax for
    ``kind="flex"``): → ``[B, C, D]``."""

    def __init__(self, d_model: int, n_heads: int, *, kind: str):
        super().__init__()
        self.n_heads, self.head_dim, self.kind = n_heads, d_model // n_heads, kind
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.kv = nn.Linear(d_model, 2 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.norm = RMSNorm(d_model)

    def forward(self, cand_BCD, x_TD, layout, max_len, masks: FlexMasks | None = None):
        batch, tokens, d = cand_BCD.shape
        q = self.q(cand_BCD).view(batch * tokens, self.n_heads, self.head_dim)
        k, v = self.kv(x_TD).view(x_TD.shape[0], 2, self.n_heads, self.head_dim).unbind(1)
        offsets = layout.offsets
        if self.kind == "flex":  # softmax over each history's keys (token r: sample r // C)
            o = _need_masks(masks, "model.pooling_attention").attend("cross", q, k, v)
        elif self.kind == "jagged":
            # [0, C, 2C, ...] built and checked on the host: no synchronisation
            candidates = layout.memo(
                ("candidates", tokens),
                lambda: layout.with_queries(torch.arange(batch + 1, dtype=offsets.dtype) * tokens),
            )
            o = _op("gdpa")(q, k, v, candidates, activation="silu")
        else:
            (k_B, valid_BL), (v_B, _) = pad(k, offsets, max_len), pad(v, offsets, max_len)
            q_B = q.view(batch, tokens, self.n_heads, self.head_dim)
            valid_q = torch.ones(batch, tokens, dtype=torch.bool, device=q.device)
            o = padded_gdpa(
                q_B,
                k_B,
                v_B,
                valid_q,
                valid_BL,
                activation="silu",
                scale=1 / math.sqrt(self.head_dim),
            )
        return self.norm(self.out(o.reshape(batch, tokens, d)))

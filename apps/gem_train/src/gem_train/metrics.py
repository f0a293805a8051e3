"""What the trainer reports: quality (loss, NE, AUC per task), speed (QPS, MFU) and balance.

**NE** (normalized entropy) is the mean log loss divided by the entropy of the base rate,
``NE = LL / H(p̄)``; 1.0 means "no better than predicting the average click rate", lower is better.
**AUC** is the probability that a random positive is scored above a random negative (ties count
one half), computed exactly from ranks. Under ``torchrun`` both are computed from every rank's
predictions (``gather_over_ranks``), not from one rank's share: NE's base rate and AUC's ranking
are global, and neither is an average of per-rank values.

**FLOPs** are counted as ``workloads.md`` says, from the real tokens only (padding never counts):
a linear layer is ``2 · tokens · in · out`` forward and 3× that forward + backward; attention is
``4 · heads · head_dim · pairs`` forward (pairs = ``L(L+1)/2`` causal, ``Lq · Lk`` otherwise, per
sample) and 3.5× that forward + backward; an MoE counts its router and the ``top_k`` experts each
token visits. Embedding lookups, norms and activations are not counted. **MFU** = those FLOPs per
second / the device's datasheet dense BF16 peak. **Local MFU** (``gem-train mfu``) times each
layer alone and averages the layers' MFUs weighted by their FLOPs; **E2E MFU** comes from the
training step time; **Scaling Ratio** = E2E / Local.
"""

import math
import resource
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist

from gem_train.config import ModelConfig
from gem_train.data.batch import CANDIDATE_FEATURES, SEQUENCE_FEATURES

# Datasheet dense BF16 FLOP/s (no sparsity).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """Datasheet peak for ``device`` (or ``override_tflops``); ``None`` where none is known (CPU)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    logits, labels = logits.double(), labels.double()
    if labels.numel() == 0:
        return math.nan
    base = labels.mean().item()
    if base <= 0.0 or base >= 1.0:
        return math.nan
    log_loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).item()
    return log_loss / -(base * math.log(base) + (1 - base) * math.log(1 - base))


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC from average ranks (ties count one half); NaN with a single class."""
    scores, positive = scores.double().flatten(), labels.flatten() > 0.5
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    sorted_scores, order = torch.sort(scores)
    _, inverse, counts = torch.unique_consecutive(
        sorted_scores, return_inverse=True, return_counts=True
    )
    ends = torch.cumsum(counts, 0).double()
    average_rank = ends - (counts.double() - 1) / 2  # 1-based average rank of each tie group
    ranks = torch.empty_like(scores)
    ranks[order] = average_rank[inverse]
    return (ranks[positive].sum().item() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


class Window:
    """Accumulates what happened since the last report: predictions, losses and work done."""

    def __init__(self):
        self.logits, self.labels = defaultdict(list), defaultdict(list)
        self.samples, self.tokens, self.padded_tokens = 0, 0, 0
        self.flops = 0.0

    def add(self, logits: dict, labels: dict, *, tokens: int, padded_tokens: int, flops: float):
        """Record one step (device tensors are kept; they are copied when the window closes)."""
        for task, value in logits.items():
            self.logits[task].append(value.detach())
            self.labels[task].append(labels[task].detach())
        self.samples += labels[next(iter(labels))].numel()
        self.tokens += tokens
        self.padded_tokens += padded_tokens
        self.flops += flops


def gather_over_ranks(
    logits: dict[str, list], labels: dict[str, list], *, world: int
) -> tuple[dict[str, list], dict[str, list]]:
    """Every rank's logits and labels per task, on every rank: ``{task: [rank 0's, rank 1's,
    ...]}`` (CPU float tensors, in rank order, so every rank computes the same metrics from them).
    One ``all_gather_object`` over the default group when ``world > 1``; ranks may hold different
    sample counts."""
    local = tuple(
        {task: torch.cat(values).detach().float().cpu() for task, values in d.items() if values}
        for d in (logits, labels)
    )
    if world == 1:
        return tuple({task: [value] for task, value in d.items()} for d in local)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, local)
    tasks = [dict.fromkeys(task for part in gathered for task in part[i]) for i in (0, 1)]
    return tuple(
        {task: [part[i][task] for part in gathered if task in part[i]] for task in tasks[i]}
        for i in (0, 1)
    )


def quality_of(logits: dict[str, list], labels: dict[str, list]) -> dict[str, float]:
    """NE and AUC per task from lists of logits and labels (any device)."""
    out = {}
    for task in logits:
        lg, lb = torch.cat(logits[task]).float().cpu(), torch.cat(labels[task]).float().cpu()
        out[f"{task}_ne"], out[f"{task}_auc"] = normalized_entropy(lg, lb), auc(lg, lb)
    return out


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; peak resident set size of the process on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _linear(tokens: float, d_in: int, d_out: int) -> float:
    return 2.0 * tokens * d_in * d_out


def _attention(pairs: float, heads: int, head_dim: int) -> float:
    return 4.0 * heads * head_dim * pairs


def causal_pairs(lengths: np.ndarray, *, block_size: int | None = None) -> float:
    """Σ L(L+1)/2, or with fixed blocks the causal pairs inside each block."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if block_size is None:
        return float((lengths * (lengths + 1) // 2).sum())
    full, rest = lengths // block_size, lengths % block_size
    return float((full * block_size * (block_size + 1) // 2 + rest * (rest + 1) // 2).sum())


def layer_flops(m: ModelConfig, lengths, *, backward: bool = True) -> dict[str, float]:
    """Useful FLOPs of one batch with these history lengths, per layer of the model."""
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens, batch = float(lengths.sum()), len(lengths)
    d, e, n, h = m.d_model, m.emb_dim, m.n_heads, m.head_dim
    lin, att = (3.0, 3.5) if backward else (1.0, 1.0)
    n_cand = len(CANDIDATE_FEATURES)
    out = {
        "token_proj": lin
        * (_linear(tokens, len(SEQUENCE_FEATURES) * e, d) + _linear(batch * n_cand, e, d))
    }
    block = m.block_size if m.attention == "block" else None
    for i in range(m.n_layers):
        out[f"block{i}.attention"] = att * _attention(causal_pairs(lengths, block_size=block), n, h)
        out[f"block{i}.attn_proj"] = lin * (_linear(tokens, d, 3 * d) + _linear(tokens, d, d))
        if m.ffn == "swiglu":
            out[f"block{i}.ffn"] = lin * 3 * _linear(tokens, d, m.ffn_hidden)
        else:
            experts = m.top_k * 2 * _linear(tokens, d, m.ffn_hidden)  # SiLU experts: 2 matrices
            out[f"block{i}.ffn"] = lin * (_linear(tokens, d, m.n_experts) + experts)
    out["pma"] = lin * (
        _linear(tokens, d, 2 * d) + _linear(batch * m.pma_seeds, d, d)
    ) + att * _attention(m.pma_seeds * tokens, n, h)
    out["cross"] = lin * (
        _linear(batch * n_cand, d, d) * 2 + _linear(tokens, d, 2 * d)
    ) + att * _attention(n_cand * tokens, n, h)
    concat = m.pma_seeds * d + n_cand * d + n_cand * e + 2 * e
    width = m.mlp_hidden
    out["interaction"] = lin * (
        _linear(batch, concat, width) + m.interaction_layers * _linear(batch, width, width)
        + _linear(batch, width, width) + 2 * _linear(batch, width, 1)
    )  # fmt: skip
    return out


def batch_flops(m: ModelConfig, lengths, *, backward: bool = True) -> float:
    return sum(layer_flops(m, lengths, backward=backward).values())

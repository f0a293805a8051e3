"""FLOP formulas of the jagged ops for ``torch.utils.flop_counter.FlopCounterMode``.

The counter sees each custom op once per call (``gem_jagged._dispatch`` sends every call under a
dispatch mode through the custom op) and asks the formula registered for it. Attention FLOPs
follow docs/workloads.md: forward ``4 · N · H · pairs`` (two matmuls), backward ``2.5×`` that
(five), where ``pairs`` counts the (query, key) pairs that the mask lets through, real tokens
only. Counting pairs reads the offsets on the host; under fake tensors (tracing), where no value
exists, the count is the upper bound of every query seeing every key of its sequence on average
(``Tq · Tk / B``).

FlopCounterMode copies the registry when it is constructed: import the op (call it once, or
import ``gem_jagged.ops.<op>``) before constructing the counter.
"""

import torch

__all__ = ["attention_pairs", "block_pairs", "register_attention_formulas"]

BACKWARD_MATMULS_PER_FORWARD = 2.5


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta"


def _lengths(offsets: torch.Tensor) -> torch.Tensor:
    host = offsets.detach().to("cpu", torch.int64)
    return host[1:] - host[:-1]


def attention_pairs(
    q_offsets: torch.Tensor, kv_offsets: torch.Tensor, *, causal: bool, total_q: int, total_kv: int
) -> int:
    """Visible (query, key) pairs; causal is aligned bottom-right (query i of Lq sees keys
    j ≤ i + Lk − Lq)."""
    if _is_fake(q_offsets) or _is_fake(kv_offsets):
        return total_q * total_kv // max(q_offsets.shape[0] - 1, 1)
    lq, lk = _lengths(q_offsets), _lengths(kv_offsets)
    if not causal:
        return int((lq * lk).sum())
    seq = torch.repeat_interleave(torch.arange(lq.numel()), lq)
    first = torch.cumsum(lq, 0) - lq
    position = torch.arange(int(lq.sum())) - first[seq]
    seen = (position + (lk - lq)[seq] + 1).clamp(min=0)
    return int(torch.minimum(seen, lk[seq]).sum())


def block_pairs(offsets: torch.Tensor, *, block_size: int, causal: bool, total: int) -> int:
    """Visible pairs of attention inside ``block_size`` blocks counted from each sequence's
    start."""
    if _is_fake(offsets):
        return total * block_size
    lengths = _lengths(offsets)
    full, rest = lengths // block_size, lengths % block_size

    def per_block(b):
        return b * (b + 1) // 2 if causal else b * b

    return int((full * per_block(block_size) + per_block(rest)).sum())


def register_attention_formulas(forward_op, backward_op, *, forward_pairs, backward_pairs):
    """Register ``forward_op`` (``4·N·H·pairs``) and ``backward_op`` (2.5× that), where
    ``forward_pairs(*args)`` / ``backward_pairs(*args)`` return ``(pairs, heads, head_dim)``
    from each op's positional arguments."""
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(forward_op, get_raw=True)
    def _forward(*args, out_val=None, **kwargs):
        pairs, heads, head_dim = forward_pairs(*args, **kwargs)
        return 4 * heads * head_dim * pairs

    @register_flop_formula(backward_op, get_raw=True)
    def _backward(*args, out_val=None, **kwargs):
        pairs, heads, head_dim = backward_pairs(*args, **kwargs)
        return int(BACKWARD_MATMULS_PER_FORWARD * 4 * heads * head_dim * pairs)

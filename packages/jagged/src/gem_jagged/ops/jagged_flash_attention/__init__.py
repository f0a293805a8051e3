"""Jagged flash attention: exact softmax attention over jagged sequences, never padded.

``jagged_flash_attention(q, k, v, q_offsets, kv_offsets=None, *, causal=False, scale=None,
rel_bias=None, max_q_len=None, max_kv_len=None, backend="auto")`` attends each sequence's queries
to that sequence's keys: ``q [Tq, N, H]`` with ``q_offsets [B+1]``, ``k, v [Tk, N, H]`` with
``kv_offsets [B+1]`` (``None``: self-attention, the query offsets). Causal masking is aligned
bottom-right (query ``i`` of ``Lq`` sees key ``j`` iff ``j ≤ i + Lk − Lq``), as FlashAttention
does; ``rel_bias [N, 2R+1]`` adds ``rel_bias[n, clamp(j − i, −R, R) + R]`` to every score and
gets a gradient. A query row that sees no key outputs zeros. ``max_q_len`` / ``max_kv_len`` are
launch hints (the backward pass uses ``max_q_len`` to size its split of long sequences); they
never truncate anything. Without the hint, an eager call takes the longest sequence from the
offsets' host check when it ran (it does once per offsets tensor); otherwise the token count.

``backend="auto"`` runs the Triton kernels (``triton.py``) on CUDA tensors and the PyTorch
reference (``reference.py``) on CPU tensors. The op is a ``torch.library`` custom op with a fake
implementation and autograd (``_op.py``), so ``torch.compile(fullgraph=True)`` traces it and CUDA
graphs capture it (nothing in the Triton path synchronises with the host); plain eager calls of
the Triton backend skip the custom-op machinery for the same kernels (``_op.py`` says when).
"""

import math

import torch

from gem_jagged._checks import (
    check_head_dim,
    check_offsets,
    check_rel_bias,
    check_same,
    check_values,
    resolve_backend,
)

from . import _op, _plan

__all__ = ["jagged_flash_attention"]

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_length_hint(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{name} must be None or a non-negative int (a launch hint), got {value!r}"
        )


def jagged_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    rel_bias: torch.Tensor | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax attention per jagged sequence; returns ``[Tq, N, H]`` (see the module docstring)."""
    plan_key = _plan.key_of(
        q, k, v, q_offsets, kv_offsets, causal=causal, scale=scale, rel_bias=rel_bias,
        hints=(max_q_len, max_kv_len), backend=backend,
    )  # fmt: skip
    plan = _plan.lookup(plan_key, q_offsets, kv_offsets)
    if plan is not None:  # an earlier call with this key passed every check below
        kv_offsets = q_offsets if kv_offsets is None else kv_offsets
        return _op.eager_triton_attention(
            q, k, v, q_offsets, kv_offsets, None, plan.causal, plan.scale, max_q_len, plan=plan,
            plan_key=plan_key,
        )  # fmt: skip
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_values(name, x)
    check_same([("q", q), ("k", k), ("v", v)])
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k has {k.shape[1]} heads but q has {q.shape[1]}; they must match")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k has head dim {k.shape[2]} but q has {q.shape[2]}; they must match")
    check_head_dim("q", q.shape[2])
    check_offsets("q_offsets", q_offsets, total=q.shape[0], device=q.device)
    if kv_offsets is None:
        if k.shape[0] != q.shape[0]:
            raise ValueError(
                f"kv_offsets=None means self-attention, but k has {k.shape[0]} tokens and q has "
                f"{q.shape[0]}; pass kv_offsets for cross-attention"
            )
        kv_offsets = q_offsets
    else:
        check_offsets("kv_offsets", kv_offsets, total=k.shape[0], device=k.device)
        if kv_offsets.shape != q_offsets.shape:
            raise ValueError(
                f"kv_offsets has {kv_offsets.shape[0] - 1} sequences but q_offsets has "
                f"{q_offsets.shape[0] - 1}; they must match"
            )
    check_rel_bias(rel_bias, num_heads=q.shape[1], like=q)
    _check_length_hint("max_q_len", max_q_len)
    _check_length_hint("max_kv_len", max_kv_len)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[2])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    backend = resolve_backend(backend, q.device)
    if backend == "triton" and q.dtype not in TRITON_DTYPES:
        raise TypeError(
            f"q has dtype {q.dtype}; the triton backend supports {TRITON_DTYPES} "
            "(use backend='reference' for others)"
        )
    if backend == "triton" and _op.eager_path_allowed(q, k, v, q_offsets, kv_offsets, rel_bias):
        return _op.eager_triton_attention(
            q, k, v, q_offsets, kv_offsets, rel_bias, bool(causal), float(scale), max_q_len,
            plan_key=plan_key,
        )  # fmt: skip
    out, _, _ = _op.attention_forward(
        q, k, v, q_offsets, kv_offsets, rel_bias, bool(causal), float(scale), max_q_len, backend
    )
    return out

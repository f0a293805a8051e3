"""GDPA: generalized dot-product attention over jagged sequences (self, cross and PMA).

``out = out_scale · (act(scale · Q Kᵀ + bias) ⊙ mask) V`` per sequence, where ``act`` is a
pointwise activation instead of softmax. Three shapes of use:

- self-attention over a user history: ``q, k, v [T, N, H]`` and one ``q_offsets``;
- cross-attention of jagged queries over jagged (often short, e.g. 64 candidate) keys/values:
  pass ``kv_offsets`` too; causal is aligned bottom-right as for the softmax op;
- PMA pooling (``broadcast_q=True``): ``q [S, N, H]`` holds ``S`` learned seeds shared by every
  sequence, ``q_offsets`` is ignored (it may be None) and the output is ``[B·S, N, H]``,
  ``S`` rows per sequence of ``kv_offsets``.

``q_offsets`` may be a ``gem_jagged.JaggedBatch`` (``kv_offsets`` then stays None): for self-
and cross-attention its two sides are the query and key sequences; for PMA its key/value side
describes the sequences (a self-attention batch of the history serves). The batch's checks,
length range and work lists are shared by every call that gets it (``gem_jagged.batch``).

q, k and v may be torchrec ``JaggedTensor``s or jagged nested tensors instead, which carry their
offsets (for PMA: jagged k and v, plain seeds); the output is of their kind
(``gem_jagged._jagged_inputs``).

``rel_bias [N, 2R+1]`` adds ``rel_bias[n, clamp(j − i, −R, R) + R]`` to each score (``i`` is the
query's position in its sequence, or the seed index for PMA) and receives a gradient.
"""

import math

import torch

from ..._checks import (
    check_head_dim,
    check_rel_bias,
    check_same,
    check_tokens,
    check_values,
    resolve_backend,
)
from ..._dispatch import custom_op_required
from ..._jagged_inputs import unwrap_jagged
from ...batch import JaggedBatch, as_batch
from ._op import GdpaTritonFunction, gdpa_op, resolve_tiles
from .config import GdpaTiles, Regime, SigmoidForm, arch_of, regime_for, tiles_for
from .reference import ACTIVATIONS

__all__ = [
    "ACTIVATIONS",
    "GdpaTiles",
    "Regime",
    "SigmoidForm",
    "arch_of",
    "gdpa",
    "regime_for",
    "tiles_for",
]


def gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | JaggedBatch | None = None,
    kv_offsets: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    causal: bool = False,
    scale: float | None = None,
    out_scale: float = 1.0,
    broadcast_q: bool = False,
    rel_bias: torch.Tensor | None = None,
    backend: str = "auto",
    tiles: GdpaTiles | None = None,
) -> torch.Tensor:
    """Generalized dot-product attention, ``out_scale · (act(scale·QKᵀ + bias) ⊙ mask) V``.

    Args:
        q: ``[Tq, N, H]`` queries, or ``[S, N, H]`` shared seeds with ``broadcast_q``. Or a
            torchrec ``JaggedTensor`` / jagged nested tensor (``[B, j, N, H]``) carrying its
            offsets, with k and v of the same kind (the seeds of PMA stay a plain tensor).
        k, v: ``[Tk, N, H]`` keys and values (q's dtype and device); H in {32, 64, 128}.
        q_offsets: ``[B+1]`` int32/int64 query offsets, a ``JaggedBatch``, or None with
            ``broadcast_q`` (ignored there unless it is a batch) or with jagged q.
        kv_offsets: ``[B+1]`` key offsets (cross-attention, PMA), or None for self-attention.
        activation: one of ``ACTIVATIONS``.
        causal: mask aligned bottom-right, as for the softmax op.
        scale: score scale, default ``1/sqrt(H)``; ``out_scale`` multiplies the output.
        broadcast_q: PMA: every sequence attends with the same ``S`` seeds; output
            ``[B·S, N, H]``.
        rel_bias: ``[N, 2R+1]`` learned relative bias (it receives a gradient).
        backend: "auto" (Triton on CUDA, the reference on CPU), "triton" or "reference".
        tiles: the Triton kernels' ``GdpaTiles`` (tile shapes, program counts, activation
            form); None picks the measured ones, ``tiles_for(arch=arch_of(q.device),
            dtype=q.dtype, head_dim=H, regime=regime_for(rel_bias_NB=rel_bias))``. The
            reference backend ignores it.

    Returns:
        ``[Tq, N, H]`` (``[B·S, N, H]`` with ``broadcast_q``) in q's dtype. For jagged inputs,
        of their kind: with q's offsets, or ``S`` rows per sequence for PMA.

    Raises:
        TypeError / ValueError naming the argument for bad types, shapes, activations,
        offsets or ``tiles``, for jagged inputs of mixed kinds or with offsets passed beside
        them.
    """
    q, k, v, q_offsets, kv_offsets, wrap = unwrap_jagged(
        q, k, v, q_offsets, kv_offsets, broadcast_q=bool(broadcast_q)
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_values(name, t)
    check_same([("q", q), ("k", k), ("v", v)])
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must hold the same tokens, got {k.shape[0]} and {v.shape[0]}")
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(
            f"q, k and v must have the same number of heads, got {q.shape[1]}, {k.shape[1]}, "
            f"{v.shape[1]}"
        )
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(
            f"q, k and v must have the same head dim, got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}"
        )
    check_head_dim("q", q.shape[2])
    if broadcast_q:
        if isinstance(q_offsets, JaggedBatch):
            batch = q_offsets
            if kv_offsets is not None:
                raise ValueError("pass kv_offsets=None when q_offsets is a JaggedBatch")
        elif kv_offsets is None:
            raise ValueError(
                "broadcast_q=True (PMA) needs kv_offsets, the [B+1] offsets of the key/value "
                "sequences; q holds the shared seeds and q_offsets is ignored"
            )
        else:
            batch = as_batch(
                kv_offsets, names=("kv_offsets", "kv_offsets", "max_len", "max_kv_len")
            )
        check_tokens("kv_offsets", batch.kv_length_range, k.shape[0], values="k")
        q_offsets_t = kv_offsets_t = batch.kv_offsets
        is_cross = True
    else:
        if q_offsets is None:
            raise ValueError("q_offsets is required unless broadcast_q=True")
        batch = as_batch(q_offsets, kv_offsets)
        check_tokens("q_offsets", batch.length_range, q.shape[0], values="q")
        is_cross = not batch.is_self_attention
        if is_cross:
            check_tokens("kv_offsets", batch.kv_length_range, k.shape[0], values="k")
        elif k.shape[0] != q.shape[0]:
            raise ValueError(
                f"self-attention (kv_offsets=None) needs k and v with the {q.shape[0]} "
                f"query tokens, got {k.shape[0]}; pass kv_offsets for cross-attention"
            )
        q_offsets_t, kv_offsets_t = batch.offsets, batch.kv_offsets
    if batch.device != q.device:
        raise ValueError(f"the offsets are on {batch.device} but q is on {q.device}")
    check_rel_bias(rel_bias, num_heads=q.shape[1], like=q)
    if tiles is not None and not isinstance(tiles, GdpaTiles):
        raise TypeError(f"tiles must be a GdpaTiles or None, got {type(tiles).__name__}")
    tiles = resolve_tiles(tiles, q, rel_bias)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    backend = resolve_backend(backend, q.device)
    if backend == "triton" and not custom_op_required(q, k, v, rel_bias):
        out = GdpaTritonFunction.apply(
            q, k, v, batch, q_offsets_t, kv_offsets_t, rel_bias, activation, bool(causal), scale,
            float(out_scale), bool(broadcast_q), is_cross, tiles,
        )  # fmt: skip
    else:
        out = gdpa_op(
            q, k, v, q_offsets_t, kv_offsets_t, rel_bias, activation, bool(causal), scale,
            float(out_scale), bool(broadcast_q), is_cross, backend, tiles.as_ints(),
        )  # fmt: skip
    return wrap(out)

"""GDPA: generalized dot-product attention over jagged sequences (self, cross and PMA).

``out = out_scale · (act(scale · Q Kᵀ + bias) ⊙ mask) V`` per sequence, where ``act`` is a
pointwise activation instead of softmax. Three shapes of use:

- self-attention over a user history: ``q, k, v [T, N, H]`` and one ``q_offsets``;
- cross-attention of jagged queries over jagged (often short, e.g. 64 candidate) keys/values:
  pass ``kv_offsets`` too; causal is aligned bottom-right as for the softmax op;
- PMA pooling (``broadcast_q=True``): ``q [S, N, H]`` holds ``S`` learned seeds shared by every
  sequence, ``q_offsets`` is ignored (it may be None) and the output is ``[B·S, N, H]``,
  ``S`` rows per sequence of ``kv_offsets``.

``rel_bias [N, 2R+1]`` adds ``rel_bias[n, clamp(j − i, −R, R) + R]`` to each score (``i`` is the
query's position in its sequence, or the seed index for PMA) and receives a gradient.
"""

import math

import torch

from ..._checks import (
    check_head_dim,
    check_offsets,
    check_rel_bias,
    check_same,
    check_values,
    resolve_backend,
)
from ._op import GdpaTritonFunction, gdpa_op
from .reference import ACTIVATIONS

__all__ = ["gdpa", "ACTIVATIONS"]


def gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    causal: bool = False,
    scale: float | None = None,
    out_scale: float = 1.0,
    broadcast_q: bool = False,
    rel_bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Generalized dot-product attention; see the module docstring for the shapes.

    ``scale`` defaults to ``1/sqrt(H)``. ``kv_offsets=None`` means self-attention (``k, v`` share
    the query offsets). ``backend="auto"`` runs Triton on CUDA tensors, the reference on the CPU.
    """
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
        if kv_offsets is None:
            raise ValueError(
                "broadcast_q=True (PMA) needs kv_offsets, the [B+1] offsets of the key/value "
                "sequences; q holds the shared seeds and q_offsets is ignored"
            )
        check_offsets("kv_offsets", kv_offsets, total=k.shape[0], device=q.device)
        q_offsets = kv_offsets
        is_cross = True
    else:
        if q_offsets is None:
            raise ValueError("q_offsets is required unless broadcast_q=True")
        check_offsets("q_offsets", q_offsets, total=q.shape[0], device=q.device)
        is_cross = kv_offsets is not None
        if kv_offsets is None:
            if k.shape[0] != q.shape[0]:
                raise ValueError(
                    f"self-attention (kv_offsets=None) needs k and v with the {q.shape[0]} "
                    f"query tokens, got {k.shape[0]}; pass kv_offsets for cross-attention"
                )
            kv_offsets = q_offsets
        else:
            check_offsets("kv_offsets", kv_offsets, total=k.shape[0], device=q.device)
            if kv_offsets.shape[0] != q_offsets.shape[0]:
                raise ValueError(
                    f"q_offsets and kv_offsets must describe the same number of sequences, got "
                    f"{q_offsets.shape[0] - 1} and {kv_offsets.shape[0] - 1}"
                )
    check_rel_bias(rel_bias, num_heads=q.shape[1], like=q)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    backend = resolve_backend(backend, q.device)
    if backend == "triton" and not torch.compiler.is_compiling():
        return GdpaTritonFunction.apply(
            q, k, v, q_offsets, kv_offsets, rel_bias, activation, bool(causal), scale,
            float(out_scale), bool(broadcast_q), is_cross,
        )  # fmt: skip
    return gdpa_op(
        q, k, v, q_offsets, kv_offsets, rel_bias, activation, bool(causal), scale,
        float(out_scale), bool(broadcast_q), is_cross, backend,
    )  # fmt: skip

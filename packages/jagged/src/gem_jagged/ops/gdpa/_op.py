"""``torch.library`` wiring of GDPA: forward and backward custom ops, fake shapes, autograd,
and the eager path of the Triton backend.

The public function normalises its arguments (``kv_offsets`` filled in for self-attention, a
concrete ``scale``) so that the ops see tensors, plain scalars and a backend name only. Both
backends run behind the same ops, so ``torch.compile(fullgraph=True)`` traces either one as a
single opaque node with a known output shape.

Eager calls of the Triton backend run through ``GdpaTritonFunction`` instead where
``gem_jagged._dispatch`` allows it: the same launchers under a plain ``autograd.Function``,
which spares the custom op's eager dispatch (more host time than the kernels of a
cross-attention or PMA step take), keeps its work lists in the caller's ``JaggedBatch`` and
hands the forward's query list to the backward.
"""

import torch

from gem_jagged._flops import attention_pairs, register_attention_formulas
from gem_jagged.batch import JaggedBatch

from . import reference
from .config import GdpaTiles, arch_of, regime_for, tiles_for


def _kernels():
    """The Triton launchers, imported on first use: the reference backend runs without triton."""
    from . import triton

    return triton


def resolve_tiles(tiles: GdpaTiles | None, q: torch.Tensor, rel_bias: torch.Tensor | None):
    """``tiles``, or the measured ones for this call (``tiles_for``) when it is None."""
    if tiles is not None:
        return tiles
    return tiles_for(
        arch=arch_of(q.device), dtype=q.dtype, head_dim=q.shape[2],
        regime=regime_for(rel_bias_NB=rel_bias),
    )  # fmt: skip


def _tiles_from(values: list[int] | None, q, rel_bias) -> GdpaTiles:
    return resolve_tiles(None if values is None else GdpaTiles.from_ints(values), q, rel_bias)


@torch.library.custom_op("gem_jagged::gdpa", mutates_args=())
def gdpa_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    rel_bias: torch.Tensor | None,
    activation: str,
    causal: bool,
    scale: float,
    out_scale: float,
    broadcast_q: bool,
    is_cross: bool,
    backend: str,
    tiles: list[int] | None = None,
) -> torch.Tensor:
    """The forward; ``tiles`` is ``GdpaTiles.as_ints()`` (None: ``tiles_for`` picks)."""
    options = dict(
        activation=activation, causal=causal, scale=scale, out_scale=out_scale,
        broadcast_q=broadcast_q,
    )  # fmt: skip
    if backend == "triton":
        batch = JaggedBatch.of_owned(q_offsets, kv_offsets, max_len=None)
        return _kernels().gdpa_forward(
            q, k, v, q_offsets, kv_offsets, rel_bias_NB=rel_bias, is_cross=is_cross,
            batch=batch, tiles=_tiles_from(tiles, q, rel_bias), **options,
        )  # fmt: skip
    return reference.gdpa_reference(q, k, v, q_offsets, kv_offsets, rel_bias=rel_bias, **options)


@gdpa_op.register_fake
def _(q, k, v, q_offsets, kv_offsets, rel_bias, activation, causal, scale, out_scale,
      broadcast_q, is_cross, backend, tiles=None):  # fmt: skip
    rows = (kv_offsets.shape[0] - 1) * q.shape[0] if broadcast_q else q.shape[0]
    return q.new_empty((rows, k.shape[1], v.shape[2]))


@torch.library.custom_op("gem_jagged::gdpa_backward", mutates_args=())
def gdpa_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    rel_bias: torch.Tensor | None,
    activation: str,
    causal: bool,
    scale: float,
    out_scale: float,
    broadcast_q: bool,
    is_cross: bool,
    backend: str,
    tiles: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, d_rel_bias)``; ``d_rel_bias`` is an empty tensor when there is no bias."""
    options = dict(
        activation=activation, causal=causal, scale=scale, out_scale=out_scale,
        broadcast_q=broadcast_q,
    )  # fmt: skip
    if backend == "triton":
        batch = JaggedBatch.of_owned(q_offsets, kv_offsets, max_len=None)
        dq, dk, dv, d_bias = _kernels().gdpa_backward(
            grad_out, q, k, v, q_offsets, kv_offsets, rel_bias_NB=rel_bias, is_cross=is_cross,
            batch=batch, tiles=_tiles_from(tiles, q, rel_bias), **options,
        )  # fmt: skip
    else:
        dq, dk, dv, d_bias = reference.gdpa_reference_backward(
            grad_out, q, k, v, q_offsets, kv_offsets, rel_bias=rel_bias, **options
        )
    if d_bias is None:
        d_bias = q.new_empty((0,))
    return dq, dk, dv, d_bias


@gdpa_backward_op.register_fake
def _(grad_out, q, k, v, q_offsets, kv_offsets, rel_bias, activation, causal, scale,
      out_scale, broadcast_q, is_cross, backend, tiles=None):  # fmt: skip
    d_bias = q.new_empty((0,)) if rel_bias is None else torch.empty_like(rel_bias)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), d_bias


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, kv_offsets, rel_bias, *options = inputs
    ctx.save_for_backward(q, k, v, q_offsets, kv_offsets, rel_bias)
    ctx.options = options


def _backward(ctx, grad_out):
    q, k, v, q_offsets, kv_offsets, rel_bias = ctx.saved_tensors
    dq, dk, dv, d_bias = gdpa_backward_op(
        grad_out.contiguous(), q, k, v, q_offsets, kv_offsets, rel_bias, *ctx.options
    )
    nones = [None] * len(ctx.options)
    return dq, dk, dv, None, None, (d_bias if rel_bias is not None else None), *nones


gdpa_op.register_autograd(_backward, setup_context=_setup_context)


def _pairs(q, k, q_offsets, kv_offsets, causal, broadcast_q):
    if broadcast_q:  # every sequence's keys against the S shared seeds
        seeds = torch.arange(kv_offsets.shape[0], device="cpu", dtype=torch.int64) * q.shape[0]
        q_offsets, total_q = seeds, q.shape[0] * (kv_offsets.shape[0] - 1)
    else:
        total_q = q.shape[0]
    pairs = attention_pairs(
        q_offsets, kv_offsets, causal=causal, total_q=total_q, total_kv=k.shape[0]
    )
    return pairs, q.shape[1], q.shape[2]


register_attention_formulas(
    torch.ops.gem_jagged.gdpa,
    torch.ops.gem_jagged.gdpa_backward,
    forward_pairs=lambda q, k, v, q_off, kv_off, bias, act, causal, scale, out_scale, bq, *_: (
        _pairs(q, k, q_off, kv_off, causal, bq)
    ),
    backward_pairs=lambda g, q, k, v, q_off, kv_off, bias, act, causal, scale, o_s, bq, *_: (
        _pairs(q, k, q_off, kv_off, causal, bq)
    ),
)


class GdpaTritonFunction(torch.autograd.Function):
    """Eager Triton path: the launchers behind autograd, without the custom-op dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, batch, q_offsets, kv_offsets, rel_bias, activation, causal, scale,
                out_scale, broadcast_q, is_cross, tiles):  # fmt: skip
        options = dict(
            activation=activation, causal=causal, scale=scale, out_scale=out_scale,
            broadcast_q=broadcast_q, is_cross=is_cross, tiles=tiles,
        )  # fmt: skip
        out, work = _kernels().gdpa_forward(
            q, k, v, q_offsets, kv_offsets, rel_bias_NB=rel_bias, return_work=True, batch=batch,
            **options,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, q_offsets, kv_offsets, rel_bias)
        ctx.options, ctx.work, ctx.batch = options, work, batch
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, q_offsets, kv_offsets, rel_bias = ctx.saved_tensors
        dq, dk, dv, d_bias = _kernels().gdpa_backward(
            grad_out, q, k, v, q_offsets, kv_offsets, rel_bias_NB=rel_bias, query_work=ctx.work,
            batch=ctx.batch, **ctx.options,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, d_bias, *([None] * 7)

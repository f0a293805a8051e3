"""``torch.library`` wiring of BlockAttention: forward and backward custom ops and autograd,
and the eager path of the Triton backend.

Both backends sit behind the same ops, so ``torch.compile(fullgraph=True)`` sees one opaque node
whose output has the shape of ``q``; the backward op returns gradients with respect to the
un-rotated q and k. Eager calls of the Triton backend run through
``BlockAttentionTritonFunction`` where ``gem_jagged._dispatch`` allows it: the same launchers
under a plain ``autograd.Function``, which spares the custom ops' eager dispatch and takes its
block table from the caller's ``JaggedBatch``.
"""

import torch

from gem_jagged._flops import block_pairs, register_attention_formulas

from . import reference
from .config import BlockAttentionConfig, config_for


def _kernels():
    """The Triton launchers, imported on first use: the reference backend runs without triton."""
    from . import triton

    return triton


def resolve_config(config: BlockAttentionConfig | None, q: torch.Tensor, block_size: int):
    """``config``, or ``config_for`` this call's block size and head dim when it is None."""
    if config is not None:
        return config
    return config_for(block_size=block_size, head_dim=q.shape[2])


def _config_from(values: list[int] | None, q, block_size) -> BlockAttentionConfig:
    config = None if values is None else BlockAttentionConfig.from_ints(values)
    return resolve_config(config, q, block_size)


@torch.library.custom_op("gem_jagged::block_attention", mutates_args=())
def block_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_size: int,
    causal: bool,
    rope_theta: float | None,
    scale: float,
    backend: str,
    config: list[int] | None = None,
) -> torch.Tensor:
    """The forward; ``config`` is ``BlockAttentionConfig.as_ints()`` (None: ``config_for``)."""
    options = dict(block_size=block_size, causal=causal, rope_theta=rope_theta, scale=scale)
    if backend == "triton":
        config = _config_from(config, q, block_size)
        return _kernels().block_attention_forward(q, k, v, offsets, config=config, **options)
    return reference.block_attention_reference(q, k, v, offsets, **options)


@block_attention_op.register_fake
def _(q, k, v, offsets, block_size, causal, rope_theta, scale, backend, config=None):
    return torch.empty_like(q)


@torch.library.custom_op("gem_jagged::block_attention_backward", mutates_args=())
def block_attention_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_size: int,
    causal: bool,
    rope_theta: float | None,
    scale: float,
    backend: str,
    config: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = dict(block_size=block_size, causal=causal, rope_theta=rope_theta, scale=scale)
    if backend == "triton":
        config = _config_from(config, q, block_size)
        return _kernels().block_attention_backward(
            grad_out, q, k, v, offsets, config=config, **options
        )
    return reference.block_attention_reference_backward(grad_out, q, k, v, offsets, **options)


@block_attention_backward_op.register_fake
def _(grad_out, q, k, v, offsets, block_size, causal, rope_theta, scale, backend, config=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, offsets, *options = inputs
    ctx.save_for_backward(q, k, v, offsets)
    ctx.options = options


def _backward(ctx, grad_out):
    q, k, v, offsets = ctx.saved_tensors
    dq, dk, dv = block_attention_backward_op(grad_out.contiguous(), q, k, v, offsets, *ctx.options)
    return dq, dk, dv, None, *([None] * len(ctx.options))


block_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _pairs(q, offsets, block_size, causal):
    pairs = block_pairs(offsets, block_size=block_size, causal=causal, total=q.shape[0])
    return pairs, q.shape[1], q.shape[2]


register_attention_formulas(
    torch.ops.gem_jagged.block_attention,
    torch.ops.gem_jagged.block_attention_backward,
    forward_pairs=lambda q, k, v, offsets, block_size, causal, *_: _pairs(
        q, offsets, block_size, causal
    ),
    backward_pairs=lambda g, q, k, v, offsets, block_size, causal, *_: _pairs(
        q, offsets, block_size, causal
    ),
)


class BlockAttentionTritonFunction(torch.autograd.Function):
    """Eager Triton path: the launchers behind autograd, without the custom-op dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, batch, block_size, causal, rope_theta, scale, config):
        options = dict(
            block_size=block_size, causal=causal, rope_theta=rope_theta, scale=scale,
            config=config,
        )  # fmt: skip
        offsets = batch.offsets
        kernels = _kernels()
        table = kernels.batch_block_table(batch, block_size)
        out = kernels.block_attention_forward(q, k, v, offsets, block_ends_B=table, **options)
        ctx.save_for_backward(q, k, v, offsets, table)
        ctx.options = options
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, offsets, table = ctx.saved_tensors
        dq, dk, dv = _kernels().block_attention_backward(
            grad_out, q, k, v, offsets, block_ends_B=table, **ctx.options
        )
        return dq, dk, dv, None, None, None, None, None, None

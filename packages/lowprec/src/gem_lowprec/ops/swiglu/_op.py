"""The ``gem_lowprec::swiglu`` custom op and its backward op, with fake implementations and
registered autograd, so ``torch.compile`` traces through the fused gate. Both take the resolved
backend (``"triton"`` or ``"reference"``); the backward runs on the backend of its forward and
recomputes ``silu`` from the saved ``u``."""

import torch
from gem_lowprec.ops.swiglu.reference import swiglu_backward_reference, swiglu_reference


@torch.library.custom_op("gem_lowprec::swiglu", mutates_args=())
def swiglu_op(u: torch.Tensor, backend: str) -> torch.Tensor:
    """``h [T, F]`` of a contiguous-able ``u [T, 2F]`` on ``backend`` ("triton" or "reference")."""
    if backend == "triton":
        from gem_lowprec.ops.swiglu.triton import swiglu_forward_triton

        return swiglu_forward_triton(u)
    return swiglu_reference(u)


@swiglu_op.register_fake
def _(u, backend):
    return u.new_empty(u.shape[0], u.shape[1] // 2)


@torch.library.custom_op("gem_lowprec::swiglu_backward", mutates_args=())
def swiglu_backward_op(u: torch.Tensor, dh: torch.Tensor, backend: str) -> torch.Tensor:
    """``du [T, 2F]`` of ``u [T, 2F]`` and ``dh [T, F]`` on ``backend``."""
    if backend == "triton":
        from gem_lowprec.ops.swiglu.triton import swiglu_backward_triton

        return swiglu_backward_triton(u, dh)
    return swiglu_backward_reference(u, dh)


@swiglu_backward_op.register_fake
def _(u, dh, backend):
    return torch.empty_like(u)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.backend = inputs[1]


def _backward(ctx, dh):
    (u,) = ctx.saved_tensors
    return swiglu_backward_op(u, dh, ctx.backend), None


swiglu_op.register_autograd(_backward, setup_context=_setup_context)

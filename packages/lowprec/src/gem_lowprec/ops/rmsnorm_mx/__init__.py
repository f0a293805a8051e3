"""``rmsnorm_to_mx``: RMSNorm fused with 1×32 MX quantization along the last dim.

Returns the ``MXTensor`` of ``rmsnorm(x) · weight`` (normalized in float32, quantized from
float32, so there is one rounding, not two). One ``torch.library`` custom op (``_op.py``);
Triton on CUDA tensors, the reference on CPU tensors.
"""

import math
from dataclasses import astuple
from typing import TYPE_CHECKING

import torch
from gem_lowprec._checks import (
    Backend,
    ScaleMode,
    check_divisible,
    check_input,
    check_options,
    resolve_backend,
)
from gem_lowprec.codec import elem_format
from gem_lowprec.mx_tensor import MXLayout, MXTensor
from gem_lowprec.ops.rmsnorm_mx._op import rmsnorm_mx, rmsnorm_mx_op

if TYPE_CHECKING:
    from gem_lowprec.ops.rmsnorm_mx.triton import RmsnormTiles

__all__ = ["MAX_FEATURES", "rmsnorm_mx_op", "rmsnorm_to_mx"]

MAX_FEATURES = 16384


def rmsnorm_to_mx(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_mode: ScaleMode = "rceil",
    backend: Backend = "auto",
    tiles: "RmsnormTiles | None" = None,
) -> MXTensor:
    """``to_mx(x / sqrt(mean(x², -1) + eps) · weight)`` with the normalized activation computed
    in float32 and never written to memory.

    The quantization of the kernel's own float32 activation is bit-exact; that activation may
    differ from the reference's in the last float32 bit (summation order, rsqrt).

    Args:
        x: bfloat16, float16 or float32 ``[..., N]``, N a multiple of 32 and at most 16384.
        weight: bfloat16, float16 or float32 ``[N]`` on x's device.
        eps: added to the mean square.
        elem_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale_mode: ``"rceil"`` or ``"floor"`` (as for ``to_mx``).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        tiles: the Triton launch shape (``triton.RmsnormTiles``); None for the default.

    Returns:
        ``MXTensor`` with ``data`` float8 of x's shape, ``scale`` uint8 ``[..., N/32]``, layout
        ``MXLayout("1x32", axis=x.dim() - 1)``.

    Raises:
        TypeError: x or weight not a float tensor of the dtypes above, ``elem_dtype`` not fp8.
        ValueError: a bad option, weight's shape or device, N not a multiple of 32 or above
            16384.
    """
    check_input(x)
    check_input(weight, name="weight")
    fmt = elem_format(elem_dtype)
    check_options(scale_mode=scale_mode, backend=backend)
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(
            f"weight must have shape ({n},) to match x's last dim, got {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    check_divisible(x, -1, 32, what="block size")
    if n > MAX_FEATURES:
        raise ValueError(
            f"x's last dim must be at most {MAX_FEATURES} for the fused kernel, got {n}"
        )
    data, scale = rmsnorm_mx(
        x.contiguous().view(math.prod(x.shape[:-1]), n),
        weight.contiguous(),
        float(eps),
        str(fmt.dtype).removeprefix("torch."),
        scale_mode,
        resolve_backend(backend, x.device),
        None if tiles is None else list(astuple(tiles)),
    )
    return MXTensor(
        data.view(x.shape).view(fmt.dtype),
        scale.view(*x.shape[:-1], n // 32),
        MXLayout("1x32", axis=x.dim() - 1),
    )

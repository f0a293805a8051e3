"""``rmsnorm_to_mx``: RMSNorm fused with 1×32 MX quantization along the last dim.

Returns the ``MXTensor`` of ``rmsnorm(x) · weight`` (normalized in float32, quantized from
float32). One ``torch.library`` custom op; Triton on CUDA tensors, the reference on CPU tensors;
in plain eager use its implementation is called directly (the same eager fast path as
``to_mx``: the dispatcher's host cost is larger than this kernel's time).
"""

import torch
from gem_lowprec.formats import (
    check_divisible,
    check_input,
    check_options,
    elem_format,
    resolve_backend,
)
from gem_lowprec.mx_tensor import MXLayout, MXTensor
from gem_lowprec.ops.mx_quantize import eager_path_allowed
from gem_lowprec.ops.rmsnorm_mx import reference

__all__ = ["rmsnorm_to_mx"]

MAX_FEATURES = 16384


def _rmsnorm_mx(
    x: torch.Tensor, weight: torch.Tensor, eps: float, elem: str, scale_mode: str, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = elem_format(getattr(torch, elem))
    if backend == "triton":
        from gem_lowprec.ops.rmsnorm_mx import triton as kernels

        data, scale, _ = kernels.rmsnorm_mx(x, weight, eps, fmt, scale_mode)
        return data, scale
    data, scale = reference.rmsnorm_mx(x, weight, eps, fmt, scale_mode)
    return data, scale.contiguous()


rmsnorm_mx_op = torch.library.custom_op("gem_lowprec::rmsnorm_mx", _rmsnorm_mx, mutates_args=())


@rmsnorm_mx_op.register_fake
def _(x, weight, eps, elem, scale_mode, backend):
    m, n = x.shape
    return x.new_empty((m, n), dtype=torch.uint8), x.new_empty((m, n // 32), dtype=torch.uint8)


def rmsnorm_to_mx(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_mode: str = "rceil",
    backend: str = "auto",
) -> MXTensor:
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
    args = (
        x.contiguous().reshape(-1, n),
        weight.contiguous(),
        float(eps),
        str(fmt.dtype).removeprefix("torch."),
        scale_mode,
        resolve_backend(backend, x.device),
    )
    if eager_path_allowed(x, weight):
        data, scale = _rmsnorm_mx(*args)
    else:
        data, scale = rmsnorm_mx_op(*args)
    return MXTensor(
        data.view(x.shape).view(fmt.dtype),
        scale.view(*x.shape[:-1], n // 32),
        MXLayout("1x32", axis=x.dim() - 1),
    )

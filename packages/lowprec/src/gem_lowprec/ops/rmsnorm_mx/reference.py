"""RMSNorm followed by 1×32 MX quantization, in plain PyTorch.

``y = x / sqrt(mean(x², last dim) + eps) · weight`` computed in float32, then quantized to MX
along the last dim directly from float32 (no bf16 rounding in between, so there is one rounding,
not two). The fused kernel's normalization may differ from this one in the last float32 bit
(summation order, rsqrt); its quantization of its own float32 ``y`` is bit-exact.
"""

import torch
from gem_lowprec.codec import ElemFormat
from gem_lowprec.ops.mx_quantize import reference as mx_reference


def rmsnorm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x², -1) + eps) · weight`` in float32."""
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return xf * rstd * weight.to(torch.float32)


def rmsnorm_mx(x, weight, eps: float, fmt: ElemFormat, scale_mode: str):
    """(data uint8 ``[M, N]``, scale uint8 ``[M, N/32]``) of the float32 RMSNorm of ``x``."""
    y = rmsnorm_fp32(x, weight, eps)
    return mx_reference.quantize_1d(y, fmt, axis=-1, scale_mode=scale_mode, seed=None)

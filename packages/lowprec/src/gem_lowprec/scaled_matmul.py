"""The fp8 GEMMs behind the recipes: ``a @ bᵀ`` for operands quantized along their last dim (K).

``blockwise_matmul`` multiplies operands in 1×128 blocks (``quantize_mx_k128`` makes them from
MX 1×32 blocks: Hopper has no MX matmul) through ``torch._scaled_mm`` with 1×128 blockwise
float32 scales (cuBLAS on sm_90 takes A's scales M-major and B's as ``[K/128, N]``).
``mx_matmul`` is the same for two ``MXTensor`` operands. ``rowwise_matmul`` is the fp8_rowwise
recipe's GEMM: one float32 scale per row of each operand (``gem_lowprec.ops.fp8_cast`` makes
them), ``torch._scaled_mm`` rowwise.

On the CPU the same quantized operands are dequantized exactly in float32 and multiplied: the
emulation computes the same products, only the float32 summation order differs.
"""

import torch

from gem_lowprec.mx_tensor import MXTensor
from gem_lowprec.ops.mx_quantize.reference import merge_k128

__all__ = ["blockwise_matmul", "mx_matmul", "rowwise_matmul"]


def _expand_k(scale: torch.Tensor, block: int) -> torch.Tensor:
    return scale.repeat_interleave(block, dim=-1)


def blockwise_matmul(
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a · a_scale) @ (b · b_scale)ᵀ`` for fp8 ``a_data [M, K]``, ``b_data [N, K]``
    (row-major) with float32 scales ``[M, K/128]``, ``[N, K/128]`` along K; ``[M, N]`` in
    ``out_dtype``. On a GPU the scales are passed outer-dim-major (no copy when already stored
    so, as ``quantize_mx_k128_rowcol``'s kernel stores them)."""
    if a_data.is_cuda:
        return torch._scaled_mm(
            a_data,
            b_data.t(),
            # outer-dim-major, as cuBLAS wants for 1x128: no copy when already stored so
            scale_a=a_scale.t().contiguous().t(),  # [M, K/128], strides (1, M)
            scale_b=b_scale.t().contiguous(),  # [K/128, N], strides (N, 1)
            out_dtype=out_dtype,
        )
    a = a_data.to(torch.float32) * _expand_k(a_scale, 128)
    b = b_data.to(torch.float32) * _expand_k(b_scale, 128)
    return (a @ b.t()).to(out_dtype)


def mx_matmul(a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ bᵀ`` for MX operands ``a [M, K]`` and ``b [N, K]``, both in 1×32 blocks along K
    (K a multiple of 128): merged to 1×128 blocks, then ``blockwise_matmul``."""
    a_data, a_scale = merge_k128(a)
    b_data, b_scale = merge_k128(b)
    return blockwise_matmul(a_data, a_scale, b_data, b_scale, out_dtype)


def rowwise_matmul(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a_q · a_scale) @ (b_q · b_scale)ᵀ`` for fp8 ``a_q [M, K]``, ``b_q [N, K]`` (row-major)
    with float32 scales ``[M]``, ``[N]``; ``[M, N]`` in ``out_dtype``. On a GPU
    ``torch._scaled_mm`` rowwise: ``b_q.t()`` is the column-major view it wants, the scales go
    as ``[M, 1]`` and ``[1, N]`` (contiguous views, no copies), and the product comes out in
    BF16 (the only rowwise output type on sm_90). ``fast_accum`` (the forward, as torchao does)
    skips the periodic promotion of the fp8 tensor-core partial sums to float32."""
    if a_q.is_cuda:
        out = torch._scaled_mm(
            a_q,
            b_q.t(),
            scale_a=a_scale.view(-1, 1),
            scale_b=b_scale.view(1, -1),
            out_dtype=torch.bfloat16,
            use_fast_accum=fast_accum,
        )
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
    a = a_q.to(torch.float32) * a_scale[:, None]
    b = b_q.to(torch.float32) * b_scale[:, None]
    return (a @ b.t()).to(out_dtype)

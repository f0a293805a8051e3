"""The fp8 GEMMs behind the recipes: ``a @ bᵀ`` for operands quantized along their last dim (K).

``mx_matmul`` takes two MX operands (1×32 blocks along K). Hopper has no MX matmul, so
``merge_k128`` turns each run of four E8M0 scales along K into one 1×128 scale, their maximum
``e_max``, and shifts the fp8 values of the smaller blocks down by ``e_max − e`` whole binades
(a multiply by a power of two: exact while the value stays normal; values pushed below the normal
range are rounded to nearest-even in the element format, as any fp8 cast does). The merged
operands go to ``torch._scaled_mm`` with 1×128 blockwise float32 scales (cuBLAS on sm_90 takes
A's scales M-major and B's as ``[K/128, N]``). On the CPU the same merged operands are
dequantized exactly in float32 and multiplied: the emulation computes the same products, only
the float32 summation order differs.

``rowwise_matmul`` is the fp8_rowwise recipe's GEMM: one float32 scale per row of each operand
(``gem_lowprec.ops.fp8_cast`` makes them), ``torch._scaled_mm`` rowwise on a GPU, the dequantized
product on the CPU.
"""

import torch

from gem_lowprec.formats import SCALE_NAN, scale_to_float
from gem_lowprec.mx_tensor import MXTensor


def merge_k128(mx: MXTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1×32 MX along the last dim of ``[R, K]`` (K % 128 == 0) -> (fp8 ``[R, K]`` contiguous,
    float32 scales ``[R, K/128]``) with ``value = fp8 · scale`` per 1×128 block."""
    r, k = mx.shape
    if mx.layout.kind != "1x32" or mx.layout.axis != 1:
        raise ValueError(f"merge_k128 needs 1x32 blocks along the last dim, got {mx.layout}")
    if k % 128:
        raise ValueError(f"merge_k128 needs K to be a multiple of 128, got K={k}")
    byte = mx.scale.contiguous().to(torch.int32).view(r, k // 128, 4)
    byte_max = byte.amax(dim=-1, keepdim=True)
    shift = byte_max - byte  # whole binades each block's values move down
    down = torch.where(
        shift >= 127,
        torch.zeros_like(shift, dtype=torch.float32),
        ((127 - shift) << 23).view(torch.float32),
    )
    values = mx.data.contiguous().to(torch.float32).view(r, k // 128, 4, 32) * down[..., None]
    nan_block = (byte_max == SCALE_NAN)[..., None]
    values = torch.where(nan_block, torch.full_like(values, float("nan")), values)
    data = values.to(mx.elem_dtype).view(r, k)
    return data, scale_to_float(byte_max.squeeze(-1).to(torch.uint8))


def quantize_mx_k128(
    x: torch.Tensor,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    scale_mode: str = "rceil",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_k128(to_mx(x))`` for a 2-D ``x`` whose last dim is a multiple of 128; on a GPU one
    fused kernel (quantize, merge, re-encode) with the same bits."""
    from gem_lowprec.formats import elem_format, resolve_backend
    from gem_lowprec.ops.mx_quantize import to_mx

    if x.dim() != 2 or x.shape[1] % 128:
        raise ValueError(
            f"x must be 2-D with a last dim that is a multiple of 128, got {tuple(x.shape)}"
        )
    if resolve_backend(backend, x.device) == "triton":
        from gem_lowprec.ops.mx_quantize import triton as kernels

        fmt = elem_format(elem_dtype)
        data, scale = kernels.mx_quantize_merged_k128(x.contiguous(), fmt, scale_mode=scale_mode)
        return data.view(elem_dtype), scale
    return merge_k128(to_mx(x, elem_dtype=elem_dtype, scale_mode=scale_mode, backend=backend))


def quantize_mx_k128_rowcol(
    x: torch.Tensor,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    scale_mode: str = "rceil",
    backend: str = "auto",
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(quantize_mx_k128(x), quantize_mx_k128(xᵀ))`` for a 2-D ``x`` whose dims are multiples
    of 128: the operands of a GEMM contracting over x's columns and of one contracting over its
    rows. On a GPU one kernel reads x once and writes both (no transposed BF16 copy)."""
    from gem_lowprec.formats import elem_format, resolve_backend
    from gem_lowprec.ops.mx_quantize import to_mx

    if x.dim() != 2 or x.shape[0] % 128 or x.shape[1] % 128:
        raise ValueError(f"x must be 2-D with both dims multiples of 128, got {tuple(x.shape)}")
    if resolve_backend(backend, x.device) == "triton":
        from gem_lowprec.ops.fp8_cast import triton as kernels

        fmt = elem_format(elem_dtype)
        data, scale, data_t, scale_t = kernels.mx_rowcol_k128(
            x.contiguous(), fmt, scale_mode=scale_mode
        )
        return (data.view(elem_dtype), scale), (data_t.view(elem_dtype), scale_t)
    mx = dict(elem_dtype=elem_dtype, scale_mode=scale_mode, backend=backend)
    return merge_k128(to_mx(x, **mx)), merge_k128(to_mx(x.t().contiguous(), **mx))


def _expand_k(scale: torch.Tensor, block: int) -> torch.Tensor:
    return scale.repeat_interleave(block, dim=-1)


def blockwise_matmul(a_data, a_scale, b_data, b_scale, out_dtype) -> torch.Tensor:
    """``(a · a_scale) @ (b · b_scale)ᵀ`` with 1×128 float32 scales along K."""
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
    """``a @ bᵀ`` for MX operands ``a [M, K]`` and ``b [N, K]``, both in 1×32 blocks along K."""
    a_data, a_scale = merge_k128(a)
    b_data, b_scale = merge_k128(b)
    return blockwise_matmul(a_data, a_scale, b_data, b_scale, out_dtype)


def rowwise_matmul(
    a_q, a_scale, b_q, b_scale, out_dtype, *, fast_accum: bool = False
) -> torch.Tensor:
    """``(a_q · a_scale) @ (b_q · b_scale)ᵀ`` for fp8 ``a_q [M, K]``, ``b_q [N, K]`` (row-major)
    with float32 scales ``[M]``, ``[N]``. On a GPU ``torch._scaled_mm`` rowwise: ``b_q.t()`` is
    the column-major view it wants, the scales go as ``[M, 1]`` and ``[1, N]`` (contiguous
    views, no copies), and the product comes out in BF16 (the only rowwise output type on
    sm_90). ``fast_accum`` (the forward, as torchao does) skips the periodic promotion of the
    fp8 tensor-core partial sums to float32."""
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

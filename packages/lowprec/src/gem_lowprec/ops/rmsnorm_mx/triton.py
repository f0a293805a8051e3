"""Triton RMSNorm fused with 1×32 MX quantization: the normalized activation never goes to memory.

Legend: ``M`` rows, ``N`` features (a multiple of 32, at most 16384), ``Nb = N/32``, ``NB_P2``
that rounded up to a power of two (extra blocks masked). A program holds ``BLOCK_M`` whole rows
as a slab ``[R, 32]`` of ``R = BLOCK_M · NB_P2`` MX blocks, the shape in which the 32-element
reductions are cheapest; per-row sums go through a ``[BLOCK_M, NB_P2]`` reshape of block sums.

Stages: (1) load the rows once and widen to float32; (2) ``rstd = 1/sqrt(mean(x²) + eps)`` per
row and ``y = x · rstd · weight``; (3) per 32-element block, the amax of ``|y|`` bit patterns gives
the E8M0 byte and ``y`` is encoded exactly like ``to_mx`` does (the shared ``encode`` of the
quantize kernel); (4) store fp8 bytes and scale bytes. ``STORE_Y`` (tests only) also writes the
float32 ``y`` so the quantization can be checked bit for bit against the reference.
"""

import torch
import triton
import triton.language as tl
from gem_lowprec.formats import ElemFormat
from gem_lowprec.ops.mx_quantize.triton import (
    INTERPRETING,
    encode,
    format_constants,
    load_as_float32,
    scale_byte,
    use_hw_convert,
)


@triton.jit
def rmsnorm_mx_kernel(
    x_ptr,
    w_ptr,
    data_ptr,
    scale_ptr,
    y_ptr,
    M,
    N,
    eps,
    BLOCK_M: tl.constexpr,
    NB_P2: tl.constexpr,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX_EXP: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    RCEIL: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    IN_BF16: tl.constexpr,
    W_BF16: tl.constexpr,
    STORE_Y: tl.constexpr,
):
    # The program's rows as a slab of R = BLOCK_M · NB_P2 MX blocks of 32 ([R, 32]); block r is
    # (row r // NB_P2, block r % NB_P2 of that row).
    R: tl.constexpr = BLOCK_M * NB_P2
    blk_R = tl.arange(0, R)
    row_R = tl.program_id(0) * BLOCK_M + blk_R // NB_P2
    nb_R = blk_R % NB_P2
    j = tl.arange(0, 32)[None, :]
    cols_R32 = nb_R[:, None] * 32 + j
    mask_R32 = (row_R[:, None] < M) & (cols_R32 < N)
    offs_R32 = row_R[:, None].to(tl.int64) * N + cols_R32
    # Stage 1-2: one read, sum of squares per block then per row, normalize in float32.
    x = load_as_float32(x_ptr + offs_R32, mask_R32, IN_BF16)
    w = load_as_float32(w_ptr + cols_R32, cols_R32 < N, W_BF16)
    sum_sq_M = tl.sum(tl.reshape(tl.sum(x * x, axis=1), [BLOCK_M, NB_P2]), axis=1)
    rstd_M = 1.0 / tl.sqrt(sum_sq_M / N + eps)
    rstd_R = tl.reshape(tl.broadcast_to(rstd_M[:, None], [BLOCK_M, NB_P2]), [R])
    y = x * rstd_R[:, None] * w
    if STORE_Y:
        tl.store(y_ptr + offs_R32, y, mask=mask_R32)
    # Stage 3: block scales and elements (the encoder of to_mx).
    amax_R1 = tl.max(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1, keep_dims=True)
    byte_R1 = scale_byte(amax_R1, EMAX_EXP, RCEIL)
    q = encode(
        y, byte_R1, offs_R32, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT, False
    )
    # Stage 4: store bytes and scales.
    tl.store(data_ptr + offs_R32, q, mask=mask_R32)
    scale_offs = row_R[:, None].to(tl.int64) * (N // 32) + nb_R[:, None]
    tl.store(
        scale_ptr + scale_offs,
        byte_R1.to(tl.uint8),
        mask=(row_R[:, None] < M) & (nb_R[:, None] * 32 < N),
    )


def rmsnorm_mx(
    x_MN: torch.Tensor,
    weight_N: torch.Tensor,
    eps: float,
    fmt: ElemFormat,
    scale_mode: str,
    *,
    store_y: bool = False,
    block_m: int | None = None,
    num_warps: int | None = None,
):
    """Returns (data uint8 [M, N], scale uint8 [M, N/32], y float32 [M, N] or empty)."""
    M, N = x_MN.shape
    dev = x_MN.device
    data = torch.empty((M, N), dtype=torch.uint8, device=dev)
    scale = torch.empty((M, N // 32), dtype=torch.uint8, device=dev)
    y = torch.empty((M, N) if store_y else 0, dtype=torch.float32, device=dev)
    if M == 0:
        return data, scale, y
    nb_p2 = triton.next_power_of_2(N // 32)
    if block_m is None:  # about 8K elements per program on a GPU, fewer under the interpreter
        block_m = max(1, min(64, (2048 if INTERPRETING else 8192) // (nb_p2 * 32)))
        block_m = min(block_m, triton.next_power_of_2(M))
    if num_warps is None:
        num_warps = 8 if block_m * nb_p2 * 32 >= 8192 else 4
    in_bf16 = x_MN.dtype == torch.bfloat16
    w_bf16 = weight_N.dtype == torch.bfloat16
    rmsnorm_mx_kernel[(triton.cdiv(M, block_m),)](
        x_MN.view(torch.int16) if in_bf16 else x_MN,
        weight_N.view(torch.int16) if w_bf16 else weight_N,
        data,
        scale,
        y,
        M,
        N,
        eps,
        BLOCK_M=block_m,
        NB_P2=nb_p2,
        RCEIL=scale_mode == "rceil",
        HW_CONVERT=use_hw_convert(x_MN, False),
        IN_BF16=in_bf16,
        W_BF16=w_bf16,
        STORE_Y=store_y,
        num_warps=num_warps,
        **format_constants(fmt),
    )
    return data, scale, y

"""Triton RMSNorm fused with 1×32 MX quantization: the normalized activation never goes to memory.

Legend: ``M`` rows, ``N`` features (a multiple of 32, at most 16384), ``Nb = N/32``, ``NB`` that
rounded up to a power of two (extra blocks masked), ``BM`` rows per program. A program holds its
rows as a ``[BM, NB, 32]`` tile (row, MX block, element in block): the row's sum of squares
reduces the last two axes, a block's amax the last one, so every reduction stays on register
axes of one tile and no reshape moves data between threads.

Stages: (1) load the rows once and widen to float32, and the weight once per program;
(2) ``rstd = 1/sqrt(mean(x²) + eps)`` per row and ``y = x · rstd · weight``; (3) per 32-element
block, the amax of ``|y|`` bit patterns gives the E8M0 byte and ``y`` is encoded exactly like
``to_mx`` does (the shared ``encode`` of ``gem_lowprec._triton_codec``); (4) store the fp8 bytes and the
``[BM, NB]`` scale bytes (contiguous rows of the ``[M, Nb]`` scale matrix). ``STORE_Y`` (tests
only) also writes the float32 ``y`` so the quantization can be checked bit for bit against the
reference.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gem_lowprec._intmath import cdiv, next_power_of_2
from gem_lowprec._triton_codec import encode, load_as_float32, scale_byte
from gem_lowprec.codec import ElemFormat
from gem_lowprec.ops.launch import AUTO_LAUNCH, Launch


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
    NB: tl.constexpr,
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
    WIDE_INDEX: tl.constexpr,
):
    # Stage 1: the program's rows as [BM, NB, 32], the weight as [NB, 32].
    rows_BM = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if WIDE_INDEX:
        rows_BM = rows_BM.to(tl.int64)
    blk_NB = tl.arange(0, NB)
    cols_NB32 = blk_NB[:, None] * 32 + tl.arange(0, 32)[None, :]
    col_ok_NB32 = cols_NB32 < N
    offs = rows_BM[:, None, None] * N + cols_NB32[None, :, :]
    mask = (rows_BM[:, None, None] < M) & col_ok_NB32[None, :, :]
    x = load_as_float32(x_ptr + offs, mask, IN_BF16)
    w_NB32 = load_as_float32(w_ptr + cols_NB32, col_ok_NB32, W_BF16)
    # Stage 2: sum of squares per row, normalize in float32 (the reference's order of products).
    sum_sq_BM = tl.sum(tl.sum(x * x, axis=2), axis=1)
    rstd_BM = 1.0 / tl.sqrt(sum_sq_BM / N + eps)
    y = x * rstd_BM[:, None, None] * w_NB32[None, :, :]
    if STORE_Y:
        tl.store(y_ptr + offs, y, mask=mask)
    # Stage 3: one scale byte per block, then the elements (the encoder of to_mx).
    amax_BMNB = tl.max(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    byte_BMNB = scale_byte(amax_BMNB, EMAX_EXP, RCEIL)
    q = encode(
        y,
        byte_BMNB[:, :, None],
        offs,
        E4M3,
        MBITS,
        EMIN,
        MAX_BITS,
        MAX_VALUE,
        NAN_BITS,
        HW_CONVERT,
        False,
        127,  # RANGE_EMAX of float32, the dtype of y
    )
    # Stage 4: store bytes and scales.
    tl.store(data_ptr + offs, q, mask=mask)
    tl.store(
        scale_ptr + rows_BM[:, None] * (N // 32) + blk_NB[None, :],
        byte_BMNB.to(tl.uint8),
        mask=(rows_BM[:, None] < M) & (blk_NB[None, :] * 32 < N),
    )


@dataclass(frozen=True)
class RmsnormTiles:
    """Launch shape: about ``elements`` tile elements per program (whole rows), ``num_warps``."""

    elements: int = 4096
    num_warps: int = 4

    def block_m(self, n_features: int) -> int:
        return max(1, self.elements // (next_power_of_2(n_features // 32) * 32))


# On a GPU the dataclass defaults, the fastest of the benchmark's sweep (eager and replayed from
# a CUDA graph; persistent programs looping over row blocks with pipelined loads are no faster).
# Under the interpreter a few thousand elements per program keep numpy's arrays small.
GPU_TILES = RmsnormTiles()
INTERPRETER_TILES = RmsnormTiles(elements=2048, num_warps=4)


def rmsnorm_mx(
    x_MN: torch.Tensor,
    weight_N: torch.Tensor,
    eps: float,
    fmt: ElemFormat,
    scale_mode: str,
    *,
    store_y: bool = False,
    tiles: RmsnormTiles | None = None,
    launch: Launch = AUTO_LAUNCH,
):
    """Launch the fused kernel on a contiguous ``x [M, N]`` with ``weight [N]``. Returns (data
    uint8 [M, N], scale uint8 [M, N/32], y float32 [M, N] or empty); ``store_y`` (tests) also
    writes the float32 activation. ``tiles`` overrides the launch shape; ``launch`` picks the
    default shapes and the encoder."""
    M, N = x_MN.shape
    dev = x_MN.device
    data = torch.empty((M, N), dtype=torch.uint8, device=dev)
    scale = torch.empty((M, N // 32), dtype=torch.uint8, device=dev)
    y = torch.empty((M, N) if store_y else 0, dtype=torch.float32, device=dev)
    if M == 0 or N == 0:
        return data, scale, y
    if tiles is None:
        tiles = GPU_TILES if launch.gpu_shapes(x_MN) else INTERPRETER_TILES
    block_m = min(tiles.block_m(N), next_power_of_2(M))
    in_bf16 = x_MN.dtype == torch.bfloat16
    w_bf16 = weight_N.dtype == torch.bfloat16
    rmsnorm_mx_kernel[(cdiv(M, block_m),)](
        x_MN.view(torch.int16) if in_bf16 else x_MN,
        weight_N.view(torch.int16) if w_bf16 else weight_N,
        data,
        scale,
        y,
        M,
        N,
        eps,
        BLOCK_M=block_m,
        NB=next_power_of_2(N // 32),
        RCEIL=scale_mode == "rceil",
        HW_CONVERT=launch.hardware_encoder(x_MN),
        IN_BF16=in_bf16,
        W_BF16=w_bf16,
        STORE_Y=store_y,
        WIDE_INDEX=x_MN.numel() >= 2**31 - 2**20,
        num_warps=tiles.num_warps,
        **fmt.kernel_constants,
    )
    return data, scale, y

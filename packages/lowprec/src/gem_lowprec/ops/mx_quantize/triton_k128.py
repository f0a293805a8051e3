"""Triton MX quantization merged into 1×128 blocks, the operands of Hopper's blockwise fp8 GEMM.

Hopper has no MX matmul. ``merge_k128`` (``reference.py``) turns each run of four 1×32 E8M0
scales along K into one 1×128 float32 scale, their maximum, and shifts the fp8 values of the
smaller blocks down by whole binades. Two fused kernels do the same without writing the 1×32
intermediate:

- rows only: ``mx_quantize_rows_kernel`` with ``MERGE_K128`` (``triton.py``), for an operand
  that contracts over its columns;
- both ways: ``mx_rowcol_k128_kernel`` reads a 128×128 tile once as ``[4, 32, 4, 32]`` (row
  block, row, column block, column) and writes the 1×128 copy along C and the 128×1 copy along R
  (stored transposed), the operands of the GEMMs that contract over C and over R. Its scales are
  stored outer-dim-major, the layout cuBLAS's 1×128 blockwise GEMM takes for either operand.

Per element: MX-encode at the 1×32 block's byte (saturating where the input dtype's range
ends, as ``to_mx`` does), decode, multiply by ``2^−(group − byte)`` and
re-encode at scale 2^0 (``merge_to_k128``): exact unless a value leaves the normal range, where
the re-encode rounds to nearest-even, as the reference's fp8 cast does.
"""

import torch
import triton
import triton.language as tl
from gem_lowprec._triton_codec import decode, encode, load_as_float32, scale_byte, scale_float
from gem_lowprec.codec import ElemFormat, range_emax
from gem_lowprec.ops.launch import AUTO_LAUNCH, Launch
from gem_lowprec.ops.mx_quantize.triton import (
    RowsTiles,
    as_kernel_input,
    default_tiles,
    launch_constants,
    launch_rows,
)


@triton.jit
def merge_to_k128(
    x,
    byte,
    byte_group,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    RANGE_EMAX: tl.constexpr,
):
    """fp8 bytes of x in a 1×128 block: MX-encode at the 1×32 block's byte (saturating where
    the input dtype's range ends), then shift down by ``byte_group − byte`` whole binades and
    re-encode at scale 2^0 (``scaled_matmul.merge_k128``; the shifted values are in range)."""
    q = encode(
        x, byte, byte, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT, False,
        RANGE_EMAX,
    )  # fmt: skip
    down = ((127 - tl.minimum(byte_group - byte, 126)) << 23).to(tl.float32, bitcast=True)
    v = decode(q.to(tl.int32), E4M3, MBITS, EMIN, HW_CONVERT) * down
    unit = tl.where(byte_group == 255, 255, 127)
    return encode(
        v, unit, unit, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT, False, None
    )


@triton.jit
def mx_rowcol_k128_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    data_t_ptr,
    scale_t_ptr,
    R,
    C,
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
    RANGE_EMAX: tl.constexpr,
):
    """One 128×128 tile, read once as ``[4, 32, 4, 32]`` (row block, row, column block, column):
    MX 1×32 blocks along C merged into 1×128 (row-major copy, a float32 scale per row and
    128 columns, stored ``[C/128, R]``) and 1×32 blocks along R merged into 128×1 (stored
    transposed, a scale per column and 128 rows, stored ``[R/128, C]``): both fp8 operands of
    the GEMMs that contract over C and over R."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rb = tl.arange(0, 4)[:, None, None, None]
    ri = tl.arange(0, 32)[None, :, None, None]
    cb = tl.arange(0, 4)[None, None, :, None]
    ci = tl.arange(0, 32)[None, None, None, :]
    rows = (pid_r * 128 + rb * 32 + ri).to(tl.int64)
    cols = (pid_c * 128 + cb * 32 + ci).to(tl.int64)
    x = load_as_float32(x_ptr + rows * C + cols, (rows < R) & (cols < C), IN_BF16)
    abs_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    # along C: a byte per 1×32 block, the group's largest of the four
    byte_r = scale_byte(tl.max(abs_bits, axis=3, keep_dims=True), EMAX_EXP, RCEIL)
    group_r = tl.max(byte_r, axis=2, keep_dims=True)
    q = merge_to_k128(
        x,
        byte_r,
        group_r,
        E4M3,
        MBITS,
        EMIN,
        MAX_BITS,
        MAX_VALUE,
        NAN_BITS,
        HW_CONVERT,
        RANGE_EMAX,
    )
    tl.store(data_ptr + rows * C + cols, q)
    rows_128 = (pid_r * 128 + tl.arange(0, 128)).to(tl.int64)
    tl.store(scale_ptr + pid_c * R + rows_128, scale_float(tl.reshape(group_r, [128])))
    # along R: a byte per 32×1 block, the group's largest of the four; stored as [C, R]
    byte_c = scale_byte(tl.max(abs_bits, axis=1, keep_dims=True), EMAX_EXP, RCEIL)
    group_c = tl.max(byte_c, axis=0, keep_dims=True)
    q_t = merge_to_k128(
        x,
        byte_c,
        group_c,
        E4M3,
        MBITS,
        EMIN,
        MAX_BITS,
        MAX_VALUE,
        NAN_BITS,
        HW_CONVERT,
        RANGE_EMAX,
    )
    tl.store(data_t_ptr + cols * R + rows, q_t)
    cols_128 = (pid_c * 128 + tl.arange(0, 128)).to(tl.int64)
    tl.store(scale_t_ptr + pid_r * C + cols_128, scale_float(tl.reshape(group_c, [128])))


def mx_quantize_merged_k128(
    x_MK: torch.Tensor,
    fmt: ElemFormat,
    *,
    scale_mode: str,
    tiles: RowsTiles | None = None,
    launch: Launch = AUTO_LAUNCH,
):
    """MX-quantize rows of a contiguous ``[M, K]`` (K % 128 == 0) and merge to 1×128 blocks:
    returns (fp8 bytes uint8 ``[M, K]``, float32 scales ``[M, K/128]``)."""
    M, K = x_MK.shape
    data = torch.empty((M, K), dtype=torch.uint8, device=x_MK.device)
    group_scale = torch.empty((M, K // 128), dtype=torch.float32, device=x_MK.device)
    if M == 0 or K == 0:
        return data, group_scale
    constants = launch_constants(x_MK, fmt, scale_mode, launch)
    t = tiles or default_tiles(x_MK, launch)[0]
    launch_rows(as_kernel_input(x_MK), data, data, group_scale, None, t, constants)
    return data, group_scale


def mx_rowcol_k128(
    x: torch.Tensor, fmt: ElemFormat, *, scale_mode: str, launch: Launch = AUTO_LAUNCH
):
    """MX-quantize a contiguous ``[R, C]`` (both multiples of 128) into 1×128 blocks along C and
    along R from one read. Returns (data uint8 ``[R, C]``, scale float32 ``[R, C/128]``, data_t
    uint8 ``[C, R]``, scale_t float32 ``[C, R/128]``). The scales are stored outer-dim-major
    (views of ``[C/128, R]`` and ``[R/128, C]``), the layout cuBLAS's 1×128 blockwise GEMM takes
    for either operand, so ``blockwise_matmul`` passes them without a copy."""
    R, C = x.shape
    dev = x.device
    data = torch.empty((R, C), dtype=torch.uint8, device=dev)
    scale = torch.empty((C // 128, R), dtype=torch.float32, device=dev).t()
    data_t = torch.empty((C, R), dtype=torch.uint8, device=dev)
    scale_t = torch.empty((R // 128, C), dtype=torch.float32, device=dev).t()
    if R and C:
        num_warps = dict(num_warps=16) if launch.gpu_shapes(x) else {}
        mx_rowcol_k128_kernel[(R // 128, C // 128)](
            as_kernel_input(x), data, scale, data_t, scale_t, R, C, RCEIL=scale_mode == "rceil",
            HW_CONVERT=launch.hardware_encoder(x), IN_BF16=x.dtype == torch.bfloat16,
            RANGE_EMAX=range_emax(x.dtype), **fmt.kernel_constants, **num_warps,
        )  # fmt: skip
    return data, scale, data_t, scale_t

"""Triton MX quantize kernels: 1×32 row-wise and column-wise copies from one read, and 32×32.

Legend (shape suffixes): ``M`` rows of x, ``K`` columns of x (x is ``[M, K]`` contiguous),
``Mb = M/32``, ``Kb = K/32``; inside a program the tile is held as a 4-D block
``[BM/32, 32, BK/32, 32]`` = (row block, row in block, column block, column in block), so every
MX block is a reduction over one or two axes of the same registers.

Stages of one program:
1. Load a ``[BM, BK]`` tile of x once, widen to float32, take ``|x|`` bit patterns (integers order
   like the values; a pattern ``>= 0x7F800000`` is NaN/Inf).
2. Per requested layout, reduce those patterns to the block amax: over the column-in-block axis
   for row-wise 1×32 blocks, over the row-in-block axis for column-wise blocks, over both for
   32×32 tiles, and turn each amax into its E8M0 byte (integer rule of the reference).
3. Encode the elements. On a GPU: multiply by ``2^−e`` (exact in float32 until the result drops
   below 2^−126, which rounds to zero in fp8 either way), clamp to ±max (saturation; the hardware
   cast alone would give NaN), and let the hardware round-to-nearest-even cast do the rest.
   Under Triton's interpreter, whose fp32 -> fp8 cast rounds wrongly, and for stochastic
   rounding, the reference's integer encoder runs instead (``HW_CONVERT=False``); both are
   checked bit for bit against the reference, the integer one on every bf16 bit pattern on CPU
   and the hardware one likewise on the GPU.
4. Store the fp8 bytes: row-major for the row-wise copy and the 32×32 tiles, transposed
   (``[K, M]``) for the column-wise copy so that it is the K-major operand a GEMM wants, and the
   scale bytes beside them.
"""

import os

import torch
import triton
import triton.language as tl
from gem_lowprec.formats import ElemFormat
from gem_lowprec.ops.mx_quantize.reference import seed_key

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def scale_byte(amax_bits, EMAX_EXP: tl.constexpr, RCEIL: tl.constexpr):
    """E8M0 byte (int32) of blocks whose amax has float32 bits ``amax_bits``; 255 for NaN/Inf."""
    byte = (amax_bits >> 23) - EMAX_EXP
    if RCEIL:
        byte += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    byte = tl.minimum(tl.maximum(byte, 0), 254)
    return tl.where(amax_bits >= 0x7F800000, 255, byte)


@triton.jit
def load_as_float32(ptrs, mask, IN_BF16: tl.constexpr):
    """Load and widen to float32. bf16 arrives as int16 bits and is widened by a shift (exact for
    subnormals too, which the interpreter's bf16 cast flushes)."""
    if IN_BF16:
        raw = tl.load(ptrs, mask=mask, other=0)
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def lowbias32(x):
    """Wellons' 32-bit hash on int64 values in [0, 2^32) (same as the reference)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def encode_hw(x_f32, byte, E4M3: tl.constexpr, MAX_VALUE: tl.constexpr, NAN_BITS: tl.constexpr):
    """fp8 bytes of x / 2^(byte − 127) through the hardware round-to-nearest-even cast."""
    inv_scale = (tl.maximum(254 - byte, 1) << 23).to(tl.float32, bitcast=True)  # 2^−e
    v = tl.minimum(tl.maximum(x_f32 * inv_scale, -MAX_VALUE), MAX_VALUE)
    if E4M3:
        q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        q = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return tl.where(byte == 255, NAN_BITS, q.to(tl.int32))


@triton.jit
def encode_int(
    x_bits,
    byte,
    noise,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    MAX_BITS: tl.constexpr,
    NAN_BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """fp8 bytes of x / 2^(byte − 127) by integer arithmetic (the reference's ``encode``)."""
    sign = (x_bits >> 31) & 1
    magnitude = x_bits & 0x7FFFFFFF
    biased_exp = magnitude >> 23
    mantissa = magnitude & 0x7FFFFF
    normal = biased_exp > 0
    sig = tl.where(normal, mantissa | 0x800000, mantissa)
    lsb_exp = tl.maximum(biased_exp, 1) - 150
    top_bit = (mantissa.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    log2_x = tl.where(normal, biased_exp - 127, top_bit - 149)
    e = byte - 127
    exp_scaled = tl.maximum(log2_x - e, EMIN)
    shift = tl.maximum(e + exp_scaled - MBITS - lsb_exp, 0)
    if STOCHASTIC:
        shift_c = tl.minimum(shift, 32).to(tl.int64)
        n64 = (sig.to(tl.int64) + (noise >> (32 - shift_c))) >> shift_c
        n = tl.where(shift <= 32, n64, 0).to(tl.int32)
    else:
        shift = tl.minimum(shift, 30)
        n = sig >> shift
        remainder = sig - (n << shift)
        half = (tl.full(shift.shape, 1, tl.int32) << shift) >> 1
        round_up = (remainder > half) | ((remainder == half) & (half > 0) & ((n & 1) == 1))
        n = n + round_up.to(tl.int32)
    out = ((exp_scaled - EMIN) << MBITS) + n
    out = tl.minimum(tl.where(sig == 0, 0, out), MAX_BITS)
    return tl.where(byte == 255, NAN_BITS, out | (sign << 7))


@triton.jit
def encode(
    x_f32,
    byte,
    noise,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    if HW_CONVERT and not STOCHASTIC:
        q = encode_hw(x_f32, byte, E4M3, MAX_VALUE, NAN_BITS)
    else:
        x_bits = x_f32.to(tl.int32, bitcast=True)
        q = encode_int(x_bits, byte, noise, MBITS, EMIN, MAX_BITS, NAN_BITS, STOCHASTIC)
    return q.to(tl.uint8)


@triton.jit
def decode(
    q, E4M3: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, HW_CONVERT: tl.constexpr
):
    """fp8 bytes (int32) -> exact float32 values (NaN bytes are the caller's business)."""
    if HW_CONVERT:
        if E4M3:
            return q.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return q.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
    exp_field = (q & 0x7F) >> MBITS
    mantissa = q & ((1 << MBITS) - 1)
    normal_bits = ((exp_field - (1 - EMIN) + 127) << 23) | (mantissa << (23 - MBITS))
    subnormal = mantissa.to(tl.float32) * (2.0 ** (EMIN - MBITS))
    magnitude = tl.where(exp_field > 0, normal_bits.to(tl.float32, bitcast=True), subnormal)
    return tl.where((q & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def mx_quantize_kernel(
    x_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    M,
    K,
    seed_key,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    TILE_2D: tl.constexpr,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX_EXP: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    RCEIL: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    IN_BF16: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Stage 1: one read of the [BM, BK] tile as [BM/32, 32, BK/32, 32].
    mb = tl.arange(0, BLOCK_M // 32)[:, None, None, None]
    mi = tl.arange(0, 32)[None, :, None, None]
    kb = tl.arange(0, BLOCK_K // 32)[None, None, :, None]
    ki = tl.arange(0, 32)[None, None, None, :]
    rows = pid_m * BLOCK_M + mb * 32 + mi
    cols = pid_k * BLOCK_K + kb * 32 + ki
    if WIDE_INDEX:  # 64-bit offsets only for tensors past 2^31 elements
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    in_bounds = (rows < M) & (cols < K)
    offs_MK = rows * K + cols
    x = load_as_float32(x_ptr + offs_MK, in_bounds, IN_BF16)
    abs_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    Kb = K // 32
    Mb = M // 32

    if ROWS:  # 1×32 blocks along K, stored row-major [M, K] with scales [M, Kb]
        amax_r = tl.max(abs_bits, axis=3, keep_dims=True)
        byte_r = scale_byte(amax_r, EMAX_EXP, RCEIL)
        noise_r = offs_MK
        if STOCHASTIC:
            noise_r = lowbias32((offs_MK.to(tl.int64) + seed_key) & 0xFFFFFFFF)
        q_r = encode(
            x,
            byte_r,
            noise_r,
            E4M3,
            MBITS,
            EMIN,
            MAX_BITS,
            MAX_VALUE,
            NAN_BITS,
            HW_CONVERT,
            STOCHASTIC,
        )
        tl.store(row_data_ptr + offs_MK, q_r, mask=in_bounds)
        scale_rows = rows * Kb + pid_k * (BLOCK_K // 32) + kb
        tl.store(
            row_scale_ptr + scale_rows,
            byte_r.to(tl.uint8),
            mask=(rows < M) & (kb * 32 + pid_k * BLOCK_K < K),
        )
    if COLS:  # 1×32 blocks along M, stored transposed [K, M] with scales [K, Mb]
        amax_c = tl.max(abs_bits, axis=1, keep_dims=True)
        byte_c = scale_byte(amax_c, EMAX_EXP, RCEIL)
        offs_KM = cols * M + rows
        noise_c = offs_KM
        if STOCHASTIC:
            noise_c = lowbias32((offs_KM.to(tl.int64) + seed_key) & 0xFFFFFFFF)
        q_c = encode(
            x,
            byte_c,
            noise_c,
            E4M3,
            MBITS,
            EMIN,
            MAX_BITS,
            MAX_VALUE,
            NAN_BITS,
            HW_CONVERT,
            STOCHASTIC,
        )
        tl.store(col_data_ptr + offs_KM, q_c, mask=in_bounds)
        scale_cols = cols * Mb + pid_m * (BLOCK_M // 32) + mb
        tl.store(
            col_scale_ptr + scale_cols,
            byte_c.to(tl.uint8),
            mask=(cols < K) & (mb * 32 + pid_m * BLOCK_M < M),
        )
    if TILE_2D:  # 32×32 tiles, stored row-major [M, K] with scales [Mb, Kb]
        amax_t = tl.max(tl.max(abs_bits, axis=3, keep_dims=True), axis=1, keep_dims=True)
        byte_t = scale_byte(amax_t, EMAX_EXP, RCEIL)
        q_t = encode(
            x, byte_t, offs_MK, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT, False
        )
        tl.store(row_data_ptr + offs_MK, q_t, mask=in_bounds)
        tile_rows = pid_m * (BLOCK_M // 32) + mb
        tile_cols = pid_k * (BLOCK_K // 32) + kb
        tl.store(
            row_scale_ptr + tile_rows * Kb + tile_cols,
            byte_t.to(tl.uint8),
            mask=(tile_rows < Mb) & (tile_cols < Kb),
        )


@triton.jit
def mx_quantize_rows_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    group_scale_ptr,
    n_blocks,
    seed_key,
    BLOCKS: tl.constexpr,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX_EXP: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    RCEIL: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    IN_BF16: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
    MERGE_K128: tl.constexpr,
):
    """Row-wise 1×32 blocks of a contiguous tensor: block ``b`` is elements ``32b .. 32b+31`` and
    its scale is byte ``b``, so a program is a ``[BLOCKS, 32]`` slab of consecutive blocks (one
    contiguous read, one contiguous write, one contiguous scale write).

    ``MERGE_K128`` (rows a multiple of 128 long) then merges each run of four blocks into one
    1×128 block for Hopper's blockwise GEMM, exactly as ``scaled_matmul.merge_k128`` does: the
    group scale is the largest of the four, each block's fp8 values are decoded, shifted down by
    the difference in whole binades and re-encoded (round-to-nearest-even; exact unless a value
    leaves the normal range). It stores the merged bytes and one float32 scale per group."""
    blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    if WIDE_INDEX:
        blk = blk.to(tl.int64)
    in_bounds_B = blk < n_blocks
    offs_B32 = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask_B32 = in_bounds_B[:, None]
    x = load_as_float32(x_ptr + offs_B32, mask_B32, IN_BF16)
    amax_B1 = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1, keep_dims=True)
    byte_B1 = scale_byte(amax_B1, EMAX_EXP, RCEIL)
    noise = offs_B32
    if STOCHASTIC:
        noise = lowbias32((offs_B32.to(tl.int64) + seed_key) & 0xFFFFFFFF)
    q = encode(
        x, byte_B1, noise, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT, STOCHASTIC
    )
    if MERGE_K128:
        G: tl.constexpr = BLOCKS // 4
        byte_G = tl.max(tl.reshape(byte_B1, [G, 4]), axis=1)
        byte_max_B1 = tl.reshape(tl.broadcast_to(byte_G[:, None], [G, 4]), [BLOCKS, 1])
        shift_B1 = tl.minimum(byte_max_B1 - byte_B1, 126)
        down_B1 = ((127 - shift_B1) << 23).to(tl.float32, bitcast=True)  # 2^-shift
        v = decode(q.to(tl.int32), E4M3, MBITS, EMIN, HW_CONVERT) * down_B1
        unit_B1 = tl.where(byte_max_B1 == 255, 255, 127)  # scale 2^0, or NaN for NaN groups
        q = encode(
            v, unit_B1, noise, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT, False
        )
        grp = tl.program_id(0) * G + tl.arange(0, G)
        group_bits = tl.where(byte_G == 0, 0x00400000, byte_G << 23)  # 2^-127 is subnormal
        group_bits = tl.where(byte_G == 255, 0x7FC00000, group_bits)
        tl.store(
            group_scale_ptr + grp, group_bits.to(tl.float32, bitcast=True), mask=grp < n_blocks // 4
        )
    else:
        tl.store(scale_ptr + blk[:, None], byte_B1.to(tl.uint8), mask=in_bounds_B[:, None])
    tl.store(data_ptr + offs_B32, q, mask=mask_B32)


_ROWS_CONFIGS = [
    triton.Config({"BLOCKS": b}, num_warps=w, num_stages=1)
    for b, w in [(64, 4), (128, 4), (128, 8), (256, 4), (256, 8), (512, 8), (1024, 8)]
]
_tuned_rows_kernel = triton.autotune(
    configs=_ROWS_CONFIGS,
    key=["n_blocks", "E4M3", "HW_CONVERT", "IN_BF16", "STOCHASTIC", "MERGE_K128"],
)(mx_quantize_rows_kernel)


_TUNED_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bm, bk, w, s in [
        (32, 128, 4, 1),
        (32, 256, 4, 1),
        (32, 256, 8, 1),
        (64, 128, 4, 1),
        (64, 256, 8, 1),
        (128, 128, 8, 1),
        (32, 512, 8, 1),
        (64, 64, 4, 1),
        (64, 512, 8, 1),
    ]
]
_tuned_kernel = triton.autotune(
    configs=_TUNED_CONFIGS,
    key=["M", "K", "ROWS", "COLS", "TILE_2D", "E4M3", "HW_CONVERT", "IN_BF16"],
)(mx_quantize_kernel)

# Under the interpreter each program is a round of numpy calls: few, large tiles run fastest.
_INTERPRETER_BLOCK = {"BLOCK_M": 256, "BLOCK_K": 64}


def format_constants(fmt: ElemFormat) -> dict:
    return {
        "E4M3": fmt.name == "e4m3",
        "MBITS": fmt.mbits,
        "EMIN": fmt.emin,
        "EMAX_EXP": fmt.emax_exp,
        "MAX_BITS": fmt.max_bits,
        "MAX_VALUE": fmt.max_value,
        "NAN_BITS": fmt.nan_bits,
    }


def use_hw_convert(x: torch.Tensor, force_integer: bool) -> bool:
    return x.is_cuda and not INTERPRETING and not force_integer


def mx_quantize(
    x_MK: torch.Tensor,
    fmt: ElemFormat,
    *,
    rows: bool,
    cols: bool,
    tile_2d: bool,
    scale_mode: str,
    seed: int | None,
    force_integer: bool = False,
):
    """Launch the quantizer on a contiguous ``[M, K]`` tensor (M, K multiples of 32).

    Returns ``(row_data [M, K], row_scale [M, Kb] or [Mb, Kb] for 32×32, col_data [K, M],
    col_scale [K, Mb])`` as uint8; outputs of layouts not asked for are empty.
    """
    M, K = x_MK.shape
    dev = x_MK.device

    def buffer(shape, wanted):  # a distinct empty tensor for each output not asked for
        return torch.empty(shape if wanted else 0, dtype=torch.uint8, device=dev)

    row_data = buffer((M, K), rows or tile_2d)
    row_scale = buffer((M // 32, K // 32), True) if tile_2d else buffer((M, K // 32), rows)
    col_data = buffer((K, M), cols)
    col_scale = buffer((K, M // 32), cols)
    if M == 0 or K == 0:
        return row_data, row_scale, col_data, col_scale
    in_bf16 = x_MK.dtype == torch.bfloat16
    x_arg = x_MK.view(torch.int16) if in_bf16 else x_MK
    wide = x_MK.numel() >= 2**31 - 2**20
    if rows and not cols:
        _launch_rows(
            x_arg, row_data, row_scale, None, fmt, scale_mode, seed, force_integer, in_bf16, wide
        )
        return row_data, row_scale, col_data, col_scale
    args = (x_arg, row_data, row_scale, col_data, col_scale, M, K, seed_key(seed or 0))
    constants = dict(
        ROWS=rows,
        COLS=cols,
        TILE_2D=tile_2d,
        RCEIL=scale_mode == "rceil",
        HW_CONVERT=use_hw_convert(x_MK, force_integer),
        STOCHASTIC=seed is not None,
        IN_BF16=in_bf16,
        WIDE_INDEX=wide,
        **format_constants(fmt),
    )
    if INTERPRETING or not x_MK.is_cuda:
        bm, bk = _INTERPRETER_BLOCK["BLOCK_M"], _INTERPRETER_BLOCK["BLOCK_K"]
        grid = (triton.cdiv(M, bm), triton.cdiv(K, bk))
        mx_quantize_kernel[grid](*args, BLOCK_M=bm, BLOCK_K=bk, **constants)
    else:
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(K, meta["BLOCK_K"]))
        _tuned_kernel[grid](*args, **constants)
    return row_data, row_scale, col_data, col_scale


def mx_quantize_merged_k128(x_MK: torch.Tensor, fmt: ElemFormat, *, scale_mode: str):
    """MX-quantize rows of a contiguous ``[M, K]`` (K % 128 == 0) and merge to 1×128 blocks:
    returns (fp8 bytes uint8 ``[M, K]``, float32 scales ``[M, K/128]``)."""
    M, K = x_MK.shape
    data = torch.empty((M, K), dtype=torch.uint8, device=x_MK.device)
    group_scale = torch.empty((M, K // 128), dtype=torch.float32, device=x_MK.device)
    if M == 0:
        return data, group_scale
    in_bf16 = x_MK.dtype == torch.bfloat16
    x_arg = x_MK.view(torch.int16) if in_bf16 else x_MK
    wide = x_MK.numel() >= 2**31 - 2**20
    _launch_rows(x_arg, data, data, group_scale, fmt, scale_mode, None, False, in_bf16, wide)
    return data, group_scale


def _launch_rows(
    x_arg, data, scale, group_scale, fmt, scale_mode, seed, force_integer, in_bf16, wide
):
    n_blocks = x_arg.numel() // 32
    merge = group_scale is not None
    constants = dict(
        MERGE_K128=merge,
        RCEIL=scale_mode == "rceil",
        HW_CONVERT=use_hw_convert(x_arg, force_integer),
        STOCHASTIC=seed is not None,
        IN_BF16=in_bf16,
        WIDE_INDEX=wide,
        **format_constants(fmt),
    )
    args = (x_arg, data, scale, group_scale if merge else scale, n_blocks, seed_key(seed or 0))
    if INTERPRETING or not x_arg.is_cuda:
        blocks = 512
        mx_quantize_rows_kernel[(triton.cdiv(n_blocks, blocks),)](*args, BLOCKS=blocks, **constants)
    else:
        grid = lambda meta: (triton.cdiv(n_blocks, meta["BLOCKS"]),)
        _tuned_rows_kernel[grid](*args, **constants)

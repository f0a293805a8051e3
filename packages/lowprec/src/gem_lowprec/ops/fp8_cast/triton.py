"""Triton kernels for the row-wise / column-wise fp8 casts of ``reference.py``.

Legend (shape suffixes): ``x`` is ``[R, C]`` contiguous; ``_R`` one value per row, ``_C`` one per
column, ``_RC`` a tile of rows × columns.

``cast_rows_kernel`` (one program per ``BLOCK_R`` rows, persistent over row blocks):
1. Read the rows chunk by chunk, keep the largest ``|x|`` bit pattern per row (and, when asked,
   fold ``|x · row_mult|`` into a per-column amax with an atomic max: the statistics the
   column-wise cast of the same tensor needs, from the same read).
2. Turn each row amax into its power-of-two scale (the E8M0 rule of the MX kernels).
3. Read the rows again (the grid is sized so that a wave's rows fit in L2: the second read comes
   from L2, not HBM), cast and store the fp8 row-major.
Rows that fit one chunk skip the second read: the block is cast from registers. With a column
amax the loads of the next row blocks are in flight meanwhile (``tl.range`` with
``num_stages``); without one they did not help on an H200.

``transpose_bytes_kernel`` then writes the transposed copy (``[C, R]``, the layout the
weight-gradient GEMM contracts over) from the fp8 bytes: one byte read and one written per
element on top of the cast's three, in square tiles whose rows are whole 128-byte lines both
ways. The cast kernel used to write it too, from a second, transposed read of its row chunk:
16-byte segments at a stride of R, 1.1 TB/s on an H200 against 2.8 without the copy. It could
not simply store its fp8 tile a second time through a layout conversion: on an H200 (Triton
3.6) that double store came out with a wrong column (the pattern of an upstream report of fp8
double stores miscompiled by ptxas 12.9); here every byte tile is stored once.

``tile_amax_kernel`` + ``cast_both_kernel`` cast a (small) weight both ways in two launches
after a zero-fill: the first reads each tile with one load and folds its row and column amaxes
in by atomic max, the second casts each tile with its row scales (stored row-major) and its
column scales (stored transposed). A weight is a few MiB: what bounds it is the latency of
dependent loads, so every program reads one tile at once instead of looping over a stripe.

``column_amax_kernel`` and ``cast_columns_kernel`` are the two passes of a column-wise cast of a
tall tensor (scale per column over all rows): an amax over row tiles with atomics, then a tile
cast stored transposed. Column amaxes of NaN columns are the canonical quiet NaN ``0x7FC00000``
(a GPU multiply returns ``0x7FFFFFFF`` for any NaN, the CPU keeps the input's payload; the
reference canonicalises the same way).

Casting multiplies by ``2^−e`` (exact) and lets the hardware's round-to-nearest-even cast round;
under the interpreter the integer encoder of the MX kernels runs instead, so both match the
reference bit for bit.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gem_lowprec._intmath import cdiv, next_power_of_2
from gem_lowprec.formats import ElemFormat
from gem_lowprec.ops.mx_quantize.triton import (
    INTERPRETING,
    decode,
    encode,
    format_constants,
    load_as_float32,
    scale_byte,
)


@triton.jit
def scale_float(byte):
    """float32 ``2^(byte − 127)``: byte 0 is the subnormal 2^−127, byte 255 NaN."""
    bits = tl.where(byte == 0, 0x00400000, byte << 23)
    return tl.where(byte == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def canonical_amax(abs_bits):
    """``|v|`` bit patterns with every NaN made the canonical quiet NaN ``0x7FC00000``."""
    return tl.where(abs_bits > 0x7F800000, 0x7FC00000, abs_bits)


@triton.jit
def cast_at_scale(
    x,
    byte,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    HW_CONVERT: tl.constexpr,
):
    """fp8 bytes of ``x / 2^(byte − 127)``, rounded to nearest-even and saturated (the MX
    encoder with one scale byte per element's row or column)."""
    return encode(
        x, byte, byte, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT, False
    )


@triton.jit
def cast_rows_kernel(
    x_ptr,
    row_mult_ptr,
    data_ptr,
    scale_ptr,
    col_amax_ptr,
    R,
    C,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    COL_AMAX: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX_EXP: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    """``ONE_CHUNK`` (``C <= BLOCK_C``): a row block is read once and cast from registers, with
    the loads of ``NUM_STAGES`` row blocks in flight; the column amax is kept in registers over
    all of the program's row blocks as an elementwise running maximum of whole tiles, reduced
    across rows (a cross-warp reduction through shared memory) and folded in with one atomic per
    column only at the end, not per block (reducing every block made the cast 4× slower on an
    H200). Longer rows go chunk by chunk, twice (stages 1 and 3)."""
    n_row_blocks = tl.cdiv(R, BLOCK_R)
    col_amax_RC = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    for row_block in tl.range(
        tl.program_id(0), n_row_blocks, tl.num_programs(0), num_stages=NUM_STAGES
    ):
        rows_R = (row_block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        row_ok_R = rows_R < R
        if COL_AMAX:
            mult_R = tl.load(row_mult_ptr + rows_R, mask=row_ok_R, other=0.0)
        if ONE_CHUNK:
            # Stages 1-3 on whole rows: amaxes, the row scales, the cast from registers.
            cols_C = tl.arange(0, BLOCK_C).to(tl.int64)
            mask_RC = row_ok_R[:, None] & (cols_C < C)[None, :]
            x_RC = load_as_float32(x_ptr + rows_R[:, None] * C + cols_C[None, :], mask_RC, IN_BF16)
            byte_R = scale_byte(
                tl.max(x_RC.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1), EMAX_EXP, True
            )
            if COL_AMAX:
                v_bits_RC = (x_RC * mult_R[:, None]).to(tl.int32, bitcast=True) & 0x7FFFFFFF
                col_amax_RC = tl.maximum(col_amax_RC, v_bits_RC)
            tl.store(scale_ptr + rows_R, scale_float(byte_R), mask=row_ok_R)
            q_RC = cast_at_scale(
                x_RC, byte_R[:, None], E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT
            )
            tl.store(data_ptr + rows_R[:, None] * C + cols_C[None, :], q_RC, mask=mask_RC)
        else:
            # Stage 1: row amax (and the column amax of x · row_mult) from one read.
            amax_R = tl.zeros([BLOCK_R], dtype=tl.int32)
            for c0 in range(0, C, BLOCK_C):
                cols_C = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
                mask_RC = row_ok_R[:, None] & (cols_C < C)[None, :]
                x_RC = load_as_float32(
                    x_ptr + rows_R[:, None] * C + cols_C[None, :], mask_RC, IN_BF16
                )
                amax_R = tl.maximum(amax_R, tl.max(x_RC.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1))
                if COL_AMAX:
                    v_bits_RC = (x_RC * mult_R[:, None]).to(tl.int32, bitcast=True) & 0x7FFFFFFF
                    tl.atomic_max(
                        col_amax_ptr + cols_C,
                        canonical_amax(tl.max(v_bits_RC, 0)),
                        mask=cols_C < C,
                        sem="relaxed",
                    )
            # Stage 2: one power-of-two scale per row.
            byte_R = scale_byte(amax_R, EMAX_EXP, True)
            tl.store(scale_ptr + rows_R, scale_float(byte_R), mask=row_ok_R)
            # Stage 3: read again (from L2), cast and store row-major.
            for c0 in range(0, C, BLOCK_C):
                cols_C = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
                mask_RC = row_ok_R[:, None] & (cols_C < C)[None, :]
                x_RC = load_as_float32(
                    x_ptr + rows_R[:, None] * C + cols_C[None, :], mask_RC, IN_BF16
                )
                q_RC = cast_at_scale(
                    x_RC, byte_R[:, None], E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS,
                    HW_CONVERT,
                )  # fmt: skip
                tl.store(data_ptr + rows_R[:, None] * C + cols_C[None, :], q_RC, mask=mask_RC)
    if COL_AMAX and ONE_CHUNK:
        cols_C = tl.arange(0, BLOCK_C)
        tl.atomic_max(
            col_amax_ptr + cols_C,
            canonical_amax(tl.max(col_amax_RC, 0)),
            mask=cols_C < C,
            sem="relaxed",
        )


@triton.jit
def transpose_bytes_kernel(src_ptr, dst_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dst [C, R] = src [R, C]ᵀ`` for one ``[BLOCK_R, BLOCK_C]`` tile of bytes: a coalesced
    load along C, a layout conversion through shared memory, a coalesced store along R."""
    rows_R = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols_C = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask_RC = (rows_R < R)[:, None] & (cols_C < C)[None, :]
    bytes_RC = tl.load(src_ptr + rows_R[:, None] * C + cols_C[None, :], mask=mask_RC)
    tl.store(dst_ptr + cols_C[None, :] * R + rows_R[:, None], bytes_RC, mask=mask_RC)


@triton.jit
def tile_amax_kernel(
    x_ptr,
    amax_ptr,
    R,
    C,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    """One ``[BLOCK_R, BLOCK_C]`` tile, read with a single load: its rows' ``|x|`` amax bits
    folded into ``amax[row]`` and its columns' into ``amax[R + col]`` by atomic max (the buffer
    starts at zero)."""
    rows_R = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols_C = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    row_ok_R, col_ok_C = rows_R < R, cols_C < C
    mask_RC = row_ok_R[:, None] & col_ok_C[None, :]
    x_RC = load_as_float32(x_ptr + rows_R[:, None] * C + cols_C[None, :], mask_RC, IN_BF16)
    bits_RC = x_RC.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(amax_ptr + rows_R, tl.max(bits_RC, 1), mask=row_ok_R, sem="relaxed")
    tl.atomic_max(amax_ptr + R + cols_C, tl.max(bits_RC, 0), mask=col_ok_C, sem="relaxed")


@triton.jit
def cast_both_kernel(
    x_ptr,
    amax_ptr,
    data_ptr,
    scale_ptr,
    data_t_ptr,
    scale_t_ptr,
    R,
    C,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX_EXP: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    """One ``[BLOCK_R, BLOCK_C]`` tile cast with its rows' scales (stored row-major) and with its
    columns' scales (stored transposed), from the amaxes of ``tile_amax_kernel``."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows_R = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols_C = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    row_ok_R, col_ok_C = rows_R < R, cols_C < C
    mask_RC = row_ok_R[:, None] & col_ok_C[None, :]
    x_RC = load_as_float32(x_ptr + rows_R[:, None] * C + cols_C[None, :], mask_RC, IN_BF16)
    byte_R = scale_byte(tl.load(amax_ptr + rows_R, mask=row_ok_R, other=0), EMAX_EXP, True)
    byte_C = scale_byte(tl.load(amax_ptr + R + cols_C, mask=col_ok_C, other=0), EMAX_EXP, True)
    q_RC = cast_at_scale(
        x_RC, byte_R[:, None], E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT
    )
    tl.store(data_ptr + rows_R[:, None] * C + cols_C[None, :], q_RC, mask=mask_RC)
    qc_RC = cast_at_scale(
        x_RC, byte_C[None, :], E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT
    )
    tl.store(data_t_ptr + cols_C[None, :] * R + rows_R[:, None], qc_RC, mask=mask_RC)
    if pid_c == 0:
        tl.store(scale_ptr + rows_R, scale_float(byte_R), mask=row_ok_R)
    if pid_r == 0:
        tl.store(scale_t_ptr + cols_C, scale_float(byte_C), mask=col_ok_C)


@triton.jit
def column_amax_kernel(
    x_ptr,
    row_mult_ptr,
    col_amax_ptr,
    R,
    C,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROW_TILES: tl.constexpr,
    HAS_MULT: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    """Column amax of ``x · row_mult`` over ``ROW_TILES`` row tiles, then one atomic max per
    column (bit patterns of non-negative floats order like their values)."""
    cols_C = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    amax_C = tl.zeros([BLOCK_C], dtype=tl.int32)
    for t in range(ROW_TILES):
        rows_R = ((tl.program_id(0) * ROW_TILES + t) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask_RC = (rows_R < R)[:, None] & (cols_C < C)[None, :]
        v_RC = load_as_float32(x_ptr + rows_R[:, None] * C + cols_C[None, :], mask_RC, IN_BF16)
        if HAS_MULT:
            v_RC = v_RC * tl.load(row_mult_ptr + rows_R, mask=rows_R < R, other=0.0)[:, None]
        amax_C = tl.maximum(amax_C, tl.max(v_RC.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))
    tl.atomic_max(col_amax_ptr + cols_C, canonical_amax(amax_C), mask=cols_C < C, sem="relaxed")


@triton.jit
def cast_columns_kernel(
    x_ptr,
    row_mult_ptr,
    col_amax_ptr,
    data_t_ptr,
    scale_ptr,
    R,
    C,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_MULT: tl.constexpr,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX_EXP: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    rows_R = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols_C = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    col_ok_C = cols_C < C
    mask_RC = (rows_R < R)[:, None] & col_ok_C[None, :]
    v_RC = load_as_float32(x_ptr + rows_R[:, None] * C + cols_C[None, :], mask_RC, IN_BF16)
    if HAS_MULT:
        v_RC = v_RC * tl.load(row_mult_ptr + rows_R, mask=rows_R < R, other=0.0)[:, None]
    byte_C = scale_byte(tl.load(col_amax_ptr + cols_C, mask=col_ok_C, other=0), EMAX_EXP, True)
    q_RC = cast_at_scale(
        v_RC, byte_C[None, :], E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT
    )
    # one cast, one store (the transposed addresses get a layout conversion of the bytes)
    tl.store(data_t_ptr + cols_C[None, :] * R + rows_R[:, None], q_RC, mask=mask_RC)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr + cols_C, scale_float(byte_C), mask=col_ok_C)


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
):
    """fp8 bytes of x in a 1×128 block: MX-encode at the 1×32 block's byte, then shift down by
    ``byte_group − byte`` whole binades and re-encode at scale 2^0 (``scaled_matmul.merge_k128``)."""
    q = encode(x, byte, byte, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT, False)
    down = ((127 - tl.minimum(byte_group - byte, 126)) << 23).to(tl.float32, bitcast=True)
    v = decode(q.to(tl.int32), E4M3, MBITS, EMIN, HW_CONVERT) * down
    unit = tl.where(byte_group == 255, 255, 127)
    return encode(
        v, unit, unit, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT, False
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
        x, byte_r, group_r, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT
    )
    tl.store(data_ptr + rows * C + cols, q)
    rows_128 = (pid_r * 128 + tl.arange(0, 128)).to(tl.int64)
    tl.store(scale_ptr + pid_c * R + rows_128, scale_float(tl.reshape(group_r, [128])))
    # along R: a byte per 32×1 block, the group's largest of the four; stored as [C, R]
    byte_c = scale_byte(tl.max(abs_bits, axis=1, keep_dims=True), EMAX_EXP, RCEIL)
    group_c = tl.max(byte_c, axis=0, keep_dims=True)
    q_t = merge_to_k128(
        x, byte_c, group_c, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT
    )
    tl.store(data_t_ptr + cols * R + rows, q_t)
    cols_128 = (pid_c * 128 + tl.arange(0, 128)).to(tl.int64)
    tl.store(scale_t_ptr + pid_r * C + cols_128, scale_float(tl.reshape(group_c, [128])))


# Launch shapes on a GPU. Rows kernel: [BLOCK_R, BLOCK_C] chunks, a persistent grid sized so
# that the rows of one wave of programs (programs · BLOCK_R · C · bytes) fit in ``l2_wave_mib``
# of the 50 MiB L2, from which stage 3 re-reads rows longer than one chunk.


@dataclass(frozen=True)
class RowsTiles:
    """Rows kernel: ``[block_r, block_c]`` chunks, ``num_warps``, the L2 budget of a wave; the
    byte transpose after it: square tiles of ``transpose_block``, ``transpose_warps``."""

    block_r: int = 16
    block_c: int = 1024  # 32 KiB of bf16 per load: two programs per SM keep 64 KiB in flight
    num_warps: int = 8
    # rows at least ``wide_c`` long (without a column amax) take ``wide_block_c`` columns on
    # ``wide_warps`` warps: on [32768, 4096] 123 µs against 135 for 1024 on 8 (H200), where on
    # [32768, 1024] 2048-column chunks would be half masked (42 µs against 29)
    wide_c: int = 4096
    wide_block_c: int = 2048
    wide_warps: int = 16
    # and 8 rows per chunk in waves of 24 MiB: 109 µs against 125 for 16 rows in 32 MiB
    # (2026-11-30; with the transposed copy 180 µs against 194)
    wide_block_r: int = 8
    wide_l2_wave_mib: int = 24
    l2_wave_mib: int = 32
    amax_programs_per_sm: int = 2  # with a column amax: fewer programs, fewer atomics per column
    # with a column amax over whole rows: elements per tile (the running-maximum tile stays in
    # registers: 16 rows of 1024 took 246 registers at 8 warps, 8 rows 102; ptxas, sm_90)
    amax_tile_elems: int = 8192
    # with a column amax: whole rows per chunk up to this width (wider rows reduce every chunk
    # across warps and fold it in with atomics: 0.41 ms, 1 TB/s, on [32768, 4096] at 2048)
    amax_one_chunk_max_c: int = 8192
    # rows of at most ``block_c`` columns are read once and cast from registers: 25.9 µs on
    # [32768, 1024] against 28.5 when read twice; with 2 row blocks' loads in flight 29.1 (H200)
    one_chunk_stages: int = 1
    # with a column amax over whole rows: warps and row blocks' loads in flight (39.5 µs on
    # [32768, 1024] against 48.0 on 8 warps with 2 in flight, 51 when read twice)
    amax_warps: int = 4
    amax_stages: int = 3
    transpose_block: int = 128  # the transposed copy: square byte tiles, 128-byte lines
    transpose_warps: int = 8


@dataclass(frozen=True)
class BothTiles:
    """Weight cast both ways: ``[amax_r, amax_c]`` amax tiles, ``[block_r, block_c]`` cast tiles."""

    amax_r: int = 64
    amax_c: int = 256
    block_r: int = 64
    block_c: int = 128
    num_warps: int = 8


@dataclass(frozen=True)
class ColumnTiles:
    """Column-wise cast of a tall tensor: the amax pass reads ``amax_row_tiles`` tiles of
    ``[block_r, block_c]`` per program (one atomic per column and program) on ``amax_warps``;
    the cast pass one tile per program on ``cast_warps``."""

    block_r: int = 64
    block_c: int = 128
    # on [32768, 1024] (H200, 2026-11-30): amax 27.6 µs against 29.0 for 8 row tiles; cast
    # 26.5 µs against 27.5 on 8 warps; wider tiles or more warps were slower
    amax_row_tiles: int = 2
    amax_warps: int = 4
    cast_warps: int = 4


_ROWS_TILES = RowsTiles()
_BOTH_TILES = BothTiles()
_COLUMN_TILES = ColumnTiles()
# Under the interpreter each program is a round of numpy calls: few, large tiles run fastest.
_INTERPRETER_BLOCK = {"BLOCK_R": 64, "BLOCK_C": 64}
_INTERPRETER_PROGRAMS = 3


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and not INTERPRETING


@functools.cache
def _constants(fmt: ElemFormat, on_gpu: bool, in_bf16: bool) -> dict:
    """The kernels' format constexprs, built once per combination (eager calls are host-bound:
    every µs of Python per launch shows in G1)."""
    return dict(HW_CONVERT=on_gpu, IN_BF16=in_bf16, **format_constants(fmt))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _common(x: torch.Tensor, fmt: ElemFormat) -> tuple[torch.Tensor, dict]:
    in_bf16 = x.dtype == torch.bfloat16
    return (x.view(torch.int16) if in_bf16 else x), _constants(fmt, _on_gpu(x), in_bf16)


def cast_rows(
    x: torch.Tensor,
    fmt: ElemFormat,
    *,
    transposed: bool,
    col_amax_row_mult: torch.Tensor | None,
    tiles: RowsTiles | None = None,
):
    """Launch the rows kernel on a contiguous ``[R, C]`` (and, for ``transposed``, the byte
    transpose after it). Returns (data uint8 ``[R, C]``, scale float32 ``[R]``, data_t uint8
    ``[C, R]`` or None, column amax of ``x · row_mult`` as float32 ``[C]`` or None). ``tiles``
    overrides the GPU launch shape (benchmark sweeps)."""
    R, C = x.shape
    dev = x.device
    data = torch.empty((R, C), dtype=torch.uint8, device=dev)
    scale = torch.empty(R, dtype=torch.float32, device=dev)
    want_amax = col_amax_row_mult is not None
    # without a column amax the kernel never touches it: scale stands in for the pointer
    col_amax = torch.zeros(C, dtype=torch.int32, device=dev) if want_amax else scale
    if R and C:
        x_arg, constants = _common(x, fmt)
        if _on_gpu(x):
            t = tiles or _ROWS_TILES
            block_r, block_c, warps, wave_mib = t.block_r, t.block_c, t.num_warps, t.l2_wave_mib
            stages = t.one_chunk_stages
            if want_amax and C <= t.amax_one_chunk_max_c:  # whole rows per chunk
                block_c = next_power_of_2(C)
                block_r = max(1, t.amax_tile_elems // block_c)
                warps, stages = t.amax_warps, t.amax_stages
            elif not want_amax and C >= t.wide_c:
                block_r, block_c, warps = t.wide_block_r, t.wide_block_c, t.wide_warps
                wave_mib = t.wide_l2_wave_mib
            sms = _sm_count(dev)
            wave = (wave_mib << 20) // (block_r * C * x.element_size())
            programs = max(wave, sms)
            if want_amax:
                programs = min(programs, t.amax_programs_per_sm * sms)
            grid = (min(cdiv(R, block_r), programs),)
            blocks = {"BLOCK_R": block_r, "BLOCK_C": block_c}
            launch = dict(num_warps=warps)
        else:  # few programs, so that each loops over several row blocks as on a GPU
            blocks, launch, stages = _INTERPRETER_BLOCK, {}, 2
            grid = (min(cdiv(R, blocks["BLOCK_R"]), _INTERPRETER_PROGRAMS),)
        mult = col_amax_row_mult if want_amax else scale
        one_chunk = C <= blocks["BLOCK_C"]
        cast_rows_kernel[grid](
            x_arg, mult, data, scale, col_amax, R, C, COL_AMAX=want_amax, ONE_CHUNK=one_chunk,
            NUM_STAGES=stages if one_chunk else 1, **blocks, **constants, **launch,
        )  # fmt: skip
    return (
        data,
        scale,
        transpose_bytes(data, tiles=tiles) if transposed else None,
        col_amax.view(torch.float32) if want_amax else None,
    )


def transpose_bytes(src: torch.Tensor, *, tiles: RowsTiles | None = None) -> torch.Tensor:
    """uint8 ``[C, R]``: the transpose of a contiguous uint8 ``[R, C]``."""
    R, C = src.shape
    dst = torch.empty((C, R), dtype=torch.uint8, device=src.device)
    if R and C:
        if _on_gpu(src):
            t = tiles or _ROWS_TILES
            blocks = {"BLOCK_R": t.transpose_block, "BLOCK_C": t.transpose_block}
            launch = dict(num_warps=t.transpose_warps)
        else:
            blocks, launch = _INTERPRETER_BLOCK, {}
        grid = (cdiv(R, blocks["BLOCK_R"]), cdiv(C, blocks["BLOCK_C"]))
        transpose_bytes_kernel[grid](src, dst, R, C, **blocks, **launch)
    return dst


def cast_both(x: torch.Tensor, fmt: ElemFormat, *, tiles: BothTiles | None = None):
    """Row-wise and column-wise casts of a contiguous ``[R, C]``: a zero-fill and two launches,
    each program one tile read once (a weight is small: latency, not bandwidth, bounds it).
    Returns (data uint8 ``[R, C]``, scale float32 ``[R]``, data_t uint8 ``[C, R]``, scale_t
    float32 ``[C]``)."""
    R, C = x.shape
    dev = x.device
    data = torch.empty((R, C), dtype=torch.uint8, device=dev)
    scale = torch.empty(R, dtype=torch.float32, device=dev)
    data_t = torch.empty((C, R), dtype=torch.uint8, device=dev)
    scale_t = torch.empty(C, dtype=torch.float32, device=dev)
    if R and C:
        x_arg, constants = _common(x, fmt)
        t = (tiles or _BOTH_TILES) if _on_gpu(x) else BothTiles(64, 64, 64, 64)
        launch = dict(num_warps=t.num_warps) if _on_gpu(x) else {}
        amax = torch.zeros(R + C, dtype=torch.int32, device=dev)
        tile_amax_kernel[(cdiv(R, t.amax_r), cdiv(C, t.amax_c))](
            x_arg, amax, R, C, BLOCK_R=t.amax_r, BLOCK_C=t.amax_c,
            IN_BF16=constants["IN_BF16"], **launch,
        )  # fmt: skip
        cast_both_kernel[(cdiv(R, t.block_r), cdiv(C, t.block_c))](
            x_arg, amax, data, scale, data_t, scale_t, R, C, BLOCK_R=t.block_r,
            BLOCK_C=t.block_c, **constants, **launch,
        )  # fmt: skip
    return data, scale, data_t, scale_t


def _column_launch(x: torch.Tensor, tiles: ColumnTiles | None) -> ColumnTiles:
    if _on_gpu(x):
        return tiles or _COLUMN_TILES
    b = _INTERPRETER_BLOCK
    return ColumnTiles(b["BLOCK_R"], b["BLOCK_C"], amax_row_tiles=1)


def column_amax(
    x: torch.Tensor, row_mult: torch.Tensor | None, *, tiles: ColumnTiles | None = None
) -> torch.Tensor:
    """float32 ``[C]``: ``max_r |x[r, c] · row_mult[r]|`` of a contiguous ``[R, C]``. ``tiles``
    overrides the GPU launch shape (benchmark sweeps)."""
    R, C = x.shape
    col_amax = torch.zeros(C, dtype=torch.int32, device=x.device)
    if R and C:
        in_bf16 = x.dtype == torch.bfloat16
        t = _column_launch(x, tiles)
        launch = dict(num_warps=t.amax_warps) if _on_gpu(x) else {}
        grid = (cdiv(R, t.block_r * t.amax_row_tiles), cdiv(C, t.block_c))
        column_amax_kernel[grid](
            x.view(torch.int16) if in_bf16 else x,
            col_amax if row_mult is None else row_mult,
            col_amax, R, C, BLOCK_R=t.block_r, BLOCK_C=t.block_c, ROW_TILES=t.amax_row_tiles,
            HAS_MULT=row_mult is not None, IN_BF16=in_bf16, **launch,
        )  # fmt: skip
    return col_amax.view(torch.float32)


def cast_columns(
    x: torch.Tensor,
    fmt: ElemFormat,
    *,
    row_mult: torch.Tensor | None,
    col_amax: torch.Tensor,
    tiles: ColumnTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast a contiguous ``[R, C]`` (rows times ``row_mult``) with one scale per column from
    ``col_amax`` (float32 ``[C]``). Returns (data uint8 ``[C, R]``, scale float32 ``[C]``)."""
    R, C = x.shape
    data_t = torch.empty((C, R), dtype=torch.uint8, device=x.device)
    scale = torch.empty(C, dtype=torch.float32, device=x.device)
    if R and C:
        x_arg, constants = _common(x, fmt)
        t = _column_launch(x, tiles)
        blocks = {"BLOCK_R": t.block_r, "BLOCK_C": t.block_c}
        grid = (cdiv(R, t.block_r), cdiv(C, t.block_c))
        launch = dict(num_warps=t.cast_warps) if _on_gpu(x) else {}
        cast_columns_kernel[grid](
            x_arg, scale if row_mult is None else row_mult, col_amax.view(torch.int32), data_t,
            scale, R, C, HAS_MULT=row_mult is not None, **blocks, **constants, **launch,
        )  # fmt: skip
    return data_t, scale


def mx_rowcol_k128(x: torch.Tensor, fmt: ElemFormat, *, scale_mode: str):
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
        x_arg, constants = _common(x, fmt)
        launch = dict(num_warps=16) if _on_gpu(x) else {}
        mx_rowcol_k128_kernel[(R // 128, C // 128)](
            x_arg, data, scale, data_t, scale_t, R, C, RCEIL=scale_mode == "rceil",
            **constants, **launch,
        )  # fmt: skip
    return data, scale, data_t, scale_t

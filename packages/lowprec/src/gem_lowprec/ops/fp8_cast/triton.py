"""Triton kernels for the row-wise fp8 cast of ``reference.py`` and its transposed copy (the
column-wise and both-ways casts are in ``triton_columns.py``).

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
``num_stages``); without one they do not help.

``transpose_bytes_kernel`` then writes the transposed copy (``[C, R]``, the layout the
weight-gradient GEMM contracts over) from the fp8 bytes: one byte read and one written per
element on top of the cast's three, in square tiles whose rows are whole 128-byte lines both
ways. The cast kernel does not write it itself: a second, transposed read of its row chunk moves
16-byte segments at a stride of R (well under half the bandwidth), and storing its fp8 tile a
second time through a layout conversion miscompiles on Hopper with Triton 3.6 (a wrong column
in the transposed copy, the pattern of an upstream report of fp8 double stores miscompiled by
ptxas 12.9); here every byte tile is stored once. docs/design/lowprec.md has the history.

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
from gem_lowprec._triton_codec import encode, load_as_float32, scale_byte, scale_float
from gem_lowprec.codec import E4M3, E5M2, ElemFormat
from gem_lowprec.ops.launch import AUTO_LAUNCH, Launch


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
    """fp8 bytes of ``x / 2^(byte − 127)``, rounded to nearest-even and saturated at the
    format's maximum (the MX encoder with one scale byte per element's row or column; a GEMM
    scales the result in float32, so no input range applies)."""
    return encode(
        x, byte, byte, E4M3, MBITS, EMIN, MAX_BITS, MAX_VALUE, NAN_BITS, HW_CONVERT, False, None
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
    column only at the end, not per block (reducing every block instead makes the cast several
    times slower). Longer rows go chunk by chunk, twice (stages 1 and 3)."""
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


# Launch shapes on a GPU. Rows kernel: [BLOCK_R, BLOCK_C] chunks, a persistent grid sized so
# that the rows of one wave of programs (programs · BLOCK_R · C · bytes) fit in ``l2_wave_mib``
# of the 50 MiB L2, from which stage 3 re-reads rows longer than one chunk. Each default is the
# fastest of the sweep in ``benchmarks/lowprec/bench_lowprec_linear.py --sweep``.


@dataclass(frozen=True)
class RowsTiles:
    """Rows kernel: ``[block_r, block_c]`` chunks, ``num_warps``, the L2 budget of a wave; the
    byte transpose after it: square tiles of ``transpose_block``, ``transpose_warps``."""

    block_r: int = 16
    block_c: int = 1024  # 32 KiB of bf16 per load: two programs per SM keep 64 KiB in flight
    num_warps: int = 8
    # rows at least ``wide_c`` long (without a column amax) take ``wide_block_c`` columns on
    # ``wide_warps`` warps (narrower rows would leave 2048-column chunks half masked), 8 rows
    # per chunk in waves of 24 MiB
    wide_c: int = 4096
    wide_block_c: int = 2048
    wide_warps: int = 16
    wide_block_r: int = 8
    wide_l2_wave_mib: int = 24
    l2_wave_mib: int = 32
    amax_programs_per_sm: int = 2  # with a column amax: fewer programs, fewer atomics per column
    # with a column amax over whole rows: elements per tile (the running-maximum tile stays in
    # registers: 16 rows of 1024 take 246 registers at 8 warps, 8 rows 102; ptxas, sm_90)
    amax_tile_elems: int = 8192
    # with a column amax: whole rows per chunk up to this width (wider rows reduce every chunk
    # across warps and fold it in with atomics, at about a third of the bandwidth)
    amax_one_chunk_max_c: int = 8192
    # rows of at most ``block_c`` columns are read once and cast from registers, without the
    # loads of further row blocks in flight
    one_chunk_stages: int = 1
    # with a column amax over whole rows: warps and row blocks' loads in flight
    amax_warps: int = 4
    amax_stages: int = 3
    transpose_block: int = 128  # the transposed copy: square byte tiles, 128-byte lines
    transpose_warps: int = 8


_ROWS_TILES = RowsTiles()
# Under the interpreter each program is a round of numpy calls: few, large tiles run fastest.
INTERPRETER_BLOCK = {"BLOCK_R": 64, "BLOCK_C": 64}
_INTERPRETER_PROGRAMS = 3
# The format constexprs with the encoder and input-dtype flags, built once at import for every
# combination: eager calls are host-bound, and each launch looks its dict up instead of
# building it.
_CONSTANTS = {
    (fmt.name, hw, bf16): dict(HW_CONVERT=hw, IN_BF16=bf16, **fmt.kernel_constants)
    for fmt in (E4M3, E5M2)
    for hw in (False, True)
    for bf16 in (False, True)
}


@functools.cache
def _device_sm_count(device: torch.device) -> int:
    """A device's SM count: a constant of the hardware, read once per device (a properties
    query costs microseconds, on a launch path where every microsecond shows)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def kernel_input(x: torch.Tensor, fmt: ElemFormat, launch: Launch) -> tuple[torch.Tensor, dict]:
    """``x`` as the kernels read it (bf16 as int16 bits) and the constexprs of its launch."""
    in_bf16 = x.dtype == torch.bfloat16
    constants = _CONSTANTS[fmt.name, launch.hardware_encoder(x), in_bf16]
    return (x.view(torch.int16) if in_bf16 else x), constants


def cast_rows(
    x: torch.Tensor,
    fmt: ElemFormat,
    *,
    transposed: bool,
    col_amax_row_mult: torch.Tensor | None,
    tiles: RowsTiles | None = None,
    launch: Launch = AUTO_LAUNCH,
):
    """Launch the rows kernel on a contiguous ``[R, C]`` (and, for ``transposed``, the byte
    transpose after it). Returns (data uint8 ``[R, C]``, scale float32 ``[R]``, data_t uint8
    ``[C, R]`` or None, column amax of ``x · row_mult`` as float32 ``[C]`` or None). ``tiles``
    overrides the GPU launch shape (benchmark sweeps); ``launch`` picks the shapes' table, the
    encoder and the SM count."""
    R, C = x.shape
    dev = x.device
    data = torch.empty((R, C), dtype=torch.uint8, device=dev)
    scale = torch.empty(R, dtype=torch.float32, device=dev)
    want_amax = col_amax_row_mult is not None
    # without a column amax the kernel never touches it: scale stands in for the pointer
    col_amax = torch.zeros(C, dtype=torch.int32, device=dev) if want_amax else scale
    if R and C:
        x_arg, constants = kernel_input(x, fmt, launch)
        if launch.gpu_shapes(x):
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
            sms = launch.sm_count or _device_sm_count(dev)
            wave = (wave_mib << 20) // (block_r * C * x.element_size())
            programs = max(wave, sms)
            if want_amax:
                programs = min(programs, t.amax_programs_per_sm * sms)
            grid = (min(cdiv(R, block_r), programs),)
            blocks = {"BLOCK_R": block_r, "BLOCK_C": block_c}
            num_warps = dict(num_warps=warps)
        else:  # few programs, so that each loops over several row blocks as on a GPU
            blocks, num_warps, stages = INTERPRETER_BLOCK, {}, 2
            grid = (min(cdiv(R, blocks["BLOCK_R"]), _INTERPRETER_PROGRAMS),)
        mult = col_amax_row_mult if want_amax else scale
        one_chunk = C <= blocks["BLOCK_C"]
        cast_rows_kernel[grid](
            x_arg, mult, data, scale, col_amax, R, C, COL_AMAX=want_amax, ONE_CHUNK=one_chunk,
            NUM_STAGES=stages if one_chunk else 1, **blocks, **constants, **num_warps,
        )  # fmt: skip
    return (
        data,
        scale,
        transpose_bytes(data, tiles=tiles, launch=launch) if transposed else None,
        col_amax.view(torch.float32) if want_amax else None,
    )


def transpose_bytes(
    src: torch.Tensor, *, tiles: RowsTiles | None = None, launch: Launch = AUTO_LAUNCH
) -> torch.Tensor:
    """uint8 ``[C, R]``: the transpose of a contiguous uint8 ``[R, C]``."""
    R, C = src.shape
    dst = torch.empty((C, R), dtype=torch.uint8, device=src.device)
    if R and C:
        if launch.gpu_shapes(src):
            t = tiles or _ROWS_TILES
            blocks = {"BLOCK_R": t.transpose_block, "BLOCK_C": t.transpose_block}
            num_warps = dict(num_warps=t.transpose_warps)
        else:
            blocks, num_warps = INTERPRETER_BLOCK, {}
        grid = (cdiv(R, blocks["BLOCK_R"]), cdiv(C, blocks["BLOCK_C"]))
        transpose_bytes_kernel[grid](src, dst, R, C, **blocks, **num_warps)
    return dst

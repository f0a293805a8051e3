"""Triton kernels for the column-wise and both-ways fp8 casts of ``reference.py``.

Legend as in ``triton.py``: ``x`` is ``[R, C]`` contiguous; ``_R`` one value per row, ``_C`` one
per column, ``_RC`` a tile of rows × columns.

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
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gem_lowprec._intmath import cdiv
from gem_lowprec._triton_codec import load_as_float32, scale_byte, scale_float
from gem_lowprec.codec import ElemFormat
from gem_lowprec.ops.fp8_cast.triton import (
    INTERPRETER_BLOCK,
    canonical_amax,
    cast_at_scale,
    kernel_input,
)
from gem_lowprec.ops.launch import AUTO_LAUNCH, Launch


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
    the cast pass one tile per program on ``cast_warps``. The defaults are the fastest of the
    benchmark's sweep; wider tiles or more warps are slower."""

    block_r: int = 64
    block_c: int = 128
    amax_row_tiles: int = 2
    amax_warps: int = 4
    cast_warps: int = 4


_BOTH_TILES = BothTiles()
_COLUMN_TILES = ColumnTiles()


def cast_both(
    x: torch.Tensor,
    fmt: ElemFormat,
    *,
    tiles: BothTiles | None = None,
    launch: Launch = AUTO_LAUNCH,
):
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
        x_arg, constants = kernel_input(x, fmt, launch)
        gpu = launch.gpu_shapes(x)
        t = (tiles or _BOTH_TILES) if gpu else BothTiles(64, 64, 64, 64)
        num_warps = dict(num_warps=t.num_warps) if gpu else {}
        amax = torch.zeros(R + C, dtype=torch.int32, device=dev)
        tile_amax_kernel[(cdiv(R, t.amax_r), cdiv(C, t.amax_c))](
            x_arg, amax, R, C, BLOCK_R=t.amax_r, BLOCK_C=t.amax_c,
            IN_BF16=constants["IN_BF16"], **num_warps,
        )  # fmt: skip
        cast_both_kernel[(cdiv(R, t.block_r), cdiv(C, t.block_c))](
            x_arg, amax, data, scale, data_t, scale_t, R, C, BLOCK_R=t.block_r,
            BLOCK_C=t.block_c, **constants, **num_warps,
        )  # fmt: skip
    return data, scale, data_t, scale_t


def _column_tiles(tiles: ColumnTiles | None, gpu: bool) -> ColumnTiles:
    if gpu:
        return tiles or _COLUMN_TILES
    b = INTERPRETER_BLOCK
    return ColumnTiles(b["BLOCK_R"], b["BLOCK_C"], amax_row_tiles=1)


def column_amax(
    x: torch.Tensor,
    row_mult: torch.Tensor | None,
    *,
    tiles: ColumnTiles | None = None,
    launch: Launch = AUTO_LAUNCH,
) -> torch.Tensor:
    """float32 ``[C]``: ``max_r |x[r, c] · row_mult[r]|`` of a contiguous ``[R, C]``. ``tiles``
    overrides the GPU launch shape (benchmark sweeps)."""
    R, C = x.shape
    col_amax = torch.zeros(C, dtype=torch.int32, device=x.device)
    if R and C:
        in_bf16 = x.dtype == torch.bfloat16
        gpu = launch.gpu_shapes(x)
        t = _column_tiles(tiles, gpu)
        num_warps = dict(num_warps=t.amax_warps) if gpu else {}
        grid = (cdiv(R, t.block_r * t.amax_row_tiles), cdiv(C, t.block_c))
        column_amax_kernel[grid](
            x.view(torch.int16) if in_bf16 else x,
            col_amax if row_mult is None else row_mult,
            col_amax, R, C, BLOCK_R=t.block_r, BLOCK_C=t.block_c, ROW_TILES=t.amax_row_tiles,
            HAS_MULT=row_mult is not None, IN_BF16=in_bf16, **num_warps,
        )  # fmt: skip
    return col_amax.view(torch.float32)


def cast_columns(
    x: torch.Tensor,
    fmt: ElemFormat,
    *,
    row_mult: torch.Tensor | None,
    col_amax: torch.Tensor,
    tiles: ColumnTiles | None = None,
    launch: Launch = AUTO_LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast a contiguous ``[R, C]`` (rows times ``row_mult``) with one scale per column from
    ``col_amax`` (float32 ``[C]``). Returns (data uint8 ``[C, R]``, scale float32 ``[C]``)."""
    R, C = x.shape
    data_t = torch.empty((C, R), dtype=torch.uint8, device=x.device)
    scale = torch.empty(C, dtype=torch.float32, device=x.device)
    if R and C:
        x_arg, constants = kernel_input(x, fmt, launch)
        gpu = launch.gpu_shapes(x)
        t = _column_tiles(tiles, gpu)
        blocks = {"BLOCK_R": t.block_r, "BLOCK_C": t.block_c}
        grid = (cdiv(R, t.block_r), cdiv(C, t.block_c))
        num_warps = dict(num_warps=t.cast_warps) if gpu else {}
        cast_columns_kernel[grid](
            x_arg, scale if row_mult is None else row_mult, col_amax.view(torch.int32), data_t,
            scale, R, C, HAS_MULT=row_mult is not None, **blocks, **constants, **num_warps,
        )  # fmt: skip
    return data_t, scale

"""Triton MX quantize kernels: 1×32 row-wise blocks, 32×32 tiles, and row-wise plus column-wise
1×32 copies of a matrix from one read (the merges to 1×128 blocks are in ``triton_k128.py``).

Legend (shape suffixes): ``M`` rows of x, ``K`` columns of x (x is ``[M, K]`` contiguous),
``Mb = M/32``, ``Kb = K/32``; ``B`` MX blocks held by a program, ``KB`` 32-column blocks held by
a program, ``BM``/``BK`` rows/columns held by a program.

Three kernels, each shaped so that its reductions are over register axes of one tile and its
stores are contiguous:

- ``mx_quantize_rows_kernel`` (blocks along the contiguous dim): x seen as a flat run of MX
  blocks, a program a ``[B, 32]`` slab of consecutive blocks. One contiguous read, one
  contiguous write of fp8 bytes, and the ``B`` scale bytes as one contiguous vector. Optionally
  merges runs of four blocks into 1×128 blocks for Hopper's blockwise GEMM.
- ``mx_quantize_tile2d_kernel`` (32×32 tiles): a program is a 32-row strip ``[1, 32, KB, 32]``
  on a GPU; the tile amax reduces the column-in-block axis, then the row axis, leaving a ``[KB]``
  vector of scale bytes (contiguous in the ``[Mb, Kb]`` scale matrix).
- ``mx_quantize_rowcol_kernel`` (both 1×32 copies, or only the column-wise one): a
  ``[BM/32, 32, KB, 32]`` tile; row blocks reduce axis 3, column blocks axis 1; the column copy
  is stored transposed (``[K, M]``), the K-major operand a GEMM wants.

Stages of every program:
1. Load the tile once, widen to float32, take ``|x|`` bit patterns (integers order like the
   values; a pattern ``>= 0x7F800000`` is NaN/Inf).
2. Reduce those patterns to the block amax and turn each amax into its E8M0 byte (the integer
   rule of the codec), once per block, not per element.
3. Encode the elements (``_triton_codec.encode``: the hardware cast on a GPU, the integer
   encoder under the interpreter and for stochastic rounding), saturating where the input
   dtype's range ends (``RANGE_EMAX``), so that every finite input dequantizes finite.
4. Store the fp8 bytes and the scale bytes.

Launch shapes live in one small dataclass per kernel (``RowsTiles``, ``Tile2dTiles``,
``RowColTiles``); the GPU defaults are the fastest of the sweep in ``benchmarks/lowprec/
bench_mx_quantize.py --sweep`` (docs/design/lowprec.md has the numbers), and under the
interpreter fewer, larger programs.
"""

from dataclasses import astuple, dataclass

import torch
import triton
import triton.language as tl
from gem_lowprec._intmath import cdiv
from gem_lowprec._triton_codec import decode, encode, load_as_float32, lowbias32, scale_byte
from gem_lowprec.codec import ElemFormat, range_emax, seed_key
from gem_lowprec.ops.launch import AUTO_LAUNCH, Launch


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
    RANGE_EMAX: tl.constexpr,
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
    # Stage 1: the slab of consecutive blocks.
    blk_B = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    if WIDE_INDEX:
        blk_B = blk_B.to(tl.int64)
    in_bounds_B = blk_B < n_blocks
    offs_B32 = blk_B[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask_B32 = in_bounds_B[:, None]
    x = load_as_float32(x_ptr + offs_B32, mask_B32, IN_BF16)
    # Stage 2: one amax and one scale byte per block, kept as a [BLOCKS] vector.
    amax_B = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    byte_B = scale_byte(amax_B, EMAX_EXP, RCEIL)
    # Stage 3: encode every element against its block's byte.
    noise = offs_B32
    if STOCHASTIC:
        noise = lowbias32((offs_B32.to(tl.int64) + seed_key) & 0xFFFFFFFF)
    q = encode(
        x,
        byte_B[:, None],
        noise,
        E4M3,
        MBITS,
        EMIN,
        MAX_BITS,
        MAX_VALUE,
        NAN_BITS,
        HW_CONVERT,
        STOCHASTIC,
        RANGE_EMAX,
    )
    if MERGE_K128:
        G: tl.constexpr = BLOCKS // 4
        byte_G = tl.max(tl.reshape(byte_B, [G, 4]), axis=1)
        byte_max_B = tl.reshape(tl.broadcast_to(byte_G[:, None], [G, 4]), [BLOCKS])
        shift_B = tl.minimum(byte_max_B - byte_B, 126)
        down_B = ((127 - shift_B) << 23).to(tl.float32, bitcast=True)  # 2^-shift
        v = decode(q.to(tl.int32), E4M3, MBITS, EMIN, HW_CONVERT) * down_B[:, None]
        unit_B = tl.where(byte_max_B == 255, 255, 127)  # scale 2^0, or NaN for NaN groups
        q = encode(
            v,
            unit_B[:, None],
            noise,
            E4M3,
            MBITS,
            EMIN,
            MAX_BITS,
            MAX_VALUE,
            NAN_BITS,
            HW_CONVERT,
            False,
            None,  # the merged values are in range already
        )
        grp_G = tl.program_id(0) * G + tl.arange(0, G)
        group_bits = tl.where(byte_G == 0, 0x00400000, byte_G << 23)  # 2^-127 is subnormal
        group_bits = tl.where(byte_G == 255, 0x7FC00000, group_bits)
        tl.store(
            group_scale_ptr + grp_G,
            group_bits.to(tl.float32, bitcast=True),
            mask=grp_G < n_blocks // 4,
        )
    else:
        tl.store(scale_ptr + blk_B, byte_B.to(tl.uint8), mask=in_bounds_B)
    # Stage 4: the fp8 bytes.
    tl.store(data_ptr + offs_B32, q, mask=mask_B32)


@triton.jit
def mx_quantize_tile2d_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    M,
    K,
    TILE_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX_EXP: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    RANGE_EMAX: tl.constexpr,
    RCEIL: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    IN_BF16: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
):
    """32×32 tiles: a program is ``TILE_ROWS`` strips of 32 rows by ``BLOCK_K`` columns, held as
    ``[TM, 32, KB, 32]`` = (tile row, row in tile, tile column, column in tile). One strip
    (``TM = 1``) on a GPU; several under the interpreter, where programs are expensive."""
    TM: tl.constexpr = TILE_ROWS
    KB: tl.constexpr = BLOCK_K // 32
    Kb = K // 32
    # Stage 1: one read of the strips.
    tile_row_TM = tl.program_id(0) * TM + tl.arange(0, TM)
    tile_col_KB = tl.program_id(1) * KB + tl.arange(0, KB)
    if WIDE_INDEX:
        tile_row_TM = tile_row_TM.to(tl.int64)
    rows_TM32 = tile_row_TM[:, None] * 32 + tl.arange(0, 32)[None, :]
    cols_KB32 = tile_col_KB[:, None] * 32 + tl.arange(0, 32)[None, :]
    offs = rows_TM32[:, :, None, None] * K + cols_KB32[None, None, :, :]
    mask = (rows_TM32[:, :, None, None] < M) & (tile_col_KB[None, None, :, None] < Kb)
    x = load_as_float32(x_ptr + offs, mask, IN_BF16)
    # Stage 2: amax over the 32 columns of each block, then over the 32 rows: one byte per tile.
    amax_TMKB = tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=3), axis=1)
    byte_TMKB = scale_byte(amax_TMKB, EMAX_EXP, RCEIL)
    # Stage 3-4: encode, store the bytes and the scale bytes (rows of the [Mb, Kb] matrix).
    q = encode(
        x,
        byte_TMKB[:, None, :, None],
        offs,
        E4M3,
        MBITS,
        EMIN,
        MAX_BITS,
        MAX_VALUE,
        NAN_BITS,
        HW_CONVERT,
        False,
        RANGE_EMAX,
    )
    tl.store(data_ptr + offs, q, mask=mask)
    tl.store(
        scale_ptr + tile_row_TM[:, None] * Kb + tile_col_KB[None, :],
        byte_TMKB.to(tl.uint8),
        mask=(tile_col_KB[None, :] < Kb) & (tile_row_TM[:, None] * 32 < M),
    )


@triton.jit
def mx_quantize_rowcol_kernel(
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
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    EMAX_EXP: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    RANGE_EMAX: tl.constexpr,
    RCEIL: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    IN_BF16: tl.constexpr,
    WIDE_INDEX: tl.constexpr,
):
    """Column-wise 1×32 blocks (stored transposed, ``[K, M]``), and with ``ROWS`` the row-wise
    ones from the same read. The tile is ``[BM/32, 32, KB, 32]`` = (row block, row in block,
    column block, column in block)."""
    MB: tl.constexpr = BLOCK_M // 32
    KB: tl.constexpr = BLOCK_K // 32
    Kb = K // 32
    Mb = M // 32
    # Stage 1: one read of the [BM, BK] tile.
    mb = tl.program_id(0) * MB + tl.arange(0, MB)  # global row-block and column-block indices
    kb = tl.program_id(1) * KB + tl.arange(0, KB)
    if WIDE_INDEX:  # 64-bit offsets only for tensors past 2^31 elements
        mb = mb.to(tl.int64)
        kb = kb.to(tl.int64)
    rows = mb[:, None, None, None] * 32 + tl.arange(0, 32)[None, :, None, None]
    cols = kb[None, None, :, None] * 32 + tl.arange(0, 32)[None, None, None, :]
    in_bounds = (rows < M) & (cols < K)
    offs_MK = rows * K + cols
    x = load_as_float32(x_ptr + offs_MK, in_bounds, IN_BF16)
    abs_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    if ROWS:  # 1×32 blocks along K, stored row-major [M, K] with scales [M, Kb]
        byte_r = scale_byte(tl.max(abs_bits, axis=3), EMAX_EXP, RCEIL)  # [MB, 32, KB]
        noise_r = offs_MK
        if STOCHASTIC:
            noise_r = lowbias32((offs_MK.to(tl.int64) + seed_key) & 0xFFFFFFFF)
        q_r = encode(
            x,
            byte_r[:, :, :, None],
            noise_r,
            E4M3,
            MBITS,
            EMIN,
            MAX_BITS,
            MAX_VALUE,
            NAN_BITS,
            HW_CONVERT,
            STOCHASTIC,
            RANGE_EMAX,
        )
        tl.store(row_data_ptr + offs_MK, q_r, mask=in_bounds)
        rows_r = mb[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
        kb_r = kb[None, None, :]
        tl.store(
            row_scale_ptr + rows_r * Kb + kb_r,
            byte_r.to(tl.uint8),
            mask=(rows_r < M) & (kb_r < Kb),
        )
    # 1×32 blocks along M, stored transposed [K, M] with scales [K, Mb]
    byte_c = scale_byte(tl.max(abs_bits, axis=1), EMAX_EXP, RCEIL)  # [MB, KB, 32]
    offs_KM = cols * M + rows
    noise_c = offs_KM
    if STOCHASTIC:
        noise_c = lowbias32((offs_KM.to(tl.int64) + seed_key) & 0xFFFFFFFF)
    q_c = encode(
        x,
        byte_c[:, None, :, :],
        noise_c,
        E4M3,
        MBITS,
        EMIN,
        MAX_BITS,
        MAX_VALUE,
        NAN_BITS,
        HW_CONVERT,
        STOCHASTIC,
        RANGE_EMAX,
    )
    tl.store(col_data_ptr + offs_KM, q_c, mask=in_bounds)
    cols_c = kb[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    mb_c = mb[:, None, None]
    tl.store(
        col_scale_ptr + cols_c * Mb + mb_c,
        byte_c.to(tl.uint8),
        mask=(cols_c < K) & (mb_c < Mb),
    )


@dataclass(frozen=True)
class RowsTiles:
    """``mx_quantize_rows_kernel``: ``blocks`` consecutive MX blocks (of 32) per program."""

    blocks: int = 128
    num_warps: int = 4


@dataclass(frozen=True)
class Tile2dTiles:
    """``mx_quantize_tile2d_kernel``: ``tile_rows`` strips of 32 rows by ``block_k`` columns per
    program."""

    block_k: int = 256
    num_warps: int = 4
    tile_rows: int = 1


@dataclass(frozen=True)
class RowColTiles:
    """``mx_quantize_rowcol_kernel``: a ``[block_m, block_k]`` tile per program."""

    block_m: int = 32
    block_k: int = 128
    num_warps: int = 4


Tiles = RowsTiles | Tile2dTiles | RowColTiles
# On a GPU: the dataclass defaults, the fastest of the benchmark's sweep. Under the interpreter
# each program is a round of numpy calls: few, large tiles run fastest.
GPU_TILES = (RowsTiles(), Tile2dTiles(), RowColTiles())
INTERPRETER_TILES = (RowsTiles(512, 4), Tile2dTiles(64, 4, 16), RowColTiles(256, 64, 4))
TILES_OF_LAYOUT = {
    "rows": RowsTiles,
    "tile2d": Tile2dTiles,
    "cols": RowColTiles,
    "rowcol": RowColTiles,
}


def default_tiles(x: torch.Tensor, launch: Launch = AUTO_LAUNCH):
    """(rows, tile2d, rowcol) launch shapes for ``x`` under ``launch``."""
    return GPU_TILES if launch.gpu_shapes(x) else INTERPRETER_TILES


def tiles_as_ints(tiles: Tiles | None) -> list[int] | None:
    """A launch shape as the int list the custom op's schema carries (None stays None)."""
    return None if tiles is None else list(astuple(tiles))


def tiles_from_ints(layout: str, ints: list[int] | None) -> Tiles | None:
    """The launch shape of ``layout``'s kernel from ``tiles_as_ints``."""
    return None if ints is None else TILES_OF_LAYOUT[layout](*(int(i) for i in ints))


def needs_wide_index(x: torch.Tensor) -> bool:
    """64-bit offsets only for tensors past 2^31 elements (less a margin for masked tails)."""
    return x.numel() >= 2**31 - 2**20


def launch_constants(x: torch.Tensor, fmt: ElemFormat, scale_mode: str, launch: Launch) -> dict:
    """The constexprs every MX kernel shares: the format, the scale rule, the encoder, the input
    dtype (its load and the end of its range) and the index width."""
    return dict(
        RCEIL=scale_mode == "rceil",
        HW_CONVERT=launch.hardware_encoder(x),
        IN_BF16=x.dtype == torch.bfloat16,
        RANGE_EMAX=range_emax(x.dtype),
        WIDE_INDEX=needs_wide_index(x),
        **fmt.kernel_constants,
    )


def as_kernel_input(x: torch.Tensor) -> torch.Tensor:
    """bf16 goes in as its int16 bits (``load_as_float32`` widens them by a shift)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def mx_quantize(
    x_MK: torch.Tensor,
    fmt: ElemFormat,
    *,
    rows: bool,
    cols: bool,
    tile_2d: bool,
    scale_mode: str,
    seed: int | None,
    tiles: Tiles | None = None,
    launch: Launch = AUTO_LAUNCH,
):
    """Launch the quantizer on a contiguous ``[M, K]`` tensor (M, K multiples of 32).

    Returns ``(row_data [M, K], row_scale [M, Kb] or [Mb, Kb] for 32×32, col_data [K, M],
    col_scale [K, Mb])`` as uint8; outputs of layouts not asked for are empty. ``tiles``
    overrides the launch shape of the kernel the layout picks (benchmark sweeps); ``launch``
    picks the default shapes and the encoder.
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
    rows_tiles, tile2d_tiles, rowcol_tiles = default_tiles(x_MK, launch)
    x_arg = as_kernel_input(x_MK)
    constants = launch_constants(x_MK, fmt, scale_mode, launch)
    if tile_2d:
        t = tiles or tile2d_tiles
        grid = (cdiv(M // 32, t.tile_rows), cdiv(K, t.block_k))
        mx_quantize_tile2d_kernel[grid](
            x_arg,
            row_data,
            row_scale,
            M,
            K,
            TILE_ROWS=t.tile_rows,
            BLOCK_K=t.block_k,
            num_warps=t.num_warps,
            **constants,
        )
    elif rows and not cols:
        launch_rows(x_arg, row_data, row_scale, None, seed, tiles or rows_tiles, constants)
    else:
        t = tiles or rowcol_tiles
        grid = (cdiv(M, t.block_m), cdiv(K, t.block_k))
        mx_quantize_rowcol_kernel[grid](
            x_arg,
            row_data,
            row_scale,
            col_data,
            col_scale,
            M,
            K,
            seed_key(seed or 0),
            BLOCK_M=t.block_m,
            BLOCK_K=t.block_k,
            ROWS=rows,
            STOCHASTIC=seed is not None,
            num_warps=t.num_warps,
            **constants,
        )
    return row_data, row_scale, col_data, col_scale


def launch_rows(x_arg, data, scale, group_scale, seed, tiles: RowsTiles, constants):
    """Launch ``mx_quantize_rows_kernel`` over all of ``x_arg``'s blocks; with ``group_scale``
    (float32 ``[M, K/128]``) it merges them to 1×128 blocks."""
    n_blocks = x_arg.numel() // 32
    merge = group_scale is not None
    mx_quantize_rows_kernel[(cdiv(n_blocks, tiles.blocks),)](
        x_arg,
        data,
        scale,
        group_scale if merge else scale,
        n_blocks,
        seed_key(seed or 0),
        BLOCKS=tiles.blocks,
        MERGE_K128=merge,
        STOCHASTIC=seed is not None,
        num_warps=tiles.num_warps,
        **constants,
    )

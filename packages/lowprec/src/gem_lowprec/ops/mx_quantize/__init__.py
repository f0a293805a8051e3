"""Public MX quantizers: ``to_mx`` (1×32 blocks along any axis), ``to_mx_2d`` (32×32 tiles),
``to_mx_rowcol`` (row-wise and column-wise 1×32 copies of a matrix from one read), and the
quantizers merged into 1×128 blocks for Hopper's blockwise fp8 GEMM (``quantize_mx_k128``,
``quantize_mx_k128_rowcol``).

The three MX quantizers go through one ``torch.library`` custom op (``_op.py``), so
``torch.compile(fullgraph=True)`` traces them; the op picks Triton on CUDA tensors and the
integer reference on CPU tensors (``backend`` overrides; Triton on CPU tensors runs under the
interpreter). Tensors whose block dimension is not a multiple of 32 are refused with a message:
nothing is padded or truncated silently. The bits are DESIGN.md's "MX semantics", defined by
``reference.py`` and ``gem_lowprec.codec``.
"""

import math
from typing import TYPE_CHECKING

import torch
from gem_lowprec._checks import (
    Backend,
    Rounding,
    ScaleMode,
    check_block_size,
    check_divisible,
    check_input,
    check_options,
    resolve_backend,
)
from gem_lowprec.codec import ElemFormat, elem_format
from gem_lowprec.mx_tensor import MXLayout, MXTensor
from gem_lowprec.ops.mx_quantize._op import mx_quantize_op, quantize
from gem_lowprec.ops.mx_quantize.reference import merge_k128

if TYPE_CHECKING:
    from gem_lowprec.ops.mx_quantize.triton import RowColTiles, RowsTiles, Tile2dTiles

__all__ = [
    "mx_quantize_op",
    "quantize_mx_k128",
    "quantize_mx_k128_rowcol",
    "to_mx",
    "to_mx_2d",
    "to_mx_rowcol",
]


def _seed_for(rounding: str, seed: int | None) -> int:
    """The kernel's seed: -1 for nearest rounding, else a 32-bit seed.

    The hash keys on ``seed mod 2**32``, so a larger seed would silently repeat a smaller one's
    noise; a bool is not a seed, and a seed with nearest rounding would be ignored."""
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32
    ):
        raise ValueError(f"seed must be an int in [0, 2**32 - 1], got {seed!r}")
    if rounding == "nearest":
        if seed is not None:
            raise ValueError(
                f'seed only makes sense with rounding="stochastic", got seed={seed} with '
                f'rounding="nearest"'
            )
        return -1
    if seed is None:
        return int(torch.randint(0, 2**31 - 1, ()).item())
    return seed


def _common_checks(x, elem_dtype, block_size, scale_mode, rounding, backend):
    check_input(x)
    fmt = elem_format(elem_dtype)
    check_block_size(block_size)
    check_options(scale_mode=scale_mode, rounding=rounding, backend=backend)
    return fmt, resolve_backend(backend, x.device)


def _elem_name(fmt: ElemFormat) -> str:
    return str(fmt.dtype).removeprefix("torch.")


def _tile_ints(tiles) -> list[int] | None:
    if tiles is None:
        return None
    from gem_lowprec.ops.mx_quantize.triton import tiles_as_ints

    return tiles_as_ints(tiles)


def to_mx(
    x: torch.Tensor,
    *,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int = 32,
    axis: int = -1,
    scale_mode: ScaleMode = "rceil",
    rounding: Rounding = "nearest",
    backend: Backend = "auto",
    seed: int | None = None,
    tiles: "RowsTiles | RowColTiles | None" = None,
) -> MXTensor:
    """Quantize ``x`` to MX with blocks of 32 consecutive elements along ``axis``.

    Args:
        x: bfloat16, float16 or float32, any shape with ``x.shape[axis] % 32 == 0``.
        elem_dtype: ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (max 57344).
        block_size: must be 32 (the MX block).
        axis: the block axis (negative counts from the end).
        scale_mode: ``"rceil"`` (smallest e with amax / 2^e ≤ max, what hardware uses) or
            ``"floor"`` (the OCP rule e = floor(log2 amax) − emax_exp).
        rounding: ``"nearest"`` (round-half-even) or ``"stochastic"``.
        backend: ``"auto"`` (Triton on CUDA tensors, the reference on CPU tensors),
            ``"triton"`` or ``"reference"``.
        seed: the stochastic-rounding seed (an int in [0, 2**32 - 1], only with
            ``rounding="stochastic"``; None draws one from torch's default generator). The same seed gives the same bytes on every backend.
        tiles: the Triton launch shape (``triton.RowsTiles`` for the last axis of any tensor,
            ``triton.RowColTiles`` for axis 0 of a matrix); None for the device's default. It
            changes the speed, never the bytes.

    Returns:
        ``MXTensor`` with ``data`` float8 of x's shape (for axis 0 of a matrix a transposed
        view of ``[K, M]`` bytes), ``scale`` uint8 E8M0 with ``x.shape[axis] / 32`` along
        ``axis``, layout ``MXLayout("1x32", axis=axis)``.

    Raises:
        TypeError: x is not a tensor of a float dtype above, ``elem_dtype`` is not fp8, or
            ``axis`` is not an int (a bool included).
        ValueError: a bad option, axis out of range, ``x.shape[axis]`` not a multiple of 32,
            a seed outside [0, 2**32 - 1], or a seed with ``rounding="nearest"``.
    """
    fmt, backend = _common_checks(x, elem_dtype, block_size, scale_mode, rounding, backend)
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"axis must be an int, got {axis!r}")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(
            f"axis must be in [{-x.dim()}, {x.dim() - 1}] for x of shape {tuple(x.shape)}, got {axis}"
        )
    axis = axis % x.dim()
    check_divisible(x, axis, 32, what="block size")
    seed_value = _seed_for(rounding, seed)
    elem = _elem_name(fmt)
    t = _tile_ints(tiles)
    if x.dim() == 2 and axis == 0:
        _, _, col_data, col_scale = quantize(
            x.contiguous(), elem, scale_mode, "cols", seed_value, backend, t
        )
        data, scale = col_data.t(), col_scale.t()
    elif axis == x.dim() - 1:
        k = x.shape[-1]
        row_data, row_scale, _, _ = quantize(
            x.contiguous().view(math.prod(x.shape[:-1]), k),
            elem,
            scale_mode,
            "rows",
            seed_value,
            backend,
            t,
        )
        data, scale = row_data.view(x.shape), row_scale.view(*x.shape[:-1], k // 32)
    else:
        moved = x.movedim(axis, -1)
        flat = moved.contiguous().view(math.prod(moved.shape[:-1]), moved.shape[-1])
        row_data, row_scale, _, _ = quantize(flat, elem, scale_mode, "rows", seed_value, backend, t)
        data = row_data.view(moved.shape).movedim(-1, axis)
        scale = row_scale.view(*moved.shape[:-1], moved.shape[-1] // 32).movedim(-1, axis)
    return MXTensor(data.view(fmt.dtype), scale, MXLayout("1x32", axis=axis))


def to_mx_2d(
    x: torch.Tensor,
    *,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int = 32,
    scale_mode: ScaleMode = "rceil",
    backend: Backend = "auto",
    tiles: "Tile2dTiles | None" = None,
) -> MXTensor:
    """Quantize ``x`` to MX with one scale per 32×32 tile of its last two dims.

    One scale serves a tile and its transpose, so ``result.t()`` (same bytes) is the MX tensor
    of ``xᵀ``.

    Args:
        x: bfloat16, float16 or float32 ``[..., M, N]`` with M and N multiples of 32.
        elem_dtype, block_size, scale_mode, backend: as for ``to_mx``.
        tiles: the Triton launch shape (``triton.Tile2dTiles``); None for the default.

    Returns:
        ``MXTensor`` with ``data`` float8 of x's shape, ``scale`` uint8 ``[..., M/32, N/32]``,
        layout ``MXLayout("32x32")``.

    Raises:
        TypeError: as for ``to_mx``.
        ValueError: a bad option, fewer than 2 dims, or M or N not a multiple of 32.
    """
    fmt, backend = _common_checks(x, elem_dtype, block_size, scale_mode, "nearest", backend)
    if x.dim() < 2:
        raise ValueError(
            f"x must have at least 2 dimensions for 32x32 tiles, got shape {tuple(x.shape)}"
        )
    check_divisible(x, -2, 32, what="tile edge")
    check_divisible(x, -1, 32, what="tile edge")
    *lead, m, n = x.shape
    data, scale, _, _ = quantize(
        x.contiguous().view(math.prod(lead) * m, n), _elem_name(fmt), scale_mode, "tile2d", -1,
        backend,
        _tile_ints(tiles),
    )  # fmt: skip
    return MXTensor(
        data.view(x.shape).view(fmt.dtype),
        scale.view(*lead, m // 32, n // 32),
        MXLayout("32x32"),
    )


def to_mx_rowcol(
    x: torch.Tensor,
    *,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int = 32,
    scale_mode: ScaleMode = "rceil",
    rounding: Rounding = "nearest",
    backend: Backend = "auto",
    seed: int | None = None,
    tiles: "RowColTiles | None" = None,
) -> tuple[MXTensor, MXTensor]:
    """Both 1×32 copies of a matrix from one read: (blocks along dim 1, blocks along dim 0).

    The second copy's bytes are stored ``[K, M]`` (the K-major GEMM operand) and exposed as a
    transposed view, so its ``data`` has x's shape. Each copy equals ``to_mx(x, axis=1)`` and
    ``to_mx(x, axis=0)`` bit for bit (with the same seed).

    Args:
        x: bfloat16, float16 or float32 ``[M, K]``, M and K multiples of 32.
        elem_dtype, block_size, scale_mode, rounding, backend, seed: as for ``to_mx``.
        tiles: the Triton launch shape (``triton.RowColTiles``); None for the default.

    Returns:
        ``(rows, cols)``: ``MXTensor`` s in ``MXLayout("1x32", axis=1)`` (scale ``[M, K/32]``)
        and ``MXLayout("1x32", axis=0)`` (scale ``[M/32, K]``, a transposed view).

    Raises:
        TypeError: as for ``to_mx``.
        ValueError: a bad option, x not 2-D, or M or K not a multiple of 32.
    """
    fmt, backend = _common_checks(x, elem_dtype, block_size, scale_mode, rounding, backend)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K] for to_mx_rowcol, got shape {tuple(x.shape)}")
    check_divisible(x, 0, 32, what="block size")
    check_divisible(x, 1, 32, what="block size")
    row_data, row_scale, col_data, col_scale = quantize(
        x.contiguous(),
        _elem_name(fmt),
        scale_mode,
        "rowcol",
        _seed_for(rounding, seed),
        backend,
        _tile_ints(tiles),
    )
    rows = MXTensor(row_data.view(fmt.dtype), row_scale, MXLayout("1x32", axis=1))
    cols = MXTensor(col_data.t().view(fmt.dtype), col_scale.t(), MXLayout("1x32", axis=0))
    return rows, cols


def quantize_mx_k128(
    x: torch.Tensor,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    scale_mode: ScaleMode = "rceil",
    backend: Backend = "auto",
    tiles: "RowsTiles | None" = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_k128(to_mx(x))``: MX blocks along the last dim merged into 1×128 blocks.

    On the Triton backend one fused kernel (quantize, merge, re-encode) with the same bits.

    Args:
        x: bfloat16, float16 or float32 ``[M, K]`` with K a multiple of 128.
        elem_dtype, scale_mode, backend: as for ``to_mx``.
        tiles: the rows kernel's launch shape (``triton.RowsTiles``); None for the default.

    Returns:
        ``(data, scale)``: float8 ``[M, K]`` (contiguous) and float32 ``[M, K/128]`` powers of
        two (NaN for a block holding NaN/Inf), with ``value = data · scale`` per 1×128 block.

    Raises:
        ValueError: x not 2-D or K not a multiple of 128; the errors of ``to_mx``.
    """
    if x.dim() != 2 or x.shape[1] % 128:
        raise ValueError(
            f"x must be 2-D with a last dim that is a multiple of 128, got {tuple(x.shape)}"
        )
    if resolve_backend(backend, x.device) == "triton":
        from gem_lowprec.ops.mx_quantize import triton_k128 as kernels

        fmt = elem_format(elem_dtype)
        data, scale = kernels.mx_quantize_merged_k128(
            x.contiguous(), fmt, scale_mode=scale_mode, tiles=tiles
        )
        return data.view(elem_dtype), scale
    return merge_k128(to_mx(x, elem_dtype=elem_dtype, scale_mode=scale_mode, backend=backend))


def quantize_mx_k128_rowcol(
    x: torch.Tensor,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    scale_mode: ScaleMode = "rceil",
    backend: Backend = "auto",
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(quantize_mx_k128(x), quantize_mx_k128(xᵀ))``: the operands of a GEMM contracting over
    x's columns and of one contracting over its rows.

    On the Triton backend one kernel reads x once and writes both (no transposed copy of x).

    Args:
        x: bfloat16, float16 or float32 ``[R, C]``, R and C multiples of 128.
        elem_dtype, scale_mode, backend: as for ``to_mx``.

    Returns:
        ``((data [R, C], scale [R, C/128]), (data_t [C, R], scale_t [C, R/128]))``: float8
        data and float32 scales; the Triton backend stores the scales outer-dim-major
        (transposed views), the layout cuBLAS's blockwise GEMM takes.

    Raises:
        ValueError: x not 2-D or a dim not a multiple of 128; the errors of ``to_mx``.
    """
    if x.dim() != 2 or x.shape[0] % 128 or x.shape[1] % 128:
        raise ValueError(f"x must be 2-D with both dims multiples of 128, got {tuple(x.shape)}")
    if resolve_backend(backend, x.device) == "triton":
        from gem_lowprec.ops.mx_quantize import triton_k128 as kernels

        fmt = elem_format(elem_dtype)
        data, scale, data_t, scale_t = kernels.mx_rowcol_k128(
            x.contiguous(), fmt, scale_mode=scale_mode
        )
        return (data.view(elem_dtype), scale), (data_t.view(elem_dtype), scale_t)
    mx = dict(elem_dtype=elem_dtype, scale_mode=scale_mode, backend=backend)
    return merge_k128(to_mx(x, **mx)), merge_k128(to_mx(x.t().contiguous(), **mx))

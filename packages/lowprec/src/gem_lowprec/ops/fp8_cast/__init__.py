"""fp8 casts for the ``fp8_rowwise`` linear: row-wise (with the column amax for a later
column-wise cast from the same read, and optionally a transposed copy of the same bytes) and
column-wise (stored transposed), with power-of-two scales, and both casts of a weight at once
(``cast_both``). ``backend="auto"`` takes Triton on CUDA tensors and the reference on CPU
tensors; both give the same bits (``reference.py`` defines them).
"""

from typing import NamedTuple

import torch
from gem_lowprec.formats import check_input, elem_format, resolve_backend
from gem_lowprec.ops.fp8_cast import reference

__all__ = ["RowCast", "cast_rows", "cast_columns", "cast_both"]


class RowCast(NamedTuple):
    data: torch.Tensor  # fp8 [R, C]
    scale: torch.Tensor  # float32 [R], a power of two per row
    data_t: torch.Tensor | None  # fp8 [C, R], the same bytes transposed (if asked)
    col_amax: torch.Tensor | None  # float32 [C], max_r |x[r, c] · row_mult[r]| (if asked)


def _check(x: torch.Tensor, row_mult: torch.Tensor | None, mult_name: str) -> None:
    check_input(x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [R, C], got shape {tuple(x.shape)}")
    if row_mult is not None and (
        row_mult.dtype != torch.float32
        or row_mult.shape != (x.shape[0],)
        or row_mult.device != x.device
    ):
        raise ValueError(
            f"{mult_name} must be float32 of shape ({x.shape[0]},) on {x.device}, got "
            f"{row_mult.dtype} {tuple(row_mult.shape)} on {row_mult.device}"
        )


def cast_rows(
    x: torch.Tensor,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    transposed: bool = False,
    col_amax_row_mult: torch.Tensor | None = None,
    backend: str = "auto",
) -> RowCast:
    """One power-of-two scale per row of ``x [R, C]``; ``transposed`` also returns the bytes as
    ``[C, R]``; ``col_amax_row_mult`` (float32 ``[R]``) also returns the column amax of
    ``x · row_mult`` for ``cast_columns``."""
    _check(x, col_amax_row_mult, "col_amax_row_mult")
    fmt = elem_format(elem_dtype)
    x = x.contiguous()
    if resolve_backend(backend, x.device) == "triton":
        from gem_lowprec.ops.fp8_cast import triton as kernels

        data, scale, data_t, col_amax = kernels.cast_rows(
            x, fmt, transposed=transposed, col_amax_row_mult=col_amax_row_mult
        )
    else:
        data, scale = reference.cast_rows(x, fmt)
        data_t = data.t().contiguous() if transposed else None
        col_amax = None
        if col_amax_row_mult is not None:
            col_amax = reference.column_amax(x, col_amax_row_mult)
    return RowCast(
        data.view(elem_dtype), scale, None if data_t is None else data_t.view(elem_dtype), col_amax
    )


def cast_columns(
    x: torch.Tensor,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    row_mult: torch.Tensor | None = None,
    col_amax: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-of-two scale per column of ``x [R, C] · row_mult[:, None]`` (``row_mult``
    float32 powers of two, so the product is exact); returns (fp8 ``[C, R]``, float32 ``[C]``).
    ``col_amax`` (from ``cast_rows``) skips the amax pass."""
    _check(x, row_mult, "row_mult")
    fmt = elem_format(elem_dtype)
    x = x.contiguous()
    if resolve_backend(backend, x.device) == "triton":
        from gem_lowprec.ops.fp8_cast import triton as kernels

        if col_amax is None:
            col_amax = kernels.column_amax(x, row_mult)
        data_t, scale = kernels.cast_columns(x, fmt, row_mult=row_mult, col_amax=col_amax)
    else:
        data_t, scale = reference.cast_columns_transposed(x, fmt, row_mult)
    return data_t.view(elem_dtype), scale


def cast_both(
    x: torch.Tensor, elem_dtype: torch.dtype = torch.float8_e4m3fn, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(*cast_rows(x)[:2], *cast_columns(x))`` in two launches on a GPU (one amax pass over
    tiles, one cast pass writing both copies): the fp8 weight for the forward
    (``[R, C]``, a scale per row) and for the input-gradient (``[C, R]``, a scale per column)."""
    _check(x, None, "row_mult")
    fmt = elem_format(elem_dtype)
    x = x.contiguous()
    if resolve_backend(backend, x.device) == "triton":
        from gem_lowprec.ops.fp8_cast import triton as kernels

        data, scale, data_t, scale_t = kernels.cast_both(x, fmt)
    else:
        data, scale = reference.cast_rows(x, fmt)
        data_t, scale_t = reference.cast_columns_transposed(x, fmt)
    return data.view(elem_dtype), scale, data_t.view(elem_dtype), scale_t

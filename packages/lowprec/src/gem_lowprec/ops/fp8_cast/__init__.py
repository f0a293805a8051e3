"""fp8 casts for the ``fp8_rowwise`` linear, with power-of-two scales: row-wise (with the column
amax for a later column-wise cast from the same read, and optionally a transposed copy of the
same bytes), column-wise (stored transposed), and both casts of a weight at once
(``cast_both``). ``backend="auto"`` takes Triton on CUDA tensors and the reference on CPU
tensors; both give the same bits (``reference.py`` defines them).
"""

from typing import NamedTuple

import torch
from gem_lowprec._checks import Backend, check_input, resolve_backend
from gem_lowprec.codec import elem_format
from gem_lowprec.ops.fp8_cast import reference

__all__ = ["RowCast", "cast_both", "cast_columns", "cast_rows"]


class RowCast(NamedTuple):
    """The result of ``cast_rows``."""

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
    backend: Backend = "auto",
) -> RowCast:
    """Cast ``x`` to fp8 with one power-of-two scale per row (the smallest ``2^e`` with
    ``amax_row / 2^e ≤`` the format's largest value), rounding to nearest-even and saturating.

    Args:
        x: bfloat16, float16 or float32 ``[R, C]``.
        elem_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transposed: also return the fp8 bytes transposed, ``[C, R]`` contiguous.
        col_amax_row_mult: float32 ``[R]`` on x's device; also return the column amax of
            ``x · row_mult[:, None]`` (for ``cast_columns``), from the same read of x.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Returns:
        ``RowCast(data fp8 [R, C], scale float32 [R], data_t fp8 [C, R] or None, col_amax
        float32 [C] or None)``; a row holding NaN/Inf gets a NaN scale and NaN data, and a
        column amax holding a NaN is the canonical quiet NaN.

    Raises:
        TypeError: x not a float tensor of the dtypes above, or ``elem_dtype`` not fp8.
        ValueError: x not 2-D, or ``col_amax_row_mult`` of the wrong dtype, shape or device.
    """
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
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x · row_mult[:, None]`` to fp8 with one power-of-two scale per column, stored
    transposed (the operand layout of a GEMM contracting over R).

    Args:
        x: bfloat16, float16 or float32 ``[R, C]``.
        elem_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        row_mult: float32 ``[R]`` powers of two on x's device (so the product is exact while it
            stays normal), or None for ones.
        col_amax: float32 ``[C]``, the column amax of ``x · row_mult`` from ``cast_rows``: the
            Triton backend then skips its amax pass (the reference recomputes it).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Returns:
        ``(data_t, scale)``: fp8 ``[C, R]`` contiguous and float32 ``[C]``.

    Raises:
        TypeError, ValueError: as for ``cast_rows`` (for ``row_mult``).
    """
    _check(x, row_mult, "row_mult")
    fmt = elem_format(elem_dtype)
    x = x.contiguous()
    if resolve_backend(backend, x.device) == "triton":
        from gem_lowprec.ops.fp8_cast import triton_columns as kernels

        if col_amax is None:
            col_amax = kernels.column_amax(x, row_mult)
        data_t, scale = kernels.cast_columns(x, fmt, row_mult=row_mult, col_amax=col_amax)
    else:
        data_t, scale = reference.cast_columns_transposed(x, fmt, row_mult)
    return data_t.view(elem_dtype), scale


def cast_both(
    x: torch.Tensor, elem_dtype: torch.dtype = torch.float8_e4m3fn, *, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(*cast_rows(x)[:2], *cast_columns(x))``, in two launches on the Triton backend (one
    amax pass over tiles, one cast pass writing both copies): the fp8 weight for the forward
    (a scale per row) and for the input-gradient (a scale per column, stored transposed).

    Args:
        x: bfloat16, float16 or float32 ``[R, C]`` (a weight: a few MiB).
        elem_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Returns:
        ``(data fp8 [R, C], scale float32 [R], data_t fp8 [C, R], scale_t float32 [C])``.

    Raises:
        TypeError, ValueError: as for ``cast_rows``.
    """
    _check(x, None, "row_mult")
    fmt = elem_format(elem_dtype)
    x = x.contiguous()
    if resolve_backend(backend, x.device) == "triton":
        from gem_lowprec.ops.fp8_cast import triton_columns as kernels

        data, scale, data_t, scale_t = kernels.cast_both(x, fmt)
    else:
        data, scale = reference.cast_rows(x, fmt)
        data_t, scale_t = reference.cast_columns_transposed(x, fmt)
    return data.view(elem_dtype), scale, data_t.view(elem_dtype), scale_t

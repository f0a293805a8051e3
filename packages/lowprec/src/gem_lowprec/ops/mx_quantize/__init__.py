"""Public MX quantizers: ``to_mx`` (1×32 blocks along any axis), ``to_mx_2d`` (32×32 tiles) and
``to_mx_rowcol`` (row-wise and column-wise 1×32 copies of a matrix from one read).

All three go through one ``torch.library`` custom op on a contiguous ``[M, K]`` view, so
``torch.compile(fullgraph=True)`` traces them; the op picks Triton on CUDA tensors and the integer
reference on CPU tensors (``backend`` overrides; Triton on CPU tensors runs under the interpreter).
Tensors whose block dimension is not a multiple of 32 are refused with a message: nothing is
padded or truncated silently.

Eager fast path: when nothing could observe the op (no compilation or tracing, no dispatch mode
such as fake tensors, plain tensors), the op's implementation is called directly. The dispatcher's
Python layers cost tens of microseconds a call, more than a quantize kernel of a few MB takes, and
the results are the same bytes.
"""

import torch
from gem_lowprec.formats import (
    check_block_size,
    check_divisible,
    check_input,
    check_options,
    elem_format,
    resolve_backend,
)
from gem_lowprec.mx_tensor import MXLayout, MXTensor
from gem_lowprec.ops.mx_quantize import reference

__all__ = ["to_mx", "to_mx_2d", "to_mx_rowcol"]

_LAYOUTS = ("rows", "cols", "rowcol", "tile2d")


def eager_path_allowed(*tensors: torch.Tensor) -> bool:
    """True when calling an op's implementation directly is unobservable: not compiling or
    tracing, no dispatch mode on the stack (fake tensors, functionalization, proxies), no functorch
    transform, and plain tensors only."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return all(type(t) is torch.Tensor for t in tensors)


def _mx_quantize(
    x: torch.Tensor, elem: str, scale_mode: str, layout: str, seed: int, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 (row_data [M,K], row_scale, col_data [K,M], col_scale [K,M/32]); seed < 0: nearest."""
    fmt = elem_format(getattr(torch, elem))
    stochastic_seed = seed if seed >= 0 else None
    if backend == "triton":
        from gem_lowprec.ops.mx_quantize import triton as kernels

        return kernels.mx_quantize(
            x,
            fmt,
            rows=layout in ("rows", "rowcol"),
            cols=layout in ("cols", "rowcol"),
            tile_2d=layout == "tile2d",
            scale_mode=scale_mode,
            seed=stochastic_seed,
        )
    if layout == "tile2d":
        data, scale = reference.quantize_2d(x, fmt, scale_mode=scale_mode)
        return data, scale, x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.uint8)
    row_data, row_scale, col_data, col_scale = (x.new_empty(0, dtype=torch.uint8) for _ in range(4))
    if layout in ("rows", "rowcol"):
        row_data, row_scale = reference.quantize_1d(
            x, fmt, axis=1, scale_mode=scale_mode, seed=stochastic_seed
        )
    if layout in ("cols", "rowcol"):
        data, scale = reference.quantize_1d(
            x, fmt, axis=0, scale_mode=scale_mode, seed=stochastic_seed
        )
        col_data, col_scale = data.t().contiguous(), scale.t().contiguous()
    return row_data, row_scale.contiguous(), col_data, col_scale


mx_quantize_op = torch.library.custom_op("gem_lowprec::mx_quantize", _mx_quantize, mutates_args=())


def _quantize(x, elem, scale_mode, layout, seed, backend):
    if eager_path_allowed(x):
        return _mx_quantize(x, elem, scale_mode, layout, seed, backend)
    return mx_quantize_op(x, elem, scale_mode, layout, seed, backend)


@mx_quantize_op.register_fake
def _(x, elem, scale_mode, layout, seed, backend):
    m, k = x.shape
    u8 = dict(dtype=torch.uint8)
    rows = layout in ("rows", "rowcol")
    cols = layout in ("cols", "rowcol")
    if layout == "tile2d":
        return (
            x.new_empty((m, k), **u8),
            x.new_empty((m // 32, k // 32), **u8),
            *(x.new_empty(0, **u8) for _ in range(2)),
        )
    return (
        x.new_empty((m, k) if rows else 0, **u8),
        x.new_empty((m, k // 32) if rows else 0, **u8),
        x.new_empty((k, m) if cols else 0, **u8),
        x.new_empty((k, m // 32) if cols else 0, **u8),
    )


def _seed_for(rounding: str, seed: int | None) -> int:
    if rounding == "nearest":
        return -1
    if seed is None:
        return int(torch.randint(0, 2**31 - 1, ()).item())
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return seed


def _common_checks(x, elem_dtype, block_size, scale_mode, rounding, backend):
    check_input(x)
    fmt = elem_format(elem_dtype)
    check_block_size(block_size)
    check_options(scale_mode=scale_mode, rounding=rounding, backend=backend)
    return fmt, resolve_backend(backend, x.device)


def _elem_name(elem_dtype) -> str:
    return str(elem_dtype).removeprefix("torch.")


def to_mx(
    x: torch.Tensor,
    *,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int = 32,
    axis: int = -1,
    scale_mode: str = "rceil",
    rounding: str = "nearest",
    backend: str = "auto",
    seed: int | None = None,
) -> MXTensor:
    """Quantize ``x`` to MX with blocks of 32 consecutive elements along ``axis``.

    ``rounding="stochastic"`` uses ``seed`` (drawn from torch's default generator when None).
    """
    fmt, backend = _common_checks(x, elem_dtype, block_size, scale_mode, rounding, backend)
    if not -x.dim() <= axis < x.dim():
        raise ValueError(
            f"axis must be in [{-x.dim()}, {x.dim() - 1}] for x of shape {tuple(x.shape)}, got {axis}"
        )
    axis = axis % x.dim()
    check_divisible(x, axis, 32, what="block size")
    seed_value = _seed_for(rounding, seed)
    elem = _elem_name(fmt.dtype)
    if x.dim() == 2 and axis == 0:
        _, _, col_data, col_scale = _quantize(
            x.contiguous(), elem, scale_mode, "cols", seed_value, backend
        )
        data, scale = col_data.t(), col_scale.t()
    elif axis == x.dim() - 1:
        k = x.shape[-1]
        row_data, row_scale, _, _ = _quantize(
            x.contiguous().view(-1, k), elem, scale_mode, "rows", seed_value, backend
        )
        data, scale = row_data.view(x.shape), row_scale.view(*x.shape[:-1], k // 32)
    else:
        moved = x.movedim(axis, -1)
        flat = moved.contiguous().reshape(-1, moved.shape[-1])
        row_data, row_scale, _, _ = _quantize(flat, elem, scale_mode, "rows", seed_value, backend)
        data = row_data.view(moved.shape).movedim(-1, axis)
        scale = row_scale.view(*moved.shape[:-1], moved.shape[-1] // 32).movedim(-1, axis)
    return MXTensor(data.view(fmt.dtype), scale, MXLayout("1x32", axis=axis))


def to_mx_2d(
    x: torch.Tensor,
    *,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int = 32,
    scale_mode: str = "rceil",
    backend: str = "auto",
) -> MXTensor:
    """Quantize ``x`` (at least 2-D) to MX with 32×32 tiles over its last two dims."""
    fmt, backend = _common_checks(x, elem_dtype, block_size, scale_mode, "nearest", backend)
    if x.dim() < 2:
        raise ValueError(
            f"x must have at least 2 dimensions for 32x32 tiles, got shape {tuple(x.shape)}"
        )
    check_divisible(x, -2, 32, what="tile edge")
    check_divisible(x, -1, 32, what="tile edge")
    *lead, m, n = x.shape
    data, scale, _, _ = _quantize(
        x.contiguous().reshape(-1, n), _elem_name(fmt.dtype), scale_mode, "tile2d", -1, backend
    )
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
    scale_mode: str = "rceil",
    rounding: str = "nearest",
    backend: str = "auto",
    seed: int | None = None,
) -> tuple[MXTensor, MXTensor]:
    """Both 1×32 copies of a matrix from one read: (blocks along dim 1, blocks along dim 0).

    The second copy's bytes are stored ``[K, M]`` (the K-major GEMM operand) and exposed as a
    transposed view, so its ``data`` has x's shape.
    """
    fmt, backend = _common_checks(x, elem_dtype, block_size, scale_mode, rounding, backend)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K] for to_mx_rowcol, got shape {tuple(x.shape)}")
    check_divisible(x, 0, 32, what="block size")
    check_divisible(x, 1, 32, what="block size")
    row_data, row_scale, col_data, col_scale = _quantize(
        x.contiguous(),
        _elem_name(fmt.dtype),
        scale_mode,
        "rowcol",
        _seed_for(rounding, seed),
        backend,
    )
    rows = MXTensor(row_data.view(fmt.dtype), row_scale, MXLayout("1x32", axis=1))
    cols = MXTensor(col_data.t().view(fmt.dtype), col_scale.t(), MXLayout("1x32", axis=0))
    return rows, cols

"""The ``gem_lowprec::mx_quantize`` custom op behind ``to_mx``, ``to_mx_2d`` and ``to_mx_rowcol``.

One op on a contiguous ``[M, K]`` view for every layout (``rows``: 1×32 along K; ``cols``: 1×32
along M, stored ``[K, M]``; ``rowcol``: both from one read; ``tile2d``: 32×32 tiles), with a
fake implementation, so ``torch.compile(fullgraph=True)`` traces it. Its arguments are plain
values: the element dtype by name, ``seed < 0`` for round-to-nearest, the resolved backend, and
the launch shape as an int list (``triton.tiles_as_ints``; None for the default).

Eager fast path (``quantize``): when nothing could observe the op (``eager_path_allowed``), its
implementation is called directly; the results are the same bytes.
"""

import torch
from gem_lowprec._checks import eager_path_allowed
from gem_lowprec.codec import elem_format
from gem_lowprec.ops.mx_quantize import reference

LAYOUTS = ("rows", "cols", "rowcol", "tile2d")


def _mx_quantize(
    x: torch.Tensor,
    elem: str,
    scale_mode: str,
    layout: str,
    seed: int,
    backend: str,
    tiles: list[int] | None = None,
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
            tiles=kernels.tiles_from_ints(layout, tiles),
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


@mx_quantize_op.register_fake
def _(x, elem, scale_mode, layout, seed, backend, tiles=None):
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


def quantize(x, elem, scale_mode, layout, seed, backend, tiles=None):
    """The op, or its implementation directly where nothing could tell the difference."""
    if eager_path_allowed(x):
        return _mx_quantize(x, elem, scale_mode, layout, seed, backend, tiles)
    return mx_quantize_op(x, elem, scale_mode, layout, seed, backend, tiles)

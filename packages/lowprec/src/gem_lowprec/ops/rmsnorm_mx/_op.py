"""The ``gem_lowprec::rmsnorm_mx`` custom op behind ``rmsnorm_to_mx``: a fake implementation for
``torch.compile``, and the same eager fast path as ``to_mx`` (``eager_path_allowed``: the
dispatcher's host cost is larger than this kernel's time). The launch shape travels as an int
list (``RmsnormTiles(elements, num_warps)``; None for the default)."""

import torch
from gem_lowprec._checks import eager_path_allowed
from gem_lowprec.codec import elem_format
from gem_lowprec.ops.rmsnorm_mx import reference


def _rmsnorm_mx(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    elem: str,
    scale_mode: str,
    backend: str,
    tiles: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    fmt = elem_format(getattr(torch, elem))
    if backend == "triton":
        from gem_lowprec.ops.rmsnorm_mx import triton as kernels

        shape = None if tiles is None else kernels.RmsnormTiles(*(int(i) for i in tiles))
        data, scale, _ = kernels.rmsnorm_mx(x, weight, eps, fmt, scale_mode, tiles=shape)
        return data, scale
    data, scale = reference.rmsnorm_mx(x, weight, eps, fmt, scale_mode)
    return data, scale.contiguous()


rmsnorm_mx_op = torch.library.custom_op("gem_lowprec::rmsnorm_mx", _rmsnorm_mx, mutates_args=())


@rmsnorm_mx_op.register_fake
def _(x, weight, eps, elem, scale_mode, backend, tiles=None):
    m, n = x.shape
    return x.new_empty((m, n), dtype=torch.uint8), x.new_empty((m, n // 32), dtype=torch.uint8)


def rmsnorm_mx(x, weight, eps, elem, scale_mode, backend, tiles=None):
    """The op, or its implementation directly where nothing could tell the difference."""
    if eager_path_allowed(x, weight):
        return _rmsnorm_mx(x, weight, eps, elem, scale_mode, backend, tiles)
    return rmsnorm_mx_op(x, weight, eps, elem, scale_mode, backend, tiles)

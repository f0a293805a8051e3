"""A minimal FP8 all-gather weight, as gem_lowprec would plug it into ``all_gather_hook``.

The weight is a wrapper tensor subclass (torchao's Float8 training pattern): FSDP2 shards it like
any parameter, then, before each all-gather, asks it for the tensors to send
(``fsdp_pre_all_gather``: row-wise E4M3 values plus one fp32 scale per row) and, after, to rebuild
the unsharded weight from what arrived (``fsdp_post_all_gather``: values x scales). Every other op
runs on the plain data; the ops FSDP uses to shard and copy keep the subclass.
"""

import torch
from torch.utils import _pytree as pytree

aten = torch.ops.aten
E4M3_MAX = 448.0
_KEEP_SUBCLASS = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.clone.default,
    aten.detach.default,
}


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (values.float() * scale).to(dtype)


class FP8GatherWeight(torch.Tensor):
    gathers = 0  # how many times FSDP asked for FP8 all-gather inputs (all instances)

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor):
        self._data = data

    def __repr__(self):
        return f"FP8GatherWeight({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, metadata, outer_size, outer_stride):
        return FP8GatherWeight(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func == aten.copy_.default:  # copy into our data, keep ourselves
            dst, src = args[0], args[1]
            dst._data.copy_(src._data if isinstance(src, cls) else src)
            return dst
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        FP8GatherWeight.gathers += 1
        values, scale = quantize_rows(self._data)
        return (values.view(torch.uint8), scale), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        values, scale = outputs
        weight = dequantize_rows(values.view(torch.float8_e4m3fn), scale, param_dtype)
        if out is not None:  # later all-gathers refill the unsharded parameter in place, as
            # FSDP's own copy-out does (autograd saw this storage before it was freed)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(weight)
            return None
        return weight, (weight,)


def fp8_all_gather_hook(block: torch.nn.Module) -> None:
    """Swap every Linear weight of ``block`` for the FP8 all-gather subclass."""
    for module in block.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(
                FP8GatherWeight(module.weight.data), requires_grad=True
            )

"""FP8 all-gather for FSDP2: quantize the local weight shard to MX before the all-gather.

``FP8AllGatherWeight`` wraps a weight shard as a tensor subclass that FSDP2 recognizes through
its extension hooks:

- ``fsdp_pre_all_gather`` quantizes the local shard to MX with 1×32 blocks along the input dim
  (dim 1). FSDP2 shards dim 0 (output rows), and a row's blocks never cross rows, so quantizing
  each shard and gathering gives exactly the bytes of quantizing the gathered weight. The
  all-gather moves the fp8 bytes and the E8M0 scale bytes: ``(1 + 1/32) / 2 = 0.516×`` the BF16
  bytes.
- ``fsdp_post_all_gather`` dequantizes the gathered MX weight (exactly, in float32, then to the
  parameter dtype) into the unsharded parameter. A ``LowPrecisionLinear`` re-quantizes it
  losslessly (MX-dequantized values are on the MX grid of the same or a finer scale); a plain
  module computes with the MX-rounded weight. ``gather_log.last`` keeps the gathered
  ``MXTensor`` for inspection (the log is shared by every view FSDP makes of the shard).

Every other op on the wrapper runs on the wrapped high-precision shard (the optimizer updates it
in place), and views, copies and splits keep the wrapper, as FSDP2's sharding needs.
``enable_fp8_all_gather(model)`` wraps the weights of a model's ``nn.Linear`` modules; call it
before ``fully_shard``. Weights must have ``in_features % 32 == 0`` and ``out_features``
divisible by the FSDP world size (FSDP2 requires even shards for all-gather extensions).
"""

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from gem_lowprec.mx_tensor import MXLayout, MXTensor
from gem_lowprec.ops.mx_quantize import to_mx

aten = torch.ops.aten

_PRESERVE_WRAPPER = {
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
    aten.chunk.default,
    aten.narrow.default,
}


class GatherLog:
    """A copy of the last gathered ``MXTensor`` of one weight, kept when ``keep`` is set (shared by
    all of its shard's views; a copy because FSDP2 frees the all-gather buffers after use)."""

    def __init__(self, keep: bool = False):
        self.keep = keep
        self.last: MXTensor | None = None


class FP8AllGatherWeight(torch.Tensor):
    """A weight shard that FSDP2 all-gathers as MX bytes + E8M0 scales (see the module).

    Args:
        tensor: the high-precision shard ``[rows, in_features]`` (in_features % 32 == 0).
        elem_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale_mode: ``"rceil"`` or ``"floor"``.
        gather_log: the ``GatherLog`` shared by the shard's views (a new one by default).
    """

    @staticmethod
    def __new__(
        cls,
        tensor: torch.Tensor,
        elem_dtype=torch.float8_e4m3fn,
        scale_mode="rceil",
        gather_log=None,
    ):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(
        self,
        tensor: torch.Tensor,
        elem_dtype=torch.float8_e4m3fn,
        scale_mode="rceil",
        gather_log=None,
    ):
        self._tensor = tensor
        self._elem_dtype = elem_dtype
        self._scale_mode = scale_mode
        self.gather_log = gather_log if gather_log is not None else GatherLog()

    def _rewrap(self, tensor: torch.Tensor) -> "FP8AllGatherWeight":
        return FP8AllGatherWeight(tensor, self._elem_dtype, self._scale_mode, self.gather_log)

    def __repr__(self) -> str:
        return f"FP8AllGatherWeight({self._tensor!r}, elem_dtype={self._elem_dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        like = next(a for a in tree_leaves_of(args, kwargs) if isinstance(a, cls))
        if func == aten.detach.default:
            return like._rewrap(args[0]._tensor.detach())
        args, kwargs = tree_map_only(cls, lambda t: t._tensor, (args, kwargs))
        out = func(*args, **kwargs)
        if func not in _PRESERVE_WRAPPER:
            return out
        return tree_map_only(torch.Tensor, like._rewrap, out)

    def __tensor_flatten__(self):
        return ["_tensor"], (self._elem_dtype, self._scale_mode, self.gather_log)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return FP8AllGatherWeight(inner_tensors["_tensor"], *meta)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        mx = to_mx(self._tensor, elem_dtype=self._elem_dtype, scale_mode=self._scale_mode, axis=1)
        return (mx.data.view(torch.uint8), mx.scale), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        data, scale = all_gather_outputs
        mx = MXTensor(data.view(self._elem_dtype), scale, MXLayout("1x32", axis=1))
        if self.gather_log.keep:
            self.gather_log.last = MXTensor(mx.data.clone(), mx.scale.clone(), mx.layout)
        weight = mx.dequantize(param_dtype)
        if out is not None:
            # Refill the unsharded parameter in place (backward's re-gather) without bumping its
            # version: autograd saved it in the forward, and its values are the same as then.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(weight)
            return None
        return weight, (weight,)


def tree_leaves_of(args, kwargs):
    from torch.utils._pytree import tree_leaves

    return tree_leaves((args, kwargs))


def enable_fp8_all_gather(
    model: nn.Module,
    *,
    elem_dtype=torch.float8_e4m3fn,
    scale_mode: str = "rceil",
    keep_gathered: bool = False,
) -> list[str]:
    """Wrap the weight of every ``nn.Linear`` of ``model`` with ``in_features % 32 == 0`` in an
    ``FP8AllGatherWeight`` (in place; call before ``fully_shard``).

    Args:
        model: any module.
        elem_dtype: the gathered element format (``torch.float8_e4m3fn`` or ``float8_e5m2``).
        scale_mode: the MX scale rule, ``"rceil"`` or ``"floor"``.
        keep_gathered: keep a copy of each last gathered MX weight in ``weight.gather_log``.

    Returns:
        The qualified names of the wrapped linears.
    """
    wrapped = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod.in_features % 32 == 0:
            w = mod.weight
            mod.weight = nn.Parameter(
                FP8AllGatherWeight(w.data, elem_dtype, scale_mode, GatherLog(keep_gathered)),
                requires_grad=w.requires_grad,
            )
            wrapped.append(name)
    return wrapped

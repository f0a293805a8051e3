"""Apply the dense half of a plan to a model: FSDP2 HSDP, mixed precision, expert parallelism.

``apply_dense_parallel(model, meshes, blocks=...)`` does, in order:

1. Expert parallelism: every :class:`~gem_parallel.moe.MoE` in the model keeps its ``E / ep``
   experts and dispatches tokens over the ``ep`` group (skipped when ``ep == 1``). Build the model
   identically on every rank (same seed) before calling this, as with any FSDP model.
2. The all-gather hook (``DenseParallelConfig.all_gather_hook``), called on every block before
   it is sharded. This is where gem_lowprec plugs its FP8 all-gather in: it swaps a block's
   weights for a tensor subclass that implements FSDP2's ``fsdp_pre_all_gather`` /
   ``fsdp_post_all_gather`` (so the weights travel as FP8 plus scales and are rebuilt after the
   gather), exactly as torchao's Float8 training does.
3. FSDP2: each MoE's experts are sharded on the expert HSDP mesh ``(dp_replicate, edp_shard)``,
   each block on the dense HSDP mesh ``(dp_replicate, dp_shard)``, then the root, all with one
   ``MixedPrecisionPolicy`` (bf16 weights in compute, fp32 gradient reduction by default).
4. The module hook (``DenseParallelConfig.fsdp_module_hook``), called on every FSDP module after
   sharding, for per-module settings such as ``set_custom_all_gather`` (copy-engine all-gathers)
   or prefetch distances.

Gradients come out as the mean over all ranks for every parameter: FSDP averages the dense
weights over ``dp_replicate x dp_shard`` and the experts over ``dp_replicate x edp_shard``, and the
MoE layer scales its experts' gradients by ``1/ep`` for the ranks whose tokens they served.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from gem_parallel.meshes import ParallelMeshes
from gem_parallel.moe import MoE


@dataclass(frozen=True)
class DenseParallelConfig:
    """How ``apply_dense_parallel`` shards: FSDP2's mixed precision (``param_dtype`` for compute,
    None for the parameters' own; ``reduce_dtype`` for gradient reduction), whether to reshard
    after the forward, and the two hooks of the module docstring (``all_gather_hook(block)``
    before sharding, ``fsdp_module_hook(fsdp_module)`` after)."""

    param_dtype: torch.dtype | None = torch.bfloat16  # None: compute in the parameters' dtype
    reduce_dtype: torch.dtype | None = torch.float32
    reshard_after_forward: bool = True
    all_gather_hook: Callable[[nn.Module], None] | None = None
    fsdp_module_hook: Callable[[FSDPModule], None] | None = None

    def mp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's ``MixedPrecisionPolicy`` of these dtypes."""
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    """``model.layers`` when the model has that list, else its direct children with parameters."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList | nn.Sequential):
        return list(layers)
    return [m for m in model.children() if any(True for _ in m.parameters())]


def apply_dense_parallel(
    model: nn.Module,
    meshes: ParallelMeshes,
    *,
    blocks: Iterable[nn.Module] | None = None,
    config: DenseParallelConfig | None = None,
) -> nn.Module:
    """Shard ``model`` in place (it becomes an FSDP module) and return it.

    Args:
        model: built identically on every rank (same seed).
        meshes: from ``build_meshes`` (the plan's layout).
        blocks: the FSDP units (default: ``model.layers``, else each direct child with
            parameters); the root is sharded last.
        config: ``DenseParallelConfig`` (default: bf16 compute, fp32 reduction).

    Raises:
        ValueError: the layout's ``ep`` does not divide an MoE layer's number of experts.
    """
    config = config or DenseParallelConfig()
    blocks = _default_blocks(model) if blocks is None else list(blocks)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    layout = meshes.layout
    for moe in moes:
        if moe.config.num_experts % layout.ep:
            raise ValueError(
                f"ep={layout.ep} does not divide num_experts={moe.config.num_experts} of an MoE "
                "layer; plan with an ep that divides it"
            )
        if layout.ep > 1:
            moe.shard_experts(meshes.group("ep"))
    if config.all_gather_hook is not None:
        for block in blocks:
            config.all_gather_hook(block)
    common = {
        "mp_policy": config.mp_policy(),
        "reshard_after_forward": config.reshard_after_forward,
    }
    sharded = [fully_shard(moe.experts, mesh=meshes.expert_hsdp, **common) for moe in moes]
    sharded += [fully_shard(block, mesh=meshes.dense_hsdp, **common) for block in blocks]
    sharded.append(fully_shard(model, mesh=meshes.dense_hsdp, **common))
    if config.fsdp_module_hook is not None:
        for module in sharded:
            config.fsdp_module_hook(module)
    return model

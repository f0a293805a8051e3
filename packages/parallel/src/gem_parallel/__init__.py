"""gem_parallel: topology-aware parallelism for GEM-like recommendation models.

Planning (pure Python, no torch import): ``Topology``, ``CostModel``, ``ModelSpec``, ``make_plan``
(``gem_parallel.planner.plan``) -> ``Plan`` with a ``MeshLayout``; ``python -m gem_parallel.cli``
is its command line. Running (torch.distributed): ``build_meshes`` -> ``ParallelMeshes``,
``apply_dense_parallel`` (FSDP2 HSDP + expert parallelism), ``MoE``. Sparse side:
``shard_embeddings`` and the ``collectives`` module.

Every name is imported on first use, so ``import gem_parallel`` is cheap and a part that cannot
load (say, an optional back end) fails only when it is used, with the reason.
"""

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("gem-parallel")
except PackageNotFoundError:  # the source tree on PYTHONPATH (the GPU image), not installed
    __version__ = "0.1.0"

# Type checkers read these imports; at run time ``__getattr__`` below imports on first use.
if TYPE_CHECKING:
    from gem_parallel import collectives
    from gem_parallel.cost_model import CollectiveEstimate, CostModel
    from gem_parallel.dense import DenseParallelConfig, apply_dense_parallel
    from gem_parallel.embeddings import shard_embeddings
    from gem_parallel.layout import MeshLayout
    from gem_parallel.meshes import ParallelMeshes, build_meshes, fake_world
    from gem_parallel.model_spec import ModelSpec
    from gem_parallel.moe import MoE, MoEConfig, moe_reference
    from gem_parallel.planner import Plan, PlannerConfig
    from gem_parallel.planner import plan as make_plan
    from gem_parallel.topology import GroupPlacement, Tier, Topology

_EXPORTS = {
    "Tier": "gem_parallel.topology",
    "Topology": "gem_parallel.topology",
    "GroupPlacement": "gem_parallel.topology",
    "CostModel": "gem_parallel.cost_model",
    "CollectiveEstimate": "gem_parallel.cost_model",
    "ModelSpec": "gem_parallel.model_spec",
    "MeshLayout": "gem_parallel.layout",
    "Plan": "gem_parallel.planner",
    "PlannerConfig": "gem_parallel.planner",
    "make_plan": "gem_parallel.planner",
    "ParallelMeshes": "gem_parallel.meshes",
    "build_meshes": "gem_parallel.meshes",
    "fake_world": "gem_parallel.meshes",
    "DenseParallelConfig": "gem_parallel.dense",
    "apply_dense_parallel": "gem_parallel.dense",
    "MoE": "gem_parallel.moe",
    "MoEConfig": "gem_parallel.moe",
    "moe_reference": "gem_parallel.moe",
    "shard_embeddings": "gem_parallel.embeddings",
}
_SUBMODULES = ("collectives",)

__all__ = [
    "CollectiveEstimate",
    "CostModel",
    "DenseParallelConfig",
    "GroupPlacement",
    "MeshLayout",
    "MoE",
    "MoEConfig",
    "ModelSpec",
    "ParallelMeshes",
    "Plan",
    "PlannerConfig",
    "Tier",
    "Topology",
    "apply_dense_parallel",
    "build_meshes",
    "collectives",
    "fake_world",
    "make_plan",
    "moe_reference",
    "shard_embeddings",
]


def __getattr__(name: str):
    if name in _SUBMODULES:
        target, attribute = f"gem_parallel.{name}", None
    elif name in _EXPORTS:
        target, attribute = _EXPORTS[name], ("plan" if name == "make_plan" else name)
    else:
        raise AttributeError(f"module 'gem_parallel' has no attribute {name!r}")
    try:
        module = importlib.import_module(target)
    except ImportError as err:
        raise AttributeError(f"gem_parallel.{name} is unavailable: {err}") from err
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return __all__

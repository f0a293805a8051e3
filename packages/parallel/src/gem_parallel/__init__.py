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

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


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

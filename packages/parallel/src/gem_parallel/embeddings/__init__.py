"""Sharded embedding tables: 2D and fully sharded 2D, through torchrec or in plain PyTorch.

``shard_embeddings(module, backend=..., mesh=...)`` is the one entry:

- ``backend="native"`` (``native.py``): plain PyTorch tables, row-wise sharded over the
  model-parallel group, with the replicas' copies fully sharded (gathered on demand with an
  asynchronous prefetch, gradients reduce-scattered) or kept whole (2D). Runs on the CPU with gloo
  and on GPUs with NCCL; needs no fbgemm and no torchrec.
- ``backend="torchrec"`` (``torchrec_backend.py``, torchrec installed: the ``torchrec`` extra):
  on CUDA torchrec's ``DMPCollection`` in its fully sharded mode; on the CPU (gloo) torchrec's
  ``DistributedModelParallel``, table-wise over the world, with no replicas. There pooled tables
  train through their ``.grad`` and any optimizer; unpooled ones need ``fused_optimizer``.

Both take a torchrec ``KeyedJaggedTensor`` (or ``KeyedJagged``, its stand-in here) and return
``PooledEmbeddings`` (pooling "sum"/"mean") or a dict of ``JaggedEmbeddings`` (pooling "none").

The ranks come as a 2D ``DeviceMesh`` or as two process groups. The mesh's dimensions are found
by name ("sparse_replica"/"replicate" and "sparse_mp"/"model_parallel", in either order, so the
planner's sparse mesh plugs in directly); an unnamed 2D mesh is (replicas, model parallel), and a
1D mesh is model parallel only.
"""

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import CopyEngines
from .fused_optimizer import RowwiseAdagrad
from .kjt import FeatureIds, JaggedEmbeddings, KeyedJagged, PooledEmbeddings, split_features
from .native import ShardedEmbeddingTables, ShardingConfig
from .tables import EmbeddingTables, TableConfig

BACKENDS = ("native", "torchrec")
# Mesh dimension names recognised, in either order (the planner's sparse mesh names its dims
# "sparse_replica" and "sparse_mp"); a mesh without these names is read as (replicas, model parallel).
REPLICA_DIM_NAMES = ("sparse_replica", "replicate", "replica", "replicas")
MODEL_PARALLEL_DIM_NAMES = ("sparse_mp", "model_parallel", "mp", "shard")

__all__ = [
    "BACKENDS",
    "EmbeddingTables",
    "FeatureIds",
    "JaggedEmbeddings",
    "KeyedJagged",
    "PooledEmbeddings",
    "RowwiseAdagrad",
    "ShardedEmbeddingTables",
    "ShardingConfig",
    "TableConfig",
    "resolve_groups",
    "shard_embeddings",
    "split_features",
]


def resolve_groups(
    mesh=None,
    *,
    model_parallel_group: dist.ProcessGroup | None = None,
    replica_group: dist.ProcessGroup | None = None,
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """``(model_parallel_group, replica_group)`` from a mesh or from the groups themselves."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    if mesh is not None:
        if model_parallel_group is not None or replica_group is not None:
            raise ValueError("pass either mesh or the process groups, not both")
        if mesh.ndim == 1:
            return mesh.get_group(0), None
        if mesh.ndim != 2:
            raise ValueError(
                f"mesh must be 1D (model parallel) or 2D (replicas x model parallel), got {mesh.ndim}D"
            )
        names = tuple(mesh.mesh_dim_names or ())
        replica_dim = next((i for i, n in enumerate(names) if n in REPLICA_DIM_NAMES), None)
        mp_dim = next((i for i, n in enumerate(names) if n in MODEL_PARALLEL_DIM_NAMES), None)
        if replica_dim is None or mp_dim is None or replica_dim == mp_dim:
            replica_dim, mp_dim = 0, 1  # unnamed (or unknown names): replicas x model parallel
        return mesh.get_group(mp_dim), mesh.get_group(replica_dim)
    mp = model_parallel_group if model_parallel_group is not None else dist.group.WORLD
    if replica_group is not None and replica_group.size() * mp.size() > dist.get_world_size():
        raise ValueError(
            f"replica_group ({replica_group.size()} ranks) x model_parallel_group ({mp.size()} "
            f"ranks) exceeds the world ({dist.get_world_size()} ranks)"
        )
    return mp, replica_group


def shard_embeddings(
    module: nn.Module,
    *,
    backend: str = "native",
    mesh=None,
    model_parallel_group: dist.ProcessGroup | None = None,
    replica_group: dist.ProcessGroup | None = None,
    config: ShardingConfig | None = None,
    device: torch.device | str | None = None,
    engines: CopyEngines | None = None,
    fused_optimizer: RowwiseAdagrad | None = None,
) -> nn.Module:
    """Shard ``module`` (an ``EmbeddingTables``, or a torchrec EmbeddingBagCollection /
    EmbeddingCollection) over the mesh; returns a module with the same forward.

    Every rank must pass identical weights (same seed or a loaded checkpoint); each keeps its
    slice, on ``device`` (default: where ``module``'s weights are), so the full tables may stay on
    the CPU. ``config`` (``ShardingConfig``) picks fully sharded vs 2D, prefetch, gradient reduction
    and the collectives' engine; the torchrec back end reads only ``fully_sharded`` from it (on
    CUDA).

    Args:
        module: the tables to shard.
        backend: ``"native"`` (plain PyTorch, CPU or GPU) or ``"torchrec"`` (the extra:
            ``DMPCollection`` on CUDA, ``DistributedModelParallel`` table-wise on the CPU).
        mesh: a 1D (model parallel) or 2D (replicas x model parallel) ``DeviceMesh``; or pass
            ``model_parallel_group`` (default: the world) and ``replica_group`` instead.
        config: ``ShardingConfig`` (default: fully sharded, prefetch, ``reduce="avg"``, engine
            ``"auto"``).
        device: where the shards live.
        engines: the ``collectives.CopyEngines`` that keeps the copy engines' workspaces (native
            back end; default: the sharded module's own, as its ``copy_engines``).
        fused_optimizer: torchrec back end on the CPU: a ``RowwiseAdagrad`` that FBGEMM applies
            in the backward (``EXACT_ROWWISE_ADAGRAD``, torchrec's ``fused`` kernel), the sharded
            module's ``fused_optimizer``, whose ``lr`` may change between steps. None: the
            ``dense`` kernel, gradients in ``.grad`` (pooled tables only). An ``EmbeddingTables``
            passes its own.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: an unknown backend, a mesh and groups together, a mesh of 3 or more
            dimensions, groups larger than the world, a fused optimizer on the native back end
            or on CUDA; on the CPU with torchrec, replicas, a model-parallel group smaller than
            the world, or an unpooled collection without ``fused_optimizer``.
        TypeError: ``module`` is neither ``EmbeddingTables`` nor a torchrec collection, or
            ``fused_optimizer`` is not a ``RowwiseAdagrad``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    config = config if config is not None else ShardingConfig()
    mp, replicas = resolve_groups(
        mesh, model_parallel_group=model_parallel_group, replica_group=replica_group
    )
    if backend == "torchrec":
        from .torchrec_backend import shard_with_torchrec

        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        return shard_with_torchrec(
            module,
            model_parallel_group=mp,
            replica_group=replicas,
            fully_sharded=config.fully_sharded,
            device=torch.device(device),
            fused_optimizer=fused_optimizer,
        )
    if fused_optimizer is not None:
        raise ValueError(
            "fused_optimizer: the native back end keeps dense gradients; a fused optimizer "
            "shards with backend='torchrec' on the CPU"
        )
    if isinstance(module, EmbeddingTables) and module.fused_optimizer is not None:
        raise ValueError(
            "module: tables with a fused_optimizer train on one process; the sharded native "
            "back end keeps dense gradients (build the tables without fused_optimizer to shard)"
        )
    if not isinstance(module, EmbeddingTables):
        if hasattr(module, "embedding_bag_configs") or hasattr(module, "embedding_configs"):
            module = EmbeddingTables.from_torchrec(module)
        else:
            raise TypeError(
                "module must be a gem_parallel EmbeddingTables or a torchrec "
                f"EmbeddingBagCollection / EmbeddingCollection, got {type(module).__name__}"
            )
    return ShardedEmbeddingTables(
        module,
        model_parallel_group=mp,
        replica_group=replicas,
        config=config,
        device=device,
        engines=engines,
    )

"""The torchrec back end: torchrec's own 2D sharding (``DMPCollection``), fully sharded on CUDA.

torchrec is an optional dependency (the ``torchrec`` extra); it is imported only when this back end
is used. ``DMPCollection`` shards a torchrec EmbeddingBagCollection or EmbeddingCollection row-wise
over each model-parallel group and, with ``ShardingStrategy.FULLY_SHARDED``, keeps only a
``1/replicas`` slice of each replica's copy, gathering it on demand. It runs on CUDA only (it
asserts so); on the CPU use the native back end.

torchrec builds its own groups from the world: with ``use_inter_host_allreduce=True`` the
model-parallel groups are contiguous ranks (``[0..M)``, ``[M..2M)``, ...), otherwise strided
(``{g, g + R, g + 2R, ...}``). The groups handed in must be one of those two layouts; this module
picks the matching flag and refuses any other layout instead of silently sharding differently.
Unlike the native back end, torchrec applies its fused optimizer in backward and keeps the
replicas consistent by reduce-scattering weights, so there are no ``.grad`` tensors to inspect.
"""

import torch
import torch.distributed as dist
from torch import nn

from .kjt import JaggedEmbeddings, PooledEmbeddings
from .tables import EmbeddingTables


def _import_torchrec():
    try:
        import torchrec
    except ImportError as exc:
        raise ImportError(
            "backend='torchrec' needs torchrec (install gem-parallel[torchrec]); "
            "backend='native' needs only PyTorch"
        ) from exc
    return torchrec


def torchrec_layout(model_parallel_ranks: list[int], *, world: int) -> bool:
    """``use_inter_host_allreduce`` for DMPCollection that reproduces these model-parallel ranks."""
    size = len(model_parallel_ranks)
    ranks = sorted(model_parallel_ranks)
    if ranks == list(range(ranks[0], ranks[0] + size)) and ranks[0] % size == 0:
        return True
    step = world // size
    if ranks == [ranks[0] + step * k for k in range(size)] and ranks[0] < step:
        return False
    raise ValueError(
        f"model-parallel group {ranks} is neither contiguous nor strided by world/size={step}; "
        "torchrec's DMPCollection can build only those two layouts"
    )


def to_torchrec(tables: EmbeddingTables, device: torch.device) -> nn.Module:
    """A torchrec collection with the same tables and weights as ``tables``."""
    torchrec = _import_torchrec()
    if tables.pooling == "none":
        configs = [
            torchrec.EmbeddingConfig(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                feature_names=list(t.feature_names),
            )
            for t in tables.tables
        ]
        module, prefix = torchrec.EmbeddingCollection(tables=configs, device=device), "embeddings"
    else:
        pooling = torchrec.PoolingType.SUM if tables.pooling == "sum" else torchrec.PoolingType.MEAN
        configs = [
            torchrec.EmbeddingBagConfig(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                feature_names=list(t.feature_names),
                pooling=pooling,
            )
            for t in tables.tables
        ]
        module = torchrec.EmbeddingBagCollection(tables=configs, device=device)
        prefix = "embedding_bags"
    with torch.no_grad():
        state = module.state_dict()
        for t in tables.tables:
            state[f"{prefix}.{t.name}.weight"].copy_(tables.weights[t.name])
    return module


class TorchrecShardedEmbeddings(nn.Module):
    """A DMPCollection that takes a KJT (torchrec's or ``KeyedJagged``) and returns this package's
    output types."""

    def __init__(self, dmp: nn.Module, *, pooled: bool):
        super().__init__()
        self.dmp = dmp
        self.pooled = pooled

    def forward(self, features):
        """As ``EmbeddingTables.forward``: the same inputs, the same output types."""
        torchrec = _import_torchrec()
        if not isinstance(features, torchrec.KeyedJaggedTensor):
            features = torchrec.KeyedJaggedTensor(
                keys=list(features.keys()),
                values=features.values(),
                lengths=features.lengths(),
                weights=features.weights_or_none(),
            )
        out = self.dmp(features)
        if self.pooled:
            return PooledEmbeddings(list(out.keys()), list(out.length_per_key()), out.values())
        return {k: JaggedEmbeddings(jt.values(), jt.offsets()) for k, jt in out.items()}


def shard_with_torchrec(
    module: nn.Module,
    *,
    model_parallel_group: dist.ProcessGroup,
    fully_sharded: bool,
    device: torch.device,
) -> TorchrecShardedEmbeddings:
    """``shard_embeddings``' torchrec back end: ``DMPCollection`` row-wise over
    ``model_parallel_group`` (fully sharded replicas when asked). ``ValueError`` off CUDA;
    ``ImportError`` without torchrec."""
    if device.type != "cuda":
        raise ValueError(
            f"backend='torchrec' shards with DMPCollection, which runs on CUDA only; got device "
            f"{device}. Use backend='native' on the CPU"
        )
    torchrec = _import_torchrec()
    from torchrec.distributed.model_parallel import DMPCollection
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingStrategy, ShardingType

    if isinstance(module, EmbeddingTables):
        module = to_torchrec(module, device=device)
    if not isinstance(module, torchrec.EmbeddingBagCollection | torchrec.EmbeddingCollection):
        raise TypeError(
            "backend='torchrec' shards a torchrec EmbeddingBagCollection or EmbeddingCollection "
            f"(or a gem_parallel EmbeddingTables), got {type(module).__name__}"
        )
    pooled = isinstance(module, torchrec.EmbeddingBagCollection)
    configs = module.embedding_bag_configs() if pooled else module.embedding_configs()
    world, size = dist.get_world_size(), model_parallel_group.size()
    inter_host = torchrec_layout(dist.get_process_group_ranks(model_parallel_group), world=world)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=size, local_world_size=size, compute_device="cuda"),
        constraints={
            c.name: ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value])
            for c in configs
        },
    )
    plan = planner.collective_plan(module, pg=dist.group.WORLD)
    strategy = ShardingStrategy.FULLY_SHARDED if fully_sharded else ShardingStrategy.DEFAULT
    dmp = DMPCollection(
        module=module,
        device=device,
        plan=plan,
        world_size=world,
        sharding_group_size=size,
        global_pg=dist.group.WORLD,
        sharding_strategy=strategy,
        use_inter_host_allreduce=inter_host,
    )
    return TorchrecShardedEmbeddings(dmp, pooled=pooled)

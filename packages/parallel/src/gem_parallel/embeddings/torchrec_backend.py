"""The torchrec back end: torchrec's own sharding of its collections, on GPUs and on the CPU.

torchrec is an optional dependency (the ``torchrec`` extra); it is imported only when this back end
is used. Two paths, by device:

- **CUDA**: ``DMPCollection`` shards a torchrec EmbeddingBagCollection or EmbeddingCollection
  row-wise over each model-parallel group and, with ``ShardingStrategy.FULLY_SHARDED``, keeps only
  a ``1/replicas`` slice of each replica's copy, gathering it on demand. torchrec builds its own
  groups from the world: with ``use_inter_host_allreduce=True`` the model-parallel groups are
  contiguous ranks (``[0..M)``, ``[M..2M)``, ...), otherwise strided (``{g, g + R, g + 2R,
  ...}``). The groups handed in must be one of those two layouts; this module picks the matching
  flag and refuses any other layout instead of silently sharding differently. torchrec applies
  its fused optimizer in backward, so there are no ``.grad`` tensors to inspect.
- **CPU** (gloo): ``DistributedModelParallel`` shards table-wise, each table whole on one rank
  of the world (the largest tables first, each onto the rank holding the fewest rows), ids and
  embeddings exchanged by all-to-alls; there are no replicas. torchrec's planner offers the CPU
  table-wise sharding with the ``fused`` kernel only; the plan here is built per table instead,
  so pooled tables can take the ``dense`` kernel: plain tables with a ``.grad`` that any PyTorch
  optimizer steps (torchrec divides the gradients it sends back by the world size, so a step
  matches one process on the union of the ranks' batches). An EmbeddingCollection (unpooled
  lookups) cannot: FBGEMM's CPU dense lookup
  (``torch.ops.fbgemm.dense_embedding_codegen_lookup_function``) ignores ``PoolingMode.NONE``
  and returns sums per bag, ``[B, T·D]`` where ``[ids, D]`` is due, and the sequence all-to-all
  then fails ("Split sizes doesn't match total dim 0 size") after writing past its buffer. Those
  tables shard with the ``fused`` kernel and a ``RowwiseAdagrad`` (``fused_optimizer``), which
  FBGEMM applies in the backward as ``EXACT_ROWWISE_ADAGRAD``, the update ``RowwiseAdagrad``
  defines; FBGEMM's fused Adam and LAMB do not run on the CPU.
"""

import torch
import torch.distributed as dist
from torch import nn

from .fused_optimizer import RowwiseAdagrad
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
    """A torchrec-sharded collection (``dmp``) that takes a KJT (torchrec's or ``KeyedJagged``)
    and returns this package's output types. With ``fused_optimizer`` (a ``RowwiseAdagrad`` that
    FBGEMM applies in the backward), each forward first hands its current ``lr`` to torchrec, so
    a schedule that sets ``fused_optimizer.lr`` reaches the tables."""

    def __init__(
        self, dmp: nn.Module, *, pooled: bool, fused_optimizer: RowwiseAdagrad | None = None
    ):
        super().__init__()
        self.dmp = dmp
        self.pooled = pooled
        self.fused_optimizer = fused_optimizer
        self._lr = None if fused_optimizer is None else fused_optimizer.lr

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
        if self.fused_optimizer is not None and self.fused_optimizer.lr != self._lr:
            self._lr = self.fused_optimizer.lr
            torchrec_optimizer = self.dmp.fused_optimizer
            for group in torchrec_optimizer.param_groups:
                group["lr"] = self._lr
            torchrec_optimizer.step()  # a fused optimizer's step only passes the rate to FBGEMM
        out = self.dmp(features)
        if self.pooled:
            return PooledEmbeddings(list(out.keys()), list(out.length_per_key()), out.values())
        return {k: JaggedEmbeddings(jt.values(), jt.offsets()) for k, jt in out.items()}


def shard_with_torchrec(
    module: nn.Module,
    *,
    model_parallel_group: dist.ProcessGroup,
    replica_group: dist.ProcessGroup | None,
    fully_sharded: bool,
    device: torch.device,
    fused_optimizer: RowwiseAdagrad | None = None,
) -> TorchrecShardedEmbeddings:
    """``shard_embeddings``' torchrec back end: on CUDA, ``DMPCollection`` row-wise over
    ``model_parallel_group`` (fully sharded replicas when asked); on the CPU,
    ``DistributedModelParallel`` table-wise over the world. ``fused_optimizer`` (or the fused
    optimizer of an ``EmbeddingTables``) trains the tables in the backward, on the CPU path.

    Raises:
        ImportError: torchrec is not installed.
        TypeError: a module that is not a torchrec collection or ``EmbeddingTables``.
        ValueError: on the CPU, replicas or a model-parallel group smaller than the world, or an
            EmbeddingCollection without a fused optimizer; on CUDA, a fused optimizer; a fused
            optimizer given twice.
    """
    torchrec = _import_torchrec()
    if isinstance(module, EmbeddingTables):
        if module.fused_optimizer is not None:
            if fused_optimizer is not None:
                raise ValueError(
                    "fused_optimizer: the tables carry a fused optimizer already; pass one of them"
                )
            fused_optimizer = module.fused_optimizer
        module = to_torchrec(module, device=device)
    if not isinstance(module, torchrec.EmbeddingBagCollection | torchrec.EmbeddingCollection):
        raise TypeError(
            "backend='torchrec' shards a torchrec EmbeddingBagCollection or EmbeddingCollection "
            f"(or a gem_parallel EmbeddingTables), got {type(module).__name__}"
        )
    if fused_optimizer is not None and not isinstance(fused_optimizer, RowwiseAdagrad):
        raise TypeError(
            f"fused_optimizer must be a RowwiseAdagrad or None, got {type(fused_optimizer).__name__}"
        )
    if device.type == "cuda":
        if fused_optimizer is not None:
            raise ValueError(
                "fused_optimizer: the CUDA path (DMPCollection) keeps torchrec's own fused "
                "optimizer settings; a RowwiseAdagrad is taken on the CPU path only"
            )
        return _shard_with_dmp_collection(
            module, model_parallel_group=model_parallel_group, fully_sharded=fully_sharded,
            device=device,
        )  # fmt: skip
    return _shard_table_wise(
        module, group=model_parallel_group, replica_group=replica_group,
        fused_optimizer=fused_optimizer,
    )  # fmt: skip


def _shard_with_dmp_collection(
    module: nn.Module,
    *,
    model_parallel_group: dist.ProcessGroup,
    fully_sharded: bool,
    device: torch.device,
) -> TorchrecShardedEmbeddings:
    """``DMPCollection`` row-wise over ``model_parallel_group`` (CUDA)."""
    import torchrec
    from torchrec.distributed.model_parallel import DMPCollection
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingStrategy, ShardingType

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


def table_placement(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """``{table: rank}``: the largest tables first, each onto the rank holding the fewest
    elements so far (ties: the lower rank, then the table's name), the same on every rank."""
    load = [0] * ranks
    placement = {}
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        placement[name] = rank
        load[rank] += size
    return placement


def _shard_table_wise(
    module: nn.Module,
    *,
    group: dist.ProcessGroup,
    replica_group: dist.ProcessGroup | None,
    fused_optimizer: RowwiseAdagrad | None,
) -> TorchrecShardedEmbeddings:
    """``DistributedModelParallel`` table-wise over ``group`` (the world), on the CPU."""
    import torchrec
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
    from torchrec.optim import RowWiseAdagrad

    if replica_group is not None and replica_group.size() > 1:
        raise ValueError(
            f"backend='torchrec' on the CPU shards table-wise with DistributedModelParallel, "
            f"which keeps no replicas; got {replica_group.size()} replicas: pass a mesh or groups "
            "without replicas, or use backend='native'"
        )
    if group.size() != dist.get_world_size():
        raise ValueError(
            f"backend='torchrec' on the CPU shards over the whole world ({dist.get_world_size()} "
            f"ranks), got a model-parallel group of {group.size()}; use backend='native'"
        )
    pooled = isinstance(module, torchrec.EmbeddingBagCollection)
    if not pooled and fused_optimizer is None:
        raise ValueError(
            "backend='torchrec' on the CPU shards an EmbeddingCollection only with a "
            "fused_optimizer (RowwiseAdagrad): FBGEMM's CPU dense lookup pools the ids of each "
            "sequence instead of returning one row per id, so torchrec's dense kernel cannot "
            "serve unpooled tables there. Pass fused_optimizer=RowwiseAdagrad(...), or use "
            "backend='native'"
        )
    fused_params = None
    if fused_optimizer is not None:
        fused_params = {
            "optimizer": optimizer_type_to_emb_opt_type(RowWiseAdagrad),  # exact row-wise
            "learning_rate": fused_optimizer.lr,
            "eps": fused_optimizer.eps,
        }
    sharder_type = EmbeddingBagCollectionSharder if pooled else EmbeddingCollectionSharder
    sharder = sharder_type(fused_params=fused_params)
    configs = module.embedding_bag_configs() if pooled else module.embedding_configs()
    size = group.size()
    placement = table_placement({c.name: c.num_embeddings * c.embedding_dim for c in configs}, size)
    kernel = "fused" if fused_optimizer is not None else "dense"
    plan = construct_module_sharding_plan(
        module,
        per_param_sharding={
            name: table_wise(rank=rank, compute_kernel=kernel) for name, rank in placement.items()
        },
        sharder=sharder,
        local_size=size,
        world_size=size,
        device_type="cpu",
    )
    weights = module.state_dict()
    dmp = DistributedModelParallel(
        module,
        env=ShardingEnv.from_process_group(group),
        device=torch.device("cpu"),
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],
    )
    dmp.load_state_dict(weights)  # sharding initialises the tables afresh; every rank's are equal
    return TorchrecShardedEmbeddings(dmp, pooled=pooled, fused_optimizer=fused_optimizer)

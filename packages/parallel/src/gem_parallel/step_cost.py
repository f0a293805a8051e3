"""The step time and memory per GPU of one candidate plan, built from the cost model.

A plan has a dense half (FSDP2 HSDP and expert parallelism) and a sparse half (2D or fully
sharded 2D embeddings). Each half is costed once (:func:`dense_half`, :func:`sparse_half`); a
candidate plan is a pair of halves (:func:`combine`): memory adds up, and

    step = overlap(compute, Σ overlapped collectives) + Σ exposed collectives

Per step, with ``L`` layers and ``P`` dense parameters (per-layer collectives, as FSDP2 issues
them, so per-call latency counts ``L`` times; every collective is charged the flat cost, one NCCL
call on one process group, as torch runs it):

- FSDP all-gather of ``P/L`` bf16 weights over ``dp_shard``, twice per layer (forward, backward);
  reduce-scatter of ``P/L`` fp32 gradients over ``dp_shard``; all-reduce of the ``P/L/dp_shard``
  shard over ``dp_replicate``. The experts' weights the same over ``edp_shard``.
- MoE: four all-to-alls per MoE layer (dispatch and combine, forward and backward) of
  ``tokens·top_k·d_model`` bf16 values over ``ep``.
- Embeddings: two all-to-alls (pooled forward, gradients backward) of
  ``samples·features·dim`` values over ``sparse_mp``; fully sharded 2D also all-gathers each
  rank's ``sparse/mp`` shard over the replicas and reduce-scatters its gradient (an upper bound:
  real gradients touch only the looked-up rows); plain 2D all-reduces the shard's gradient.
"""

from dataclasses import dataclass, field

from gem_parallel.cost_model import CollectiveEstimate, CostModel
from gem_parallel.layout import MeshLayout
from gem_parallel.model_spec import ModelSpec
from gem_parallel.topology import Topology

SPARSE_MODES = ("fully_sharded_2d", "2d")


@dataclass(frozen=True)
class PlannerConfig:
    """How the planner costs a plan: the collectives' engine (``"nccl"`` on the SMs or
    ``"copy_engine"``), the sparse mode (``SPARSE_MODES``), how many chunks a fully sharded table
    is gathered in, and whether FSDP reshards after the forward (two gathers per layer)."""

    engine: str = "nccl"  # collectives on the SMs ("nccl") or on the copy engines ("copy_engine")
    sparse_mode: str = "fully_sharded_2d"
    # the fully sharded tables are gathered 1/sparse_gather_chunks of the shard at a time,
    # double-buffered
    sparse_gather_chunks: int = 16
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class PlannedCollective:
    """One collective of a plan: its name, mesh dimension, calls per step, the estimate of one
    call, and whether it overlaps compute."""

    name: str
    dim: str
    calls: int
    per_call: CollectiveEstimate
    overlapped: bool

    @property
    def seconds(self) -> float:
        """Seconds per step: calls times one call's estimate."""
        return self.calls * self.per_call.seconds

    def per_tier(self) -> dict[str, float]:
        """Seconds per step by tier."""
        return {k: self.calls * v for k, v in self.per_call.per_tier.items()}


@dataclass(frozen=True)
class Half:
    """Collectives and memory of one half (dense or sparse) of a candidate plan."""

    choice: dict
    collectives: tuple[PlannedCollective, ...]
    memory: dict[str, float]


@dataclass
class Plan:
    """A parallel plan: the layout chosen for ``spec`` on ``topology``, its collectives, memory
    per GPU by part (bytes), and the step time's terms in seconds (``step_s = overlap(compute_s,
    overlapped_s) + exposed_s``); ``candidates`` plans were costed and ``rules`` says which of
    GEM's placement rules it keeps and why it breaks the others."""

    topology: Topology
    spec: ModelSpec
    layout: MeshLayout
    config: PlannerConfig
    collectives: list[PlannedCollective]
    memory: dict[str, float]
    compute_s: float
    overlapped_s: float
    exposed_s: float
    step_s: float
    candidates: int = 0
    rules: list[str] = field(default_factory=list)

    @property
    def memory_bytes(self) -> float:
        """Memory per GPU, all parts."""
        return sum(self.memory.values())

    def terms(self) -> dict[str, float]:
        """Step-time terms by name (compute with its overlap, then each exposed collective)."""
        out = {"compute + overlapped collectives": self.step_s - self.exposed_s}
        for c in self.collectives:
            if not c.overlapped:
                out[c.name] = out.get(c.name, 0.0) + c.seconds
        return out

    def to_dict(self) -> dict:
        """Everything as plain JSON types (the command line's ``--json``)."""
        return {
            "model": self.spec.name,
            "topology": {
                "num_gpus": self.topology.num_gpus,
                "gpus_per_host": self.topology.gpus_per_host,
                "hosts_per_zone": self.topology.hosts_per_zone,
                "num_zones": self.topology.num_zones,
            },
            "layout": self.layout.to_dict(),
            "memory_bytes": dict(self.memory),
            "memory_total_bytes": self.memory_bytes,
            "memory_usable_bytes": self.topology.usable_memory_bytes,
            "compute_s": self.compute_s,
            "overlapped_s": self.overlapped_s,
            "exposed_s": self.exposed_s,
            "step_s": self.step_s,
            "collectives": [
                {
                    "name": c.name,
                    "dim": c.dim,
                    "kind": c.per_call.kind,
                    "group": c.per_call.group,
                    "algorithm": c.per_call.algorithm,
                    "bytes_per_call": c.per_call.nbytes,
                    "calls": c.calls,
                    "overlapped": c.overlapped,
                    "seconds": c.seconds,
                    "seconds_per_tier": c.per_tier(),
                }
                for c in self.collectives
            ],
            "rules": list(self.rules),
            "candidates": self.candidates,
        }


def fastest_fitting(plans: list[Plan]) -> Plan | None:
    """The plan with the least step time among those that fit in GPU memory; None if none fits."""
    fitting = [p for p in plans if p.memory_bytes <= p.topology.usable_memory_bytes]
    return min(fitting, key=lambda p: p.step_s) if fitting else None


# ------------------------------------------------------------------------------------------
# costing one half


def _collective(model, layout, name, dim, kind, nbytes, calls, overlapped, algorithm="flat"):
    size, stride = layout.group(dim)
    estimate = model.collective(
        kind, nbytes, model.topology.placement(size, stride), algorithm=algorithm
    )
    return PlannedCollective(name, dim, calls, estimate, overlapped)


def dense_half(model: CostModel, spec: ModelSpec, cfg: PlannerConfig, dp_shard, ep) -> Half:
    """The collectives and memory of FSDP2 HSDP over ``dp_shard`` with expert parallelism ``ep``."""
    world = model.topology.num_gpus
    layout = MeshLayout(world, world // dp_shard, dp_shard, ep)
    L, wb, gb = spec.num_layers, spec.dense_compute_bytes, spec.grad_reduce_bytes
    per_layer = spec.dense_params / L
    gathers = 2 if cfg.reshard_after_forward else 1
    cs = []
    if dp_shard > 1:
        cs.append(
            _collective(
                model,
                layout,
                "fsdp all-gather",
                "dp_shard",
                "all_gather",
                per_layer * wb,
                gathers * L,
                True,
            )
        )
        cs.append(
            _collective(
                model,
                layout,
                "fsdp reduce-scatter",
                "dp_shard",
                "reduce_scatter",
                per_layer * gb,
                L,
                True,
            )
        )
    if layout.dp_replicate > 1:
        cs.append(
            _collective(
                model,
                layout,
                "hsdp all-reduce",
                "dp_replicate",
                "all_reduce",
                per_layer / dp_shard * gb,
                L,
                True,
            )
        )
    memory = {
        "dense weights + optimizer": spec.dense_params
        / dp_shard
        * spec.dense_state_bytes_per_param,
        "dense gathered layers": per_layer * (2 * wb + gb),
        "activations": spec.tokens_per_gpu * spec.activation_bytes_per_token,
    }
    if spec.num_experts:
        M, local = spec.moe_layers, spec.num_experts // ep * spec.params_per_expert
        edp = layout.edp_shard
        if edp > 1:
            cs.append(
                _collective(
                    model,
                    layout,
                    "expert all-gather",
                    "edp_shard",
                    "all_gather",
                    local * wb,
                    gathers * M,
                    True,
                )
            )
            cs.append(
                _collective(
                    model,
                    layout,
                    "expert reduce-scatter",
                    "edp_shard",
                    "reduce_scatter",
                    local * gb,
                    M,
                    True,
                )
            )
        if layout.dp_replicate > 1:
            cs.append(
                _collective(
                    model,
                    layout,
                    "expert all-reduce",
                    "dp_replicate",
                    "all_reduce",
                    local / edp * gb,
                    M,
                    True,
                )
            )
        tokens_bytes = (
            spec.tokens_per_gpu * spec.top_k * spec.d_model * spec.activation_compute_bytes
        )
        if ep > 1:
            cs.append(
                _collective(
                    model, layout, "moe all-to-all", "ep", "all_to_all", tokens_bytes, 4 * M, False
                )
            )
        memory["expert weights + optimizer"] = M * local / edp * spec.dense_state_bytes_per_param
        memory["expert gathered layers"] = local * (2 * wb + gb)
        memory["moe dispatch buffers"] = 4 * tokens_bytes
    return Half({"dp_shard": dp_shard, "ep": ep}, tuple(cs), memory)


def sparse_half(model: CostModel, spec: ModelSpec, cfg: PlannerConfig, replicas, inner) -> Half:
    """The collectives and memory of the embeddings over ``replicas`` sparse replicas, with
    ``inner`` (``"replica"`` or ``"mp"``) the contiguous sparse dimension."""
    world = model.topology.num_gpus
    layout = MeshLayout(world, 1, world, sparse_replicas=replicas, sparse_inner=inner)
    cs, memory = [], {}
    if spec.sparse_params:
        shard = spec.sparse_params * spec.sparse_bytes_per_param / layout.sparse_mp
        pooled = (
            spec.samples_per_gpu
            * spec.num_sparse_features
            * spec.embedding_dim
            * spec.activation_compute_bytes
        )
        if layout.sparse_mp > 1:
            cs.append(
                _collective(
                    model,
                    layout,
                    "embedding all-to-all",
                    "sparse_mp",
                    "all_to_all",
                    pooled,
                    2,
                    False,
                )
            )
        if cfg.sparse_mode == "fully_sharded_2d":
            memory["embeddings"] = shard / replicas
            if replicas > 1:
                cs.append(
                    _collective(
                        model,
                        layout,
                        "embedding replica all-gather",
                        "sparse_replica",
                        "all_gather",
                        shard,
                        1,
                        True,
                    )
                )
                cs.append(
                    _collective(
                        model,
                        layout,
                        "embedding replica reduce-scatter",
                        "sparse_replica",
                        "reduce_scatter",
                        shard,
                        1,
                        True,
                    )
                )
                memory["embedding gather buffers"] = 2 * shard / cfg.sparse_gather_chunks
        else:
            memory["embeddings"] = shard
            if replicas > 1:
                cs.append(
                    _collective(
                        model,
                        layout,
                        "embedding replica all-reduce",
                        "sparse_replica",
                        "all_reduce",
                        shard,
                        1,
                        True,
                    )
                )
        memory["embedding all-to-all buffers"] = 2 * pooled
    return Half({"sparse_replicas": replicas, "sparse_inner": inner}, tuple(cs), memory)


def combine(model, spec, cfg, dense: Half, sparse: Half) -> Plan:
    """The candidate plan of one dense and one sparse half: memory adds up, step time as above."""
    world = model.topology.num_gpus
    layout = MeshLayout(world, world // dense.choice["dp_shard"], **dense.choice, **sparse.choice)
    collectives = list(dense.collectives) + list(sparse.collectives)
    overlapped = sum(c.seconds for c in collectives if c.overlapped)
    exposed = sum(c.seconds for c in collectives if not c.overlapped)
    compute = model.compute_seconds(spec.train_flops_per_gpu)
    step = model.overlap(compute, overlapped, engine=cfg.engine) + exposed
    memory = {**dense.memory, **sparse.memory}
    return Plan(
        model.topology, spec, layout, cfg, collectives, memory, compute, overlapped, exposed, step
    )


def memory_floor(spec: ModelSpec) -> tuple[dict[str, float], float]:
    """A lower bound of any plan's memory per GPU on any number of GPUs, in two parts.

    Returns:
        ``(fixed, sharded)``: ``fixed`` holds the parts (bytes, by the names ``dense_half`` and
        ``sparse_half`` give them) that no layout shrinks below these values: gathered layers,
        activations, MoE and embedding exchange buffers; ``sharded`` is the bytes that shard
        at best over all ``world`` GPUs (dense and expert state, embeddings). Every plan on
        ``world`` GPUs needs at least ``sum(fixed.values()) + sharded / world``: dense state
        shards over ``dp_shard <= world``, expert state over ``ep · edp_shard <= world``, an
        embedding shard over ``sparse_mp · sparse_replicas = world`` at best, and a rank holds
        at least one expert per MoE layer (``ep <= num_experts``).
    """
    wb, gb = spec.dense_compute_bytes, spec.grad_reduce_bytes
    fixed = {
        "dense gathered layers": spec.dense_params / spec.num_layers * (2 * wb + gb),
        "activations": spec.tokens_per_gpu * spec.activation_bytes_per_token,
    }
    sharded = (spec.dense_params + spec.expert_params) * spec.dense_state_bytes_per_param
    if spec.num_experts:
        tokens_bytes = (
            spec.tokens_per_gpu * spec.top_k * spec.d_model * spec.activation_compute_bytes
        )
        fixed["expert gathered layers"] = spec.params_per_expert * (2 * wb + gb)
        fixed["moe dispatch buffers"] = 4 * tokens_bytes
    if spec.sparse_params:
        pooled = (
            spec.samples_per_gpu
            * spec.num_sparse_features
            * spec.embedding_dim
            * spec.activation_compute_bytes
        )
        fixed["embedding all-to-all buffers"] = 2 * pooled
        sharded += spec.sparse_params * spec.sparse_bytes_per_param
    return fixed, sharded

"""Choose the dense, expert and sparse meshes for a model on a cluster, and say why.

The search is exhaustive and cheap. The dense half is a choice of ``dp_shard`` (a divisor of the
world; ``dp_replicate`` is the rest) and ``ep`` (a divisor of both ``dp_shard`` and the number of
experts); the sparse half a choice of ``sparse_replicas`` (a divisor of the world) and of which
sparse dimension is contiguous. Each half's collectives and memory are costed once, then every
pair is combined: memory adds up, and the step time is

    step = overlap(compute, Σ overlapped collectives) + Σ exposed collectives

where FSDP's all-gathers, reduce-scatters and HSDP all-reduces, and the fully sharded embedding
gathers, overlap compute (prefetched), while the MoE token all-to-alls and the pooled-embedding
all-to-alls sit on the critical path. Among the plans that fit in GPU memory the fastest wins.
For 16,384 GPUs that is a few thousand combinations: well under a second.

Per step, with ``L`` layers and ``P`` dense parameters (per-layer collectives, as FSDP2 issues
them, so per-call latency counts ``L`` times):

Every collective is charged the flat cost (one NCCL call on one process group, as torch runs it).

- FSDP all-gather of ``P/L`` bf16 weights over ``dp_shard``, twice per layer (forward, backward);
  reduce-scatter of ``P/L`` fp32 gradients over ``dp_shard``; all-reduce of the ``P/L/dp_shard``
  shard over ``dp_replicate``. The experts' weights the same over ``edp_shard``.
- MoE: four all-to-alls per MoE layer (dispatch and combine, forward and backward) of
  ``tokens·top_k·d_model`` bf16 values over ``ep``.
- Embeddings: two all-to-alls (pooled forward, gradients backward) of
  ``samples·features·dim`` values over ``sparse_mp``; fully sharded 2D also all-gathers each
  rank's ``sparse/mp`` shard over the replicas and reduce-scatters its gradient (an upper bound:
  real gradients touch only the looked-up rows); plain 2D all-reduces the shard's gradient.

Afterwards the plan is checked against GEM's rules (EP and sparse replicas inside a host, FSDP
shard groups inside a zone, replication across zones). For each rule the plan breaks, the best
plan that keeps it is costed and the decision explained: either it does not fit in memory, or the
term of the step time that differs most says why.
"""

import functools
import math
from dataclasses import dataclass, field

from gem_parallel.cost_model import CollectiveEstimate, CostModel
from gem_parallel.layout import SPARSE_INNER, MeshLayout, divisors, nearest_divisors
from gem_parallel.model_spec import ModelSpec
from gem_parallel.topology import Topology

SPARSE_MODES = ("fully_sharded_2d", "2d")


@dataclass(frozen=True)
class PlannerConfig:
    engine: str = "nccl"  # collectives on the SMs ("nccl") or on the copy engines ("copy_engine")
    sparse_mode: str = "fully_sharded_2d"
    sparse_gather_chunks: int = (
        16  # tables are gathered a 1/chunks slice at a time, double-buffered
    )
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class PlannedCollective:
    name: str
    dim: str
    calls: int
    per_call: CollectiveEstimate
    overlapped: bool

    @property
    def seconds(self) -> float:
        return self.calls * self.per_call.seconds

    def per_tier(self) -> dict[str, float]:
        return {k: self.calls * v for k, v in self.per_call.per_tier.items()}


@dataclass(frozen=True)
class _Half:
    """Collectives and memory of one half (dense or sparse) of a candidate plan."""

    choice: dict
    collectives: tuple[PlannedCollective, ...]
    memory: dict[str, float]


@dataclass
class Plan:
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
        return sum(self.memory.values())

    def terms(self) -> dict[str, float]:
        """Step-time terms by name (compute with its overlap, then each exposed collective)."""
        out = {"compute + overlapped collectives": self.step_s - self.exposed_s}
        for c in self.collectives:
            if not c.overlapped:
                out[c.name] = out.get(c.name, 0.0) + c.seconds
        return out

    def to_dict(self) -> dict:
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


# ------------------------------------------------------------------------------------------
# costing one half


@functools.lru_cache(maxsize=4096)
def _placement(topology: Topology, size: int, stride: int):
    return topology.placement(size, stride)


def _collective(model, layout, name, dim, kind, nbytes, calls, overlapped, algorithm="flat"):
    size, stride = layout.group(dim)
    estimate = model.collective(
        kind, nbytes, _placement(model.topology, size, stride), algorithm=algorithm
    )
    return PlannedCollective(name, dim, calls, estimate, overlapped)


def _dense_half(model: CostModel, spec: ModelSpec, cfg: PlannerConfig, dp_shard, ep) -> _Half:
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
    return _Half({"dp_shard": dp_shard, "ep": ep}, tuple(cs), memory)


def _sparse_half(model: CostModel, spec: ModelSpec, cfg: PlannerConfig, replicas, inner) -> _Half:
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
    return _Half({"sparse_replicas": replicas, "sparse_inner": inner}, tuple(cs), memory)


def _combine(model, spec, cfg, dense: _Half, sparse: _Half) -> Plan:
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


# ------------------------------------------------------------------------------------------
# search


def _check_request(topology: Topology, spec: ModelSpec, fixed: dict) -> None:
    world = topology.num_gpus
    ep = fixed.get("ep")
    if ep is not None:
        if ep > 1 and not spec.num_experts:
            raise ValueError(f"ep={ep} but model {spec.name!r} has no experts: use ep=1")
        fitting = (
            [d for d in divisors(world) if spec.num_experts % d == 0] if spec.num_experts else [1]
        )
        if ep > world:
            raise ValueError(
                f"ep={ep} exceeds the {world} GPUs: the largest expert parallelism that fits is "
                f"ep={max(fitting)}"
            )
        if spec.num_experts and spec.num_experts % ep:
            raise ValueError(
                f"ep={ep} does not divide num_experts={spec.num_experts}: use ep="
                f"{nearest_divisors(ep, spec.num_experts)}"
            )
    for name in ("dp_shard", "dp_replicate", "sparse_replicas", "ep"):
        value = fixed.get(name)
        if value is not None and (value < 1 or world % value):
            raise ValueError(
                f"{name}={value} does not divide the {world} GPUs: use {name}="
                f"{nearest_divisors(value, world)}"
            )
    if (
        fixed.get("dp_shard")
        and fixed.get("dp_replicate")
        and fixed["dp_shard"] * fixed["dp_replicate"] != world
    ):
        raise ValueError(
            f"dp_replicate={fixed['dp_replicate']} x dp_shard={fixed['dp_shard']} != {world} GPUs: "
            f"use dp_shard={world // fixed['dp_replicate']}"
        )
    if fixed.get("dp_shard") and ep and fixed["dp_shard"] % ep:
        raise ValueError(
            f"ep={ep} must divide dp_shard={fixed['dp_shard']}: use ep="
            f"{nearest_divisors(ep, fixed['dp_shard'])} or dp_shard a multiple of {ep}"
        )


def _candidates(topology, spec, cfg, fixed):
    model, world = CostModel(topology), topology.num_gpus
    dense = []
    for dp_shard in divisors(world):
        if fixed.get("dp_shard") not in (None, dp_shard):
            continue
        if fixed.get("dp_replicate") not in (None, world // dp_shard):
            continue
        for ep in divisors(dp_shard):
            if (spec.num_experts % ep if spec.num_experts else ep > 1) or fixed.get("ep") not in (
                None,
                ep,
            ):
                continue
            dense.append(_dense_half(model, spec, cfg, dp_shard, ep))
    sparse = []
    for replicas in divisors(world):
        if fixed.get("sparse_replicas") not in (None, replicas):
            continue
        for inner in SPARSE_INNER:
            if fixed.get("sparse_inner") not in (None, inner) or (
                replicas in (1, world) and inner == "mp"
            ):
                continue
            sparse.append(_sparse_half(model, spec, cfg, replicas, inner))
    return model, dense, sparse


def _all_plans(topology, spec, cfg, fixed) -> list[Plan]:
    model, dense, sparse = _candidates(topology, spec, cfg, fixed)
    return [_combine(model, spec, cfg, d, s) for d in dense for s in sparse]


def fastest_fitting(plans: list[Plan]) -> Plan | None:
    fitting = [p for p in plans if p.memory_bytes <= p.topology.usable_memory_bytes]
    return min(fitting, key=lambda p: p.step_s) if fitting else None


def _smallest_fitting_world(topology: Topology, spec: ModelSpec, cfg: PlannerConfig) -> int | None:
    """The fewest GPUs (whole hosts, then whole zones) on which the model fits at all."""
    import dataclasses

    sizes = list(range(topology.gpus_per_host, topology.gpus_per_zone + 1, topology.gpus_per_host))
    sizes += [topology.gpus_per_zone * z for z in range(2, 4097)]
    for n in sizes:
        if n <= topology.num_gpus:
            continue
        t = dataclasses.replace(topology, num_gpus=n)
        model = CostModel(t)
        ep = max(d for d in divisors(n) if not spec.num_experts or spec.num_experts % d == 0)
        p = _combine(
            model,
            spec,
            cfg,
            _dense_half(model, spec, cfg, n, ep),
            _sparse_half(model, spec, cfg, 1, "replica"),
        )
        if p.memory_bytes <= t.usable_memory_bytes:
            return n
    return None


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def _distance(layout: MeshLayout, fixed: dict) -> tuple[int, float]:
    """How far a layout is from the pinned choices: (fields changed, total log2 ratio)."""
    changed, ratio = 0, 0.0
    for k, v in fixed.items():
        got = getattr(layout, k)
        if got != v:
            changed += 1
            ratio += abs(math.log2(got / v)) if isinstance(v, int) else 1.0
    return changed, ratio


def _fits_nowhere(topology, spec, cfg, fixed, smallest: Plan) -> ValueError:
    need, have = smallest.memory_bytes, topology.usable_memory_bytes
    if fixed:
        fitting = [p for p in _all_plans(topology, spec, cfg, {}) if p.memory_bytes <= have]
        if fitting:
            nearest = min(fitting, key=lambda p: _distance(p.layout, fixed))
            changes = ", ".join(
                f"{k}={getattr(nearest.layout, k)}"
                for k in fixed
                if getattr(nearest.layout, k) != fixed[k]
            )
            return ValueError(
                f"{spec.name} does not fit on {topology.num_gpus} GPUs with {fixed}: the least "
                f"memory such a plan needs is {_gb(need)} per GPU, over the usable {_gb(have)}. "
                f"Smallest change that fits: {changes}"
            )
    worst = max(smallest.memory, key=smallest.memory.get)
    more = _smallest_fitting_world(topology, spec, cfg)
    hint = f"--gpus {more}" if more else "a larger cluster"
    return ValueError(
        f"{spec.name} fits nowhere on {topology.num_gpus} GPUs: the most sharded plan needs "
        f"{_gb(need)} per GPU (largest part: {worst} {_gb(smallest.memory[worst])}) but "
        f"{_gb(have)} is usable. Smallest change that fits: {hint}, or GPUs with "
        f"{_gb(need / topology.memory_headroom)} of memory"
    )


def plan(
    topology: Topology,
    spec: ModelSpec,
    *,
    dp_shard: int | None = None,
    dp_replicate: int | None = None,
    ep: int | None = None,
    sparse_replicas: int | None = None,
    sparse_inner: str | None = None,
    config: PlannerConfig | None = None,
    explain: bool = True,
) -> Plan:
    """The fastest plan that fits; keyword arguments pin a choice instead of searching it."""
    from gem_parallel.rules import explain_rules  # the rules use this module's Plan

    config = config or PlannerConfig()
    if config.sparse_mode not in SPARSE_MODES:
        raise ValueError(f"sparse_mode must be one of {SPARSE_MODES}, got {config.sparse_mode!r}")
    if sparse_inner is not None and sparse_inner not in SPARSE_INNER:
        raise ValueError(f"sparse_inner must be one of {SPARSE_INNER}, got {sparse_inner!r}")
    fixed = {
        k: v
        for k, v in dict(
            dp_shard=dp_shard,
            dp_replicate=dp_replicate,
            ep=ep,
            sparse_replicas=sparse_replicas,
            sparse_inner=sparse_inner,
        ).items()
        if v is not None
    }
    _check_request(topology, spec, fixed)
    plans = _all_plans(topology, spec, config, fixed)
    best = fastest_fitting(plans)
    if best is None:
        smallest = min(plans, key=lambda p: p.memory_bytes)
        raise _fits_nowhere(topology, spec, config, fixed, smallest)
    best.candidates = len(plans)
    if explain:
        best.rules = explain_rules(best, plans)
    return best

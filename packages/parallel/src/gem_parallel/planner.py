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

The search is bounded. Memory adds up over the halves, so the leanest dense half plus the
leanest sparse half is the least memory any plan needs: "fits nowhere" is answered from the
halves alone, before any pair is costed. A world with many divisors (480,480 GPUs has 160) would
pair hundreds of thousands of halves, so more than ``MAX_CANDIDATE_PLANS`` pairs are refused
with the fields to pin. The "smallest cluster that fits" hint skips every size below a lower
bound of memory per GPU (``memory_floor``: what no sharding shrinks, plus the sharded state over
all GPUs) and costs at most ``MAX_WORLD_PROBES`` sizes from there; when the unshrinkable part
alone exceeds a GPU, no cluster size is tried and the message says only more memory helps.

The per-step costs and memory of a candidate are in :mod:`gem_parallel.step_cost`.

Afterwards the plan is checked against GEM's rules (EP and sparse replicas inside a host, FSDP
shard groups inside a zone, replication across zones). For each rule the plan breaks, the best
plan that keeps it is costed and the decision explained: either it does not fit in memory, or the
term of the step time that differs most says why.
"""

import dataclasses
import itertools
import math

from gem_parallel.cost_model import CostModel
from gem_parallel.layout import SPARSE_INNER, MeshLayout, divisors, nearest_divisors
from gem_parallel.model_spec import ModelSpec
from gem_parallel.rules import explain_rules
from gem_parallel.step_cost import (
    SPARSE_MODES,
    Half,
    Plan,
    PlannerConfig,
    combine,
    dense_half,
    fastest_fitting,
    memory_floor,
    sparse_half,
)
from gem_parallel.topology import Topology

__all__ = ["MAX_CANDIDATE_PLANS", "Plan", "PlannerConfig", "fastest_fitting", "plan"]

# Pairs of halves one search may cost (about 30 µs each on a CPU, so ~1.5 s at the cap); a
# world with more pins a field instead.
MAX_CANDIDATE_PLANS = 50_000
# Cluster sizes the "smallest cluster that fits" hint costs, from the first its memory floor
# allows.
MAX_WORLD_PROBES = 64

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
            dense.append(dense_half(model, spec, cfg, dp_shard, ep))
    sparse = []
    for replicas in divisors(world):
        if fixed.get("sparse_replicas") not in (None, replicas):
            continue
        for inner in SPARSE_INNER:
            if fixed.get("sparse_inner") not in (None, inner) or (
                replicas in (1, world) and inner == "mp"
            ):
                continue
            sparse.append(sparse_half(model, spec, cfg, replicas, inner))
    return model, dense, sparse


def _check_search_size(topology, dense, sparse, fixed) -> None:
    """Refuse a search of more than ``MAX_CANDIDATE_PLANS`` pairs, naming the pins that shrink
    it: a world with many divisors (480480 GPUs has 160) multiplies into hundreds of thousands."""
    count = len(dense) * len(sparse)
    if count <= MAX_CANDIDATE_PLANS:
        return
    free = [k for k in ("sparse_replicas", "dp_shard", "ep") if k not in fixed]
    raise ValueError(
        f"{topology.num_gpus} GPUs give {len(dense)} dense x {len(sparse)} sparse halves = "
        f"{count} candidate plans, over the search cap of {MAX_CANDIDATE_PLANS}: pin "
        f"{' or '.join(free) or 'fewer free fields'} to search fewer"
    )


def _leanest(halves: list[Half]) -> Half:
    return min(halves, key=lambda h: sum(h.memory.values()))


def _smallest_fitting_world(topology: Topology, spec: ModelSpec, cfg: PlannerConfig) -> int | None:
    """The fewest GPUs (whole hosts, then whole zones, up to 4096 zones) on which the most
    sharded plan fits, or None.

    Sizes below the memory floor's bound (``memory_floor``) cannot fit and are skipped without
    costing; from the first size the bound allows, at most ``MAX_WORLD_PROBES`` are costed."""
    fixed, sharded = memory_floor(spec)
    room = topology.usable_memory_bytes - sum(fixed.values())
    if room <= 0:
        return None
    least = max(topology.num_gpus + 1, math.ceil(sharded / room))
    host, zone = topology.gpus_per_host, topology.gpus_per_zone
    first_host = max(host, -(-least // host) * host)
    sizes = itertools.chain(
        range(first_host, zone + 1, host),
        (zone * z for z in range(max(2, -(-least // zone)), 4097)),
    )
    for n in itertools.islice(sizes, MAX_WORLD_PROBES):
        t = dataclasses.replace(topology, num_gpus=n)
        model = CostModel(t)
        # the largest expert parallelism on n GPUs: every divisor of the experts' count that
        # divides n divides their gcd
        ep = math.gcd(n, spec.num_experts) if spec.num_experts else n
        p = combine(
            model,
            spec,
            cfg,
            dense_half(model, spec, cfg, n, ep),
            sparse_half(model, spec, cfg, 1, "replica"),
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


def _fits_nowhere(model, spec, cfg, fixed, dense, sparse) -> ValueError:
    topology = model.topology
    have = topology.usable_memory_bytes
    floor, _ = memory_floor(spec)
    if sum(floor.values()) >= have:
        worst = max(floor, key=floor.get)
        return ValueError(
            f"{spec.name} fits on no number of GPUs: the parts that no sharding shrinks need "
            f"{_gb(sum(floor.values()))} per GPU (largest part: {worst} {_gb(floor[worst])}) but "
            f"{_gb(have)} is usable. Smallest change that fits: GPUs with more than "
            f"{_gb(sum(floor.values()) / topology.memory_headroom)} of memory"
        )
    smallest = combine(model, spec, cfg, _leanest(dense), _leanest(sparse))
    need = smallest.memory_bytes
    if fixed:
        nearest = _nearest_fitting(model, spec, cfg, fixed)
        if nearest is not None:
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


def _nearest_fitting(model, spec, cfg, fixed) -> Plan | None:
    """The unpinned plan that fits and is nearest the pins (``_distance``), or None.

    Halves that cannot fit with the leanest other half are dropped before pairing; when the
    pairs left still exceed ``MAX_CANDIDATE_PLANS``, None (the message then says no more)."""
    _, dense, sparse = _candidates(model.topology, spec, cfg, {})
    have = model.topology.usable_memory_bytes
    d_min, s_min = (sum(_leanest(h).memory.values()) for h in (dense, sparse))
    dense = [d for d in dense if sum(d.memory.values()) + s_min <= have]
    sparse = [s for s in sparse if sum(s.memory.values()) + d_min <= have]
    if len(dense) * len(sparse) > MAX_CANDIDATE_PLANS:
        return None
    plans = [combine(model, spec, cfg, d, s) for d in dense for s in sparse]
    fitting = [p for p in plans if p.memory_bytes <= have]
    return min(fitting, key=lambda p: _distance(p.layout, fixed)) if fitting else None


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
    """The fastest plan that fits; keyword arguments pin a choice instead of searching it.

    Args:
        topology: the cluster.
        spec: the model.
        dp_shard, dp_replicate, ep, sparse_replicas, sparse_inner: pin these layout fields.
        config: ``PlannerConfig`` (default: NCCL, fully sharded 2D embeddings).
        explain: check the plan against GEM's rules and say why it breaks any (``Plan.rules``).

    Returns:
        The ``Plan`` with the least step time among those that fit in usable GPU memory.

    Raises:
        ValueError: an unknown sparse mode or ``sparse_inner``; a pinned value that does not
            divide the world, contradicts another or the model (``ep`` with no experts); or no
            plan fits, in which case the message names the smallest change that would (a pinned
            value, more GPUs, or GPUs with more memory; "fits on no number of GPUs" when the
            parts no sharding shrinks exceed a GPU); or the search would cost more than
            ``MAX_CANDIDATE_PLANS`` pairs, in which case the message names the fields to pin.
    """
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
    model, dense, sparse = _candidates(topology, spec, config, fixed)
    # Memory adds up over the halves, so the leanest pair answers "fits nowhere" before any
    # pair is costed.
    leanest = sum(_leanest(dense).memory.values()) + sum(_leanest(sparse).memory.values())
    if not leanest <= topology.usable_memory_bytes:
        raise _fits_nowhere(model, spec, config, fixed, dense, sparse)
    _check_search_size(topology, dense, sparse, fixed)
    plans = [combine(model, spec, config, d, s) for d in dense for s in sparse]
    best = fastest_fitting(plans)
    if best is None:  # the halves' sum and the plan's sum differ in the last bit
        raise _fits_nowhere(model, spec, config, fixed, dense, sparse)
    best.candidates = len(plans)
    if explain:
        best.rules = explain_rules(best, plans)
    return best

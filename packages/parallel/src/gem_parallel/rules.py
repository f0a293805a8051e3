"""GEM's placement rules, checked against a plan, with the reason when the plan breaks one.

GEM places each collective on the tier its volume deserves:

1. expert parallelism inside a host (token all-to-alls on NVLink);
2. sparse replicas inside a host (gathering a fully sharded replica on NVLink);
3. FSDP shard groups inside a zone (per-layer gathers never cross the oversubscribed spine);
4. replication across zones (only one all-reduce of a gradient shard per step crosses it).

The planner does not hard-code them; it searches. This module says whether the chosen plan keeps
each rule and, when it does not, why: the fastest plan that keeps the rule is compared with the
chosen one. Either no plan keeping the rule fits in memory, or the step-time term that grows most
when the rule is kept is named.
"""

import dataclasses
from collections.abc import Callable

from gem_parallel.step_cost import Plan, fastest_fitting


def _placement(plan: Plan, dim: str):
    size, stride = plan.layout.group(dim)
    return plan.topology.placement(size, stride)


def _inside_host(plan: Plan, dim: str) -> bool:
    sizes = _placement(plan, dim).sizes
    return sizes[1] == 1 and sizes[2] == 1


DENSE_FIELDS = ("dp_shard", "dp_replicate", "ep")
SPARSE_FIELDS = ("sparse_replicas", "sparse_mp", "sparse_inner")


def _rules(plan: Plan) -> list[tuple[str, Callable[[Plan], bool], str, tuple[str, ...]]]:
    """(rule, predicate, its group, the layout fields it may change) for the rules that apply."""
    spec, topo = plan.spec, plan.topology
    rules = []
    if spec.num_experts and topo.num_gpus > 1:
        rules.append(
            ("EP inside a host", lambda p: p.layout.ep > 1 and _inside_host(p, "ep"), "ep", ("ep",))
        )
    if spec.sparse_params and topo.num_gpus > 1:
        rules.append(
            (
                "sparse replicas inside a host",
                lambda p: p.layout.sparse_replicas > 1 and _inside_host(p, "sparse_replica"),
                "sparse_replica",
                SPARSE_FIELDS,
            )
        )
    if topo.num_gpus > topo.gpus_per_host:
        rules.append(
            (
                "FSDP shard groups inside a zone",
                lambda p: _placement(p, "dp_shard").sizes[2] == 1,
                "dp_shard",
                DENSE_FIELDS,
            )
        )
    if topo.num_zones > 1:
        rules.append(
            (
                "replication across zones",
                lambda p: _placement(p, "dp_replicate").sizes[2] == p.topology.num_zones,
                "dp_replicate",
                DENSE_FIELDS,
            )
        )
    return rules


OVERLAPPED_TERM = "compute + overlapped collectives"


def _collective_deltas(best: Plan, alternative: Plan):
    """(collective of the alternative, its seconds minus the same collective's in ``best``)."""
    ours = {c.name: c.seconds for c in best.collectives}
    return [(c, c.seconds - ours.get(c.name, 0.0)) for c in alternative.collectives]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def explain_rules(best: Plan, plans: list[Plan]) -> list[str]:
    """One line per applicable rule: kept (with the group's placement), or broken and why.

    The plan a broken rule is compared with is the fastest one that keeps the rule and changes
    only the layout fields the rule is about (any plan keeping it when no such plan fits), so the
    term named is the one the rule itself moves.
    """
    lines = []
    for rule, keeps, dim, free in _rules(best):
        size, _ = best.layout.group(dim)
        where = f"{dim}={size} on {_placement(best, dim).describe()}"
        if keeps(best):
            lines.append(f"{rule}: kept ({where})")
            continue
        keepers = [p for p in plans if keeps(p)]
        if not keepers:
            lines.append(f"{rule}: broken ({where}); no candidate plan can keep it on this cluster")
            continue
        same = dataclasses.asdict(best.layout)
        nearby = [
            p
            for p in keepers
            if all(v == same[k] for k, v in dataclasses.asdict(p.layout).items() if k not in free)
        ]
        alternative = fastest_fitting(nearby) or fastest_fitting(keepers)
        if alternative is None:
            leanest = min(keepers, key=lambda p: p.memory_bytes)
            lines.append(
                f"{rule}: broken ({where}); memory decided: the leanest plan keeping it needs "
                f"{leanest.memory_bytes / 1e9:.1f} GB per GPU, over the usable "
                f"{best.topology.usable_memory_bytes / 1e9:.1f} GB"
            )
            continue
        ours, theirs = best.terms(), alternative.terms()
        deltas = {k: theirs.get(k, 0.0) - ours.get(k, 0.0) for k in set(ours) | set(theirs)}
        term = max(deltas, key=deltas.get)
        detail = f"+{_ms(deltas[term])}"
        if term == OVERLAPPED_TERM:
            inner = {c.name: d for c, d in _collective_deltas(best, alternative) if c.overlapped}
            if inner:
                biggest = max(inner, key=inner.get)
                detail += f", mostly {biggest} +{_ms(inner[biggest])} before overlap"
        lines.append(
            f"{rule}: broken ({where}); step time decided: the fastest plan keeping it "
            f"({alternative.layout.describe()}) takes {_ms(alternative.step_s)} vs {_ms(best.step_s)}; "
            f"the term that decided: {term} ({detail})"
        )
    return lines

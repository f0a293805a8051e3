"""Choosing a policy per region: least recompute cost with the predicted peak under the budget.

The predicted peak (``ModelProfile.predict_peak``) is a maximum of terms, and every term that
involves region ``i`` depends only on the bytes kept by regions ``0..i`` (a prefix sum) and on
region ``i``'s own policy. So the regions can be decided in execution order with the prefix sum as
the state: a dynamic program over (kept bytes so far, cost so far), where a partial plan is
dropped when another keeps no more bytes at no more cost (it can be completed in every way the
dropped one can, at no more cost). What is left is a Pareto frontier, small in practice (a few
thousand states for dozens of regions), and the result is exact: no rounding of byte counts.

Ties are broken by a fixed order on plans (cost, then total kept bytes, then the policies in
region order), which makes the answer a function of the budget that only changes when the
previous answer stops fitting. Hence the predicted peak never rises as the budget falls.

``solver="exhaustive"`` enumerates every plan (for checking the DP on small models).
``min_peak`` is the same program minimising the predicted peak: the smallest feasible budget.
"""

import itertools

from .profile import ModelProfile

__all__ = ["SOLVERS", "COSTS", "solve", "min_peak"]

SOLVERS = ("dp", "exhaustive")
COSTS = ("time", "flops")
_EXHAUSTIVE_LIMIT = 12


def _region_cost(region, policy: str, cost: str) -> float:
    return region.recompute_ms(policy) if cost == "time" else region.recompute_flops(policy)


def _fitting(region, policies) -> list[str]:
    """The allowed policies the region was measured under (not those that ran out of memory)."""
    return [p for p in policies if p in region.policies]


def _step_peak(profile: ModelProfile, i: int, policy: str, kept: int) -> int:
    """Largest predicted term that region ``i`` under ``policy`` adds (static bytes excluded)."""
    region = profile.regions[i]
    p = region.policies[policy]
    return max(
        region.forward_base + kept + p.forward_peak,
        region.backward_base + kept + p.saved_bytes + p.backward_extra,
        profile.outside_offsets[i + 1] + kept + p.saved_bytes,
    )


def _frontier(states: list[tuple]) -> list[tuple]:
    """Keep states (kept, score, policies) not dominated in (kept, score); ties by policies."""
    states.sort(key=lambda s: (s[0], s[1], s[2]))
    out, best = [], None
    for s in states:
        if best is None or s[1] < best:
            out.append(s)
            best = s[1]
    return out


def solve(
    profile: ModelProfile, budget_bytes: int, *, policies, solver: str = "dp", cost: str = "time"
) -> tuple[tuple[str, ...], float] | None:
    """Policies per region (execution order) and their total cost, or None if nothing fits."""
    if solver not in SOLVERS:
        raise ValueError(f"solver: expected one of {SOLVERS}, got {solver!r}")
    if cost not in COSTS:
        raise ValueError(f"cost: expected one of {COSTS}, got {cost!r}")
    limit = budget_bytes - profile.static_bytes
    if solver == "exhaustive":
        return _exhaustive(profile, budget_bytes, policies, cost)
    states = [(0, 0.0, ())] if profile.outside_offsets[0] <= limit else []
    for i, region in enumerate(profile.regions):
        grown = []
        for kept, score, chosen in states:
            for policy in _fitting(region, policies):
                if _step_peak(profile, i, policy, kept) <= limit:
                    grown.append(
                        (
                            kept + region.policies[policy].saved_bytes,
                            score + _region_cost(region, policy, cost),
                            (*chosen, policy),
                        )
                    )
        states = _frontier(grown)
    if not states:
        return None
    kept, score, chosen = min(states, key=lambda s: (s[1], s[0], s[2]))
    return chosen, score


def _exhaustive(profile, budget_bytes, policies, cost):
    if len(profile.regions) > _EXHAUSTIVE_LIMIT:
        raise ValueError(
            f"solver='exhaustive': at most {_EXHAUSTIVE_LIMIT} regions, got {len(profile.regions)}"
        )
    best = None
    for chosen in itertools.product(*(_fitting(r, policies) for r in profile.regions)):
        if profile.predict_peak(chosen) > budget_bytes:
            continue
        score = 0.0
        for region, policy in zip(profile.regions, chosen, strict=True):
            score += _region_cost(region, policy, cost)
        kept = sum(r.policies[p].saved_bytes for r, p in zip(profile.regions, chosen, strict=True))
        key = (score, kept, chosen)
        if best is None or key < best:
            best = key
    return None if best is None else (best[2], best[0])


def min_peak(profile: ModelProfile, *, policies) -> tuple[int, tuple[str, ...]]:
    """The smallest predicted peak of any plan (static included) and a plan reaching it."""
    states = [(0, profile.outside_offsets[0], ())]
    for i, region in enumerate(profile.regions):
        grown = [
            (
                kept + region.policies[policy].saved_bytes,
                max(peak, _step_peak(profile, i, policy, kept)),
                (*chosen, policy),
            )
            for kept, peak, chosen in states
            for policy in _fitting(region, policies)
        ]
        states = _frontier(grown)
    kept, peak, chosen = min(states, key=lambda s: (s[1], s[0], s[2]))
    return profile.static_bytes + peak, chosen

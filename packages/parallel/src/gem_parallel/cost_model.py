"""Latency-bandwidth cost of collectives on a tiered network, and of overlapping them with compute.

Each collective moves ``M`` bytes among the ``n`` ranks of a group whose placement on the tiers
is known (:meth:`Topology.placement`): ``n_1`` members per host, ``n_2`` hosts per zone, ``n_3``
zones. ``M`` is the gathered buffer (all-gather), the input buffer (reduce-scatter), the reduced
buffer (all-reduce) or one rank's send buffer (all-to-all). ``α`` is a tier's per-step latency,
``B`` its per-GPU bus bandwidth. Two algorithms are costed.

*flat* (what NCCL runs for one process group): a ring over all ``n`` ranks, split into ``n_1``
channels, one per GPU's NIC ("rails"). Every step pays the slowest tier's latency; the links work
at once, so the busiest tier sets the pace. Each GPU forwards ``(n_1-1)/n_1`` of the ring's data
over NVLink (all of it when the group is one host), while a tier boundary is crossed by only
``n_1`` rails::

    all_gather, reduce_scatter   (n-1)·α_max + (n-1)/n · M · max_k w_k
    w_nvlink = (n_1-1)/n_1 / B_nvlink  (1 / B_nvlink inside one host),   w_roce = 1/(n_1·B_roce),   w_zone = 1/(n_1·B_zone)
    all_reduce                   min(ring: twice the above,
                                     tree: 2·⌈log2 n⌉·α_max + 2·(n-1)/n · M · max_k w_k)
    all_to_all                   α_max + (n-1)·o + max over tiers of (bytes leaving that tier) / B_tier

For all-to-all every rank posts its ``n - 1`` messages of ``M/n`` bytes at once, so it pays one
latency plus a per-message overhead ``o`` (``Topology.message_overhead``) for each peer; ``M·(n_1-1)/n`` stays on NVLink,
``M·(n - n_1)/n`` leaves the host through the rank's own NIC and ``M·(n - n_1·n_2)/n`` leaves
the zone.

*hierarchical*: one phase per tier, outermost first for all-gather (so the slow tiers move the
small pieces) and innermost first for reduce-scatter; every GPU uses its own NIC, so the phase on
tier ``k`` with fan-out ``n_k`` moves ``(n_k-1)/n_k · M / P_k`` bytes per GPU, where ``P_k`` is
the number of group members inside one tier-``k`` domain::

    all_gather, reduce_scatter   Σ_k (n_k-1)·α_k + (n_k-1)/n_k · M / (P_k · B_k)
    all_reduce                   twice that (reduce-scatter, then all-gather)
    all_to_all                   Σ_k (n_k-1)·α_k + (n_k-1)/n_k · M / B_k

torch.distributed runs the flat algorithms (FSDP's collectives and ``all_to_all_single`` are one
NCCL call on one group), so the planner charges flat costs; HSDP is the hierarchical idea applied
by hand (shard inside a zone, replicate across), which the planner reaches through the mesh
shape. ``algorithm="best"`` returns the cheaper of the two.

Overlap: a collective that runs on the SMs (NCCL's kernels take about 24 of an H200's 132) slows
the compute it overlaps; a copy-engine collective takes no SM. With compute ``p`` (at full speed)
overlapping communication ``c`` that holds ``s`` of ``S`` SMs, compute runs at ``1 - s/S`` while
the collective runs, so the pair takes ``max(c, p + c·s/S)``.
"""

import math
from dataclasses import dataclass, field

from gem_parallel.topology import GroupPlacement, Topology

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
ALGORITHMS = ("flat", "hierarchical", "best")
ENGINE_SMS = {"nccl": 24, "copy_engine": 0}


@dataclass(frozen=True)
class CollectiveEstimate:
    """The estimated time of one collective, split by the tier that spends it."""

    kind: str
    nbytes: float
    group: str
    algorithm: str
    per_tier: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        """The whole estimate: the sum over tiers."""
        return sum(self.per_tier.values())


def _check(kind: str, nbytes: float, algorithm: str) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"kind must be one of {COLLECTIVES}, got {kind!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")


def _ring_weight(placement: GroupPlacement) -> tuple[float, str]:
    """Seconds per byte of ring data and the tier that sets it (the busiest one)."""
    n1, n2, n3 = placement.sizes
    nvlink, roce, zone = placement.tiers
    # Inside one host the ring never leaves NVLink; across hosts each GPU is the exit of one of
    # the n_1 rail rings, so NVLink carries (n_1 - 1)/n_1 of its traffic.
    nvlink_share = (n1 - 1) / n1 if n2 * n3 > 1 else 1.0
    weights = {nvlink.name: nvlink_share / nvlink.bandwidth}
    if n2 > 1:
        weights[roce.name] = 1 / (n1 * roce.bandwidth)
    if n3 > 1:
        weights[zone.name] = 1 / (n1 * zone.bandwidth)
    tier = max(weights, key=weights.get)
    return weights[tier], tier


def flat_time(kind: str, nbytes: float, placement: GroupPlacement) -> dict[str, float]:
    """Seconds of the flat algorithm, attributed to the tier that bounds it."""
    _check(kind, nbytes, "flat")
    n = placement.size
    if n == 1:
        return {}
    alpha = max(t.latency for _, t in placement.used())
    if kind == "all_to_all":
        n1, n2, _ = placement.sizes
        leaving = {
            placement.tiers[0].name: nbytes * (n1 - 1) / n / placement.tiers[0].bandwidth,
            placement.tiers[1].name: nbytes * (n - n1) / n / placement.tiers[1].bandwidth,
            placement.tiers[2].name: nbytes * (n - n1 * n2) / n / placement.tiers[2].bandwidth,
        }
        bottleneck = max(leaving, key=leaving.get)
        latency = alpha + (n - 1) * placement.message_overhead
        return {bottleneck: latency + leaving[bottleneck]}
    weight, tier = _ring_weight(placement)
    transfer = (n - 1) / n * nbytes * weight
    if kind == "all_reduce":
        ring = 2 * ((n - 1) * alpha + transfer)
        tree = 2 * math.ceil(math.log2(n)) * alpha + 2 * transfer
        return {tier: min(ring, tree)}
    return {tier: (n - 1) * alpha + transfer}


def hierarchical_time(kind: str, nbytes: float, placement: GroupPlacement) -> dict[str, float]:
    """Seconds of the tier-by-tier algorithm, per tier."""
    _check(kind, nbytes, "hierarchical")
    per_tier: dict[str, float] = {}
    inside = 1  # group members inside one domain of the current tier
    for size, tier in zip(placement.sizes, placement.tiers, strict=True):
        if size > 1:
            if kind == "all_to_all":
                seconds = (size - 1) * tier.latency + (size - 1) / size * nbytes / tier.bandwidth
            else:
                phase = (size - 1) * tier.latency + (size - 1) / size * nbytes / (
                    inside * tier.bandwidth
                )
                seconds = 2 * phase if kind == "all_reduce" else phase
            per_tier[tier.name] = seconds
        inside *= size
    return per_tier


@dataclass(frozen=True)
class CostModel:
    """Collective and overlap costs on one :class:`Topology`."""

    topology: Topology

    def collective(
        self,
        kind: str,
        nbytes: float,
        placement: GroupPlacement,
        *,
        algorithm: str = "best",
    ) -> CollectiveEstimate:
        """The time of one collective of ``kind`` (``COLLECTIVES``) moving ``nbytes`` (as the
        module docstring defines M) over a group placed as ``placement``; ``algorithm`` is
        ``"flat"``, ``"hierarchical"`` or ``"best"`` (the cheaper). ``ValueError`` for an unknown
        kind or algorithm or negative bytes."""
        _check(kind, nbytes, algorithm)
        if algorithm == "best":
            flat = flat_time(kind, nbytes, placement)
            hier = hierarchical_time(kind, nbytes, placement)
            if sum(hier.values()) < sum(flat.values()):
                algorithm, per_tier = "hierarchical", hier
            else:
                algorithm, per_tier = "flat", flat
        elif algorithm == "flat":
            per_tier = flat_time(kind, nbytes, placement)
        else:
            per_tier = hierarchical_time(kind, nbytes, placement)
        return CollectiveEstimate(kind, nbytes, placement.describe(), algorithm, per_tier)

    def group(self, size: int, stride: int) -> GroupPlacement:
        """``topology.placement(size, stride)``."""
        return self.topology.placement(size, stride)

    def compute_seconds(self, flops: float) -> float:
        """Seconds of ``flops`` at the topology's achieved FLOP/s."""
        return flops / self.topology.achieved_flops

    def overlap(self, compute_s: float, comm_s: float, *, engine: str = "nccl") -> float:
        """Time of ``compute_s`` of compute overlapped with ``comm_s`` of communication on
        ``engine`` (``"nccl"`` holds SMs, ``"copy_engine"`` none): ``max(c, p + c·s/S)``.
        ``ValueError`` for an unknown engine."""
        if engine not in ENGINE_SMS:
            raise ValueError(f"engine must be one of {tuple(ENGINE_SMS)}, got {engine!r}")
        sm_share = ENGINE_SMS[engine] / self.topology.num_sms
        return max(comm_s, compute_s + comm_s * sm_share)

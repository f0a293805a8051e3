"""The machine a job runs on: GPUs per host, hosts per zone, and the three network tiers.

GEM matches each collective to the bandwidth of the links it crosses. A training cluster has three
tiers, from fast to slow:

1. ``nvlink``: the GPUs of one host, on NVLink/NVSwitch (hundreds of GB/s per GPU).
2. ``roce``: hosts of one zone, one RoCE NIC per GPU on a non-blocking fabric (~50 GB/s per GPU).
3. ``cross_zone``: zones joined by an oversubscribed spine; each GPU gets its NIC bandwidth divided
   by the oversubscription factor.

Ranks are numbered the way torchrun numbers them: the GPUs of a host are consecutive, and the
hosts of a zone are consecutive. A process group is then described by how many of its members sit
in one host, how many of its hosts sit in one zone, and how many zones it spans
(:meth:`Topology.placement`). The cost model turns that placement into time.

Bandwidths are *bus* bandwidths per GPU in bytes per second, in the sense of nccl-tests: a ring
all-gather of ``M`` bytes over ``n`` GPUs on one tier takes ``(n - 1) / n * M / bandwidth``.
Latencies are per ring step in seconds; an all-to-all posts all its messages at once and pays
``message_overhead`` per peer on top of one latency. The defaults describe an H200 host
with NVLink 4 and 400 Gb/s RoCE NICs; override them with measured values.
"""

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

TIER_NAMES = ("nvlink", "roce", "cross_zone")


def _is_real(value) -> bool:
    """A finite int or float that is not a bool (``True`` is an int to Python, not a size)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Tier:
    """One network tier: per-GPU bus bandwidth (bytes/s) and per-step latency (s).

    Raises:
        ValueError: a bandwidth that is not a finite number > 0 or a latency that is not a
            finite number >= 0 (the message names the tier and the field).
    """

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self):
        # NaN compares false with everything, so each bound is checked together with finiteness:
        # a NaN bandwidth would otherwise cost every collective NaN seconds.
        if not _is_real(self.bandwidth) or self.bandwidth <= 0:
            raise ValueError(
                f"tier {self.name!r}: bandwidth must be a finite number > 0 bytes/s, "
                f"got {self.bandwidth!r}"
            )
        if not _is_real(self.latency) or self.latency < 0:
            raise ValueError(
                f"tier {self.name!r}: latency must be a finite number >= 0 s, got {self.latency!r}"
            )


@dataclass(frozen=True)
class GroupPlacement:
    """Where the members of one process group sit, innermost tier first.

    ``sizes[k]`` is the group's fan-out on tier ``k``: members per host, hosts per zone, zones.
    Their product is the group size. ``tiers`` holds the matching :class:`Tier` objects.
    """

    sizes: tuple[int, int, int]
    tiers: tuple[Tier, Tier, Tier]
    message_overhead: float = 1e-6

    @property
    def size(self) -> int:
        """Members of the group."""
        return self.sizes[0] * self.sizes[1] * self.sizes[2]

    @property
    def outermost(self) -> Tier:
        """The slowest tier the group crosses (``nvlink`` for a group of one)."""
        for size, tier in zip(reversed(self.sizes), reversed(self.tiers), strict=True):
            if size > 1:
                return tier
        return self.tiers[0]

    def used(self) -> list[tuple[int, Tier]]:
        """(fan-out, tier) for the tiers with fan-out > 1, innermost first."""
        return [(s, t) for s, t in zip(self.sizes, self.tiers, strict=True) if s > 1]

    def describe(self) -> str:
        """``"8xnvlink*2xroce"``: the fan-out per tier crossed (``"local"`` for one rank)."""
        names = [f"{s}x{t.name}" for s, t in self.used()]
        return "*".join(names) if names else "local"


def _domains_hit(size: int, stride: int, domain: int) -> int:
    """How many domains of ``domain`` consecutive ranks hold a member of ``{0, stride, ...,
    (size - 1) * stride}``: every member its own when the stride spans a domain, else every
    domain from the first to the last member's (consecutive members are less than a domain
    apart, so none is skipped)."""
    return size if stride >= domain else (size - 1) * stride // domain + 1


@dataclass(frozen=True)
class Topology:
    """A cluster of ``num_gpus`` GPUs, ``gpus_per_host`` per host, ``hosts_per_zone`` per zone.

    ``num_gpus`` must be a multiple of ``gpus_per_host``; when it spans more than one zone it must
    be a multiple of a zone. The cross-zone tier's bandwidth is ``roce.bandwidth /
    oversubscription`` unless given explicitly.

    Raises:
        ValueError: naming the field, for a count that is not a positive integer (bools
            included), a NaN, infinite or out-of-range number (``oversubscription`` < 1, a
            negative latency or overhead, ``gpu_memory_bytes`` or ``gpu_flops`` <= 0, a
            fraction outside (0, 1]), or a shape whose hosts or zones do not divide it.
    """

    num_gpus: int
    gpus_per_host: int = 8
    hosts_per_zone: int = 16
    nvlink: Tier = field(default_factory=lambda: Tier("nvlink", 360e9, 2e-6))
    roce: Tier = field(default_factory=lambda: Tier("roce", 45e9, 5e-6))
    oversubscription: float = 4.0
    cross_zone_latency: float = 10e-6
    message_overhead: float = 1e-6  # per peer of an all-to-all, whose messages are posted at once
    gpu_memory_bytes: float = 141e9
    memory_headroom: float = 0.9
    gpu_flops: float = 989e12
    achieved_flops_fraction: float = 0.4
    num_sms: int = 132

    def __post_init__(self):
        for name in ("num_gpus", "gpus_per_host", "hosts_per_zone", "num_sms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, low, inclusive in (
            ("oversubscription", 1.0, True),
            ("cross_zone_latency", 0.0, True),
            ("message_overhead", 0.0, True),
            ("gpu_memory_bytes", 0.0, False),
            ("gpu_flops", 0.0, False),
        ):
            value = getattr(self, name)
            if not _is_real(value) or value < low or (not inclusive and value == low):
                bound = f">= {low:g}" if inclusive else f"> {low:g}"
                raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
        for name in ("memory_headroom", "achieved_flops_fraction"):
            value = getattr(self, name)
            if not _is_real(value) or not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if self.num_gpus % self.gpus_per_host:
            lower = max(
                self.gpus_per_host, self.num_gpus // self.gpus_per_host * self.gpus_per_host
            )
            upper = -(-self.num_gpus // self.gpus_per_host) * self.gpus_per_host
            if self.num_gpus < self.gpus_per_host:
                raise ValueError(
                    f"num_gpus={self.num_gpus} is smaller than one host of gpus_per_host="
                    f"{self.gpus_per_host}: use gpus_per_host={self.num_gpus} or num_gpus={upper}"
                )
            raise ValueError(
                f"num_gpus={self.num_gpus} is not a multiple of gpus_per_host={self.gpus_per_host}: "
                f"use num_gpus={lower} or {upper}"
            )
        zone = self.gpus_per_zone
        if self.num_gpus > zone and self.num_gpus % zone:
            lower, upper = self.num_gpus // zone * zone, -(-self.num_gpus // zone) * zone
            raise ValueError(
                f"num_gpus={self.num_gpus} spans several zones of {zone} GPUs "
                f"(hosts_per_zone={self.hosts_per_zone}) but is not a whole number of zones: "
                f"use num_gpus={lower} or {upper}"
            )

    # -- shape -------------------------------------------------------------------------------
    @property
    def gpus_per_zone(self) -> int:
        """GPUs of one zone."""
        return self.gpus_per_host * self.hosts_per_zone

    @property
    def num_hosts(self) -> int:
        """Hosts of the cluster."""
        return self.num_gpus // self.gpus_per_host

    @property
    def num_zones(self) -> int:
        """Zones of the cluster (1 when it fits in one)."""
        return max(1, -(-self.num_gpus // self.gpus_per_zone))

    @property
    def cross_zone(self) -> Tier:
        """The spine: RoCE bandwidth over the oversubscription, ``cross_zone_latency``."""
        return Tier(
            "cross_zone", self.roce.bandwidth / self.oversubscription, self.cross_zone_latency
        )

    @property
    def tiers(self) -> tuple[Tier, Tier, Tier]:
        """(nvlink, roce, cross_zone), innermost first."""
        return (self.nvlink, self.roce, self.cross_zone)

    @property
    def usable_memory_bytes(self) -> float:
        """GPU memory a plan may use: ``gpu_memory_bytes · memory_headroom``."""
        return self.gpu_memory_bytes * self.memory_headroom

    @property
    def achieved_flops(self) -> float:
        """FLOP/s a step achieves: ``gpu_flops · achieved_flops_fraction``."""
        return self.gpu_flops * self.achieved_flops_fraction

    def placement(self, size: int, stride: int) -> GroupPlacement:
        """Placement of the group ``{0, stride, 2*stride, ...}`` of ``size`` ranks.

        A mesh dimension laid out row-major has exactly this shape (its stride is the product of
        the sizes of the dimensions inside it); every other group of that dimension is a
        translate of it and sits the same way when the sizes divide the tiers.
        """
        if size < 1 or stride < 1:
            raise ValueError(
                f"group size and stride must be >= 1, got size={size}, stride={stride}"
            )
        if (size - 1) * stride >= self.num_gpus:
            raise ValueError(
                f"a group of {size} ranks with stride {stride} needs {(size - 1) * stride + 1} "
                f"ranks but the topology has num_gpus={self.num_gpus}"
            )
        hosts = _domains_hit(size, stride, self.gpus_per_host)
        zones = _domains_hit(size, stride, self.gpus_per_zone)
        per_host = -(-size // hosts)
        hosts_per_zone = -(-hosts // zones)
        return GroupPlacement((per_host, hosts_per_zone, zones), self.tiers, self.message_overhead)

    def describe(self) -> str:
        """One line: the shape and the tiers' bandwidths."""
        return (
            f"{self.num_gpus} GPUs = {self.num_zones} zone(s) x {min(self.num_hosts, self.hosts_per_zone)}"
            f" host(s) x {self.gpus_per_host} GPUs; nvlink {self.nvlink.bandwidth / 1e9:.0f} GB/s, "
            f"roce {self.roce.bandwidth / 1e9:.0f} GB/s, cross-zone "
            f"{self.cross_zone.bandwidth / 1e9:.1f} GB/s (oversubscription {self.oversubscription:g})"
        )

    @classmethod
    def detect(cls, *, environ: Mapping[str, str] | None = None, **overrides) -> "Topology":
        """The topology of the running job, from torchrun's environment and the local devices.

        ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (set by torchrun) give the GPU and per-host
        counts; ``GEM_HOSTS_PER_ZONE`` the zone size (default: every host in one zone). Without
        torchrun, one host with ``torch.cuda.device_count()`` GPUs (1 on a CPU machine). On CUDA
        the memory and SM count come from device 0.

        Args:
            environ: where to read the variables (default ``os.environ``).
            **overrides: ``Topology`` fields that win over everything detected.

        Raises:
            ValueError: the detected or overridden values make no valid topology (see the
                checks of ``Topology``).
        """
        import torch

        environ = os.environ if environ is None else environ
        local = int(environ.get("LOCAL_WORLD_SIZE", 0)) or max(1, torch.cuda.device_count())
        world = int(environ.get("WORLD_SIZE", 0)) or local
        hosts = max(1, world // local)
        values = {
            "num_gpus": world,
            "gpus_per_host": local,
            "hosts_per_zone": int(environ.get("GEM_HOSTS_PER_ZONE", 0)) or hosts,
        }
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            values["gpu_memory_bytes"] = float(props.total_memory)
            values["num_sms"] = int(props.multi_processor_count)
        values.update(overrides)
        return cls(**values)

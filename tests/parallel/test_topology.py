"""Topology: group placement on the tiers, validation, detection from torchrun's environment."""

import pytest
from gem_parallel.topology import Tier, Topology


def test_placement_of_contiguous_and_strided_groups():
    topo = Topology(1024, gpus_per_host=8, hosts_per_zone=16)  # zones of 128 GPUs, 8 zones
    assert topo.num_hosts == 128 and topo.num_zones == 8 and topo.gpus_per_zone == 128
    assert topo.placement(8, 1).sizes == (8, 1, 1)  # one host
    assert topo.placement(16, 1).sizes == (8, 2, 1)  # two hosts of one zone
    assert topo.placement(16, 8).sizes == (1, 16, 1)  # one GPU in each host of a zone
    assert topo.placement(8, 128).sizes == (1, 1, 8)  # one GPU per zone
    assert topo.placement(256, 1).sizes == (8, 16, 2)
    assert topo.placement(4, 2).sizes == (4, 1, 1)
    assert topo.placement(1, 1).describe() == "local"
    assert topo.placement(16, 1).describe() == "8xnvlink*2xroce"
    assert topo.placement(8, 128).outermost.name == "cross_zone"


def test_placement_counts_the_hosts_and_zones_a_group_touches():
    """The closed form against listing the members, on every group of small clusters."""
    for gpus_per_host, hosts_per_zone, zones in [(4, 3, 2), (8, 2, 3), (2, 16, 1), (1, 4, 4)]:
        world = gpus_per_host * hosts_per_zone * zones
        topo = Topology(world, gpus_per_host=gpus_per_host, hosts_per_zone=hosts_per_zone)
        for size in range(1, world + 1):
            for stride in range(1, (world - 1) // max(size - 1, 1) + 1):
                ranks = [i * stride for i in range(size)]
                hosts = len({r // gpus_per_host for r in ranks})
                zone_count = len({r // topo.gpus_per_zone for r in ranks})
                expected = (-(-size // hosts), -(-hosts // zone_count), zone_count)
                assert topo.placement(size, stride).sizes == expected, (world, size, stride)


def test_cross_zone_tier_is_the_oversubscribed_nic():
    topo = Topology(
        16, gpus_per_host=4, hosts_per_zone=2, roce=Tier("roce", 40e9, 5e-6), oversubscription=4
    )
    assert topo.cross_zone.bandwidth == pytest.approx(10e9)
    assert [t.name for t in topo.tiers] == ["nvlink", "roce", "cross_zone"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_gpus": 12, "gpus_per_host": 8}, "use num_gpus=8 or 16"),
        ({"num_gpus": 4, "gpus_per_host": 8}, "smaller than one host"),
        ({"num_gpus": 24, "gpus_per_host": 8, "hosts_per_zone": 2}, "use num_gpus=16 or 32"),
        ({"num_gpus": 0}, "num_gpus must be a positive integer"),
        ({"num_gpus": 8, "oversubscription": 0.5}, "oversubscription"),
    ],
)
def test_impossible_topologies_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Topology(**kwargs)


def test_group_larger_than_the_cluster_is_refused():
    with pytest.raises(ValueError, match="num_gpus=8"):
        Topology(8).placement(4, 4)


def test_bad_tier_is_refused():
    with pytest.raises(ValueError, match="bandwidth"):
        Tier("nvlink", 0.0, 1e-6)


def test_detect_reads_torchrun_environment():
    environ = {"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8", "GEM_HOSTS_PER_ZONE": "2"}
    topo = Topology.detect(environ=environ, gpu_memory_bytes=80e9)
    assert (topo.num_gpus, topo.gpus_per_host, topo.hosts_per_zone, topo.num_zones) == (32, 8, 2, 2)
    assert topo.gpu_memory_bytes == 80e9


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "bandwidth, latency, field",
    [
        (NAN, 1e-6, "bandwidth"),
        (INF, 1e-6, "bandwidth"),
        (-1.0, 1e-6, "bandwidth"),
        (1e9, NAN, "latency"),
        (1e9, INF, "latency"),
        (1e9, -1e-6, "latency"),
    ],
)
def test_non_finite_or_negative_tier_values_are_refused(bandwidth, latency, field):
    with pytest.raises(ValueError, match=f"tier 'roce': {field} must be"):
        Tier("roce", bandwidth, latency)


@pytest.mark.parametrize(
    "field, value",
    [
        ("oversubscription", NAN),
        ("oversubscription", INF),
        ("cross_zone_latency", NAN),
        ("cross_zone_latency", -1e-6),
        ("message_overhead", INF),
        ("message_overhead", -1.0),
        ("gpu_memory_bytes", NAN),
        ("gpu_memory_bytes", 0.0),
        ("gpu_memory_bytes", -1.0),
        ("gpu_memory_bytes", INF),
        ("gpu_flops", 0.0),
        ("gpu_flops", NAN),
        ("achieved_flops_fraction", 0.0),
        ("achieved_flops_fraction", NAN),
        ("achieved_flops_fraction", 1.5),
        ("memory_headroom", NAN),
        ("num_gpus", True),
        ("num_sms", 2.0),
    ],
)
def test_non_finite_or_out_of_range_topology_fields_are_named(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        Topology(**{"num_gpus": 8, field: value})

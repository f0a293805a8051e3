"""Cost-model formulas against hand-computed cases on a toy cluster with round numbers.

Toy cluster: 4 GPUs per host, 2 hosts per zone, 2 zones (16 GPUs). NVLink 100 B/s with latency 1 s,
RoCE 10 B/s with latency 10 s, cross-zone 10/10 = 1 B/s with latency 100 s, a2a overhead 0.5 s per
peer. Every expected value below is worked out by hand in the comment beside it.
"""

import pytest
from gem_parallel.cost_model import CostModel, flat_time, hierarchical_time
from gem_parallel.topology import Tier, Topology
from hypothesis import assume, given
from hypothesis import strategies as st

TOY = Topology(
    16,
    gpus_per_host=4,
    hosts_per_zone=2,
    nvlink=Tier("nvlink", 100.0, 1.0),
    roce=Tier("roce", 10.0, 10.0),
    oversubscription=10.0,
    cross_zone_latency=100.0,
    message_overhead=0.5,
    num_sms=132,
)
HOST = TOY.placement(4, 1)  # (4, 1, 1)
TWO_HOSTS = TOY.placement(8, 1)  # (4, 2, 1)
TWO_ZONES = TOY.placement(2, 8)  # (1, 1, 2)


def test_placements_of_the_toy_cluster():
    assert (HOST.sizes, TWO_HOSTS.sizes, TWO_ZONES.sizes) == ((4, 1, 1), (4, 2, 1), (1, 1, 2))


def test_all_gather_inside_a_host():
    # flat: 3 steps x 1 s + 3/4 x 400 B / 100 B/s = 3 + 3 = 6; hierarchical is the same ring.
    assert flat_time("all_gather", 400, HOST) == {"nvlink": pytest.approx(6.0)}
    assert hierarchical_time("all_gather", 400, HOST) == {"nvlink": pytest.approx(6.0)}


def test_all_gather_across_two_hosts():
    # flat: 7 x 10 s; weights nvlink 3/4 / 100 = 0.0075, roce 1 / (4 x 10) = 0.025 (the max);
    # 7/8 x 800 x 0.025 = 17.5; total 87.5, charged to roce.
    assert flat_time("all_gather", 800, TWO_HOSTS) == {"roce": pytest.approx(87.5)}
    # hierarchical: roce phase 1 x 10 + 1/2 x 800 / (4 x 10) = 20; nvlink phase 3 x 1 + 3/4 x 800 / 100 = 9.
    assert hierarchical_time("all_gather", 800, TWO_HOSTS) == {
        "nvlink": pytest.approx(9.0),
        "roce": pytest.approx(20.0),
    }
    assert hierarchical_time("reduce_scatter", 800, TWO_HOSTS) == hierarchical_time(
        "all_gather", 800, TWO_HOSTS
    )


def test_all_reduce_takes_the_cheaper_of_ring_and_tree():
    # ring 2 x 87.5 = 175; tree 2 x log2(8) x 10 + 2 x 17.5 = 95.
    assert flat_time("all_reduce", 800, TWO_HOSTS) == {"roce": pytest.approx(95.0)}
    # hierarchical: twice (20 + 9).
    assert sum(hierarchical_time("all_reduce", 800, TWO_HOSTS).values()) == pytest.approx(58.0)
    # large message inside a host: ring 2 x (3 + 3/4 x 4e4 / 100) = 606; tree 2 x 2 + 2 x 300 = 604.
    assert flat_time("all_reduce", 4e4, HOST) == {"nvlink": pytest.approx(604.0)}


def test_all_to_all_flat_and_hierarchical():
    # flat: latency 10 + 7 x 0.5 = 13.5; bytes leaving: nvlink 800 x 3/8 / 100 = 3,
    # roce 800 x 4/8 / 10 = 40 (the max), zone 0. Total 53.5 on roce.
    assert flat_time("all_to_all", 800, TWO_HOSTS) == {"roce": pytest.approx(53.5)}
    # hierarchical: nvlink 3 x 1 + 3/4 x 800 / 100 = 9; roce 1 x 10 + 1/2 x 800 / 10 = 50.
    assert hierarchical_time("all_to_all", 800, TWO_HOSTS) == {
        "nvlink": pytest.approx(9.0),
        "roce": pytest.approx(50.0),
    }


def test_cross_zone_collectives_use_the_oversubscribed_tier():
    # one GPU in each of 2 zones: 1 x 100 s + 1/2 x 100 B / (1 x 1 B/s) = 150.
    assert flat_time("all_gather", 100, TWO_ZONES) == {"cross_zone": pytest.approx(150.0)}
    # a2a: 100 + 1 x 0.5 + 100 x 1/2 / 1 = 150.5
    assert flat_time("all_to_all", 100, TWO_ZONES) == {"cross_zone": pytest.approx(150.5)}


def test_best_picks_the_cheaper_algorithm_and_reports_it():
    model = CostModel(TOY)
    est = model.collective("all_gather", 800, TWO_HOSTS)
    assert est.algorithm == "hierarchical" and est.seconds == pytest.approx(29.0)
    est = model.collective("all_to_all", 800, TWO_HOSTS)
    assert est.algorithm == "flat" and est.seconds == pytest.approx(53.5)
    assert model.collective("all_gather", 800, TOY.placement(1, 1)).seconds == 0.0


def test_overlap_with_sm_and_copy_engine_collectives():
    model = CostModel(TOY)
    # compute-bound: 10 + 5 x 24/132 with NCCL on the SMs; just 10 on the copy engines.
    assert model.overlap(10.0, 5.0, engine="nccl") == pytest.approx(10.0 + 5.0 * 24 / 132)
    assert model.overlap(10.0, 5.0, engine="copy_engine") == pytest.approx(10.0)
    # communication-bound: the collective's own time.
    assert model.overlap(10.0, 20.0, engine="nccl") == pytest.approx(20.0)


@given(
    kind=st.sampled_from(["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]),
    size=st.sampled_from([2, 4, 8, 16]),
    stride=st.sampled_from([1, 2, 4]),
    nbytes=st.floats(1.0, 1e12),
)
def test_costs_grow_with_bytes_and_single_tier_rings_agree(kind, size, stride, nbytes):
    assume((size - 1) * stride < TOY.num_gpus)
    placement = TOY.placement(size, stride)
    for fn in (flat_time, hierarchical_time):
        small, big = (
            sum(fn(kind, nbytes, placement).values()),
            sum(fn(kind, 2 * nbytes, placement).values()),
        )
        assert 0 < small < big
    if len(placement.used()) == 1 and kind in ("all_gather", "reduce_scatter"):
        assert sum(flat_time(kind, nbytes, placement).values()) == pytest.approx(
            sum(hierarchical_time(kind, nbytes, placement).values())
        )


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="kind must be one of"):
        flat_time("broadcast", 1, HOST)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        CostModel(TOY).collective("all_gather", 1, HOST, algorithm="magic")
    with pytest.raises(ValueError, match="engine must be one of"):
        CostModel(TOY).overlap(1, 1, engine="dma")

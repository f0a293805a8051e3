"""Planner: search, feasibility, GEM's rules with their reasons, impossible requests, the CLI."""

import dataclasses
import json
import time

import pytest
from gem_parallel.cli import main as plan_cli
from gem_parallel.model_spec import ModelSpec
from gem_parallel.planner import PlannerConfig, plan
from gem_parallel.topology import Topology

GEM_LARGE = ModelSpec.named("gem-large")


def test_named_specs_have_the_promised_scale():
    small, large = ModelSpec.named("gem-small"), GEM_LARGE
    assert small.d_model >= 1024
    assert 1e12 <= large.sparse_params < 1e13
    assert 1e9 <= large.total_dense_params < 1e10 and large.num_experts > 1
    with pytest.raises(ValueError, match="named specs are"):
        ModelSpec.named("gem-huge")


def test_spec_from_json_file(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(
        json.dumps({"dense_params": 1000, "num_layers": 2, "d_model": 16, "tokens_per_gpu": 8})
    )
    spec = ModelSpec.load(str(path))
    assert (spec.name, spec.dense_params, spec.num_experts) == ("tiny", 1000, 0)
    path.write_text(json.dumps({"dense_params": 1, "num_layers": 1, "d_model": 1, "layers": 3}))
    with pytest.raises(ValueError, match=r"unknown ModelSpec fields \['layers'\]"):
        ModelSpec.from_file(path)
    with pytest.raises(ValueError, match="top_k=4 exceeds num_experts=2"):
        ModelSpec("x", 1, 1, 1, num_experts=2, moe_layers=1, expert_hidden=1, top_k=4)


def test_one_gpu_plan_is_all_compute():
    p = plan(Topology(1, gpus_per_host=1), ModelSpec.named("gem-small"))
    assert p.collectives == [] and p.step_s == pytest.approx(p.compute_s)
    assert p.memory_bytes <= p.topology.usable_memory_bytes


def test_plan_is_the_fastest_that_fits_among_pinned_alternatives():
    topo = Topology(16, gpus_per_host=8, hosts_per_zone=1)
    spec = ModelSpec.named("gem-small")
    best = plan(topo, spec)
    assert best.memory_bytes <= topo.usable_memory_bytes
    for dp_shard in (1, 2, 4, 8, 16):
        for ep in (1, 2, 4, 8):
            if dp_shard % ep:
                continue
            pinned = plan(topo, spec, dp_shard=dp_shard, ep=ep, explain=False)
            assert pinned.step_s >= best.step_s - 1e-12
            assert (pinned.layout.dp_shard, pinned.layout.ep) == (dp_shard, ep)


@pytest.mark.parametrize("gpus", [4096, 16384])
def test_large_plans_are_fast_and_keep_the_zone_rules(gpus):
    start = time.perf_counter()
    p = plan(Topology(gpus, gpus_per_host=8, hosts_per_zone=16), GEM_LARGE)
    assert time.perf_counter() - start < 10.0
    layout = p.layout
    assert (
        layout.dp_replicate * layout.dp_shard == gpus == layout.sparse_mp * layout.sparse_replicas
    )
    rules = {line.split(":")[0]: line for line in p.rules}
    assert set(rules) == {
        "EP inside a host",
        "sparse replicas inside a host",
        "FSDP shard groups inside a zone",
        "replication across zones",
    }
    assert "kept" in rules["FSDP shard groups inside a zone"]
    assert "kept" in rules["replication across zones"]
    for line in p.rules:  # every broken rule says which term decided
        assert "kept" in line or "decided:" in line, line


def test_ep_inside_a_host_when_experts_are_heavy():
    heavy = dataclasses.replace(GEM_LARGE, num_experts=8, expert_hidden=16384, tokens_per_gpu=4096)
    p = plan(Topology(256, gpus_per_host=8, hosts_per_zone=16), heavy)
    assert p.layout.ep == 8
    assert any(line.startswith("EP inside a host: kept (ep=8 on 8xnvlink)") for line in p.rules)


def test_copy_engine_collectives_never_slow_the_step():
    topo = Topology(64, gpus_per_host=8, hosts_per_zone=4)
    nccl = plan(topo, GEM_LARGE, explain=False)
    copy = plan(topo, GEM_LARGE, config=PlannerConfig(engine="copy_engine"), explain=False)
    assert copy.step_s <= nccl.step_s


def test_fully_sharded_embeddings_use_less_memory_than_2d():
    topo = Topology(512, gpus_per_host=8, hosts_per_zone=64)
    full = plan(topo, GEM_LARGE, sparse_replicas=8, explain=False)
    twod = plan(
        topo, GEM_LARGE, sparse_replicas=8, config=PlannerConfig(sparse_mode="2d"), explain=False
    )
    assert full.memory["embeddings"] == pytest.approx(twod.memory["embeddings"] / 8)


@pytest.mark.parametrize(
    "gpus, kwargs, message",
    [
        (8, {}, r"fits nowhere on 8 GPUs.*Smallest change that fits: --gpus 24"),
        (
            64,
            {"ep": 128},
            "ep=128 exceeds the 64 GPUs: the largest expert parallelism that fits is ep=16",
        ),
        (64, {"ep": 3}, "ep=3 does not divide num_experts=16: use ep=2 or 4"),
        (64, {"dp_shard": 3}, "dp_shard=3 does not divide the 64 GPUs: use dp_shard=2 or 4"),
        (
            64,
            {"dp_shard": 8, "dp_replicate": 4},
            "dp_replicate=4 x dp_shard=8 != 64 GPUs: use dp_shard=16",
        ),
        (64, {"dp_shard": 4, "ep": 8}, "ep=8 must divide dp_shard=4"),
        (
            64,
            {"dp_shard": 1},
            r"does not fit on 64 GPUs with \{'dp_shard': 1\}.*Smallest change that fits: dp_shard=2",
        ),
    ],
)
def test_impossible_requests_name_the_smallest_change(gpus, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan(Topology(gpus, gpus_per_host=8, hosts_per_zone=16), GEM_LARGE, **kwargs)


def test_cli_table_json_and_errors(capsys):
    assert (
        plan_cli(
            [
                "--gpus",
                "64",
                "--gpus-per-host",
                "8",
                "--hosts-per-zone",
                "4",
                "--model",
                "gem-large",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "memory per GPU" in table and "fsdp all-gather" in table and "GEM's rules" in table
    assert plan_cli(["--gpus", "16", "--model", "gem-small", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["world"] == 16 and data["step_s"] >= data["compute_s"]
    assert plan_cli(["--gpus", "12", "--model", "gem-small"]) == 2
    assert "use num_gpus=8 or 16" in capsys.readouterr().err


def test_package_exports_load_lazily():
    import gem_parallel
    from gem_parallel import planner

    assert gem_parallel.make_plan is planner.plan
    with pytest.raises(AttributeError):
        gem_parallel.plan  # noqa: B018 ("plan" names the parallel plan only: make_plan, Plan)
    assert {
        "make_plan",
        "build_meshes",
        "apply_dense_parallel",
        "shard_embeddings",
        "collectives",
    } <= set(dir(gem_parallel))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        gem_parallel.nothing  # noqa: B018


@pytest.mark.parametrize(
    "field", ["dense_params", "sparse_params", "activation_bytes_per_token", "d_model"]
)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_model_sizes_are_named(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be a finite number >= 0"):
        dataclasses.replace(GEM_LARGE, **{field: value})


def _timed_plan(topology, spec, **kwargs):
    start = time.perf_counter()
    try:
        return plan(topology, spec, **kwargs)
    finally:
        assert time.perf_counter() - start < 2.0


def test_fits_nowhere_is_answered_in_seconds_on_wide_zones():
    # 16384 hosts per zone: the search for the smallest cluster that fits once costed every size
    # (up to 4096 zones) before answering; the memory floor skips the sizes that cannot fit
    topo = Topology(8, gpus_per_host=8, hosts_per_zone=16384, gpu_memory_bytes=5e9)
    with pytest.raises(
        ValueError, match=r"fits nowhere on 8 GPUs.*Smallest change that fits: --gpus 2304\b"
    ):
        _timed_plan(topo, GEM_LARGE)


def test_a_model_that_fits_on_no_cluster_says_so_in_seconds():
    # the activations alone exceed a GPU: no number of GPUs helps, only more memory per GPU
    spec = dataclasses.replace(GEM_LARGE, activation_bytes_per_token=1e9)
    with pytest.raises(ValueError, match="fits on no number of GPUs.*activations"):
        _timed_plan(Topology(16384, gpus_per_host=8, hosts_per_zone=16384), spec)


def test_fits_nowhere_still_names_the_smallest_cluster():
    with pytest.raises(ValueError, match=r"Smallest change that fits: --gpus 24\b"):
        _timed_plan(Topology(8, gpus_per_host=8, hosts_per_zone=16), GEM_LARGE)


def test_search_is_capped_and_names_the_pins_that_shrink_it():
    # 480480 = 2^5·3·5·7·11·13 GPUs: 640 dense x 382 sparse halves, 244480 candidate plans
    topo = Topology(480480, gpus_per_host=8, hosts_per_zone=60060)
    with pytest.raises(ValueError, match=r"244480 candidate plans.*pin sparse_replicas"):
        _timed_plan(topo, GEM_LARGE)
    pinned = _timed_plan(topo, GEM_LARGE, sparse_replicas=390, explain=False)
    assert pinned.layout.sparse_replicas == 390


def test_two_to_the_27_gpus_plan_in_seconds():
    topo = Topology(2**27, gpus_per_host=8, hosts_per_zone=2**10)
    assert _timed_plan(topo, GEM_LARGE).layout.world == 2**27

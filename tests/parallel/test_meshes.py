"""Meshes: fake-process-group dry runs at 4,096 and 16,384 ranks; every group is the plan's."""

import time

import pytest
import torch._dynamo  # noqa: F401  (DeviceMesh slicing imports it lazily: keep that out of the timing)
import torch.distributed as dist
from gem_parallel.layout import MeshLayout
from gem_parallel.meshes import build_meshes, fake_world, group_ranks
from gem_parallel.model_spec import ModelSpec
from gem_parallel.planner import plan
from gem_parallel.topology import Topology


def _expected(layout: MeshLayout, rank: int, dim: str) -> list[int]:
    size, stride = layout.group(dim)
    base = rank - (rank // stride % size) * stride
    return [base + i * stride for i in range(size)]


@pytest.mark.parametrize("gpus, rank", [(4096, 0), (16384, 12345)])
def test_dry_run_of_a_planned_cluster(gpus, rank):
    topology = Topology(gpus, gpus_per_host=8, hosts_per_zone=16)
    start = time.perf_counter()
    p = plan(topology, ModelSpec.named("gem-large"), ep=8, sparse_replicas=8)
    with fake_world(gpus, rank=rank):
        meshes = build_meshes(p)
        elapsed = time.perf_counter() - start
        layout = meshes.layout
        assert dist.get_world_size(meshes.group("dp_shard")) == layout.dp_shard
        for mesh, dims in (
            (meshes.dense, ("dp_replicate", "dp_shard")),
            (meshes.expert, ("dp_replicate", "edp_shard", "ep")),
            (meshes.sparse, ("sparse_mp", "sparse_replica")),
        ):
            for dim in dims:
                assert group_ranks(mesh, dim) == _expected(layout, rank, dim), dim
        # the ep group and the sparse replicas are one host; the ep group sits inside the shard group
        assert len({r // 8 for r in group_ranks(meshes.expert, "ep")}) == 1
        assert len({r // 8 for r in group_ranks(meshes.sparse, "sparse_replica")}) == 1
        assert set(group_ranks(meshes.expert, "ep")) <= set(group_ranks(meshes.dense, "dp_shard"))
        assert meshes.expert_hsdp.mesh_dim_names == ("dp_replicate", "edp_shard")
    assert elapsed < 10.0


def test_model_parallel_inside_when_asked():
    layout = MeshLayout(64, 4, 16, ep=4, sparse_replicas=4, sparse_inner="mp")
    with fake_world(64, rank=5):
        meshes = build_meshes(layout)
        assert group_ranks(meshes.sparse, "sparse_mp") == list(range(16))
        assert group_ranks(meshes.sparse, "sparse_replica") == [5, 21, 37, 53]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(world=8, dp_replicate=3, dp_shard=2),
            "dp_replicate=3 does not divide the world size 8: use dp_replicate=2 or 4",
        ),
        (
            dict(world=8, dp_replicate=2, dp_shard=2),
            "must equal the world size 8; with dp_replicate=2 use dp_shard=4",
        ),
        (dict(world=8, dp_replicate=1, dp_shard=8, ep=16), "ep=16 exceeds the world size 8"),
        (dict(world=8, dp_replicate=2, dp_shard=4, ep=8), "ep=8 must divide dp_shard=4"),
        (dict(world=8, dp_replicate=1, dp_shard=8, sparse_replicas=3), "sparse_replicas"),
    ],
)
def test_layouts_that_do_not_divide_the_world_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MeshLayout(**kwargs)


def test_build_refuses_a_layout_for_another_world():
    with fake_world(16):
        with pytest.raises(ValueError, match="layout is for 8 ranks but the process group has 16"):
            build_meshes(MeshLayout(8, 1, 8))
        with pytest.raises(TypeError, match="Plan or a MeshLayout"):
            build_meshes({"world": 16})
        with pytest.raises(RuntimeError, match="already"):
            with fake_world(4):
                pass


def test_one_rank_without_a_process_group(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert not dist.is_initialized()
    try:
        meshes = build_meshes(MeshLayout(1, 1, 1), device_type="cpu")
        assert dist.get_world_size() == 1 and meshes.dense.shape == (1, 1)
    finally:
        dist.destroy_process_group()

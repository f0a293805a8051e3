"""Named DeviceMesh views over the ranks of one job: dense (HSDP), expert (EP), sparse (2D).

``build_meshes(plan_or_layout)`` turns a plan's integers into torch DeviceMeshes:

- ``expert``: the root mesh ``(dp_replicate, edp_shard, ep)``, made with ``init_device_mesh``.
- ``dense``: ``(dp_replicate, dp_shard)``, where ``dp_shard`` is ``(edp_shard, ep)`` flattened, a
  view of the same root mesh, so the dense and expert meshes share the ``dp_replicate`` groups
  and their ranks line up (an expert-parallel group sits inside a dense shard group).
- ``sparse``: ``(sparse_mp, sparse_replica)`` (or the other order when the plan puts the
  model-parallel dimension inside), a second factorization of the same ranks.

The backend follows the device: NCCL on CUDA, gloo on the CPU; whatever default process group is
already initialized is used (torchrun's, a test's gloo group, or the fake process group). Without
one, a one-rank layout outside torchrun gets a private one-rank group (so a single-process trainer
runs the same code path), and anything larger lets ``init_device_mesh`` read torchrun's
environment.

Dry runs: ``fake_world(world_size, rank=0)`` initializes torch's fake process group (collectives
return at once, no other process exists), so a rank of a 16,384-GPU job can build its meshes in
one process in seconds and check that every group is the one the plan meant.
"""

import contextlib
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gem_parallel.layout import MeshLayout


@dataclass
class ParallelMeshes:
    """The dense, expert and sparse ``DeviceMesh``es of one layout, over the same ranks."""

    layout: MeshLayout
    dense: DeviceMesh
    expert: DeviceMesh
    sparse: DeviceMesh

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group of this rank along a named dimension of any of the three meshes."""
        for mesh in (self.expert, self.dense, self.sparse):
            if dim in mesh.mesh_dim_names:
                return mesh.get_group(dim)
        raise ValueError(f"unknown mesh dimension {dim!r}")

    @property
    def dense_hsdp(self) -> DeviceMesh:
        """The 2-D mesh FSDP2 shards dense weights over (replicate x shard)."""
        return self.dense

    @property
    def expert_hsdp(self) -> DeviceMesh:
        """The 2-D mesh FSDP2 shards each rank's experts over (replicate x expert-data shard)."""
        return self.expert["dp_replicate", "edp_shard"]


def default_device_type() -> str:
    """``"cuda"`` when the default process group is NCCL's, else ``"cpu"``."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    return "cpu"


def build_meshes(plan_or_layout, *, device_type: str | None = None) -> ParallelMeshes:
    """Meshes for a :class:`~gem_parallel.planner.Plan` or a :class:`MeshLayout`.

    ``device_type`` defaults to the default process group's (``default_device_type``). Without a
    process group, a one-rank layout outside torchrun gets a private one-rank group; anything
    larger lets ``init_device_mesh`` read torchrun's environment.

    Raises:
        TypeError: neither a plan nor a layout.
        ValueError: the layout's world differs from the process group's.
    """
    layout = getattr(plan_or_layout, "layout", plan_or_layout)
    if not isinstance(layout, MeshLayout):
        raise TypeError(
            f"plan_or_layout must be a Plan or a MeshLayout, got {type(plan_or_layout).__name__}"
        )
    device_type = device_type or default_device_type()
    if not dist.is_initialized() and layout.world == 1 and "RANK" not in os.environ:
        # one process without torchrun (a laptop, the tiny trainer): a private one-rank group
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.is_initialized() and dist.get_world_size() != layout.world:
        raise ValueError(
            f"the layout is for {layout.world} ranks but the process group has "
            f"{dist.get_world_size()}; plan for --gpus {dist.get_world_size()}"
        )
    names, shape = layout.expert
    expert = init_device_mesh(device_type, shape, mesh_dim_names=names)
    expert["edp_shard", "ep"]._flatten("dp_shard")
    with warnings.catch_warnings():
        # torch >= 2.11 warns that slicing a flattened dim off the root will change some day;
        # it is the documented way to get an HSDP view that shares the root's groups today.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        dense = expert["dp_replicate", "dp_shard"]
    names, shape = layout.sparse
    sparse = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return ParallelMeshes(layout, dense, expert, sparse)


@contextlib.contextmanager
def fake_world(world_size: int, *, rank: int = 0):
    """A fake default process group of ``world_size`` ranks, seen from ``rank``, for dry runs."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world needs no process group to be initialized; one already is")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def group_ranks(mesh: DeviceMesh, dim: str) -> list[int]:
    """The global ranks of this rank's group along ``dim`` (read from the mesh, no communication)."""
    i = mesh.mesh_dim_names.index(dim)
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if d == i else c for d, c in enumerate(coordinate))
    return (
        mesh.mesh[index].flatten().tolist()
        if torch.is_tensor(mesh.mesh)
        else list(mesh.mesh[index])
    )

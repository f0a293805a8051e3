"""HSDP + expert parallelism on gloo (2 and 4 CPU processes) against single-process training.

Each scenario builds the meshes of a plan layout, applies FSDP2 HSDP and expert parallelism to the
same tiny dense + MoE model, trains three AdamW steps on each rank's slice of the global batch,
and compares the global loss of every step and every final parameter (experts gathered over the
expert-parallel group) with one process training on the whole batch: fp32 throughout, so they
agree to fp32 round-off.

The processes are forked from the test process (torch is already imported there, so they start
in a fraction of a second); each sets one intra-op thread first.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gem_parallel.dense import DenseParallelConfig, apply_dense_parallel
from gem_parallel.layout import MeshLayout
from gem_parallel.meshes import build_meshes, group_ranks

sys.path.insert(0, str(Path(__file__).parent))
# Workers start by spawn (fork is unsafe once autograd has run in this process) and are found
# by this module's import name, tests.parallel.<file>: the repository root must be importable
# in the children, which inherit sys.path.
sys.path.insert(0, str(Path(__file__).parents[2]))
from parallel_fp8_weight import (  # noqa: E402
    FP8GatherWeight,
    dequantize_rows,
    fp8_all_gather_hook,
    quantize_rows,
)
from parallel_launch import free_port  # noqa: E402
from parallel_tiny_model import (  # noqa: E402
    batches,
    make_model,
    make_optimizer,
    train_single_process,
)

FP32 = {"rtol": 1e-4, "atol": 1e-5}


def _full_params(model, meshes) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor().detach()
        if ".experts." in name and meshes.layout.ep > 1:
            parts = [torch.empty_like(full) for _ in range(meshes.layout.ep)]
            dist.all_gather(parts, full, group=meshes.group("ep"))
            full = torch.cat(parts)
        out[name] = full
    return out


def _worker(rank, world, port, layouts, result_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for i, kwargs in enumerate(layouts):
            layout = MeshLayout(world, **kwargs)
            meshes = build_meshes(layout, device_type="cpu")
            assert len(group_ranks(meshes.expert, "ep")) == layout.ep
            model = apply_dense_parallel(
                make_model(),
                meshes,
                config=DenseParallelConfig(param_dtype=None, reduce_dtype=None),
            )
            opt = make_optimizer(model)
            losses = []
            for x, y in batches(world):
                xr, yr = x.chunk(world)[rank], y.chunk(world)[rank]
                loss = torch.nn.functional.mse_loss(model(xr), yr)
                loss.backward()
                opt.step()
                opt.zero_grad()
                global_loss = loss.detach().clone()
                dist.all_reduce(global_loss)
                losses.append(global_loss.item() / world)
            params = _full_params(model, meshes)
            if rank == 0:
                torch.save(
                    {"losses": losses, "params": params}, os.path.join(result_dir, f"{i}.pt")
                )
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _fp8_worker(rank, world, port):
    """Weights all-gathered as row-wise FP8 through ``all_gather_hook`` give the forward of the
    FP8-rounded weights, and training steps run."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        meshes = build_meshes(MeshLayout(world, 1, world, ep=world), device_type="cpu")
        rounded = make_model()
        with torch.no_grad():
            for block in rounded.layers:
                for m in block.modules():
                    if isinstance(m, torch.nn.Linear):
                        m.weight.copy_(dequantize_rows(*quantize_rows(m.weight), torch.float32))
        config = DenseParallelConfig(
            param_dtype=None, reduce_dtype=None, all_gather_hook=fp8_all_gather_hook
        )
        model = apply_dense_parallel(make_model(), meshes, config=config)
        x, y = (t.chunk(world)[rank] for t in batches(world)[0])
        FP8GatherWeight.gathers = 0
        out = model(x)
        assert FP8GatherWeight.gathers == 3  # the two dense blocks and the MoE router
        torch.testing.assert_close(out, rounded(x), **FP32)
        opt = make_optimizer(model)
        for _ in range(2):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert isinstance(model.layers[0].linear.weight.to_local(), FP8GatherWeight)
    finally:
        dist.destroy_process_group()


def test_two_processes_fp8_all_gather_through_the_hook():
    mp.start_processes(_fp8_worker, args=(2, free_port()), nprocs=2, start_method="spawn")


def _run(world, layouts, tmp_path):
    mp.start_processes(
        _worker,
        args=(world, free_port(), layouts, str(tmp_path)),
        nprocs=world,
        start_method="spawn",
    )
    expected_losses, expected_params = train_single_process(world)
    for i, kwargs in enumerate(layouts):
        got = torch.load(tmp_path / f"{i}.pt")
        torch.testing.assert_close(got["losses"], expected_losses, **FP32, msg=f"losses, {kwargs}")
        assert got["params"].keys() == expected_params.keys()
        for name, value in expected_params.items():
            torch.testing.assert_close(got["params"][name], value, **FP32, msg=f"{name}, {kwargs}")
        assert expected_losses[-1] < expected_losses[0]  # the model trains


def test_two_processes_fsdp_with_expert_parallelism(tmp_path):
    _run(2, [dict(dp_replicate=1, dp_shard=2, ep=2, sparse_replicas=2)], tmp_path)


@pytest.mark.slow
def test_four_processes_hsdp_with_expert_parallelism(tmp_path):
    _run(
        4,
        [
            dict(
                dp_replicate=2, dp_shard=2, ep=2, sparse_replicas=2
            ),  # HSDP 2x2, EP inside the shard group
            dict(
                dp_replicate=1, dp_shard=4, ep=2, sparse_replicas=4
            ),  # experts also FSDP-sharded (edp 2)
        ],
        tmp_path,
    )

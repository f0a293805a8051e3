"""Expert parallelism over 2 gloo processes with jagged token counts: each rank passes a
different number of tokens (all within the shared ``max_tokens_per_rank``), and every rank's
output and input gradient, the router's gradient summed over the ranks and the experts'
gradients gathered over the expert-parallel group equal one process running the loop reference
on each rank's tokens. fp64, so they agree to round-off. Processes are forked from the test
process (torch already imported), one intra-op thread each."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gem_parallel.moe import MoE, MoEConfig, moe_reference

sys.path.insert(0, str(Path(__file__).parent))
# Workers start by spawn (fork is unsafe once autograd has run in this process) and are found
# by this module's import name, tests.parallel.<file>: the repository root must be importable
# in the children, which inherit sys.path.
sys.path.insert(0, str(Path(__file__).parents[2]))
from parallel_launch import free_port  # noqa: E402

WORLD, D_MODEL, D_HIDDEN, EXPERTS, TOP_K, BOUND = 2, 8, 12, 4, 2, 11
TOKENS = (3, 11)  # different on each rank; the second sits exactly at the bound


def _config(capacity_factor):
    return MoEConfig(
        D_MODEL, D_HIDDEN, EXPERTS, top_k=TOP_K, capacity_factor=capacity_factor,
        max_tokens_per_rank=BOUND,
    )  # fmt: skip


def _layer(capacity_factor) -> MoE:
    torch.manual_seed(0)
    return MoE(_config(capacity_factor)).double()


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens (scaled so that several experts get used) and output gradient."""
    g = torch.Generator().manual_seed(100 + rank)
    x = 3 * torch.randn(TOKENS[rank], D_MODEL, dtype=torch.float64, generator=g)
    return x, torch.randn(TOKENS[rank], D_MODEL, dtype=torch.float64, generator=g)


def _single_process(capacity_factor) -> dict[str, object]:
    layer = _layer(capacity_factor)
    capacity = None if capacity_factor is None else layer.config.capacity(BOUND)
    outs, x_grads = [], []
    for rank in range(WORLD):
        x, grad = _data(rank)
        x.requires_grad_(True)
        out = moe_reference(
            x, layer.router.weight, layer.experts.w_in, layer.experts.w_out,
            top_k=TOP_K, capacity=capacity,
        )  # fmt: skip
        out.backward(grad)
        outs.append(out.detach())
        x_grads.append(x.grad)
    return {
        "out": outs,
        "x_grad": x_grads,
        "router": layer.router.weight.grad,
        "w_in": layer.experts.w_in.grad,
        "w_out": layer.experts.w_out.grad,
    }


def _gather_experts(grad: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(grad) for _ in range(WORLD)]
    dist.all_gather(parts, grad.contiguous())
    return torch.cat(parts)


def _worker(rank, port, capacity_factors, result_dir):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for i, capacity_factor in enumerate(capacity_factors):
            layer = _layer(capacity_factor)
            layer.shard_experts(dist.group.WORLD)
            x, grad = _data(rank)
            x.requires_grad_(True)
            out = layer(x)
            out.backward(grad)
            router = layer.router.weight.grad.clone()
            dist.all_reduce(router)  # each rank holds its own tokens' share
            dropped = layer.dropped_assignments.clone()
            dist.all_reduce(dropped)
            # the layer scales its experts' gradients by 1/ep for a data-parallel average
            w_in, w_out = (WORLD * _gather_experts(p.grad) for p in layer.experts.parameters())
            outs = [None] * WORLD
            dist.all_gather_object(outs, (out.detach(), x.grad))
            if rank == 0:
                result = {
                    "out": [o for o, _ in outs], "x_grad": [g for _, g in outs],
                    "router": router, "w_in": w_in, "w_out": w_out, "dropped": int(dropped),
                }  # fmt: skip
                torch.save(result, os.path.join(result_dir, f"{i}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _over_bound_worker(rank, port):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        layer = _layer(None)
        layer.shard_experts(dist.group.WORLD)
        if rank == 1:  # the check is on the host, before any exchange: no rank hangs
            with pytest.raises(ValueError, match=f"{BOUND + 1} tokens but max_tokens_per_rank="):
                layer(torch.zeros(BOUND + 1, D_MODEL, dtype=torch.float64))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_token_counts_match_the_reference(tmp_path):
    capacity_factors = [None, 0.5]  # no drops; drops (capacity ceil(0.5·11·2/4) = 3)
    mp.start_processes(
        _worker,
        args=(free_port(), capacity_factors, str(tmp_path)),
        nprocs=WORLD,
        start_method="spawn",
    )
    for i, capacity_factor in enumerate(capacity_factors):
        got, expected = torch.load(tmp_path / f"{i}.pt"), _single_process(capacity_factor)
        assert [o.shape[0] for o in got["out"]] == list(TOKENS)
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, msg=f"{key}, factor {capacity_factor}")
        assert (got["dropped"] > 0) == (capacity_factor is not None)


def test_a_rank_over_the_token_bound_is_named():
    mp.start_processes(_over_bound_worker, args=(free_port(),), nprocs=WORLD, start_method="spawn")

"""FP8 all-gather under FSDP2, two gloo processes on the CPU: the gathered weight equals
quantize-after-gather bit for bit, forward and backward run, the optimizer updates the shard.

The file is also the launcher (``python test_fsdp_fp8.py``): spawned workers must import it by
path, so the test runs it in a subprocess.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from gem_lowprec import to_mx
        from gem_lowprec.fsdp import FP8AllGatherWeight, enable_fp8_all_gather
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)  # same full weights on every rank
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
        full = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
        assert enable_fp8_all_gather(model, keep_gathered=True) == ["0", "2"]
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        local = model[0].weight.to_local()
        assert isinstance(local, FP8AllGatherWeight) and local.shape == (64, 64)

        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        y = model(x)
        checks = {}
        for i, layer in ((0, model[0]), (1, model[2])):
            gathered = layer.weight.to_local().gather_log.last
            expected = to_mx(full[i], axis=1)
            checks[f"bytes{i}"] = torch.equal(
                gathered.data.view(torch.uint8), expected.data.view(torch.uint8)
            ) and torch.equal(gathered.scale, expected.scale)
        w0, w2 = (to_mx(w, axis=1).dequantize() for w in full)
        y_ref = nn.functional.linear(
            torch.relu(nn.functional.linear(x, w0, model[0].bias.full_tensor())),
            w2,
            model[2].bias.full_tensor(),
        )
        checks["forward"] = torch.equal(y, y_ref)
        y.sum().backward()
        grad = model[0].weight.grad
        checks["grad"] = grad is not None and tuple(grad.shape) == (128, 64)
        before = model[0].weight.to_local()._tensor.clone()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        checks["update"] = not torch.equal(before, model[0].weight.to_local()._tensor)
        assert all(checks.values()), (rank, checks)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads can abort it)


@pytest.mark.slow
def test_fp8_all_gather_two_gloo_ranks():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__))], capture_output=True, text=True, timeout=200, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert f"all {WORLD} ranks passed" in proc.stdout


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD)
    print(f"all {WORLD} ranks passed")

"""Single-process tests of the collectives: the engine policy, argument checks, one-rank groups,
and (on a GPU) the copy-engine path through symmetric memory on one device.

The 4-rank byte-for-byte comparison with torch.distributed lives in
``test_collectives_distributed.py``.
"""

import os

import pytest
import torch
import torch.distributed as dist
from gem_parallel import collectives
from gem_parallel.collectives import policy


@pytest.fixture(scope="module")
def one_rank_world():
    """A one-rank process group (gloo for CPU tensors, NCCL for CUDA ones where present)."""
    created = not dist.is_initialized()
    if created:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def test_policy_thresholds(monkeypatch):
    monkeypatch.setattr(policy, "copy_engine_supported", lambda device, group: (True, ""))
    pol = collectives.EnginePolicy(copy_engine_min_bytes_overlapped=1024)
    pick = lambda engine, nbytes, overlap, p=pol: policy.choose_engine(
        engine, nbytes=nbytes, device=torch.device("cuda"), group=None, overlap=overlap, policy=p
    )
    assert pick("auto", 1024, True) == "copy_engine"
    assert pick("auto", 1023, True) == "sm"
    assert pick("auto", 1 << 40, False) == "sm"  # exposed collectives stay on the process group
    exposed = collectives.EnginePolicy(copy_engine_min_bytes_exposed=4096)
    assert pick("auto", 4096, False, exposed) == "copy_engine"
    assert pick("sm", 1 << 40, True) == "sm"
    assert pick("copy_engine", 1, False) == "copy_engine"


def test_policy_refuses_copy_engine_where_it_cannot_run(one_rank_world):
    cpu = torch.device("cpu")
    ok, why = collectives.copy_engine_supported(cpu, dist.group.WORLD)
    assert not ok and "CUDA" in why
    pick = lambda engine: policy.choose_engine(
        engine, nbytes=1 << 30, device=cpu, group=dist.group.WORLD, overlap=True
    )
    assert pick("auto") == "sm"
    with pytest.raises(ValueError, match="engine='copy_engine' cannot run here.*CUDA"):
        pick("copy_engine")
    with pytest.raises(ValueError, match="engine must be one of"):
        pick("nvls")
    with pytest.raises(ValueError, match="copy_engine_min_bytes_overlapped must be >= 0"):
        collectives.EnginePolicy(copy_engine_min_bytes_overlapped=-1)


def test_arguments_are_checked(one_rank_world):
    x = torch.arange(6.0).view(3, 2)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        collectives.all_gather([1, 2])
    with pytest.raises(ValueError, match="at least one dimension"):
        collectives.all_gather(torch.tensor(1.0))
    with pytest.raises(ValueError, match="op must be one of"):
        collectives.reduce_scatter(x, op="max")
    with pytest.raises(TypeError, match="floating-point"):
        collectives.reduce_scatter(torch.arange(4), op="avg")
    with pytest.raises(ValueError, match="one entry per rank"):
        collectives.all_to_all(x, input_split_sizes=[1, 2])
    with pytest.raises(ValueError, match="sums to 2 but x has 3 rows"):
        collectives.all_to_all(x, input_split_sizes=[2])
    with pytest.raises(ValueError, match="without input_split_sizes"):
        collectives.all_to_all(x, output_split_sizes=[3])


def test_one_rank_collectives_return_their_input(one_rank_world):
    x = torch.randn(4, 3)
    assert torch.equal(collectives.all_gather(x), x)
    assert torch.equal(collectives.reduce_scatter(x), x)
    assert torch.equal(collectives.reduce_scatter(x, op="avg"), x)
    assert torch.equal(collectives.all_to_all(x, input_split_sizes=[4]), x)
    out, work = collectives.all_gather(x, async_op=True)
    work.wait()
    assert torch.equal(out, x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_engine_on_one_gpu_matches_process_group(one_rank_world, dtype):
    """Symmetric memory on one device: allocation, rendezvous, barriers and copies all run."""
    group = dist.group.WORLD
    ok, why = collectives.copy_engine_supported(torch.device("cuda"), group)
    assert ok, why
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 33, device="cuda", generator=gen).to(dtype)
    for engine in ("copy_engine", "sm"):
        assert torch.equal(collectives.all_gather(x, engine=engine), x)
        out, work = collectives.all_gather(x, engine=engine, async_op=True)
        work.wait()
        assert torch.equal(out, x)
        assert torch.equal(collectives.reduce_scatter(x, engine=engine), x)
        assert torch.equal(collectives.reduce_scatter(x, engine=engine, op="avg"), x)
        assert torch.equal(collectives.all_to_all(x, engine=engine), x)
        assert torch.equal(collectives.all_to_all(x, input_split_sizes=[64], engine=engine), x)
    # a second, larger call grows the workspace (a new rendezvous) and still agrees
    big = torch.randn(1 << 20, device="cuda", generator=gen).to(dtype)
    assert torch.equal(collectives.all_gather(big, engine="copy_engine"), big)
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


@pytest.mark.gpu
def test_fsdp_hook_on_one_gpu_matches_default_all_gather(one_rank_world):
    from torch.distributed.fsdp import fully_shard

    results = []
    for engine in (None, "copy_engine"):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        m = m.cuda()
        fully_shard(m[0])
        fully_shard(m[2])
        fully_shard(m)
        hook = collectives.install_fsdp_all_gather(m, engine=engine) if engine else None
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        torch.manual_seed(1)
        for _ in range(3):
            m(torch.randn(16, 32, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.full_tensor().detach().clone() for p in m.parameters()])
        if hook is not None:
            assert hook.calls["copy_engine"] > 0 and hook.calls["sm"] == 0
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_install_fsdp_all_gather_needs_an_fsdp_module():
    with pytest.raises(ValueError, match="no FSDP2 module"):
        collectives.install_fsdp_all_gather(torch.nn.Linear(2, 2))


def test_overlap_benchmark_smoke_runs():
    import subprocess
    import sys
    from pathlib import Path

    script = (
        Path(__file__).resolve().parents[2] / "benchmarks/parallel/bench_copy_engine_overlap.py"
    )
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "smoke (CPU, gloo, one rank)" in proc.stdout

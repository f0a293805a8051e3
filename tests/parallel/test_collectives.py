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


def test_policy_thresholds():
    """The choice ``engine="auto"`` makes where the copy engines can run."""
    pol = collectives.EnginePolicy(copy_engine_min_bytes_overlapped=1024)
    assert pol.engine_for(1024, overlap=True) == "copy_engine"
    assert pol.engine_for(1023, overlap=True) == "sm"
    assert pol.engine_for(1 << 40, overlap=False) == "sm"  # exposed ones stay on the group
    exposed = collectives.EnginePolicy(copy_engine_min_bytes_exposed=4096)
    assert exposed.engine_for(4096, overlap=False) == "copy_engine"
    assert exposed.engine_for(4095, overlap=False) == "sm"


def test_policy_refuses_copy_engine_where_it_cannot_run(one_rank_world):
    cpu = torch.device("cpu")
    ok, why = collectives.copy_engine_supported(cpu, dist.group.WORLD)
    assert not ok and "CUDA" in why
    pick = lambda engine: policy.choose_engine(
        engine,
        nbytes=1 << 30,
        device=cpu,
        group=dist.group.WORLD,
        overlap=True,
        engines=collectives.CopyEngines(),
    )
    assert pick("auto") == "sm"
    assert pick("sm") == "sm"
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
    cuda = torch.device("cuda")
    ok, why = collectives.copy_engine_supported(cuda, group)
    assert not ok and "engines=" in why  # nowhere to keep the workspace
    engines = collectives.CopyEngines()
    ok, why = collectives.copy_engine_supported(cuda, group, engines=engines)
    assert ok, why
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 33, device="cuda", generator=gen).to(dtype)
    with pytest.raises(ValueError, match="engines="):
        collectives.all_gather(x, engine="copy_engine")
    for engine in ("copy_engine", "sm"):
        kw = {"engine": engine, "engines": engines}
        assert torch.equal(collectives.all_gather(x, **kw), x)
        out, work = collectives.all_gather(x, async_op=True, **kw)
        work.wait()
        assert torch.equal(out, x)
        assert torch.equal(collectives.reduce_scatter(x, **kw), x)
        assert torch.equal(collectives.reduce_scatter(x, op="avg", **kw), x)
        assert torch.equal(collectives.all_to_all(x, **kw), x)
        assert torch.equal(collectives.all_to_all(x, input_split_sizes=[64], **kw), x)
    # a second, larger call grows the workspace (a new rendezvous) and still agrees
    big = torch.randn(1 << 20, device="cuda", generator=gen).to(dtype)
    assert torch.equal(collectives.all_gather(big, engine="copy_engine", engines=engines), big)
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


@pytest.mark.parametrize(
    "device,engine",
    [("cpu", "auto"), pytest.param("cuda", "copy_engine", marks=pytest.mark.gpu)],
)
def test_fsdp_hook_gathers_in_place_like_fsdp_calls_it(one_rank_world, device, engine):
    """FSDP2 calls the hook with ``input`` a view of this rank's chunk of ``output`` (and skips
    it entirely on one rank, so the training check needs several ranks: see
    test_collectives_distributed.py). Here the call itself, as FSDP makes it."""
    hook = collectives.FSDPAllGather(engine=engine)
    output = hook.allocate((12,), dtype=torch.bfloat16, device=torch.device(device))
    output.copy_(torch.arange(12, dtype=torch.bfloat16))
    expected = output.clone()
    work = hook(output_tensor=output, input_tensor=output[0:12], group=dist.group.WORLD)
    if work is not None:
        work.wait()
    assert torch.equal(output, expected)
    assert hook.calls["copy_engine" if engine == "copy_engine" else "sm"] == 1


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

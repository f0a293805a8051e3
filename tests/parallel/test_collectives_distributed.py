"""The collectives over 4 ranks against torch.distributed's own, byte for byte.

One launch of 4 processes (gloo on the CPU; NCCL with ``--device cuda``) checks, on the world
group and on a mesh's sub-groups: all-gather, reduce-scatter (sum and avg) and all-to-all (equal,
uneven and empty splits, with and without given output splits), synchronous and asynchronous,
against ``torch.distributed.all_gather`` / ``all_reduce`` / ``all_to_all`` (the list forms, a
different code path from the tensor forms the package uses). With CUDA every engine is checked,
the copy engines included, and a small model under FSDP2 with ``install_fsdp_all_gather`` trains
to the same parameters as without it.

The file is also the launcher: ``python test_collectives_distributed.py --device cpu|cuda``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# The launcher (this file run as a script) needs no torch; the workers and pytest do. Spawned
# workers import this file as "__mp_main__", so they take the import below.
if __name__ != "__main__":
    import torch

WORLD = 4


def _run(device: str, world: int, timeout: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "--device", device, "--world", str(world)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert f"all {world} ranks passed" in proc.stdout, proc.stdout[-4000:]


def test_collectives_match_torch_distributed_on_gloo():
    _run("cpu", WORLD, timeout=240)


@pytest.mark.multigpu
def test_collectives_every_engine_match_torch_distributed_on_gpus():
    _run("cuda", min(WORLD, torch.cuda.device_count()), timeout=300)


# ---------------------------------------------------------------------------------------------
# the workers


def _assert_close(actual, expected, *, rtol=1.3e-6, atol=1e-5, msg=""):
    """torch.testing.assert_close's float32 rule, without its first-call import cost (~10 s)."""
    assert actual.shape == expected.shape, (
        f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    bad = (a - e).abs() > atol + rtol * e.abs()
    assert not bool(bad.any()), (
        f"{msg}: {int(bad.sum())} elements differ, max |diff| {float((a - e).abs().max())}"
    )


def _data(seed: int, shape, dtype, device):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        # integer-valued floats: every summation order gives the same bits
        return torch.randint(-64, 64, shape, generator=gen).to(dtype).to(device)
    return torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=dtype).to(device)


def _check_collectives(group, engines, device, copy_engines):
    import torch.distributed as dist
    from gem_parallel import collectives

    world, rank = group.size(), group.rank()
    ce = {"engines": copy_engines}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for engine in engines:
            x = _data(rank, (3, 5), dtype, device)
            expected = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(expected, x, group=group)
            got = collectives.all_gather(x, group=group, engine=engine, **ce)
            assert torch.equal(got, torch.cat(expected)), f"all_gather {engine} {dtype}"
            got, work = collectives.all_gather(x, group=group, engine=engine, async_op=True, **ce)
            work.wait()
            assert torch.equal(got, torch.cat(expected)), f"async all_gather {engine} {dtype}"

            y = _data(10 + rank, (2 * world, 3), dtype, device)
            summed = y.clone()
            dist.all_reduce(summed, group=group)
            mine = summed.chunk(world)[rank]
            got = collectives.reduce_scatter(y, group=group, engine=engine, **ce)
            assert torch.equal(got, mine), f"reduce_scatter {engine} {dtype}"
            if dtype.is_floating_point:
                got, work = collectives.reduce_scatter(
                    y, group=group, engine=engine, op="avg", async_op=True, **ce
                )
                work.wait()
                _assert_close(got, mine / world, msg=f"avg {engine} {dtype}")

            # uneven splits, empty ones included: rank s sends (s + d) % 3 rows to rank d. gloo's
            # list all_to_all needs equal sizes, so the expected rows are rebuilt from every rank's
            # (seeded) input, and torch.distributed's all_to_all_single must agree too.
            def rows_of(s, dtype=dtype):
                sends_s = [(s + d) % 3 for d in range(world)]
                return _data(20 + s, (sum(sends_s), 4), dtype, device).split(sends_s)

            sends = [(rank + d) % 3 for d in range(world)]
            recvs = [(s + rank) % 3 for s in range(world)]
            z = _data(20 + rank, (sum(sends), 4), dtype, device)
            expected = [rows_of(s)[rank] for s in range(world)]
            reference = z.new_empty((sum(recvs), 4))
            dist.all_to_all_single(reference, z, recvs, sends, group=group)
            assert torch.equal(reference, torch.cat(expected)), (
                "torch.distributed all_to_all_single"
            )
            for out_splits in (recvs, None):
                got = collectives.all_to_all(
                    z,
                    group=group,
                    input_split_sizes=sends,
                    output_split_sizes=out_splits,
                    engine=engine,
                    **ce,
                )
                assert torch.equal(got, torch.cat(expected)), f"all_to_all {engine} {dtype}"
            w = _data(30 + rank, (2 * world, 2), dtype, device)
            expected = [torch.empty_like(c) for c in w.chunk(world)]
            dist.all_to_all(expected, list(w.chunk(world)), group=group)
            got = collectives.all_to_all(w, group=group, engine=engine, **ce)
            assert torch.equal(got, torch.cat(expected)), f"equal all_to_all {engine} {dtype}"


def _check_fsdp_hook(device, group):
    """FSDP2 over ``group`` with the hook trains to the same bits as with its own all-gather."""
    import torch.distributed as dist
    from gem_parallel import collectives
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        ).to(device)

    results = []
    engine_used = "auto" if device.type == "cpu" else "copy_engine"
    for engine in (None, engine_used):
        m = model()
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        hook = collectives.install_fsdp_all_gather(m, engine=engine) if engine else None
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        torch.manual_seed(1 + dist.get_rank())
        for _ in range(2):
            loss = m(torch.randn(3, 8, device=device)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        results.append([p.full_tensor().detach().clone() for p in m.parameters()])
        if hook is not None:
            assert sum(hook.calls.values()) > 0, "the custom all-gather was never called"
    for a, b in zip(*results, strict=True):
        _assert_close(a, b, rtol=0, atol=0)


def _worker(rank: int, world: int, port: int, device_type: str) -> None:
    import torch.distributed as dist
    from gem_parallel import collectives
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    engines = ("auto", "sm", "copy_engine") if device_type == "cuda" else ("auto", "sm")
    copy_engines = collectives.CopyEngines()  # one per process, shared by every group
    _check_collectives(dist.group.WORLD, engines, device, copy_engines)
    if world % 2 == 0 and world > 2:
        mesh = init_device_mesh(device_type, (2, world // 2), mesh_dim_names=("a", "b"))
        _check_collectives(mesh.get_group(0), engines, device, copy_engines)
        _check_collectives(mesh.get_group(1), engines, device, copy_engines)
    if device_type == "cpu":
        x = torch.ones(4)
        try:
            collectives.all_gather(x, engine="copy_engine", engines=copy_engines)
        except ValueError as exc:
            assert "copy_engine" in str(exc) and "CUDA" in str(exc), str(exc)
        else:
            raise AssertionError("engine='copy_engine' on a CPU tensor did not raise")
    # FSDP2's first use costs about 9 s of CPU per process: on the CPU's two cores, train on a
    # two-rank sub-group only (every rank must create it; ranks 2 and 3 then stand by).
    pair = dist.new_group([0, 1]) if device_type == "cpu" else dist.group.WORLD
    if device_type == "cuda" or rank < 2:
        _check_fsdp_hook(device, pair)
    from parallel_launch import finish_rank  # the script's folder is on sys.path

    finish_rank()


if __name__ == "__main__":
    import argparse

    from parallel_launch import free_port, launch_spawned  # the script's folder is on sys.path

    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--world", type=int, default=WORLD)
    args = parser.parse_args()
    failed = launch_spawned(_worker, args.world, free_port(), args.device)
    if failed:
        sys.exit(f"a rank failed (exit code {failed})")
    print(f"all {args.world} ranks passed")

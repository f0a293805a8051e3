"""Sharded embeddings over 4 ranks (2 replicas x 2 model parallel) against the unsharded module.

One launch of 4 processes runs every case (process start is the expensive part): for pooling
sum, mean and none (jagged), fully sharded and 2D, with and without prefetch, each rank's forward
equals the unsharded module on its own batch, and each rank's gradient shard equals the matching
rows of the unsharded module's gradient of the sum of every rank's loss. It also checks the memory
claim: per rank, fully sharded 2D stores 1/replicas of 2D's parameters, and the gathered blocks alive
at any time never exceed the prefetch buffer (two blocks).

The file is also the launcher: ``python test_embeddings_distributed.py --device cpu|cuda``.
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

WORLD, REPLICAS = 4, 2


def _run(device: str, world: int, timeout: int, backend: str = "native") -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__)),
            "--device",
            device,
            "--world",
            str(world),
            "--backend",
            backend,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert f"all {world} ranks passed" in proc.stdout, proc.stdout[-4000:]


def test_sharded_embeddings_match_unsharded_on_gloo_2x2():
    _run("cpu", WORLD, timeout=240)


@pytest.mark.multigpu
def test_sharded_embeddings_match_unsharded_on_gpus():
    if torch.cuda.device_count() < 4:
        pytest.skip(f"needs 4 GPUs for the 2 x 2 mesh; {torch.cuda.device_count()} present")
    _run("cuda", 4, timeout=300)


@pytest.mark.multigpu
def test_torchrec_backend_matches_unsharded_on_gpus():
    """torchrec's DMPCollection (fully sharded, row-wise) against the unsharded tables: forward
    only, since torchrec applies its fused optimizer inside backward and leaves no gradients."""
    pytest.importorskip("torchrec")
    if torch.cuda.device_count() < 4:
        pytest.skip(f"needs 4 GPUs for the 2 x 2 mesh; {torch.cuda.device_count()} present")
    _run("cuda", 4, timeout=300, backend="torchrec")


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


def _batch(tables, seed: int, *, device="cpu", batch: int = 3, weighted: bool = False):
    from gem_parallel.embeddings import KeyedJagged

    gen = torch.Generator().manual_seed(seed)
    keys, values, lengths, weights = [], [], [], []
    for t in tables:
        for f in t.feature_names:
            lens = torch.randint(0, 5, (batch,), generator=gen)
            keys.append(f)
            lengths.append(lens)
            values.append(torch.randint(0, t.num_embeddings, (int(lens.sum()),), generator=gen))
            weights.append(torch.rand(int(lens.sum()), generator=gen))
    return KeyedJagged(
        keys,
        torch.cat(values).to(device),
        torch.cat(lengths).to(device),
        torch.cat(weights).to(device) if weighted else None,
    )


def _loss(out, seed: int):
    """A fixed random linear function of the output, so every output element gets a gradient."""
    gen = torch.Generator().manual_seed(1000 + seed)
    tensors = (
        [out.values]
        if hasattr(out, "values") and torch.is_tensor(out.values)
        else [out[k].values for k in sorted(out)]
    )
    return sum(
        (t * torch.randn(t.shape, generator=gen).to(t.device, t.dtype)).sum() for t in tensors
    )


def _outputs(out):
    if hasattr(out, "keys") and not isinstance(out, dict):
        return {"pooled": out.values}
    return {k: v.values for k, v in out.items()} | {
        f"{k}.offsets": v.offsets for k, v in out.items()
    }


def _wait_released(sharded, timeout_s: float = 5.0) -> None:
    """Gathered blocks are freed once the forward pass is over. gloo's worker thread drops its
    reference to a finished collective's output a moment after ``wait()`` returns, so poll."""
    import time

    deadline = time.monotonic() + timeout_s
    while sharded.live_gathered.now and time.monotonic() < deadline:
        time.sleep(0.001)
    assert sharded.live_gathered.now == 0, "gathered blocks outlived the forward pass"


def _check_case(mesh, rank, device, *, tables, pooling, fully_sharded, prefetch, weighted):
    from gem_parallel.embeddings import EmbeddingTables, ShardingConfig, shard_embeddings

    world = WORLD
    ref = EmbeddingTables(
        tables, pooling=pooling, generator=torch.Generator().manual_seed(7), device=device
    )
    sharded = shard_embeddings(
        ref,
        mesh=mesh,
        config=ShardingConfig(fully_sharded=fully_sharded, prefetch=prefetch, reduce="sum"),
    )
    batches = [_batch(tables, seed, device=device, weighted=weighted) for seed in range(world)]
    out = sharded(batches[rank])
    if fully_sharded:
        _wait_released(sharded)
        assert 0 < sharded.live_gathered.peak <= sharded.prefetch_buffer_bytes()
    _loss(out, rank).backward()

    expected = ref(batches[rank])
    for name, value in _outputs(expected).items():
        _assert_close(_outputs(out)[name], value, msg=f"forward {name}")
    total = sum(_loss(ref(b), seed) for seed, b in enumerate(batches))
    total.backward()
    for t in tables:
        start, rows = sharded.shard_range(t.name)
        grad = sharded.shards[t.name].grad
        _assert_close(
            grad[:rows], ref.weights[t.name].grad[start : start + rows], msg=f"grad {t.name}"
        )
        assert not grad[rows:].any(), "padding rows received a gradient"
    for name, full in sharded.full_weights().items():
        _assert_close(full, ref.weights[name].detach(), rtol=0, atol=0)
    return sharded


def _check_memory(mesh, device):
    from gem_parallel.embeddings import (
        EmbeddingTables,
        ShardingConfig,
        TableConfig,
        shard_embeddings,
    )

    tables = [TableConfig(f"m{i}", 64, 16, (f"m{i}",)) for i in range(3)]
    ref = EmbeddingTables(tables, generator=torch.Generator().manual_seed(3), device=device)
    two_d = shard_embeddings(ref, mesh=mesh, config=ShardingConfig(fully_sharded=False))
    full = shard_embeddings(ref, mesh=mesh, config=ShardingConfig(fully_sharded=True))
    kjt = _batch(tables, seed=int(mesh.get_rank()), device=device)
    full(kjt)
    _wait_released(full)
    assert full.persistent_bytes() * REPLICAS == two_d.persistent_bytes()
    assert full.live_gathered.peak <= full.prefetch_buffer_bytes()
    per_rank_full = full.persistent_bytes() + full.live_gathered.peak
    assert per_rank_full <= two_d.persistent_bytes() / REPLICAS + full.prefetch_buffer_bytes()


def _check_torchrec(mesh, rank, device):
    from gem_parallel.embeddings import (
        EmbeddingTables,
        ShardingConfig,
        TableConfig,
        shard_embeddings,
    )

    tables = [TableConfig("t0", 64, 8, ("a", "b")), TableConfig("t1", 32, 8, ("c",))]
    for pooling in ("sum", "none"):
        ref = EmbeddingTables(
            tables, pooling=pooling, generator=torch.Generator().manual_seed(7), device=device
        )
        sharded = shard_embeddings(
            ref, backend="torchrec", mesh=mesh, device=device, config=ShardingConfig()
        )
        kjt = _batch(tables, rank, device=device)
        out, expected = _outputs(sharded(kjt)), _outputs(ref(kjt))
        for name, value in expected.items():
            _assert_close(out[name], value, msg=f"torchrec forward {pooling} {name}")


def _worker(rank: int, world: int, port: int, device_type: str, backend_name: str) -> None:
    import torch.distributed as dist
    from gem_parallel.embeddings import TableConfig
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh(
        device_type, (REPLICAS, world // REPLICAS), mesh_dim_names=("replicate", "model_parallel")
    )
    if backend_name == "torchrec":
        _check_torchrec(mesh, rank, device)
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)
    # t0 has 37 rows: blocks of 19 and 18, shards of 10 rows with padding; t1 divides evenly.
    tables = [TableConfig("t0", 37, 8, ("a", "b")), TableConfig("t1", 64, 4, ("c",))]
    cases = [
        ("sum", True, True, False),
        ("sum", False, True, True),
        ("mean", True, False, False),
        ("none", True, True, False),
        ("none", False, True, False),
    ]
    for pooling, fully_sharded, prefetch, weighted in cases:
        _check_case(
            mesh,
            rank,
            device,
            tables=tables,
            pooling=pooling,
            fully_sharded=fully_sharded,
            prefetch=prefetch,
            weighted=weighted,
        )
    _check_memory(mesh, device)
    # the planner's sparse mesh may put model parallelism first: dims are found by name
    from gem_parallel.embeddings import resolve_groups

    mp_first = init_device_mesh(
        device_type, (world // REPLICAS, REPLICAS), mesh_dim_names=("sparse_mp", "sparse_replica")
    )
    mp_group, replica_group = resolve_groups(mp_first)
    ranks = dist.get_process_group_ranks
    assert ranks(mp_group) == ranks(mp_first.get_group("sparse_mp"))
    assert ranks(replica_group) == ranks(mp_first.get_group("sparse_replica"))
    _check_case(
        mp_first,
        rank,
        device,
        tables=tables,
        pooling="sum",
        fully_sharded=True,
        prefetch=True,
        weighted=False,
    )
    from parallel_launch import finish_rank  # the script's folder is on sys.path

    finish_rank()


if __name__ == "__main__":
    import argparse

    from parallel_launch import free_port, launch_spawned  # the script's folder is on sys.path

    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--world", type=int, default=WORLD)
    parser.add_argument("--backend", choices=["native", "torchrec"], default="native")
    args = parser.parse_args()
    failed = launch_spawned(_worker, args.world, free_port(), args.device, args.backend)
    if failed:
        sys.exit(f"a rank failed (exit code {failed})")
    print(f"all {args.world} ranks passed")

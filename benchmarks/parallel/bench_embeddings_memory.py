"""Embedding memory per GPU: 2D against fully sharded 2D (native back end), and the step time.

Goal (issue 9): fully sharded 2D uses at least 50% less embedding memory per GPU than 2D.

With several GPUs (one process per GPU, at most 8), the ranks form ``replicas x model_parallel``
(replicas = world / 2 from 4 GPUs on, else 2). Each configuration builds its shards from tables
that stay on the CPU, then runs one forward and backward step of a batch per rank; per GPU it
reports the parameter bytes resident after construction, the peak allocated during the step
(``torch.cuda.max_memory_allocated``), the module's own account of gathered blocks, and the step
time. The peak includes the step's activations and the block gradient before its reduce-scatter,
which both layouts pay alike; the resident parameters are the quantity the goal is about.

One GPU cannot hold replicas of anything, so there the comparison is blocked; ``--smoke`` runs the
same code on the CPU with gloo (two ranks, two replicas) and the module's byte accounting.

Usage: ``python benchmarks/parallel/bench_embeddings_memory.py [--smoke]``.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# (tables, rows, dim, batch per rank, ids per sample) on GPUs and in the smoke run
GPU_SHAPE = (8, 1 << 19, 128, 4096, 20)
SMOKE_SHAPE = (3, 1 << 10, 16, 8, 4)


def _batch(tables, *, batch, ids_per_sample, seed, device):
    from gem_parallel.embeddings import KeyedJagged

    gen = torch.Generator().manual_seed(seed)
    keys, values, lengths = [], [], []
    for t in tables:
        lens = torch.randint(0, 2 * ids_per_sample + 1, (batch,), generator=gen)
        keys.append(t.feature_names[0])
        lengths.append(lens)
        values.append(torch.randint(0, t.num_embeddings, (int(lens.sum()),), generator=gen))
    return KeyedJagged(keys, torch.cat(values).to(device), torch.cat(lengths).to(device))


def _measure(source, mesh, device, *, fully_sharded: bool, kjt) -> dict:
    from gem_parallel.embeddings import ShardingConfig, shard_embeddings

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    module = shard_embeddings(
        source, mesh=mesh, device=device, config=ShardingConfig(fully_sharded=fully_sharded)
    )
    resident = torch.cuda.memory_allocated() - before if cuda else module.persistent_bytes()
    step_s = []
    for _ in range(3):
        module.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        t0 = time.perf_counter()
        out = module(kjt)
        out.values.square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - before if cuda else float("nan")
    return {
        "resident": resident,
        "peak": peak,
        "gathered_peak": module.live_gathered.peak,
        "prefetch_buffer": module.prefetch_buffer_bytes(),
        "step_ms": 1e3 * sorted(step_s)[1],
    }


def _worker(rank: int, world: int, port: int, device_type: str, shape) -> None:
    from gem_parallel.embeddings import EmbeddingTables, TableConfig
    from torch.distributed.device_mesh import init_device_mesh

    n_tables, rows, dim, batch, ids_per_sample = shape
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    replicas = world // 2 if world >= 4 else world
    mesh = init_device_mesh(
        device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "model_parallel")
    )
    tables = [TableConfig(f"t{i}", rows, dim, (f"f{i}",)) for i in range(n_tables)]
    # the full tables stay on the CPU; each rank copies only its slice to its device
    source = EmbeddingTables(tables, generator=torch.Generator().manual_seed(0))
    kjt = _batch(tables, batch=batch, ids_per_sample=ids_per_sample, seed=rank, device=device)
    two_d = _measure(source, mesh, device, fully_sharded=False, kjt=kjt)
    full = _measure(source, mesh, device, fully_sharded=True, kjt=kjt)
    if rank == 0:
        mib = lambda b: b / 2**20
        saved = 100 * (1 - full["resident"] / two_d["resident"])
        common.print_table(
            f"Embedding memory per rank, {replicas} replicas x {world // replicas} model parallel, "
            f"{n_tables} tables x {rows} x {dim} fp32 ({device_type}; "
            f"{common.environment() if cuda else 'cpu'})",
            [
                "layout",
                "resident MiB",
                "step peak MiB",
                "gathered peak MiB",
                "prefetch buffer MiB",
                "step ms",
            ],
            [
                ["2D", mib(two_d["resident"]), mib(two_d["peak"]), 0.0, 0.0, two_d["step_ms"]],
                [
                    "fully sharded 2D",
                    mib(full["resident"]),
                    mib(full["peak"]),
                    mib(full["gathered_peak"]),
                    mib(full["prefetch_buffer"]),
                    full["step_ms"],
                ],
            ],
        )
        print(f"\nresident embedding memory saved by full sharding: {saved:.1f}% (goal >= 50%)")
        common.record(
            "embeddings_memory" if cuda else "embeddings_memory_smoke",
            gpus=world if cuda else 0,
            replicas=replicas,
            saved_pct=saved,
            step_ms_2d=two_d["step_ms"],
            step_ms_fully_sharded=full["step_ms"],
        )
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter teardown: gloo's worker threads, joined while Python finalizes,
    # occasionally abort the process ("terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, two ranks, tiny tables")
    args = parser.parse_args()
    gpus = min(torch.cuda.device_count(), 8) if torch.cuda.is_available() else 0
    if args.smoke or gpus == 0:
        mp.spawn(_worker, args=(2, common.free_port(), "cpu", SMOKE_SHAPE), nprocs=2)
    elif gpus >= 2:
        mp.spawn(_worker, args=(gpus, common.free_port(), "cuda", GPU_SHAPE), nprocs=gpus)
    else:
        print("Embedding memory of 2D vs fully sharded 2D needs >= 2 GPUs (replicas): blocked.")
        common.record("embeddings_memory", result="blocked: 1 GPU")


if __name__ == "__main__":
    main()

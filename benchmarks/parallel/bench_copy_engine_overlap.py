"""A GEMM overlapped with an all-gather: NCCL (SMs) against the copy engines, by message size.

Goal (issue 9): the GEMM slowed by at most 5% while a copy-engine all-gather runs beside it, where
NCCL's costs about 30%; and the message size where the copy engines start to win.

Parts, chosen by what the machine has:

- Several GPUs (one process per GPU, all of this host's, at most 8): for each message size per
  rank, the all-gather alone through NCCL and through the copy engines (time and bus bandwidth),
  then a bf16 GEMM on the compute stream while back-to-back all-gathers run on a side stream long
  enough to cover it; the GEMM's slowdown against the GEMM alone is the headline.
- One GPU (the same principle, no peers): the GEMM overlapped with a device-to-device copy of the
  same bytes done by the copy engine (``cudaMemcpyAsync``) or by an SM kernel pinned to 24 CTAs
  (NCCL's usual footprint); and the copy-engine all-gather on a one-rank group, which runs the whole
  symmetric-memory path (rendezvous, barriers, copies) and shows its fixed cost per call.
- ``--smoke``: tiny sizes on the CPU (gloo, one rank) to catch Python errors.

Usage: ``python benchmarks/parallel/bench_copy_engine_overlap.py [--smoke]``.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SIZES_GPU = [1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26]  # bytes per rank
SIZES_SMOKE = [1 << 10, 1 << 12]


def _gemm(n: int, device):
    a = torch.randn(
        n, n, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    b = torch.randn_like(a)
    return lambda: a @ b


def _overlapped_ms(gemm, comm, *, gemm_iters: int, comm_iters: int) -> float:
    """Time per GEMM on the compute stream while ``comm`` runs ``comm_iters`` times beside it.

    Launches interleave (a few collectives on the side stream, then one GEMM), so the GEMMs never
    wait for the host to finish queuing every collective first.
    """
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    per_gemm = -(-comm_iters // gemm_iters)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        side.wait_stream(main)
        start.record(main)
        for _ in range(gemm_iters):
            with torch.cuda.stream(side):
                for _ in range(per_gemm):
                    comm()
            gemm()
        end.record(main)
        main.wait_stream(side)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / gemm_iters)
    return sorted(times)[len(times) // 2]


@triton.jit
def copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, NUM_CTAS: tl.constexpr):
    # a persistent copy: each of NUM_CTAS programs strides over the buffer in BLOCK-sized tiles
    for start in range(tl.program_id(0) * BLOCK, n, NUM_CTAS * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def _sm_copy(num_ctas: int):
    """A copy kernel on exactly ``num_ctas`` CTAs, like NCCL's SM footprint."""

    def copy(dst, src):
        copy_kernel[(num_ctas,)](src, dst, src.numel(), BLOCK=4096, NUM_CTAS=num_ctas)

    return copy


def _fixed_ms(fn, *, iters: int = 20, warmup: int = 5) -> float:
    """Mean ms of ``fn`` over a fixed count: every rank calls a collective the same number of
    times (``bench_ms`` adapts its count to the measured time, which would differ across ranks)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def single_gpu() -> None:
    from gem_parallel import collectives

    device = torch.device("cuda", torch.cuda.current_device())
    gemm = _gemm(8192, device)
    gemm_ms = common.bench_ms(gemm)
    sm_copy = _sm_copy(24)
    rows = []
    headline = {}
    for nbytes in (1 << 24, 1 << 26, 1 << 28):
        src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        copies = {
            # same-device cudaMemcpyAsync: the driver may run it as a kernel or on a copy engine
            "memcpy D2D": lambda src=src, dst=dst: dst.copy_(src),
            # device to pinned host: always a copy engine (slower link, same principle)
            "memcpy D2H": lambda src=src, host=host: host.copy_(src, non_blocking=True),
            "SM 24 CTAs": lambda src=src, dst=dst: sm_copy(dst, src),
        }
        row = [f"{nbytes >> 20} MiB", gemm_ms]
        for name, fn in copies.items():
            alone = common.bench_ms(fn)
            both = _overlapped_ms(gemm, fn, gemm_iters=20, comm_iters=int(gemm_ms * 20 / alone) + 1)
            slowdown = 100 * (both / gemm_ms - 1)
            row += [alone, slowdown]
            headline[f"gemm_slowdown_{name.replace(' ', '_').lower()}_pct"] = slowdown
        rows.append(row)
    common.print_table(
        f"One GPU: GEMM 8192^3 bf16 beside a copy of the same bytes ({common.environment()})",
        ["copy size", "GEMM ms"]
        + [
            f"{name} {what}"
            for name in ("memcpy D2D", "memcpy D2H", "SM 24 CTAs")
            for what in ("ms", "GEMM slowdown %")
        ],
        rows,
    )

    port = common.free_port()
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, device_id=device
    )
    rows = []
    engines = collectives.CopyEngines()
    for nbytes in SIZES_GPU:
        x = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
        ce = _fixed_ms(lambda x=x: collectives.all_gather(x, engine="copy_engine", engines=engines))
        sm = _fixed_ms(lambda x=x: collectives.all_gather(x, engine="sm"))
        rows.append([f"{nbytes >> 10} KiB", ce * 1e3, sm * 1e3, ce / sm])
    common.print_table(
        "One-rank all-gather (symmetric-memory path end to end; no peers, so no bandwidth)",
        ["bytes/rank", "copy engine us", "NCCL us", "ratio CE/NCCL"],
        rows,
    )
    dist.destroy_process_group()
    print(
        "\nMulti-GPU measurement (GEMM beside a real all-gather, crossover) needs >= 2 GPUs: blocked."
    )
    common.record("copy_engine_overlap_1gpu", **headline, multi_gpu="blocked: 1 GPU")


def _multi_gpu_worker(rank: int, world: int, port: int) -> None:
    from gem_parallel import collectives

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device
    )
    gemm = _gemm(8192, device)
    gemm_ms = common.bench_ms(gemm)
    rows, crossover, at_largest = [], None, {}
    engines = collectives.CopyEngines()
    for nbytes in SIZES_GPU:
        x = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
        fns = {
            e: (lambda x=x, e=e: collectives.all_gather(x, engine=e, engines=engines))
            for e in ("sm", "copy_engine")
        }
        alone = {e: _fixed_ms(fn) for e, fn in fns.items()}
        busbw = {e: nbytes * (world - 1) / (alone[e] * 1e-3) / 1e9 for e in alone}
        slow = {}
        for e, fn in fns.items():
            # every rank must run the same count: take rank 0's estimate
            count = torch.tensor([int(gemm_ms * 20 / alone[e]) + 1], device=device)
            dist.broadcast(count, src=0)
            iters = int(count.item())
            slow[e] = 100 * (
                _overlapped_ms(gemm, fn, gemm_iters=20, comm_iters=iters) / gemm_ms - 1
            )
        if crossover is None and alone["copy_engine"] <= alone["sm"]:
            crossover = nbytes
        rows.append(
            [
                f"{nbytes >> 10} KiB",
                alone["sm"] * 1e3,
                alone["copy_engine"] * 1e3,
                busbw["sm"],
                busbw["copy_engine"],
                slow["sm"],
                slow["copy_engine"],
            ]
        )
        at_largest = {
            "gemm_slowdown_nccl_pct": slow["sm"],
            "gemm_slowdown_ce_pct": slow["copy_engine"],
        }
    if rank == 0:
        common.print_table(
            f"{world} GPUs: all-gather alone and beside a GEMM 8192^3 bf16 ({gemm_ms:.3g} ms alone; "
            f"{common.environment()})",
            [
                "bytes/rank",
                "NCCL us",
                "CE us",
                "NCCL GB/s",
                "CE GB/s",
                "GEMM slowdown NCCL %",
                "GEMM slowdown CE %",
            ],
            rows,
        )
        print(f"\ncopy engines at least as fast as NCCL (alone) from: {crossover} bytes per rank")
        common.record(
            "copy_engine_overlap", gpus=world, crossover_bytes=crossover or -1, **at_largest
        )
    dist.destroy_process_group()


def smoke() -> None:
    from gem_parallel import collectives

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{common.free_port()}", rank=0, world_size=1
    )
    gemm = _gemm(64, torch.device("cpu"))
    gemm_ms = common.bench_ms(gemm)
    rows = []
    engines = collectives.CopyEngines()
    for nbytes in SIZES_SMOKE:
        x = torch.randn(nbytes // 4)
        ms = common.bench_ms(lambda x=x: collectives.all_gather(x, engine="auto", engines=engines))
        rows.append([f"{nbytes} B", gemm_ms, ms * 1e3, float("nan")])
    common.print_table(
        "smoke (CPU, gloo, one rank): Python paths only",
        ["bytes/rank", "GEMM ms", "all-gather us", "copy engine us"],
        rows,
    )
    dist.destroy_process_group()
    common.record("copy_engine_overlap_smoke", ok=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.smoke or not torch.cuda.is_available():
        smoke()
        return
    gpus = min(torch.cuda.device_count(), 8)
    if gpus >= 2:
        import torch.multiprocessing as mp

        mp.spawn(_multi_gpu_worker, args=(gpus, common.free_port()), nprocs=gpus)
    else:
        single_gpu()


if __name__ == "__main__":
    main()

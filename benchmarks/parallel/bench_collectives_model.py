"""The cost model's collective formulas against measured times.

What one GPU allows (the default run, ``python3 benchmarks/parallel/bench_collectives_model.py``):

- Device-to-device copies from 4 KiB to 1 GiB. The cost model's per-tier formula is
  ``time = latency + bytes / bandwidth``; a least-squares fit (relative error) of that shape to the
  measured copies gives the device's latency and bandwidth, and the table shows, size by size,
  how far the fitted line is from what was measured. That checks the *shape* of the model's
  formulas on the one link one GPU has (its HBM), not NVLink's constants.
- NCCL all-gather, reduce-scatter, all-reduce and all-to-all with a world of one rank. They are
  local copies (or nothing), shown against a copy of the same bytes so the overhead per call is
  visible; they say nothing about the network.
- The overlap term. A bf16 GEMM runs while a copy runs on a side stream, once through a copy
  engine (a device-to-pinned-host copy, 64 MiB: DMA, no SM) and once through a Triton copy kernel
  limited to 24 CTAs (what an NCCL collective occupies), 1 GiB. The cost model predicts ``max(c, p + c·s/S)`` with ``s`` = 0 or 24 of the
  device's ``S`` SMs; the table shows measured against predicted.

What needs several GPUs, and is therefore NOT measured by a one-GPU run: every collective with
``n >= 2`` ranks on NVLink, RoCE or across zones, so the goal "each collective within 15% of the
cost model" is unmeasured there. On a host with several GPUs the script, launched plainly, runs
one process per GPU (or run it under ``torchrun --nproc-per-node N``), and
measures the four collectives over all ranks at 1 MiB to 1 GiB and prints measured over modelled
(flat algorithm, default NVLink constants of ``Topology``) for each.

``--smoke`` runs tiny sizes on the CPU with gloo in seconds.
"""

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

if "--smoke" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from gem_parallel.cost_model import CostModel  # noqa: E402
from gem_parallel.topology import Topology  # noqa: E402

# torch >= 2.12 renames all_gather_into_tensor / reduce_scatter_tensor; the GPU image has 2.11.
warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated. Please use")

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def fit_latency_bandwidth(sizes: list[int], ms: list[float]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) minimizing the relative error of ``t = a + M / b``."""
    t = torch.tensor(ms, dtype=torch.float64) * 1e-3
    design = (
        torch.stack([torch.ones_like(t), torch.tensor(sizes, dtype=torch.float64)], 1) / t[:, None]
    )
    coef = torch.linalg.lstsq(design, torch.ones_like(t)[:, None]).solution.squeeze(1)
    latency, per_byte = float(coef[0]), float(coef[1])
    return max(latency, 0.0), 1.0 / per_byte


def copy_table(device, sizes) -> None:
    measured = []
    for nbytes in sizes:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        measured.append(common.bench_ms(lambda d=dst, s=src: d.copy_(s)))
    latency, bandwidth = fit_latency_bandwidth(sizes, measured)
    rows, worst = [], 0.0
    for nbytes, ms in zip(sizes, measured, strict=True):
        model_ms = (latency + nbytes / bandwidth) * 1e3
        err = (model_ms - ms) / ms * 100
        worst = max(worst, abs(err))
        rows.append(
            [f"{nbytes / 2**20:.3f}", ms * 1e3, model_ms * 1e3, err, 2 * nbytes / (ms * 1e-3) / 1e9]
        )
    common.print_table(
        f"device copy vs latency + bytes/bandwidth (fit: {latency * 1e6:.2f} us, "
        f"{bandwidth / 1e9:.0f} GB/s one-way)",
        ["MiB", "measured us", "model us", "model error %", "read+write GB/s"],
        rows,
    )
    common.record(
        "collectives_model:copy",
        fit_latency_us=latency * 1e6,
        fit_bandwidth_GBps=bandwidth / 1e9,
        max_error_pct=worst,
    )


def run_collective(kind, nbytes, group, device):
    world = dist.get_world_size(group)
    n = max(world, nbytes // 4 // world * world)  # float32 elements, divisible by the world
    x = torch.ones(n, device=device)
    if kind == "all_gather":
        shard, out = x[: n // world].clone(), torch.empty(n, device=device)
        return lambda: dist.all_gather_into_tensor(out, shard, group=group)
    if kind == "reduce_scatter":
        out = torch.empty(n // world, device=device)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    out = torch.empty_like(x)
    return lambda: dist.all_to_all_single(out, x, group=group)


def collectives_table(device, sizes) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    topology = Topology(world, gpus_per_host=local, hosts_per_zone=max(1, world // local))
    model, placement = CostModel(topology), topology.placement(world, 1)
    rows, worst = [], 0.0
    for kind in KINDS:
        for nbytes in sizes:
            fn = run_collective(kind, nbytes, dist.group.WORLD, device)
            ms = common.bench_ms(fn)
            predicted = model.collective(kind, nbytes, placement, algorithm="flat").seconds * 1e3
            ratio = ms / predicted if predicted else float("nan")
            if predicted:
                worst = max(worst, abs(ratio - 1) * 100)
            src, dst = (
                torch.empty(nbytes // 4, device=device),
                torch.empty(nbytes // 4, device=device),
            )
            copy_ms = common.bench_ms(lambda s=src, d=dst: d.copy_(s))
            rows.append(
                [kind, f"{nbytes / 2**20:.2f}", ms * 1e3, predicted * 1e3, ratio, copy_ms * 1e3]
            )
    if rank == 0:
        common.print_table(
            f"collectives over {world} rank(s) ({dist.get_backend()}) vs the cost model (flat)",
            ["collective", "MiB", "measured us", "model us", "measured/model", "copy us"],
            rows,
        )
        if world == 1:
            print(
                "world of one rank: the collectives are local; the model predicts 0 (nothing to move)."
            )
            print(
                "NOT measured here (needs several GPUs): NVLink/RoCE/cross-zone collectives, so the"
            )
            print("15% goal of the cost model is unverified on this machine.")
        common.record(
            f"collectives_model:world{world}",
            max_error_pct=worst if world > 1 else float("nan"),
            ranks=world,
        )


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """A persistent copy: however many programs are launched, each strides over the buffer."""
    start = tl.program_id(0) * BLOCK
    step = tl.num_programs(0) * BLOCK
    for offset in range(start, n, step):
        offs = offset + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def sm_copy(src: torch.Tensor, dst: torch.Tensor, *, ctas: int) -> None:
    """Copy with exactly ``ctas`` programs (thread blocks): a collective's SM footprint."""
    _copy_kernel[(ctas,)](src, dst, src.numel(), BLOCK=4096)


def overlap_table(device, *, gemm_n: int, sm_bytes: int, dma_bytes: int) -> None:
    sm_ctas = 24
    src = torch.randn(sm_bytes // 4, device=device)
    dst = torch.empty_like(src)
    sm_copy(src, dst, ctas=sm_ctas)
    torch.testing.assert_close(dst, src)  # the kernel copies right, on this device
    if device.type != "cuda":
        print("\noverlap timing needs CUDA streams: the copy kernel was only checked on the CPU.")
        return
    dma_src = torch.randn(dma_bytes // 4, device=device)
    dma_dst = torch.empty(dma_src.shape, pin_memory=True)
    a = torch.randn(gemm_n, gemm_n, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    copies = {
        "copy_engine": (dma_bytes, lambda: dma_dst.copy_(dma_src, non_blocking=True)),
        "nccl": (sm_bytes, lambda: sm_copy(src, dst, ctas=sm_ctas)),
    }

    def overlapped(copy):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            copy()
        a @ b
        main.wait_stream(side)

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    model = CostModel(Topology(1, gpus_per_host=1, num_sms=sms))
    gemm_ms = common.bench_ms(lambda: a @ b)
    rows = []
    for engine, (nbytes, copy) in copies.items():
        copy_ms = common.bench_ms(copy)
        both_ms = common.bench_ms(lambda c=copy: overlapped(c))
        predicted = model.overlap(gemm_ms, copy_ms, engine=engine)
        rows.append(
            [
                engine,
                nbytes / 2**20,
                gemm_ms,
                copy_ms,
                both_ms,
                predicted,
                (predicted - both_ms) / both_ms * 100,
            ]
        )
        common.record(
            f"collectives_model:overlap_{engine}", measured_ms=both_ms, model_ms=predicted
        )
    common.print_table(
        f"GEMM {gemm_n}^3 bf16 overlapped with a copy (nccl = {sm_ctas}-CTA kernel on {sms} SMs, "
        "copy_engine = device to pinned host) vs max(c, p + c*s/S)",
        ["engine", "MiB", "gemm ms", "copy ms", "together ms", "model ms", "model error %"],
        rows,
    )


def run(device: torch.device) -> None:
    """The three tables, on a process group already joined (rank 0 prints the one-GPU parts)."""
    cuda = device.type == "cuda"
    print(common.environment() if cuda else f"cpu smoke run, torch {torch.__version__}")
    if dist.get_rank() == 0:
        copy_sizes = [2**k for k in (range(12, 31, 2) if cuda else range(10, 17, 3))]
        copy_table(device, copy_sizes)
    coll_sizes = [2**k for k in (range(20, 31, 2) if cuda else (12, 16))]
    collectives_table(device, coll_sizes)
    if dist.get_rank() == 0:
        if cuda:
            overlap_table(device, gemm_n=8192, sm_bytes=2**30, dma_bytes=2**26)
        else:
            overlap_table(device, gemm_n=64, sm_bytes=2**14, dma_bytes=2**12)


def _worker(rank: int, world: int, port: int | None, cuda: bool, local_rank: int | None = None):
    """One rank: spawned by ``main`` (rendezvous on ``port`` of this host) or under torchrun
    (``port`` None: the rendezvous torchrun set in the environment)."""
    device = torch.device("cuda", rank if local_rank is None else local_rank)
    if not cuda:
        device = torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world
    )
    try:
        run(device)
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Under torchrun: this process is one rank. Launched plainly on a host with several GPUs: one
    process per GPU (at most 8), spawned here. Otherwise one rank."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU with gloo")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if "RANK" in os.environ:  # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _worker(rank, world, None, cuda, local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        return
    gpus = min(torch.cuda.device_count(), 8) if cuda else 1
    if gpus >= 2:
        import torch.multiprocessing as mp

        mp.spawn(_worker, args=(gpus, common.free_port(), cuda), nprocs=gpus)
    else:
        _worker(0, 1, common.free_port(), cuda)


if __name__ == "__main__":
    main()

"""Q1, Q2, Q3 of workloads.md: MX quantize bandwidth against the PyTorch formula, compiled and
eager, and a device copy, measured in one run.

Bandwidth = (bytes read once + bytes written once) / time: bf16 input, fp8 output(s), E8M0 scales.
Rows: Q1 (1×32 along rows), Q1 with both row- and column-wise copies from one read (the
backward's need), Q1 fused with the merge to 1×128 blocks (what mxfp8 feeds Hopper's blockwise
GEMM; fp8 bytes plus one float32 scale per 128), Q2 (32×32 tiles), Q3 (RMSNorm fused with 1×32),
and a device copy of the Q1 tensor as the ceiling. "ours" is the public API call as a user makes
it; "ours graph" the same call replayed from a CUDA graph (the kernel without host overhead).
The anchors: the obvious formula under ``torch.compile`` and in eager mode (the torchao-style
float formula).

``--sweep`` first times a handful of launch shapes per kernel (direct kernel calls replayed from
a CUDA graph, so that the host's cost of a launch does not hide the kernel's), prints them,
and runs the table with the fastest of each (the defaults in the kernel modules are the fastest
of such a sweep on the GPU). ``--smoke`` runs tiny shapes on the CPU (anchors eager; the sweep
under Triton's interpreter).
"""

import argparse
import math
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # the sweep's direct kernel calls run under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import torch  # noqa: E402
from gem_lowprec import quantize_mx_k128, rmsnorm_to_mx, to_mx, to_mx_2d, to_mx_rowcol  # noqa: E402
from gem_lowprec.codec import E4M3  # noqa: E402
from gem_lowprec.ops.mx_quantize import triton as mx_kernels  # noqa: E402
from gem_lowprec.ops.mx_quantize import triton_k128 as k128_kernels  # noqa: E402
from gem_lowprec.ops.rmsnorm_mx import triton as rms_kernels  # noqa: E402

E4M3_MAX = 448.0
RowsTiles, Tile2dTiles, RowColTiles = (
    mx_kernels.RowsTiles,
    mx_kernels.Tile2dTiles,
    mx_kernels.RowColTiles,
)
RmsnormTiles = rms_kernels.RmsnormTiles
SWEEP = {
    "rows": [RowsTiles(b, w) for b, w in [(64, 4), (128, 4), (256, 8), (512, 8)]],
    "rows, Q3's input": [RowsTiles(b, w) for b, w in [(32, 2), (64, 4), (128, 4), (256, 8)]],
    "merge_k128": [RowsTiles(b, w) for b, w in [(128, 4), (256, 8)]],
    "tile2d": [Tile2dTiles(k, w) for k, w in [(128, 4), (256, 4), (512, 8), (1024, 8)]],
    "rowcol": [RowColTiles(m, k, w) for m, k, w in [(32, 128, 4), (64, 64, 4), (64, 128, 8)]],
    "rmsnorm": [
        RmsnormTiles(e, w)
        for e, w in [(1024, 1), (2048, 1), (2048, 2), (4096, 2), (2048, 4), (4096, 4), (8192, 4)]
    ],
}
SMOKE_SWEEP = {  # one interpreted call each: a few large programs
    "rows": [RowsTiles(512, 4)],
    "merge_k128": [RowsTiles(512, 4)],
    "tile2d": [Tile2dTiles(256, 4, 2)],
    "rowcol": [RowColTiles(64, 256, 4)],
    "rmsnorm": [RmsnormTiles(8192, 4)],
    "rows, Q3's input": [RowsTiles(512, 4)],
}


def formula_1x32(x):
    """The obvious PyTorch formula: float log2 for the RCEIL scale, divide, clamp, cast."""
    xb = x.reshape(-1, 32).float()
    amax = xb.abs().amax(-1, keepdim=True)
    e = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-127, 127)
    q = (xb * torch.exp2(-e)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(x.shape), (e + 127).to(torch.uint8).view(*x.shape[:-1], -1)


def formula_32x32(x):
    m, k = x.shape
    xb = x.reshape(m // 32, 32, k // 32, 32).float()
    amax = xb.abs().amax(dim=(1, 3), keepdim=True)
    e = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-127, 127)
    q = (xb * torch.exp2(-e)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(m, k), (e + 127).to(torch.uint8).view(m // 32, k // 32)


def formula_rmsnorm_1x32(x, w, eps=1e-6):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return formula_1x32(y)


def one_call_ms(fn) -> float:
    """The smoke run's timer: one call (the interpreter is slow; the figure means nothing)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def sweep(x, xr, w, byte_counts, grid, *, smoke: bool) -> dict:
    """Time each launch shape of each kernel by direct calls; returns the fastest per kernel."""
    e4m3 = E4M3
    launch = {
        "rows": lambda t: mx_kernels.mx_quantize(
            x, e4m3, rows=True, cols=False, tile_2d=False, scale_mode="rceil", seed=None, tiles=t
        ),
        "merge_k128": lambda t: k128_kernels.mx_quantize_merged_k128(
            x, e4m3, scale_mode="rceil", tiles=t
        ),
        "tile2d": lambda t: mx_kernels.mx_quantize(
            x, e4m3, rows=False, cols=False, tile_2d=True, scale_mode="rceil", seed=None, tiles=t
        ),
        "rowcol": lambda t: mx_kernels.mx_quantize(
            x, e4m3, rows=True, cols=True, tile_2d=False, scale_mode="rceil", seed=None, tiles=t
        ),
        "rmsnorm": lambda t: rms_kernels.rmsnorm_mx(xr, w, 1e-6, e4m3, "rceil", tiles=t),
        "rows, Q3's input": lambda t: mx_kernels.mx_quantize(
            xr, e4m3, rows=True, cols=False, tile_2d=False, scale_mode="rceil", seed=None, tiles=t
        ),
    }
    rows, best = [], {}
    for name, configs in grid.items():
        for tiles in configs:
            fn = lambda t=tiles, f=launch[name]: f(t)  # noqa: E731
            if smoke:
                ms = one_call_ms(fn)
            else:  # replayed from a CUDA graph: the kernel's time, not the host's
                ms = common.bench_ms(common.cuda_graph_of(fn), warmup_ms=10, rep_ms=40)
            tbps = byte_counts[name] / (ms * 1e-3) / 1e12
            rows.append([name, str(tiles), ms * 1e3, tbps])
            if name not in best or ms < best[name][1]:
                best[name] = (tiles, ms)
    common.print_table(
        "launch-shape sweep (direct kernel calls)", ["kernel", "tiles", "us", "TB/s"], rows
    )
    return {name: tiles for name, (tiles, _) in best.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--sweep", action="store_true", help="time launch shapes first")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    q1 = (64, 256) if args.smoke else (16384, 8192)
    q3 = (32, 256) if args.smoke else (32768, 1024)
    compile_ = (lambda f: f) if args.smoke else torch.compile
    print(common.environment())

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(q1, device=device, generator=gen).to(torch.bfloat16)
    xr = torch.randn(q3, device=device, generator=gen).to(torch.bfloat16)
    w = torch.rand(q3[1], device=device, generator=gen).to(torch.bfloat16) + 0.5
    n1, n3 = x.numel(), xr.numel()
    bytes_q1 = 2 * n1 + n1 + n1 // 32
    bytes_rowcol = 2 * n1 + 2 * n1 + 2 * (n1 // 32)
    bytes_merge = 2 * n1 + n1 + 4 * (n1 // 128)
    bytes_q2 = 2 * n1 + n1 + n1 // 1024
    bytes_q3 = 2 * n3 + n3 + n3 // 32 + 2 * q3[1]

    if args.sweep:
        byte_counts = dict(
            rows=bytes_q1, merge_k128=bytes_merge, tile2d=bytes_q2, rowcol=bytes_rowcol
        )
        byte_counts["rmsnorm"] = bytes_q3
        byte_counts["rows, Q3's input"] = 3 * n3 + n3 // 32
        best = sweep(x, xr, w, byte_counts, SMOKE_SWEEP if args.smoke else SWEEP, smoke=args.smoke)
        print(f"fastest launch shapes: {best}")
    # The table runs the public API with the fastest shapes of the sweep, passed as arguments
    # (the merge to 1x128 shares the rows kernel's shape: the table uses the rows one), or with
    # the kernels' defaults (None) without a sweep and on the CPU.
    rows_t = tile2d_t = rowcol_t = rms_t = None
    if args.sweep and not args.smoke:
        rows_t, tile2d_t, rowcol_t = best["rows"], best["tile2d"], best["rowcol"]
        rms_t = best["rmsnorm"]
    if not args.smoke:
        shown = (
            rows_t or mx_kernels.GPU_TILES[0], tile2d_t or mx_kernels.GPU_TILES[1],
            rowcol_t or mx_kernels.GPU_TILES[2],
        )  # fmt: skip
        print(f"launch shapes in the table: {shown}, {rms_t or rms_kernels.GPU_TILES}")

    f1, f2, f3 = compile_(formula_1x32), compile_(formula_32x32), compile_(formula_rmsnorm_1x32)
    cases = [
        ("copy (ceiling)", bytes_q1 // 3 * 4, lambda: x.clone(), None, None),
        ("copy, Q3's input", 4 * n3, lambda: xr.clone(), None, None),
        ("1x32 rows, Q3's input", 3 * n3 + n3 // 32, lambda: to_mx(xr, tiles=rows_t), None, None),
        (
            "Q1 1x32 rows",
            bytes_q1,
            lambda: to_mx(x, tiles=rows_t),
            lambda: f1(x),
            lambda: formula_1x32(x),
        ),
        (
            "Q1 rows+cols, one read",
            bytes_rowcol,
            lambda: to_mx_rowcol(x, tiles=rowcol_t),
            None,
            None,
        ),
        ("Q1 + merge to 1x128", bytes_merge, lambda: quantize_mx_k128(x, tiles=rows_t), None, None),
        (
            "Q2 32x32",
            bytes_q2,
            lambda: to_mx_2d(x, tiles=tile2d_t),
            lambda: f2(x),
            lambda: formula_32x32(x),
        ),
        (
            "Q3 rmsnorm+1x32",
            bytes_q3,
            lambda: rmsnorm_to_mx(xr, w, tiles=rms_t),
            lambda: f3(xr, w),
            lambda: formula_rmsnorm_1x32(xr, w),
        ),
    ]
    rows, headline, graph = [], {}, {}
    for name, nbytes, ours, compiled, eager in cases:
        for fn in (ours, compiled):
            if fn is not None:
                fn()  # compile outside the timing
        t = common.bench_ms(ours)
        tg = common.try_bench(common.cuda_graph_of(ours)) if not args.smoke else float("nan")
        tc = common.try_bench(compiled) if compiled else float("nan")
        te = common.try_bench(eager) if eager else float("nan")
        tb = lambda ms, nb=nbytes: nb / (ms * 1e-3) / 1e12 if ms == ms else float("nan")  # noqa: E731
        rows.append([name, t * 1e3, tb(t), tb(tg), tc * 1e3, tb(tc), tb(te), tc / t])
        headline[name], graph[name] = tb(t), tb(tg)
    common.print_table(
        f"MX quantize bandwidth (TB/s, read + write), {common.environment()}",
        [
            "workload",
            "ours us",
            "ours TB/s",
            "ours graph TB/s",
            "compiled us",
            "compiled TB/s",
            "eager TB/s",
            "compiled/ours time",
        ],
        rows,
    )
    copy = headline["copy (ceiling)"]
    for q, copy_q in (
        ("Q1 1x32 rows", copy),
        ("Q2 32x32", copy),
        ("Q3 rmsnorm+1x32", headline["copy, Q3's input"]),
    ):
        for kind, tbps in (("eager", headline[q]), ("graph", graph[q])):
            print(
                f"goal >= 3.5 TB/s, {q}, {kind}: {tbps:.2f} ({tbps / copy_q:.0%} of a copy of "
                f"its input) {'met' if tbps >= 3.5 else 'missed'}"
            )
    common.record(
        "mx_quantize",
        Q1_TBps=headline["Q1 1x32 rows"],
        Q2_TBps=headline["Q2 32x32"],
        Q3_TBps=headline["Q3 rmsnorm+1x32"],
        Q2_graph_TBps=graph["Q2 32x32"],
        Q3_graph_TBps=graph["Q3 rmsnorm+1x32"],
        rowcol_TBps=headline["Q1 rows+cols, one read"],
        merged_k128_TBps=headline["Q1 + merge to 1x128"],
        copy_TBps=copy,
    )
    # The goals: 3.5 TB/s, beside a device copy of the same input (the ceiling); replayed where
    # the graphs ran (an eager call of a 30 us kernel measures the host).
    for q, copy_of in (("Q1 1x32 rows", "copy (ceiling)"), ("Q2 32x32", "copy (ceiling)"),
                       ("Q3 rmsnorm+1x32", "copy, Q3's input")):  # fmt: skip
        by = graph if math.isfinite(graph[q] + graph[copy_of]) else headline
        common.record_goal(
            benchmark="mx_quantize",
            goal="MX quantize bandwidth",
            workload=q.split()[0],
            gemkit=by[q],
            anchor="copy of the input",
            anchor_value=by[copy_of],
            ratio=by[q] / by[copy_of],
            unit="TB/s",
            basis=common.GRAPHED if by is graph else common.EAGER,
            target=3.5,
            target_of="gemkit",
        )


if __name__ == "__main__":
    main()

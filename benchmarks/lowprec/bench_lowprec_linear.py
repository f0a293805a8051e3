"""G1 of workloads.md: linear forward + backward, 32768 tokens, 1024 -> 4096 and 4096 -> 1024,
BF16 against the low-precision recipes, all quantization included, measured in one run.

Table 1 (totals): ``F.linear`` in BF16 (the anchor), ``LowPrecisionLinear`` with ``mxfp8`` and
``fp8_rowwise``, each with the weight-gradient in BF16 (default) and in fp8, with the per-shape
fallback switched off so that the fp8 path itself is timed; then what the recipes with their
measured fallback pick. Each step is timed eagerly (``do_bench``: what a training loop that
waits on its host sees) and as CUDA-graph replays (the GPU's own time), beside the sum of its
kernels' device times (``torch.profiler``) and the host time to issue one step. TFLOP/s counts
3 · 2 · M · K · N per fwd+bwd. Each row alternates with the BF16 anchor for three rounds and
its speedups divide the anchor's median by the row's, in the same column; the anchor's own row
(the anchor against itself) shows how far apart two timings of the same step fall.

Table 2 (breakdown): each fp8 path's kernels with their device µs per step and their share,
from the profiler: what limits each recipe. ``--smoke`` runs tiny shapes on the CPU (emulated
GEMMs; no device times there). ``--sweep`` first times the fp8 casts' launch shapes.
"""

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # on the CPU the Triton kernels (--sweep) run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gem_lowprec import Fp8Decisions, LowPrecisionLinear  # noqa: E402
from gem_lowprec.ops.fp8_cast import triton as fp8_kernels  # noqa: E402
from gem_lowprec.ops.fp8_cast import triton_columns as fp8_column_kernels  # noqa: E402
from gem_lowprec.recipes import FallbackConfig, Recipe, WeightGradConfig  # noqa: E402

E4M3 = torch.float8_e4m3fn


def timer(smoke: bool):
    """``common.try_bench`` on the GPU; with ``--smoke`` one untimed-quality call (it checks that
    every path runs, in seconds)."""
    if not smoke:
        return common.try_bench

    def once(fn, **_):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return once


def emit(table: list, row: list) -> None:
    """Keep the row for the final table and print it now (a cut-short run still reports)."""
    table.append(row)
    print(
        "  " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row), flush=True
    )


def fwd_bwd(module, x, dy):
    def step():
        x.grad = None
        module.weight.grad = None
        module(x).backward(dy)

    return step


ROUNDS = 3


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def measure(bench, step, anchor_step, smoke: bool) -> dict:
    """Eager and graph-replayed ms of ``step`` and of ``anchor_step``, alternated for ``ROUNDS``
    rounds (medians: the GPU's speed drifts by up to 15% over a run, and a ratio should compare
    neighbours); device ms of the step's kernels, host ms to issue one step, and the kernels
    themselves (name, device µs per step)."""
    if smoke:
        eager = bench(step)
        return dict(
            eager=eager, graph=float("nan"), anchor_eager=bench(anchor_step),
            anchor_graph=float("nan"), kernels=float("nan"), host=float("nan"), rows=[],
        )  # fmt: skip
    replay, anchor_replay = common.cuda_graph_of(step), common.cuda_graph_of(anchor_step)
    times = {"eager": [], "graph": [], "anchor_eager": [], "anchor_graph": []}
    for _ in range(ROUNDS):
        times["anchor_eager"].append(bench(anchor_step))
        times["eager"].append(bench(step))
        times["anchor_graph"].append(bench(anchor_replay))
        times["graph"].append(bench(replay))
    rows = common.device_kernel_times(step, 5)
    host_us, _ = common.host_and_wall_us(step, 20)
    return dict(
        **{name: median(values) for name, values in times.items()},
        kernels=sum(us for _, us, _ in rows) / 1e3,
        host=host_us / 1e3,
        rows=[(name, us) for name, us, _ in rows],
    )


T = fp8_kernels.RowsTiles
ROWS_SWEEP = [
    T(),
    T(16, 512),
    T(32, 512),
    T(16, 1024, num_warps=4),
    T(16, 2048, num_warps=16),
    T(8, 1024, l2_wave_mib=16),
    T(16, 1024, l2_wave_mib=48),
    T(amax_programs_per_sm=4),
    T(amax_programs_per_sm=8),
    T(amax_tile_elems=4096),
    T(amax_tile_elems=16384),
    T(amax_tile_elems=4096, amax_programs_per_sm=4),
    T(amax_one_chunk_max_c=2048),  # the default before: chunked column amax past 2048 columns
    T(amax_tile_elems=16384, num_warps=16),
    T(wide_c=1 << 30),  # no wide launch: 1024 columns on 8 warps at every width
    T(wide_block_c=4096),
    T(wide_block_c=1024),
    T(transpose_block=64, transpose_warps=4),
    T(transpose_block=128, transpose_warps=4),
    T(transpose_block=128, transpose_warps=16),
    T(wide_block_r=8),
    T(wide_l2_wave_mib=16),
    T(wide_block_r=8, wide_l2_wave_mib=16),
    T(wide_block_r=8, wide_l2_wave_mib=24),
    T(wide_block_r=32),
    T(one_chunk_stages=2),
    T(amax_warps=8, amax_stages=1),
    T(amax_stages=2),
    T(amax_stages=4),
    T(amax_warps=8),
]
BOTH_SWEEP = [fp8_column_kernels.BothTiles(), fp8_column_kernels.BothTiles(32, 256, 32, 128, 4)]
C = fp8_column_kernels.ColumnTiles
COLUMN_SWEEP = [
    C(),
    C(amax_row_tiles=2),
    C(amax_row_tiles=4),
    C(amax_row_tiles=16),
    C(amax_warps=8),
    C(block_c=256, amax_warps=8, cast_warps=8),
    C(block_r=32, block_c=256, amax_row_tiles=8),
    C(block_r=128, block_c=64, amax_warps=8, cast_warps=8),
    C(block_r=128, block_c=128, amax_row_tiles=4, amax_warps=8, cast_warps=16),
    C(cast_warps=4),
]


def changed(tiles) -> str:
    """The fields of a launch shape that differ from its defaults ("defaults" when none)."""
    default = type(tiles)()
    fields = [f.name for f in dataclasses.fields(tiles)]
    diff = [f"{f}={getattr(tiles, f)}" for f in fields if getattr(tiles, f) != getattr(default, f)]
    return ", ".join(diff) or "defaults"


def device_ms(fn) -> float:
    """Device time of ``fn``'s kernels (profiler), not its host-bound wall time: the casts are
    tens of µs, the same order as issuing them on the H200 host. On the CPU (``--smoke``): one
    call's host time."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return sum(us for _, us, _ in common.device_kernel_times(fn, 10)) / 1e3


def sweep_casts(device: str, tokens: int, shapes: list[tuple[int, int]]) -> None:
    """``--sweep``: the rows kernel (plain, with the transposed copy, with a column amax) and
    the weight's both-ways cast under several launch shapes, in device ms and TB/s of bytes read
    once + written."""
    from gem_lowprec.codec import elem_format

    e4m3 = elem_format(E4M3)
    shapes_swept = ROWS_SWEEP if device == "cuda" else ROWS_SWEEP[:1]  # the CPU: does it run
    rows = []
    for c in sorted({k for k, _ in shapes}):
        x = torch.randn(tokens, c, device=device).to(torch.bfloat16)
        mult = torch.ones(tokens, device=device)
        amax_fields = (
            "amax_programs_per_sm", "amax_tile_elems", "amax_one_chunk_max_c", "amax_warps",
            "amax_stages",
        )  # fmt: skip
        wide_fields = ("wide_c", "wide_block_c", "wide_warps", "wide_block_r", "wide_l2_wave_mib")
        transpose_fields = ("transpose_block", "transpose_warps")
        for variant, transposed, row_mult, unused in (
            ("rows", False, None, amax_fields + transpose_fields),
            ("rows+T", True, None, amax_fields),
            ("rows+col amax", False, mult, transpose_fields + wide_fields),
        ):
            swept = set()
            for t in shapes_swept:
                # tiles that differ only in fields this variant does not use: timed once
                t = dataclasses.replace(t, **{f: getattr(T(), f) for f in unused})
                if c < t.wide_c:  # rows this short never take the wide launch
                    t = dataclasses.replace(
                        t, wide_c=1 << 30, **{f: getattr(T(), f) for f in wide_fields[1:]}
                    )
                if t in swept:
                    continue
                swept.add(t)
                ms = device_ms(
                    lambda t=t, x=x, tr=transposed, m=row_mult: fp8_kernels.cast_rows(
                        x, e4m3, transposed=tr, col_amax_row_mult=m, tiles=t
                    )
                )
                moved = x.numel() * (3 + transposed * 2)
                rows.append([f"{variant} [{tokens}x{c}]", changed(t), ms, moved / ms / 1e9])
        # the column-wise cast: its amax pass, then its cast pass
        for t in COLUMN_SWEEP if device == "cuda" else COLUMN_SWEEP[:1]:
            amax_ms = device_ms(
                lambda t=t, x=x, m=mult: fp8_column_kernels.column_amax(x, m, tiles=t)
            )
            amax = fp8_column_kernels.column_amax(x, mult, tiles=t)
            cast_ms = device_ms(
                lambda t=t, x=x, a=amax, m=mult: fp8_column_kernels.cast_columns(
                    x, e4m3, row_mult=m, col_amax=a, tiles=t
                )
            )
            rows.append([f"col amax [{tokens}x{c}]", changed(t), amax_ms, x.numel() * 2 / amax_ms / 1e9])  # fmt: skip
            rows.append([f"col cast [{tokens}x{c}]", changed(t), cast_ms, x.numel() * 3 / cast_ms / 1e9])  # fmt: skip
    for k, n in shapes:
        w = torch.randn(n, k, device=device).to(torch.bfloat16)
        for t in BOTH_SWEEP:
            ms = device_ms(lambda t=t, w=w: fp8_column_kernels.cast_both(w, e4m3, tiles=t))
            rows.append([f"both [{n}x{k}]", changed(t), ms, w.numel() * 6 / ms / 1e9])
    common.print_table(
        "fp8 cast launch-shape sweep (device time)", ["cast", "tiles", "ms", "TB/s"], rows
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument(
        "--sweep", action="store_true", help="first sweep the fp8 casts' launch shapes"
    )
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    tokens = 128 if args.smoke else 32768
    bench = timer(args.smoke)
    shapes = [(128, 256), (256, 128)] if args.smoke else [(1024, 4096), (4096, 1024)]
    no_fallback = FallbackConfig(measure_on_gpu=False)
    variants = [
        (f"{name} wgrad {wg}", Recipe(name=name, weight_grad=WeightGradConfig(wg), fallback=no_fallback))
        for name in ("mxfp8", "fp8_rowwise")
        for wg in ("bf16", "fp8")
    ] + [
        ("mxfp8 (measured fallback)", Recipe()),
        ("fp8_rowwise wgrad fp8 (measured fallback)", Recipe(name="fp8_rowwise", weight_grad=WeightGradConfig("fp8"))),
    ]  # fmt: skip
    print(common.environment())
    if args.sweep:
        sweep_casts(device, tokens, shapes)
    # one decisions object for every linear of the run, as ``convert`` gives a model's linears
    decisions = Fp8Decisions()
    totals, pieces, headline = [], [], {}
    for k, n in shapes:
        shape = f"{k}->{n}"
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, k, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(tokens, n, device=device, generator=gen).to(torch.bfloat16)
        flops = 3 * 2 * tokens * k * n
        base = LowPrecisionLinear(
            k, n, bias=False, recipe=Recipe(name="bf16"), decisions=decisions, device=device,
            dtype=torch.bfloat16,
        )  # fmt: skip
        anchor_step = fwd_bwd(base, x, dy)
        for label, rec in [("bf16 F.linear (anchor)", base.recipe), *variants]:
            if label.startswith("bf16"):  # the anchor against itself: the run's noise floor
                got = measure(bench, anchor_step, anchor_step, args.smoke)
            else:
                mod = LowPrecisionLinear(k, n, bias=False, recipe=rec, decisions=decisions, device=device, dtype=torch.bfloat16)  # fmt: skip
                mod.weight.data.copy_(base.weight.data)
                got = measure(bench, fwd_bwd(mod, x, dy), anchor_step, args.smoke)
            eager_x = got["anchor_eager"] / got["eager"]
            graph_x = got["anchor_graph"] / got["graph"]
            emit(totals, [shape, label, got["eager"], common.tflops(flops, got["eager"]), eager_x,
                          got["graph"], graph_x, got["kernels"], got["host"]])  # fmt: skip
            if rec.name != "bf16" and rec.fallback.measure_on_gpu is False:
                key = f"{rec.name}_wgrad_{rec.weight_grad.precision}_{k}to{n}"
                headline[f"{key}_speedup"], headline[f"{key}_graph_speedup"] = eager_x, graph_x
            if label == "fp8_rowwise wgrad fp8":  # the goal: 1.25x bf16, quantization included
                times = {"fp8": got["eager"], "fp8 (graph)": got["graph"],
                         "bf16": got["anchor_eager"], "bf16 (graph)": got["anchor_graph"]}  # fmt: skip
                mine, theirs, basis = common.graphed_or_eager(times, "fp8", "bf16")
                common.record_goal(
                    benchmark="lowprec_linear",
                    goal="fp8 linear vs bf16",
                    workload=f"G1 {k}->{n}",
                    gemkit=mine,
                    anchor="bf16 F.linear",
                    anchor_value=theirs,
                    ratio=theirs / mine,
                    unit="ms",
                    basis=basis,
                    target=1.25,
                )
            if rec.fallback.measure_on_gpu is False or label.startswith("bf16"):
                for name, us in got["rows"]:
                    emit(pieces, [shape, label, name[:70], us, us / 1e3 / got["kernels"]])
        y_ref = F.linear(x.detach().float(), base.weight.detach().float())
        for name in ("mxfp8", "fp8_rowwise"):
            mod = LowPrecisionLinear(k, n, bias=False, recipe=Recipe(name=name, fallback=no_fallback), decisions=decisions, device=device, dtype=torch.bfloat16)  # fmt: skip
            mod.weight.data.copy_(base.weight.data)
            y = mod(x.detach()).float()
            sqnr = 10 * torch.log10(y_ref.pow(2).sum() / (y - y_ref).pow(2).sum()).item()
            print(f"{shape}: {name} forward SQNR vs fp32 {sqnr:.1f} dB")
    env = common.environment()
    common.print_table(
        f"G1 linear fwd+bwd, {tokens} tokens, {env} (speedups: bf16 anchor's time / this row's)",
        ["shape", "recipe", "eager ms", "TFLOP/s", "speedup", "graph ms", "graph speedup",
         "kernels ms", "host ms"],
        totals,
    )  # fmt: skip
    common.print_table(
        f"G1 breakdown: device µs per step by kernel (profiler), {tokens} tokens",
        ["shape", "path", "kernel", "µs", "share"],
        pieces,
    )
    print("fallbacks:", decisions.fallback_report() or "none")
    common.record("lowprec_linear", **headline)


if __name__ == "__main__":
    main()

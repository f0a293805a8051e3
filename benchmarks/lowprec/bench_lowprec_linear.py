"""G1 of workloads.md: linear forward + backward, 32768 tokens, 1024 -> 4096 and 4096 -> 1024,
BF16 against the low-precision recipes, all quantization included, measured in one run.

Table 1 (totals): ``F.linear`` in BF16 (the anchor), ``LowPrecisionLinear`` with ``mxfp8`` and
``fp8_rowwise``, each with the weight-gradient in BF16 (default) and in fp8, with the per-shape
fallback switched off so that the fp8 path itself is timed; then what the recipes with their
measured fallback pick. TFLOP/s counts 3 · 2 · M · K · N per fwd+bwd.

Table 2 (breakdown): every kernel of each path timed alone on the same tensors (the casts in
TB/s of bytes read + written, the GEMMs in TFLOP/s), its share of the path's summed kernel time,
and the sum against the measured total (the rest is launch and autograd overhead). That says
what limits each recipe. ``--smoke`` runs tiny shapes on the CPU (emulated GEMMs).
"""

import argparse
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
from gem_lowprec import LowPrecisionLinear  # noqa: E402
from gem_lowprec.linear import fallback_report  # noqa: E402
from gem_lowprec.ops.fp8_cast import cast_both, cast_columns, cast_rows  # noqa: E402
from gem_lowprec.ops.fp8_cast import triton as fp8_kernels  # noqa: E402
from gem_lowprec.recipes import FallbackConfig, Recipe, WeightGradConfig  # noqa: E402
from gem_lowprec.scaled_matmul import (  # noqa: E402
    blockwise_matmul,
    quantize_mx_k128,
    quantize_mx_k128_rowcol,
    rowwise_matmul,
)

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


def rowwise_pieces(x, w, dy, fp8_wgrad: bool):
    """(name, fn, bytes moved or flops, kind) of the fp8_rowwise path, as linear.py runs it."""
    (m, k), n = x.shape, w.shape[0]
    fold_into_dy = fp8_wgrad and k > n
    xr = cast_rows(x, E4M3, transposed=fold_into_dy)
    wq, ws, wt, wts = cast_both(w, E4M3)
    dyr = cast_rows(
        dy,
        E4M3,
        transposed=fp8_wgrad and not fold_into_dy,
        col_amax_row_mult=xr.scale if fold_into_dy else None,
    )
    gemm = 2 * m * k * n
    out = [
        (f"cast x rows{' + xᵀ' if fold_into_dy else ''}", lambda: cast_rows(x, E4M3, transposed=fold_into_dy), m * k * (3 + fold_into_dy), "cast"),
        ("cast W rows + columns (fill + 2 launches)", lambda: cast_both(w, E4M3), n * k * 6, "cast"),
        (
            f"cast dy rows{' + dyᵀ' if fp8_wgrad and not fold_into_dy else ''}{' + col amax' if fold_into_dy else ''}",
            lambda: cast_rows(dy, E4M3, transposed=fp8_wgrad and not fold_into_dy, col_amax_row_mult=xr.scale if fold_into_dy else None),
            m * n * (3 + (fp8_wgrad and not fold_into_dy)),
            "cast",
        ),
        ("GEMM y (fast accum)", lambda: rowwise_matmul(xr.data, xr.scale, wq, ws, x.dtype, fast_accum=True), gemm, "gemm"),
        ("GEMM dx", lambda: rowwise_matmul(dyr.data, dyr.scale, wt, wts, x.dtype), gemm, "gemm"),
    ]  # fmt: skip
    if not fp8_wgrad:
        return [*out, ("GEMM dW bf16", lambda: dy.t() @ x, gemm, "gemm")]
    if fold_into_dy:
        dyt, dyts = cast_columns(dy, E4M3, row_mult=xr.scale, col_amax=dyr.col_amax)
        ones = torch.ones(k, device=x.device)
        return [
            *out,
            ("cast dy·s_x columns -> dyᵀ", lambda: cast_columns(dy, E4M3, row_mult=xr.scale, col_amax=dyr.col_amax), m * n * 3, "cast"),
            ("GEMM dW", lambda: rowwise_matmul(dyt, dyts, xr.data_t, ones, x.dtype), gemm, "gemm"),
        ]  # fmt: skip
    xt, xts = cast_columns(x, E4M3, row_mult=dyr.scale)
    ones = torch.ones(n, device=x.device)
    return [
        *out,
        ("cast x·s_dy columns -> xᵀ (2 reads)", lambda: cast_columns(x, E4M3, row_mult=dyr.scale), m * k * 5, "cast"),
        ("GEMM dW", lambda: rowwise_matmul(dyr.data_t, ones, xt, xts, x.dtype), gemm, "gemm"),
    ]  # fmt: skip


def mx_pieces(x, w, dy, fp8_wgrad: bool):
    """The mxfp8 path's kernels, as linear.py runs them (1×32 MX merged to 1×128)."""
    (m, k), n = x.shape, w.shape[0]
    wq, (wtq, wts) = quantize_mx_k128_rowcol(w)
    gemm = 2 * m * k * n
    w_piece = ("quantize W both ways", lambda: quantize_mx_k128_rowcol(w), n * k * 4, "cast")
    if not fp8_wgrad:
        xq, dyq = quantize_mx_k128(x), quantize_mx_k128(dy)
        return [
            ("quantize x", lambda: quantize_mx_k128(x), m * k * 3, "cast"),
            w_piece,
            ("quantize dy", lambda: quantize_mx_k128(dy), m * n * 3, "cast"),
            ("GEMM y", lambda: blockwise_matmul(*xq, *wq, x.dtype), gemm, "gemm"),
            ("GEMM dx", lambda: blockwise_matmul(*dyq, wtq, wts, x.dtype), gemm, "gemm"),
            ("GEMM dW bf16", lambda: dy.t() @ x, gemm, "gemm"),
        ]
    (xq, xtq), (dyq, dytq) = quantize_mx_k128_rowcol(x), quantize_mx_k128_rowcol(dy)
    return [
        ("quantize x both ways", lambda: quantize_mx_k128_rowcol(x), m * k * 4, "cast"),
        w_piece,
        ("quantize dy both ways", lambda: quantize_mx_k128_rowcol(dy), m * n * 4, "cast"),
        ("GEMM y", lambda: blockwise_matmul(*xq, *wq, x.dtype), gemm, "gemm"),
        ("GEMM dx", lambda: blockwise_matmul(*dyq, wtq, wts, x.dtype), gemm, "gemm"),
        ("GEMM dW", lambda: blockwise_matmul(*dytq, *xtq, x.dtype), gemm, "gemm"),
    ]


ROWS_SWEEP = [
    fp8_kernels.RowsTiles(16, 512, 8, 32),
    fp8_kernels.RowsTiles(16, 1024, 8, 32),
    fp8_kernels.RowsTiles(32, 256, 8, 32),
    fp8_kernels.RowsTiles(32, 512, 8, 32),
    fp8_kernels.RowsTiles(32, 512, 8, 16),
    fp8_kernels.RowsTiles(32, 512, 8, 48),
    fp8_kernels.RowsTiles(64, 256, 8, 32),
]
BOTH_SWEEP = [fp8_kernels.BothTiles(), fp8_kernels.BothTiles(32, 256, 32, 128, 4)]


def sweep_casts(bench, device: str, tokens: int, shapes: list[tuple[int, int]]) -> None:
    """``--sweep``: the rows kernel (with and without the transposed copy) and the weight's
    both-ways cast under several launch shapes, in TB/s of bytes read once + written."""
    from gem_lowprec.formats import elem_format

    e4m3 = elem_format(E4M3)
    rows = []
    for c in sorted({k for k, _ in shapes}):
        x = torch.randn(tokens, c, device=device).to(torch.bfloat16)
        for transposed in (False, True):
            for t in ROWS_SWEEP:
                ms = bench(
                    lambda t=t, x=x, tr=transposed: fp8_kernels.cast_rows(
                        x, e4m3, transposed=tr, col_amax_row_mult=None, tiles=t
                    ),
                    warmup_ms=5,
                    rep_ms=15,
                )
                moved = x.numel() * (3 + transposed)
                rows.append(
                    [
                        f"rows{'+T' if transposed else ''} [{tokens}x{c}]",
                        str(t),
                        ms,
                        moved / ms / 1e9,
                    ]
                )
    for k, n in shapes:
        w = torch.randn(n, k, device=device).to(torch.bfloat16)
        for t in BOTH_SWEEP:
            ms = bench(
                lambda t=t, w=w: fp8_kernels.cast_both(w, e4m3, tiles=t), warmup_ms=5, rep_ms=20
            )
            rows.append([f"both [{n}x{k}]", str(t), ms, w.numel() * 6 / ms / 1e9])
    common.print_table("fp8 cast launch-shape sweep", ["cast", "tiles", "ms", "TB/s"], rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument(
        "--sweep", action="store_true", help="first sweep the fp8 casts' launch shapes"
    )
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    tokens = 128 if args.smoke else 32768
    bench = timer(args.smoke)
    shapes = [(128, 256), (256, 128)] if args.smoke else [(1024, 4096), (4096, 1024)]
    quick = dict(warmup_ms=10, rep_ms=40)
    no_fallback = FallbackConfig(measure_on_gpu=False)
    variants = [
        (name, wg, Recipe(name=name, weight_grad=WeightGradConfig(wg), fallback=no_fallback))
        for name in ("mxfp8", "fp8_rowwise")
        for wg in ("bf16", "fp8")
    ]
    print(common.environment())
    if args.sweep:
        sweep_casts(bench, device, tokens, shapes)
    totals, pieces, headline = [], [], {}
    for k, n in shapes:
        shape = f"{k}->{n}"
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, k, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(tokens, n, device=device, generator=gen).to(torch.bfloat16)
        flops = 3 * 2 * tokens * k * n
        base = LowPrecisionLinear(
            k, n, bias=False, recipe=Recipe(name="bf16"), device=device, dtype=torch.bfloat16
        )
        w, xd = base.weight.detach(), x.detach()
        t_bf16 = bench(fwd_bwd(base, x, dy))
        emit(totals, [shape, "bf16 F.linear (anchor)", t_bf16, common.tflops(flops, t_bf16), 1.0])
        for label, fn in [
            ("bf16 GEMM y", lambda xd=xd, w=w: F.linear(xd, w)),
            ("bf16 GEMM dx", lambda dy=dy, w=w: dy @ w),
            ("bf16 GEMM dW", lambda dy=dy, xd=xd: dy.t() @ xd),
        ]:
            t = bench(fn, **quick)
            emit(
                pieces,
                [shape, "bf16", label, t, common.tflops(flops / 3, t), "TFLOP/s", t / t_bf16],
            )
        fallback_recipes = [
            ("mxfp8 (measured fallback)", Recipe()),
            ("fp8_rowwise wgrad fp8 (measured fallback)", Recipe(name="fp8_rowwise", weight_grad=WeightGradConfig("fp8"))),
        ]  # fmt: skip
        for label, rec in [*((f"{n_} wgrad {wg}", r) for n_, wg, r in variants), *fallback_recipes]:
            mod = LowPrecisionLinear(
                k, n, bias=False, recipe=rec, device=device, dtype=torch.bfloat16
            )
            mod.weight.data.copy_(base.weight.data)
            t = bench(fwd_bwd(mod, x, dy))
            emit(totals, [shape, label, t, common.tflops(flops, t), t_bf16 / t])
            if rec.fallback.measure_on_gpu is False:
                headline[f"{rec.name}_wgrad_{rec.weight_grad.precision}_{k}to{n}_speedup"] = (
                    t_bf16 / t
                )
                make = mx_pieces if rec.name == "mxfp8" else rowwise_pieces
                try:
                    steps = make(xd, w, dy, rec.weight_grad.precision == "fp8")
                except Exception as exc:  # a failing path must not hide the other rows
                    print(f"  breakdown of {label} failed: {type(exc).__name__}: {exc}"[:300])
                    continue
                times = [bench(fn, **quick) for _, fn, _, _ in steps]
                total_kernels = sum(times)
                for (piece, _, amount, kind), tp in zip(steps, times, strict=True):
                    rate = amount / (tp * 1e-3) / 1e12
                    emit(
                        pieces,
                        [
                            shape,
                            label,
                            piece,
                            tp,
                            rate,
                            "TB/s" if kind == "cast" else "TFLOP/s",
                            tp / total_kernels,
                        ],
                    )
                emit(pieces, [shape, label, "sum of kernels (vs measured total)", total_kernels, t, "ms", 1.0])  # fmt: skip
        y_ref = F.linear(xd.float(), w.float())
        for name in ("mxfp8", "fp8_rowwise"):
            mod = LowPrecisionLinear(k, n, bias=False, recipe=Recipe(name=name, fallback=no_fallback), device=device, dtype=torch.bfloat16)  # fmt: skip
            mod.weight.data.copy_(w)
            y = mod(xd).float()
            sqnr = 10 * torch.log10(y_ref.pow(2).sum() / (y - y_ref).pow(2).sum()).item()
            print(f"{shape}: {name} forward SQNR vs fp32 {sqnr:.1f} dB")
    env = common.environment()
    common.print_table(
        f"G1 linear fwd+bwd, {tokens} tokens, {env}",
        ["shape", "recipe", "ms", "TFLOP/s", "speedup vs bf16"],
        totals,
    )
    common.print_table(
        f"G1 breakdown: each kernel alone, {tokens} tokens (share: of the path's kernel sum; bf16 rows: of the bf16 total)",
        ["shape", "path", "kernel", "ms", "rate", "unit", "share"],
        pieces,
    )
    print("fallbacks:", fallback_report() or "none")
    common.record("lowprec_linear", **headline)


if __name__ == "__main__":
    main()

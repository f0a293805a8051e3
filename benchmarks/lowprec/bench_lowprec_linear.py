"""G1 of workloads.md: linear forward + backward, 32768 tokens, 1024 -> 4096 and 4096 -> 1024,
BF16 against the low-precision recipes, all quantization included, measured in one run.

Rows: ``F.linear`` in BF16 (the anchor), ``LowPrecisionLinear`` with ``mxfp8`` and
``fp8_rowwise``, each with the weight-gradient in BF16 (default) and in fp8, with the per-shape
fallback switched off so that the fp8 path itself is timed; then what the default recipe (with
its measured fallback) picks. TFLOP/s counts 3 · 2 · M · K · N per fwd+bwd. ``--smoke`` runs a
tiny shape on the CPU (emulated GEMMs).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gem_lowprec import LowPrecisionLinear  # noqa: E402
from gem_lowprec.linear import fallback_report  # noqa: E402
from gem_lowprec.recipes import FallbackConfig, Recipe, WeightGradConfig  # noqa: E402


def fwd_bwd(module, x, dy):
    def step():
        x.grad = None
        module.weight.grad = None
        module(x).backward(dy)

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    tokens = 256 if args.smoke else 32768
    shapes = [(1024, 4096), (4096, 1024)] if not args.smoke else [(128, 256)]
    no_fallback = FallbackConfig(measure_on_gpu=False)
    variants = [
        (
            f"{name}, wgrad {wg}",
            Recipe(name=name, weight_grad=WeightGradConfig(wg), fallback=no_fallback),
        )
        for name in ("mxfp8", "fp8_rowwise")
        for wg in ("bf16", "fp8")
    ]
    print(common.environment())
    rows, headline = [], {}
    for k, n in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, k, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(tokens, n, device=device, generator=gen).to(torch.bfloat16)
        flops = 3 * 2 * tokens * k * n
        base = LowPrecisionLinear(
            k, n, bias=False, recipe=Recipe(name="bf16"), device=device, dtype=torch.bfloat16
        )
        t_bf16 = common.bench_ms(fwd_bwd(base, x, dy))
        rows.append(
            [f"{k}->{n}", "bf16 F.linear (anchor)", t_bf16, common.tflops(flops, t_bf16), 1.0]
        )
        for label, rec in [*variants, ("default mxfp8 (measured fallback)", Recipe())]:
            mod = LowPrecisionLinear(
                k, n, bias=False, recipe=rec, device=device, dtype=torch.bfloat16
            )
            mod.weight.data.copy_(base.weight.data)
            t = common.try_bench(fwd_bwd(mod, x, dy))
            rows.append([f"{k}->{n}", label, t, common.tflops(flops, t), t_bf16 / t])
            if rec.fallback.measure_on_gpu is False and rec.weight_grad.precision == "bf16":
                headline[f"{rec.name}_{k}to{n}_speedup"] = t_bf16 / t
            if label.startswith("fp8_rowwise, wgrad fp8"):
                headline[f"rowwise_wfp8_{k}to{n}_speedup"] = t_bf16 / t
        y_ref = F.linear(x.detach().float(), base.weight.detach().float())
        mod = LowPrecisionLinear(
            k, n, bias=False, recipe=variants[0][1], device=device, dtype=torch.bfloat16
        )
        mod.weight.data.copy_(base.weight.data)
        y = mod(x.detach()).float()
        sqnr = 10 * torch.log10(y_ref.pow(2).sum() / (y - y_ref).pow(2).sum()).item()
        print(f"{k}->{n}: mxfp8 forward SQNR vs fp32 {sqnr:.1f} dB")
    common.print_table(
        f"G1 linear fwd+bwd, {tokens} tokens, {common.environment()}",
        ["shape", "recipe", "ms", "TFLOP/s", "speedup vs bf16"],
        rows,
    )
    print("fallbacks:", fallback_report() or "none")
    common.record("lowprec_linear", **headline)


if __name__ == "__main__":
    main()

"""Q1, Q2, Q3 of workloads.md: MX quantize bandwidth against the PyTorch formula, compiled and
eager, measured in one run.

Bandwidth = (bytes read once + bytes written once) / time: bf16 input, fp8 output(s), E8M0 scales.
Rows: Q1 (1×32 along rows), Q1 with both row- and column-wise copies from one read (an extra
row, the backward's need), Q1 fused with the merge to 1×128 blocks (what mxfp8 feeds Hopper's
blockwise GEMM; fp8 bytes plus one float32 scale per 128, counted as the Q1 bytes), Q2 (32×32 tiles), Q3 (RMSNorm fused with 1×32), and a device copy of
the Q1 tensor as the ceiling. ``--smoke`` runs tiny shapes on the CPU (anchors eager).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
import torch  # noqa: E402
from gem_lowprec import rmsnorm_to_mx, to_mx, to_mx_2d, to_mx_rowcol  # noqa: E402
from gem_lowprec.scaled_matmul import quantize_mx_k128  # noqa: E402

E4M3_MAX = 448.0


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


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    q1 = (256, 512) if args.smoke else (16384, 8192)
    q3 = (256, 1024) if args.smoke else (32768, 1024)
    compile_ = (lambda f: f) if args.smoke else torch.compile
    print(common.environment())

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(q1, device=device, generator=gen).to(torch.bfloat16)
    xr = torch.randn(q3, device=device, generator=gen).to(torch.bfloat16)
    w = torch.rand(q3[1], device=device, generator=gen).to(torch.bfloat16) + 0.5
    n1, n3 = x.numel(), xr.numel()
    bytes_q1 = 2 * n1 + n1 + n1 // 32
    bytes_rowcol = 2 * n1 + 2 * n1 + 2 * (n1 // 32)
    bytes_q2 = 2 * n1 + n1 + n1 // 1024
    bytes_q3 = 2 * n3 + n3 + n3 // 32 + 2 * q3[1]

    f1, f2, f3 = compile_(formula_1x32), compile_(formula_32x32), compile_(formula_rmsnorm_1x32)
    cases = [
        ("copy (ceiling)", bytes_q1 // 3 * 4, lambda: x.clone(), None, None),
        ("Q1 1x32 rows", bytes_q1, lambda: to_mx(x), lambda: f1(x), lambda: formula_1x32(x)),
        ("Q1 rows+cols, one read", bytes_rowcol, lambda: to_mx_rowcol(x), None, None),
        ("Q1 + merge to 1x128", bytes_q1, lambda: quantize_mx_k128(x), None, None),
        ("Q2 32x32", bytes_q2, lambda: to_mx_2d(x), lambda: f2(x), lambda: formula_32x32(x)),
        (
            "Q3 rmsnorm+1x32",
            bytes_q3,
            lambda: rmsnorm_to_mx(xr, w),
            lambda: f3(xr, w),
            lambda: formula_rmsnorm_1x32(xr, w),
        ),
    ]
    rows, headline = [], {}
    for name, nbytes, ours, compiled, eager in cases:
        for fn in (ours, compiled):
            if fn is not None:
                fn()  # autotune / compile outside the timing
        t = common.bench_ms(ours)
        tc = common.try_bench(compiled) if compiled else float("nan")
        te = common.try_bench(eager) if eager else float("nan")
        tb = lambda ms, nb=nbytes: nb / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
        rows.append([name, t * 1e3, tb(t), tc * 1e3, tb(tc), te * 1e3, tb(te), tc / t])
        headline[name.split()[0] if name.startswith("Q") and "cols" not in name else name] = tb(t)
    common.print_table(
        f"MX quantize bandwidth (TB/s), {common.environment()}",
        [
            "workload",
            "ours us",
            "ours TB/s",
            "compiled us",
            "compiled TB/s",
            "eager us",
            "eager TB/s",
            "compiled/ours time",
        ],
        rows,
    )
    if not args.smoke:
        from gem_lowprec.ops.mx_quantize.triton import _tuned_kernel

        print(f"autotuned quantize config (last key): {_tuned_kernel.best_config}")
    common.record(
        "mx_quantize",
        Q1_TBps=headline.get("Q1", float("nan")),
        Q2_TBps=headline.get("Q2", float("nan")),
        Q3_TBps=headline.get("Q3", float("nan")),
        rowcol_TBps=rows[2][2],
        merged_k128_TBps=rows[3][2],
    )


if __name__ == "__main__":
    main()

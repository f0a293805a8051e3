"""Host cost of launching work: a Triton kernel, a few torch ops, from the main thread and from
autograd's backward.

Eager calls of this project's kernels were host-bound on the H200 machine (docs/performance.md,
2026-11-29): a 31 µs quantize kernel took about 100 µs per public call, a weight cast of three
small kernels about 200 µs, and a jagged attention backward of three launches about 650 µs of
host time. This script separates the parts, each as host µs per call (back-to-back calls without
a sync, divided by their count):

- an empty Triton kernel with one pointer argument, and one with the argument list the
  attention kernels pass (12 pointers, 6 integers, 2 floats, 6 constexprs);
- ``torch.empty`` (a cached allocation), ``torch.zeros`` (allocation + fill), an elementwise add;
- the same empty kernel launched inside an ``autograd.Function``'s backward, which runs on
  autograd's device thread, against the same launches from the main thread.

``--smoke`` runs a few calls on the CPU (Triton's interpreter; the numbers mean nothing there).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402


@triton.jit
def _empty_kernel(x_ptr):
    pid = tl.program_id(0)
    if pid < 0:  # never true: a launch that does no memory traffic
        tl.store(x_ptr, 0.0)


@triton.jit
def _empty_wide_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11,
    i0, i1, i2, i3, i4, i5, f0, f1,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
    C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr,
):  # fmt: skip
    if tl.program_id(0) < 0:
        tl.store(p0, f0 + f1 + i0 + i1 + i2 + i3 + i4 + i5 + C0 + C1 + C2 + C3 + C4 + C5)


def launch_empty(x):
    _empty_kernel[(1,)](x)


def launch_wide(x):
    _empty_wide_kernel[(1,)](
        *([x] * 12), 1024, 7, 64, 3, 100000, 2, 0.5, 1.25,
        C0=128, C1=64, C2=1, C3=0, C4=3, C5=1,
    )  # fmt: skip


class _LaunchInBackward(torch.autograd.Function):
    """Backward launches ``launches`` empty kernels (on autograd's device thread)."""

    @staticmethod
    def forward(ctx, x, launches: int):
        ctx.launches = launches
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        for _ in range(ctx.launches):
            launch_wide(grad)
        return grad, None


def host_us(fn, calls: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def run(smoke: bool) -> None:
    device = "cpu" if smoke else "cuda"
    calls = 3 if smoke else 2000
    x = torch.zeros(1024, device=device)
    rows = [
        ["empty Triton kernel, 1 argument", host_us(lambda: launch_empty(x), calls)],
        ["empty Triton kernel, 26 arguments", host_us(lambda: launch_wide(x), calls)],
        ["torch.empty(1024)", host_us(lambda: torch.empty(1024, device=device), calls)],
        ["torch.zeros(1024)", host_us(lambda: torch.zeros(1024, device=device), calls)],
        ["x + 1", host_us(lambda: x + 1, calls)],
    ]
    per_step = 10
    leaf = torch.zeros(1024, device=device, requires_grad=True)

    def main_thread():
        for _ in range(per_step):
            launch_wide(x)

    def in_backward():
        _LaunchInBackward.apply(leaf, per_step).sum().backward()

    step_calls = max(1, calls // per_step)
    main = host_us(main_thread, step_calls) / per_step

    def no_launches():
        _LaunchInBackward.apply(leaf, 0).sum().backward()

    backward = host_us(in_backward, step_calls) - host_us(no_launches, step_calls)
    rows += [
        ["26-argument launch, main thread (of 10 in a loop)", main],
        ["26-argument launch, inside backward (of 10)", backward / per_step],
    ]
    common.print_table(
        f"host µs per call ({common.environment()})", ["what", "host µs per call"], rows
    )
    common.record(
        "launch_overhead",
        triton_empty_us=rows[0][1],
        triton_wide_us=rows[1][1],
        torch_empty_us=rows[2][1],
        launch_in_backward_us=rows[-1][1],
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few calls on the CPU")
    args = parser.parse_args()
    run(args.smoke)

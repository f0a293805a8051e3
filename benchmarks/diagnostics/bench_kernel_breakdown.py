"""Device time per kernel of one forward + backward step: GDPA (SiLU) and JFA (softmax) on J1,
J3 and J4, with and without a learned relative bias.

Answers "which kernel does a step spend its time in" and "what does the bias cost, and where":
each row sums one kernel's CUDA time over ``--steps`` profiled steps (``torch.profiler``) and
divides by their count. Where matplotlib is installed it also draws the steps as stacked bars
(forward, dQ, dK/dV, other kernels) in ``kernel_breakdown.png`` under ``$OUT`` (or the current
folder). ``--smoke`` runs tiny sizes on the CPU (Triton interpreter; no CUDA times there, only a
check that the script runs).
"""

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jagged"))
import attention_bench as ab  # noqa: E402
import bench_gdpa  # noqa: E402
import common  # noqa: E402
from gem_jagged import jagged_flash_attention  # noqa: E402


def jfa_step(w, device, radius, heads):
    q_off = common.offsets_of(w.q_lengths, device)
    kv_off = None if w.name == "J1" else common.offsets_of(w.kv_lengths, device)
    rel_bias = None
    if radius is not None:
        rel_bias = torch.zeros(heads, 2 * radius + 1, device=device).requires_grad_()

    def fn(q, k, v):
        return jagged_flash_attention(
            q, k, v, q_off, kv_off, causal=w.causal, rel_bias=rel_bias, backend="triton"
        )

    return fn


def kernel_times(fn, q, k, v, do, steps: int) -> list[tuple[str, float, float]]:
    """(kernel, device us per step, launches per step), longest first."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        torch.autograd.grad(fn(*leaves), leaves, do)

    return common.device_kernel_times(step, steps)


PARTS = ("forward", "dQ", "dK/dV", "other")


def part_of(kernel: str) -> str:
    """The stage a kernel belongs to, from its name (the project's kernels say it)."""
    for marker, part in (("_fwd", "forward"), ("_dq", "dQ"), ("_dkdv", "dK/dV")):
        if marker in kernel:
            return part
    return "other"


def plot(steps: dict[str, list[tuple[str, float]]], folder: Path, *, title: str) -> str:
    """Stacked bars of device µs per fwd+bwd step, one bar a step, one segment a stage;
    ``steps`` maps a step's label to its (kernel, µs) rows."""
    plt = common.pyplot()
    if plt is None:
        return common.NO_MATPLOTLIB
    labels = list(steps)
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(labels) + 1.4))
    left = [0.0] * len(labels)
    for part, color in zip(PARTS, ("tab:blue", "tab:orange", "tab:green", "tab:gray"), strict=True):
        widths = [sum(us for name, us in steps[label] if part_of(name) == part) for label in labels]
        ax.barh(labels, widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("device µs per forward + backward step")
    ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"kernel time per step: {title}", fontsize=9)
    return common.save_figure(fig, folder / "kernel_breakdown.png")


def run(smoke: bool, radius: int, steps: int, only: tuple[str, ...]) -> None:
    device, dtype, heads, head_dim = ab.setup(smoke, bench_gdpa.HEADS, bench_gdpa.HEAD_DIM)
    print(f"# device time per kernel, {common.environment()}, {dtype}, N={heads}, D={head_dim}")
    table, by_step = [], {}
    for w in bench_gdpa.workloads(smoke):
        if only and w.name not in only:
            continue
        q, k, v, do = ab.make_inputs(w, device, dtype, heads, head_dim)
        ops = {
            "gdpa": lambda r, w=w: bench_gdpa.project_fn(w, device, rel_bias_radius=r, heads=heads)
        }
        if not w.pma:
            ops["JFA"] = lambda r, w=w: jfa_step(w, device, r, heads)
        for op, make in ops.items():
            for r in (None, radius):
                label = f"{w.name} {op}" + ("" if r is None else f" R={r}")
                rows = kernel_times(make(r), q, k, v, do, steps)
                total = sum(us for _, us, _ in rows)
                print(f"\n{label}: {total:.0f} us of kernels per fwd+bwd step")
                for name, us, count in rows[:8]:
                    print(f"  {us:8.1f} us  x{count:<4.3g} {name[:100]}")
                by_step[label] = [(name, us) for name, us, _ in rows]
                top = [us for _, us, _ in rows[:3]]
                table.append([label, total, *top, *[float("nan")] * (3 - len(top))])
                common.record("kernel_breakdown", step=label, kernel_us=total)
    common.print_table(
        f"kernel time per fwd+bwd step (us), {common.environment()}",
        ["step", "all kernels", "1st", "2nd", "3rd"],
        table,
    )
    if not smoke:
        print(plot(by_step, Path(os.environ.get("OUT", ".")), title=common.environment()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--rel-bias", type=common.radius, default=32, metavar="R")
    parser.add_argument("--steps", type=common.positive_int, default=10)
    parser.add_argument("--only", nargs="+", choices=("J1", "J3", "J4"), default=())
    args = parser.parse_args()
    run(args.smoke, args.rel_bias, 1 if args.smoke else args.steps, tuple(args.only))

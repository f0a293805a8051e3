"""Energy per FLOP of J1's attention steps against a bf16 matrix product, at the power limit.

An H200 holds its board power to a limit (700 W) by lowering its clock, so in a loop of steps
that draws the limit, a step's time follows its energy. This benchmark says where a step's
energy stands against the tensor cores' own: each case is replayed from a CUDA graph back to
back for ``--seconds`` (``--rounds`` rounds, cases alternating) and reported as ms per call
(median of the second half), mean SM clock, mJ per call (NVML's energy counter, read only),
mean watts, pJ per computed and per useful FLOP, and computed TFLOP/s. Cases:

- ``gemm``: a bf16 8192 x 8192 x 8192 product, the tensor cores with the least work around them;
- ``project fwd`` and ``project fwd+bwd``: the project's J1 steps. Computed FLOPs count the
  64 x 64 tiles the kernels compute (causal self-attention: t(t+1)/2 tile pairs for a sequence
  of t tiles) and the products over them: 2 in the forward (S, PV), 9 in forward + backward
  (dK/dV: S, dP, dV, dK; the dQ kernel: S and dP again, and dQ). Useful FLOPs count the pairs
  (4·N·D per pair forward, 3.5x that for forward + backward, as the other benchmarks do);
- ``flex fwd`` and ``flex fwd+bwd``: FlexAttention with a document + causal mask, useful FLOPs
  only (its tiling is its own);
- ``project bwd (difference)``: forward + backward minus forward, per round.

Where matplotlib is installed it draws the medians as bars in ``energy_per_flop.png`` under
``$OUT`` (or the current folder).

    python benchmarks/diagnostics/bench_energy.py [--seconds 1] [--rounds 2]

``--smoke`` runs tiny lengths on the CPU (Triton interpreter, eager Flex forward only; no energy
there), to check that the script runs.
"""

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jagged"))
import attention_bench as ab  # noqa: E402
import bench_jagged_flash_attention as bj  # noqa: E402
import common  # noqa: E402

TILE = 64  # the kernels' query and key tiles at head dim 128 (hopper/__init__.py)
GEMM_SIZE = 8192


def computed_tile_pairs(lengths) -> int:
    """64 x 64 tile pairs a causal self-attention over ``lengths`` computes."""
    tiles = -(-np.asarray(lengths, dtype=np.int64) // TILE)
    return int((tiles * (tiles + 1) // 2).sum())


def cases(smoke: bool) -> dict[str, tuple]:
    """name -> (call, computed FLOPs or None, useful FLOPs or None)."""
    (w,) = bj.workloads(smoke, ("J1",))
    device, dtype = ab.device_and_dtype()
    heads, head_dim = w.heads, w.head_dim
    q, k, v, do = ab.make_inputs(w, device, dtype, heads, head_dim)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    project = bj.project_fn(w, q, k, v, device)
    mask = ab.document_mask(w.q_lengths, w.kv_lengths, device, causal=True)
    flex = ab.flex_fn(mask, len(q), len(k), device=device, smoke=smoke)
    product = 2 * TILE * TILE * head_dim * heads * computed_tile_pairs(w.q_lengths)
    useful = 4 * heads * head_dim * w.pairs()
    size = 64 if smoke else GEMM_SIZE
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))

    def forward(fn):
        def call():
            with torch.no_grad():
                fn(q, k, v)

        return call

    def forward_backward(fn):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, do)

    found = {
        "gemm": (lambda: a @ b, 2 * size**3, None),
        "project fwd": (forward(project), 2 * product, useful),
        "project fwd+bwd": (forward_backward(project), 9 * product, 3.5 * useful),
        "flex fwd": (forward(flex), None, useful),
        "flex fwd+bwd": (forward_backward(flex), None, 3.5 * useful),
    }
    if smoke:
        del found["flex fwd+bwd"]  # FlexAttention has no backward on the CPU
    return found


def run_for(call, seconds: float) -> tuple[float, float, float]:
    """(ms per call, mean SM MHz, mJ per call) of ``call`` back to back for ``seconds``; on
    the CPU, two timed calls and no clock or energy."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for _ in range(2):
            call()
        return (time.perf_counter() - start) / 2 * 1e3, float("nan"), float("nan")
    run = common.sustained(call, seconds=seconds, window=10)
    return run.ms, run.mhz, run.mj


@dataclass
class Measured:
    """One case in one round; ``computed`` and ``useful`` are FLOPs (None: not counted)."""

    round: int
    case: str
    ms: float
    mhz: float
    mj: float
    computed: float | None
    useful: float | None

    def pj_per(self, flops: float | None) -> float:
        return float("nan") if flops is None else self.mj * 1e9 / flops


def with_backward(measured: list[Measured]) -> list[Measured]:
    """``measured`` plus, per round, the backward alone: forward + backward minus forward (time,
    energy, FLOPs; the clock is not separable and stays NaN)."""
    out = list(measured)
    for round_ in sorted({m.round for m in measured}):
        got = {m.case: m for m in measured if m.round == round_}
        if "project fwd" in got and "project fwd+bwd" in got:
            f, fb = got["project fwd"], got["project fwd+bwd"]
            out.append(Measured(
                round_, "project bwd (difference)", fb.ms - f.ms, float("nan"), fb.mj - f.mj,
                fb.computed - f.computed, fb.useful - f.useful,
            ))  # fmt: skip
    return sorted(out, key=lambda m: m.round)


def plot(measured: list[Measured], folder: Path, *, title: str) -> str:
    """Bars of pJ per computed FLOP (the tensor cores' work as done) and per useful FLOP (the
    pairs the workload asks for), each case's median over the rounds."""
    plt = common.pyplot()
    if plt is None:
        return common.NO_MATPLOTLIB
    cases = list(dict.fromkeys(m.case for m in measured))
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(cases) + 1.6), sharey=True)
    for ax, label, flops_of in (
        (axes[0], "pJ per computed FLOP", lambda m: m.computed),
        (axes[1], "pJ per useful FLOP", lambda m: m.useful),
    ):
        values = [
            float(np.median([m.pj_per(flops_of(m)) for m in measured if m.case == case]))
            for case in cases
        ]
        colors = ["tab:orange" if case.startswith("flex") else "tab:blue" for case in cases]
        ax.barh(cases, np.nan_to_num(values), color=colors)
        for y, value in enumerate(values):
            if not np.isnan(value):
                ax.text(value, y, f" {value:.2f}", va="center", fontsize=8)
        ax.set_xlabel(label)
    axes[0].invert_yaxis()  # the axes share y: cases top to bottom in measuring order
    fig.suptitle(f"J1 and a bf16 GEMM at the power limit: {title}", fontsize=9)
    return common.save_figure(fig, folder / "energy_per_flop.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="per case and round")
    parser.add_argument("--rounds", type=common.positive_int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args()
    found = cases(args.smoke)
    graphed = torch.cuda.is_available()
    calls = {name: common.cuda_graph_of(c[0]) if graphed else c[0] for name, c in found.items()}
    measured = []
    for round_ in range(1, args.rounds + 1):
        for name, (_, computed, useful) in found.items():
            ms, mhz, mj = run_for(calls[name], args.seconds)
            print(f"round {round_}: {name} done", file=sys.stderr, flush=True)
            measured.append(Measured(round_, name, ms, mhz, mj, computed, useful))
    measured = with_backward(measured)

    def cell(value: float, digits: int) -> str:
        return "-" if np.isnan(value) else f"{value:.{digits}f}"

    rows = [
        [m.round, m.case, f"{m.ms:.4f}", cell(m.mhz, 0), cell(m.mj, 1), cell(m.mj / m.ms, 0),
         cell(m.pj_per(m.computed), 3), cell(m.pj_per(m.useful), 3),
         "-" if m.computed is None else f"{common.tflops(m.computed, m.ms):.0f}"]
        for m in measured
    ]  # fmt: skip
    title = common.environment()
    common.print_table(
        f"energy per call, {'graph replays back to back' if graphed else 'CPU smoke run'} ({title})",
        ["round", "case", "ms", "SM MHz", "mJ", "W", "pJ / computed FLOP", "pJ / useful FLOP",
         "computed TFLOP/s"],
        rows,
    )  # fmt: skip
    print(plot(measured, Path(os.environ.get("OUT", ".")), title=title))


if __name__ == "__main__":
    main()

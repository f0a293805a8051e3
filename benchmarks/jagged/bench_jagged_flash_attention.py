"""Jagged flash attention on J1, J2, J3 against FlexAttention, padded SDPA and nested-jagged SDPA.

Useful TFLOP/s count only real (query, key) pairs (workloads.md): forward 4·N·D·pairs, forward +
backward 3.5× that. J1 and J2 are causal self-attention over user histories; J3 is jagged queries
(J1's lengths) over 64 candidate keys per sample, not causal. Anchors, measured in the same run:

- FlexAttention (compiled) on the packed sequence with a document mask (+ causal), the block mask
  built once outside the timing;
- SDPA (flash backend) on a padded batch ``[B, N, Lmax, D]``, timing the attention only (padding
  and unpadding not counted, which flatters the anchor);
- SDPA on nested jagged tensors (``torch.nested`` layout ``jagged``) where it runs.

The project is timed twice: called eagerly (the public function validates the offsets' values
on the host once per offsets tensor, and repeated calls go through launch plans) and inside
``torch.compile(fullgraph=True)`` (validation is skipped while tracing, as in a compiled model);
the ratios use the compiled figure, the anchors being compiled too. A third figure
replays the project's step as a CUDA graph (the op is capturable: no host synchronisation), which
removes the host's launch overhead and shows what the kernels themselves sustain; FlexAttention
and padded SDPA are replayed the same way, and the "graphed x" ratios compare replay with
replay (device time against device time).

``--quick`` keeps the rows the goals name (under a minute on an H200): the project eager and
graph-replayed on J1 and J2 beside FlexAttention and padded SDPA, on J3 beside padded SDPA; no
compiled project (the ratios then use the eager figure) and no nested SDPA. ``--smoke`` runs tiny
sizes on the CPU (Triton interpreter, eager anchors) to catch errors fast; ``--sweep`` also times
kernel configurations of the project's kernel on J1, J2 and J3 (graph replays: device time only,
since eager timings of one config differ by ±15% from run to run once the host is the limit),
each beside its largest deviation from the default configuration's output and gradients;
``--variants TEXT ...`` keeps the configurations whose names contain one of the texts.

The goals' ratios to FlexAttention (J1, J2 forward + backward) are also measured alternately,
project then FlexAttention, five rounds of a full-length ``do_bench`` each, eager and
graph-replayed: a drift of the GPU's clocks or temperature during the run then reaches both
sides of every ratio, and the spread over the rounds shows how far one figure can be trusted.
They are measured a third way as well, as a training loop of this step would run: each side's
step replayed back to back for a second, three rounds, with the SM clock each side ran at
(``nvidia-smi``) and its energy per step (NVML's counter, read only). The H200 holds its board
power to its limit by lowering the clock; a step that draws the limit runs slower there than
in a short ``do_bench`` (docs/history/performance.md, 2026-12-02, eighteenth session). Where matplotlib is installed the first round is drawn, ms
per step over the loop, in ``jfa_sustained.png`` under ``$OUT`` (or the current directory).

Every GPU run also prints the host's cost per call: the CPU time to issue one step without
waiting for the device (a loop of calls, no synchronisation), for the public function (with
the forward's K/V through TMA descriptors, which Triton encodes on the host per launch, and by
pointers; and with its launch plans off, every call checked and launched the ordinary way) and
for the custom op with its work lists rebuilt on every call and no launch plans (how eager
calls ran before the eager fast path, the work-list cache and the plans), beside the step's
device time (graph replay). A step
whose host time exceeds its device time is host-bound when called eagerly. (The Triton forward
through TMA descriptors is never planned, so its column times the ordinary path.)
"""

import argparse
import dataclasses
import os
import sys
import textwrap
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_bench as ab  # noqa: E402
import common  # noqa: E402
import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from attention_bench import Workload  # noqa: E402
from gem_jagged import JaggedBatch, jagged_flash_attention  # noqa: E402
from gem_jagged.ops.jagged_flash_attention.config import (  # noqa: E402
    DqPlacement,
    KernelImpl,
    KeyLoads,
    arch_of,
    config_for,
    regime_for,
)

HEADS, HEAD_DIM = 4, 128
CANDIDATES = 64  # J3: keys per sample
QUICK_FLEX = ("J1", "J2")  # --quick: the workloads whose goals name FlexAttention


def workloads(smoke: bool, only: tuple[str, ...] = ()) -> list[Workload]:
    """J1, J2, J3 (tiny stand-ins for J1 and J3 with ``smoke``); ``only`` keeps those named."""
    if smoke:
        lengths = np.array([5, 20, 0, 9])
        found = [
            Workload("J1", lengths, lengths, True),
            Workload("J3", lengths, np.full(4, 8), False),
        ]
    else:
        j1, j2 = common.workload_lengths("J1"), common.workload_lengths("J2")
        found = [
            Workload("J1", j1, j1, True),
            Workload("J2", j2, j2, True),
            Workload("J3", j1, np.full(len(j1), CANDIDATES), False),
        ]
    return [w for w in found if not only or w.name in only]


def project_fn(w, q, k, v, device, *, rel_bias_radius=None, config=None, prebuilt=False):
    """The project's call; with ``rel_bias_radius`` R it also learns a relative bias
    ``[N, 2R+1]`` (the trainer's setting; its gradient is part of the backward). ``config``: the
    kernels' ``JaggedAttentionConfig`` (None: the op picks). ``prebuilt``: the call takes one
    ``JaggedBatch`` built beforehand (a model's way) instead of offsets tensors."""
    q_off = common.offsets_of(w.q_lengths, device)
    kv_off = common.offsets_of(w.kv_lengths, device)
    hints = dict(max_q_len=int(w.q_lengths.max()), max_kv_len=int(w.kv_lengths.max()))
    if prebuilt:
        q_off, kv_off, hints = JaggedBatch(q_off, kv_off, **_batch_hints(hints)), None, {}
    backend = "triton"
    rel_bias = None
    if rel_bias_radius is not None:
        gen = torch.Generator().manual_seed(0)
        rel_bias = torch.randn(q.shape[1], 2 * rel_bias_radius + 1, generator=gen) * 0.1
        rel_bias = rel_bias.to(device).requires_grad_()

    def fn(q, k, v):
        return jagged_flash_attention(
            q, k, v, q_off, kv_off, causal=w.causal, rel_bias=rel_bias, backend=backend,
            config=config, **hints,
        )  # fmt: skip

    fn.rel_bias = rel_bias  # for the sweep's check of every gradient
    return fn


def _batch_hints(hints):
    return dict(max_len=hints["max_q_len"], max_kv_len=hints["max_kv_len"])


def default_config(w, rel_bias: bool, dtype):
    """The config the op picks for ``w`` on this GPU (``config_for``)."""
    return config_for(
        arch=arch_of(torch.device("cuda")), dtype=dtype, head_dim=HEAD_DIM,
        regime=regime_for(total_kv=int(w.kv_lengths.sum()), num_seqs=len(w.kv_lengths)),
        rel_bias=rel_bias,
    )  # fmt: skip


def nested_fn(w, device):
    q_off = common.offsets_of(w.q_lengths, device)
    kv_off = common.offsets_of(w.kv_lengths, device)

    def fn(q, k, v):
        qn = torch.nested.nested_tensor_from_jagged(q, q_off).transpose(1, 2)
        kn = torch.nested.nested_tensor_from_jagged(k, kv_off).transpose(1, 2)
        vn = torch.nested.nested_tensor_from_jagged(v, kv_off).transpose(1, 2)
        return (
            F.scaled_dot_product_attention(qn, kn, vn, is_causal=w.causal).transpose(1, 2).values()
        )

    return fn


ANCHORS = ("flex", "padded", "nested")
# Timed again as CUDA-graph replays (device time, no host cost), each against the others.
GRAPHED = ("project", "flex", "padded")


def run(
    smoke: bool, sweep: bool, project_only: bool = False, quick: bool = False, only=(),
    rel_bias_radius: int | None = None, variants: tuple[str, ...] = (),
) -> None:  # fmt: skip
    device, dtype, heads, head_dim = ab.setup(smoke, HEADS, HEAD_DIM)
    bench, anchor_bench = ab.benches(smoke, quick=quick)
    bias_note = "" if rel_bias_radius is None else f", project with rel_bias R={rel_bias_radius}"
    print(f"# jagged flash attention, {common.environment()}, {dtype}, N={heads}, D={head_dim}"
          f"{bias_note} (anchors without bias)")  # fmt: skip
    rows, headline, alternating, sustained = [], {}, [], []
    for w in workloads(smoke, only):
        q, k, v, do = ab.make_inputs(w, device, dtype, heads, head_dim)
        project = project_fn(w, q, k, v, device, rel_bias_radius=rel_bias_radius)
        fns = {"project": (project, (q, k, v, do))}
        if not smoke and not quick:  # smoke mode leaves compilation to the compile test
            fns["compiled"] = (torch.compile(project, fullgraph=True), (q, k, v, do))
        if not project_only:
            if not quick or w.name in QUICK_FLEX:
                mask = ab.document_mask(w.q_lengths, w.kv_lengths, device, causal=w.causal)
                flex = ab.flex_fn(mask, len(q), len(k), device=device, smoke=smoke)
                fns["flex"] = (flex, (q, k, v, do))
            lengths = (w.q_lengths, w.kv_lengths, w.kv_lengths, w.q_lengths)
            padded = [ab.pad_heads(t, n, device) for t, n in zip((q, k, v, do), lengths)]  # noqa: B905
            fns["padded"] = (ab.padded_sdpa_fn(causal=w.causal), padded)
            if not quick:
                fns["nested"] = (nested_fn(w, device), (q, k, v, do))
        base = "compiled" if "compiled" in fns else "project"
        for backward in (False, True):
            flops = common.attention_flops(
                w.pairs(), heads=heads, head_dim=head_dim, backward=backward
            )
            ms = dict.fromkeys(
                (*ANCHORS, "compiled", *(f"{n} (graph)" for n in GRAPHED)), float("nan")
            )
            ms |= ab.measure(
                fns, project=("project", "compiled"), backward=backward, bench=bench,
                anchor_bench=anchor_bench, graphed=[n for n in GRAPHED if n in fns],
            )  # fmt: skip
            tf = {n: common.tflops(flops, t) for n, t in ms.items()}  # noqa: B023
            label = "fwd+bwd" if backward else "fwd"
            best, graphed = ms[base], ms["project (graph)"]
            rows.append(
                [w.name, label, ms["project"], tf["project"], ms["compiled"], tf["compiled"],
                 tf["flex"], tf["padded"], tf["nested"],
                 *(_ratio(ms[a] / best) for a in ("flex", "padded", "nested")),
                 tf["project (graph)"], tf["flex (graph)"], tf["padded (graph)"],
                 *(_ratio(ms[f"{a} (graph)"] / graphed) for a in ("flex", "padded"))]
            )  # fmt: skip
            common.record(
                "jagged_flash_attention",
                workload=f"{w.name} {label}",
                tflops=tf[base],
                tflops_eager=tf["project"],
                tflops_graphed=tf["project (graph)"],
                x_flex=ms["flex"] / best,
                x_padded=ms["padded"] / best,
            )
            # The goals (forward + backward, no bias; README's results table): anchor, target.
            goals = {"J1": {"flex": 2.0, "padded": 1.0}, "J2": {"flex": 1.5, "padded": 1.0},
                     "J3": {"padded": 1.0}}  # fmt: skip
            for anchor, target in goals.get(w.name, {}).items():
                if backward and rel_bias_radius is None and anchor in fns:
                    mine, theirs, basis = common.graphed_or_eager(ms, "project", anchor)
                    name = {"flex": "FlexAttention", "padded": "padded SDPA"}[anchor]
                    common.record_goal(
                        benchmark="jagged_flash_attention",
                        goal=f"jagged flash attention vs {name}",
                        workload=f"{w.name} {label}",
                        gemkit=mine,
                        anchor=name,
                        anchor_value=theirs,
                        ratio=theirs / mine,
                        unit="ms",
                        basis=basis,
                        target=target,
                    )
            key = f"{w.name.lower()}_{'fwdbwd' if backward else 'fwd'}"
            for anchor in ("flex", "padded"):
                if anchor in fns:
                    headline[f"{key}_x_{anchor}"] = ms[anchor] / best
                    headline[f"{key}_graph_x_{anchor}"] = ms[f"{anchor} (graph)"] / graphed
        if device == "cuda" and "flex" in fns:
            for graph in (False, True):
                ratios = alternating_ratios(fns["project"], fns["flex"], graph=graph)
                mode = "graphed" if graph else "eager"
                alternating.append((w.name, mode, ratios))
                headline[f"{w.name.lower()}_fwdbwd_{mode}_x_flex_alternating"] = float(
                    np.median(ratios)
                )
            rounds = sustained_rounds(fns["project"], fns["flex"])
            sustained.append((w.name, rounds))
            headline[f"{w.name.lower()}_fwdbwd_sustained_x_flex"] = float(
                np.median([r.anchor_ms / r.project_ms for r in rounds])
            )
        del fns, q, k, v, do
    common.print_table(
        f"jagged flash attention, useful TFLOP/s ({common.environment()}); "
        f"x = anchor time / {'compiled' if not (quick or smoke) else 'eager'} project time",
        ["workload", "pass", "eager ms", "eager", "compiled ms", "compiled", "flex",
         "padded SDPA", "nested SDPA", "x flex", "x padded", "x nested", "graphed", "flex graphed",
         "padded graphed", "graphed x flex", "graphed x padded"],
        rows,
    )  # fmt: skip
    if alternating:
        rounds = [f"round {i + 1}" for i in range(ALTERNATING_ROUNDS)]
        common.print_table(
            "forward + backward, FlexAttention time / project time, measured alternately "
            f"({ALTERNATING_ROUNDS} rounds of a full-length do_bench each, project first)",
            ["workload", "mode", "min", "median", "max", *rounds],
            [
                [name, mode, *map(_ratio, (min(r), float(np.median(r)), max(r), *r))]
                for name, mode, r in alternating
            ],
        )
    if sustained:
        print_sustained(sustained)
        folder = Path(os.environ.get("OUT", "."))
        print(plot_sustained(sustained, folder, title=common.environment()))
    if headline:
        basis = "eager" if quick or smoke else "compiled"
        common.record("jagged_flash_attention", workload="headline", basis=basis, **headline)
    if device == "cuda":
        run_host_cost(dtype, only)
    if sweep and device == "cuda":
        run_sweep(dtype, only, rel_bias_radius, variants)


ALTERNATING_ROUNDS = 5


def alternating_ratios(project, anchor, *, graph: bool) -> list[float]:
    """Anchor ms / project ms of a forward + backward step, each round measuring the project
    and then the anchor (``(fn, (q, k, v, do))`` pairs) with a full-length ``do_bench``."""

    def ms(fn_and_args) -> float:
        fn, args = fn_and_args
        return ab.timed(fn, *args, backward=True, bench=common.bench_ms, graph=graph)

    ratios = []
    for _ in range(ALTERNATING_ROUNDS):
        project_ms = ms(project)
        ratios.append(ms(anchor) / project_ms)
    return ratios


SUSTAINED_ROUNDS, SUSTAINED_S, SUSTAINED_WINDOW = 3, 1.0, 20  # rounds, seconds a side, steps


@dataclasses.dataclass
class SustainedRound:
    project_ms: float  # median ms per step over the second half
    anchor_ms: float
    project_mhz: float  # mean SM clock while each side ran (NaN without nvidia-smi)
    anchor_mhz: float
    project_windows: list[float]  # ms per step of each window of steps, in order
    anchor_windows: list[float]
    project_mj: float  # energy per step (NVML's counter; NaN without it)
    anchor_mj: float


def sustained_rounds(project, anchor) -> list[SustainedRound]:
    """Forward + backward steps replayed from a CUDA graph back to back for ``SUSTAINED_S``
    seconds a side (as a training loop of this step would run them), the project and then the
    anchor in each round: each side's median ms over the second half, its SM clock and its
    energy per step. The H200 holds its board power to a limit by lowering the clock, and a
    kernel that draws the limit runs slower in such a loop than in a short ``do_bench``."""

    def replay_of(fn_and_args):
        fn, (q, k, v, do) = fn_and_args
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return common.cuda_graph_of(lambda: torch.autograd.grad(fn(*leaves), leaves, do))

    def run(replay) -> common.Sustained:
        return common.sustained(replay, seconds=SUSTAINED_S, window=SUSTAINED_WINDOW)

    project_replay, anchor_replay = replay_of(project), replay_of(anchor)
    rounds = []
    for _ in range(SUSTAINED_ROUNDS):
        p, a = run(project_replay), run(anchor_replay)
        rounds.append(SustainedRound(p.ms, a.ms, p.mhz, a.mhz, p.windows, a.windows, p.mj, a.mj))
    return rounds


def plot_sustained(sustained, folder: Path, *, title: str) -> str:
    """ms per step against the time spent in steps so far, the first round of each workload:
    the project's step slows as the chip reaches its power limit, the anchor's need not."""
    plt = common.pyplot()
    if plt is None:
        return common.NO_MATPLOTLIB
    fig, axes = plt.subplots(1, len(sustained), figsize=(6 * len(sustained), 4), squeeze=False)
    for ax, (name, rounds) in zip(axes[0], sustained, strict=True):
        first = rounds[0]
        for label, windows, mhz in (
            ("project", first.project_windows, first.project_mhz),
            ("FlexAttention", first.anchor_windows, first.anchor_mhz),
        ):
            elapsed_s = np.cumsum(windows) * SUSTAINED_WINDOW / 1e3
            ax.plot(elapsed_s, windows, label=f"{label} (mean {mhz:.0f} MHz)")
        ax.set_title(f"{name} forward + backward", fontsize=9)
        ax.set_xlabel("time in steps so far (s)")
        ax.set_ylabel("ms per step")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    heading = f"steps replayed back to back: {title}"
    fig.suptitle(textwrap.fill(heading, width=int(75 * len(sustained))), fontsize=9)
    return common.save_figure(fig, folder / "jfa_sustained.png")


def print_sustained(sustained) -> None:
    rows = [
        [name, i + 1, f"{r.project_ms:.4f}", f"{r.project_mhz:.0f}", f"{r.project_mj:.0f}",
         f"{r.anchor_ms:.4f}", f"{r.anchor_mhz:.0f}", f"{r.anchor_mj:.0f}",
         _ratio(r.anchor_ms / r.project_ms)]
        for name, rounds in sustained
        for i, r in enumerate(rounds)
    ]  # fmt: skip
    common.print_table(
        f"forward + backward replayed back to back for {SUSTAINED_S:g} s a side, alternately "
        "(median ms of the second half; mean SM MHz from nvidia-smi; mJ per step from NVML's "
        "energy counter)",
        [
            "workload",
            "round",
            "project ms",
            "project MHz",
            "project mJ",
            "flex ms",
            "flex MHz",
            "flex mJ",
            "x flex",
        ],
        rows,
    )


def _ratio(x: float) -> str:
    """A ratio to three decimals (the goals sit at 2 and 1.5: "2" would not say which side)."""
    return f"{x:.3f}"


def _step(fn, q, k, v, do, backward):
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    if backward:
        return lambda: torch.autograd.grad(fn(*leaves), leaves, do)

    def forward():
        with torch.no_grad():
            fn(*leaves)

    return forward


def host_us(step, calls: int = 30) -> float:
    """CPU microseconds to issue one step, the device left to catch up afterwards."""
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def host_us_by_forward_loads(w: Workload, q, k, v, do, backward, dtype, rounds: int = 3):
    """Host us per step of the public function with the forward's K/V through TMA descriptors
    and by pointers: the least of ``rounds`` alternating measurements each (a descriptor is
    encoded per launch)."""
    base = default_config(w, False, dtype)
    times = {loads: [] for loads in KeyLoads}
    for _ in range(rounds):
        for loads in KeyLoads:
            fn = project_fn(w, q, k, v, "cuda", config=dataclasses.replace(base, key_loads=loads))
            times[loads].append(host_us(_step(fn, q, k, v, do, backward)))
    return min(times[KeyLoads.TMA]), min(times[KeyLoads.POINTERS])


def run_host_cost(dtype, only=()) -> None:
    """Host cost per call against device time, eager: the public function with the forward's
    K/V through TMA descriptors and by pointers (offsets tensors: a batch built per call), and
    over a prebuilt ``JaggedBatch`` (its work lists built once); without a relative bias."""
    rows = []
    for w in workloads(False, only):
        q, k, v, do = ab.make_inputs(w, "cuda", dtype, HEADS, HEAD_DIM)
        public = project_fn(w, q, k, v, "cuda")
        prebuilt = project_fn(w, q, k, v, "cuda", prebuilt=True)
        for backward in (False, True):
            device_ms = ab.timed(public, q, k, v, do, backward=backward, bench=common.bench_ms,
                                 graph=True)  # fmt: skip
            eager_ms = ab.timed(public, q, k, v, do, backward=backward, bench=common.bench_ms)
            rows.append(
                [w.name, "fwd+bwd" if backward else "fwd",
                 *host_us_by_forward_loads(w, q, k, v, do, backward, dtype),
                 min(host_us(_step(prebuilt, q, k, v, do, backward)) for _ in range(3)),
                 device_ms * 1e3, eager_ms * 1e3]
            )  # fmt: skip
    common.print_table(
        "host cost per call (CPU us to issue one step, no sync) against device time; no "
        "relative bias, whatever --rel-bias says",
        ["workload", "pass", "host us (public fn, fwd TMA)", "host us (public fn, fwd pointers)",
         "host us (public fn, prebuilt JaggedBatch)", "device us (graph replay)",
         "eager us (median, synced)"],
        rows,
    )  # fmt: skip


def _with(base, **changes):
    """``base`` with ``changes``: ``fwd_…``, ``dkdv_…``, ``dq_…`` tile fields (``block_m``,
    ``block_n``, ``warps``, ``stages``) of one kernel, or the config's own fields."""
    kernels = {"fwd": "forward", "dkdv": "dkdv", "dq": "dq"}
    tiles, own = {}, {}
    for key, value in changes.items():
        kernel, _, field = key.partition("_")
        if kernel in kernels and field in ("block_m", "block_n", "warps", "stages"):
            tiles.setdefault(kernels[kernel], {})[field] = value
        else:
            own[key] = value
    for kernel, fields in tiles.items():
        own[kernel] = dataclasses.replace(getattr(base, kernel), **fields)
    return dataclasses.replace(base, **own)


def _sweep_variants(base, workload: str):
    r = _with
    tma, pointers = KeyLoads.TMA, KeyLoads.POINTERS
    gluon, triton = KernelImpl.GLUON_HOPPER, KernelImpl.TRITON
    on_tma = base.key_loads == tma
    dkdv_gluon, dq_gluon = base.dkdv_impl == gluon, base.dq_impl == gluon
    fwd_gluon = base.forward_impl == gluon
    all_gluon = dict(forward_impl=gluon, dkdv_impl=gluon, dq_impl=gluon)
    variants = {
        "default": base,
        "fwd+dq m128 w8, dkdv s3 (the default before, and the bias table's)": r(
            base, fwd_block_m=128, fwd_warps=8, dq_block_m=128, dq_warps=8, dkdv_stages=3
        ),
        "fwd s2": r(base, fwd_stages=2),
        "fwd s4": r(base, fwd_stages=4),
        "fwd+dq n32": r(base, fwd_block_n=32, dq_block_n=32),
        "dkdv m32": r(base, dkdv_block_m=32),
        "dkdv s3": r(base, dkdv_stages=3),
        "dq s2" if base.dq.stages > 2 else "dq s3": r(
            base, dq_stages=2 if base.dq.stages > 2 else 3
        ),
        "fwd pointers" if on_tma else "fwd tma": r(base, key_loads=pointers if on_tma else tma),
        "fwd m128 w8": r(base, fwd_block_m=128, fwd_warps=8),
        "fwd n128 s2": r(base, fwd_block_n=128, fwd_stages=2),
        "fwd w8": r(base, fwd_warps=8),
        "fwd+dq m64 w4, dkdv s2, fwd tma (the plain table's)": r(
            base,
            fwd_block_m=64,
            fwd_warps=4,
            dq_block_m=64,
            dq_warps=4,
            dkdv_stages=2,
            key_loads=tma,
        ),
        "fwd m64 w4 tma, dq as is": r(base, fwd_block_m=64, fwd_warps=4, key_loads=tma),
        "bwd: dq m64 w4, dkdv s2": r(base, dq_block_m=64, dq_warps=4, dkdv_stages=2),
        "bwd: dq m64 w4": r(base, dq_block_m=64, dq_warps=4),
        "bwd: dkdv s2": r(base, dkdv_stages=2),
        "dkdv triton" if dkdv_gluon else "dkdv hopper": r(
            base, dkdv_impl=triton if dkdv_gluon else gluon
        ),
        "dq triton" if dq_gluon else "dq hopper": r(base, dq_impl=triton if dq_gluon else gluon),
        "fwd triton" if fwd_gluon else "fwd hopper": r(
            base, forward_impl=triton if fwd_gluon else gluon
        ),
        "all hopper, dkdv s3": r(base, **all_gluon, dkdv_stages=3),
        "dkdv hopper s4": r(base, dkdv_impl=gluon, dkdv_stages=4),
        "dkdv hopper n64 w4 s2": r(
            base, dkdv_impl=gluon, dkdv_block_n=64, dkdv_warps=4, dkdv_stages=2
        ),
        "dkdv hopper n64 w4 s3": r(
            base, dkdv_impl=gluon, dkdv_block_n=64, dkdv_warps=4, dkdv_stages=3
        ),
        "dkdv hopper n128 w8 s2": r(
            base, dkdv_impl=gluon, dkdv_block_n=128, dkdv_warps=8, dkdv_stages=2
        ),
        "fwd hopper s2": r(base, forward_impl=gluon, fwd_stages=2),
        "fwd hopper s4": r(base, forward_impl=gluon, fwd_stages=4),
        "fwd hopper n128 s2": r(base, forward_impl=gluon, fwd_block_n=128, fwd_stages=2),
        "fwd hopper m128 w8": r(base, forward_impl=gluon, fwd_block_m=128, fwd_warps=8),
        "fwd n32 (3 programs per SM)": r(base, fwd_block_n=32),
        "dq n32": r(base, dq_block_n=32),
    }
    if workload == "J3":  # the short-keys table (64-key dK/dV tiles, 32 query rows, 4 warps)
        variants |= {
            "dkdv m64 n64 w8 s2 (the J3 default before)": r(
                base,
                dkdv_block_m=64,
                dkdv_warps=8,
                dkdv_stages=2,
                dq_placement=DqPlacement.OWN_KERNEL,
            ),  # fmt: skip
            "dkdv s3": r(base, dkdv_stages=3),
            "dkdv s4": r(base, dkdv_stages=4),
            "dkdv m16": r(base, dkdv_block_m=16),
            "dkdv m16 s3": r(base, dkdv_block_m=16, dkdv_stages=3),
            "dkdv s3 w8": r(base, dkdv_stages=3, dkdv_warps=8),
            "dq kernel for every sequence, dkdv s4 (the J3 default before)": r(
                base, dq_placement=DqPlacement.OWN_KERNEL, dkdv_stages=4
            ),
        }
    return variants


def _results(fn, q, k, v, do) -> list[torch.Tensor]:
    """Output and the gradients of q, k, v (and of the relative bias, if any) of one forward +
    backward step, in float32."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    bias = [fn.rel_bias] if getattr(fn, "rel_bias", None) is not None else []
    return [t.float() for t in (out, *torch.autograd.grad(out, leaves + bias, do))]


def _worst_deviation(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest |got − want| over each tensor's largest |want|, across out and the gradients."""
    return max(
        ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
        for g, w in zip(got, want, strict=True)
    )


def _sweep_bench(fn) -> float:
    return common.bench_ms(fn, warmup_ms=10, rep_ms=50)


def run_sweep(dtype, only=(), rel_bias_radius=None, variants=()) -> None:
    """Device time (graph replay) of kernel configurations of the project (J1, J2, J3), with a
    relative bias of radius ``rel_bias_radius`` when given (as the main table); with
    ``variants``, only the default and the configurations whose names contain one of them."""
    rows = []
    for w in workloads(False, only):
        q, k, v, do = ab.make_inputs(w, "cuda", dtype, HEADS, HEAD_DIM)
        flops_f, flops_b = (
            common.attention_flops(w.pairs(), heads=HEADS, head_dim=HEAD_DIM, backward=b)
            for b in (False, True)
        )
        default_fn = project_fn(w, q, k, v, "cuda", rel_bias_radius=rel_bias_radius)
        base = default_config(w, rel_bias_radius is not None, dtype)
        want = _results(default_fn, q, k, v, do)
        for name, cfg in _sweep_variants(base, w.name).items():
            if variants and name != "default" and not any(v in name for v in variants):
                continue
            fn = project_fn(w, q, k, v, "cuda", rel_bias_radius=rel_bias_radius, config=cfg)
            try:
                deviation = _worst_deviation(_results(fn, q, k, v, do), want)
                t_f, t_b = (
                    ab.timed(fn, q, k, v, do, backward=b, bench=_sweep_bench, graph=True)
                    for b in (False, True)
                )
            except Exception as exc:  # a config that does not compile must not stop the sweep
                print(f"  {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                t_f = t_b = deviation = float("nan")
            rows.append(
                [w.name, name, t_f, common.tflops(flops_f, t_f), t_b - t_f, t_b,
                 common.tflops(flops_b, t_b), deviation]
            )  # fmt: skip
        print_kernel_profile(w.name, default_fn, q, k, v, do)
    common.print_table(
        "kernel config sweep (device time: CUDA-graph replays of the public function"
        + ("" if rel_bias_radius is None else f", rel_bias R={rel_bias_radius}")
        + ")",
        [
            "workload",
            "config",
            "fwd ms",
            "fwd TFLOP/s",
            "bwd ms",
            "fwd+bwd ms",
            "fwd+bwd TFLOP/s",
            "max dev. from default",
        ],
        rows,
    )


def print_kernel_profile(name, fn, q, k, v, do) -> None:
    """Device time per kernel over 5 forward+backward steps (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    torch.autograd.grad(fn(*leaves), leaves, do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.grad(fn(*leaves), leaves, do)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0.0))
    print(f"\n{name}: device time per step by kernel (us)")
    for e in events[:8]:
        print(
            f"  {getattr(e, 'device_time_total', 0.0) / 5:9.1f}  x{e.count // 5:<3d} {e.key[:90]}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, seconds")
    parser.add_argument("--sweep", action="store_true", help="also time kernel configurations")
    parser.add_argument(
        "--variants", nargs="+", default=[], metavar="TEXT",
        help="--sweep: only the default and the configurations whose names contain one of these",
    )  # fmt: skip
    parser.add_argument("--project-only", action="store_true", help="skip the anchors")
    parser.add_argument(
        "--quick", action="store_true", help="only the rows the goals name (< 1 min on an H200)"
    )
    parser.add_argument(
        "--only", nargs="+", default=[], metavar="J",
        help="workloads to run (default: all), e.g. J1 J3 or J1,J3",
    )  # fmt: skip
    parser.add_argument(
        "--rel-bias", type=common.radius, default=None, metavar="R",
        help="the project learns a relative bias of radius R (gem-small: 32); anchors have none",
    )  # fmt: skip
    args = parser.parse_args()
    only = tuple(name for value in args.only for name in value.split(",") if name)
    if unknown := set(only) - {"J1", "J2", "J3"}:
        parser.error(f"--only: unknown workload(s) {sorted(unknown)}; choose from J1, J2, J3")
    run(
        args.smoke, args.sweep, args.project_only, args.quick, only, args.rel_bias,
        tuple(args.variants),
    )  # fmt: skip

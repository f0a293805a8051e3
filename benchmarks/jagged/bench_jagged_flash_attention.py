"""Jagged flash attention on J1, J2, J3, J6, J7 against FlashAttention-4 and four other anchors.

Useful TFLOP/s count only real (query, key) pairs (docs/workloads.md): forward 4·N·D·pairs,
forward + backward 3.5× that. J1 and J2 are causal self-attention over user histories at 4 heads
of 128; J3 is jagged queries (J1's lengths) over 64 candidate keys per sample, not causal; J6 is
heavy-tailed causal self-attention at 8 heads of 64; J7 is 3,000 tiny histories (1–48 tokens) at
4 heads of 64. Anchors, measured in the same run on the same tensors:

- FlashAttention-4 (``flash_attn.cute.flash_attn_varlen_func``, CuTe DSL; the strongest public
  softmax kernel on Hopper) on the packed tensors with ``cu_seqlens``: the goals name it. Where it
  is not installed its columns read NaN and the run says why;
- ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 inside PyTorch), packed;
- FlexAttention (compiled) on the packed sequence with a document mask (+ causal), the block mask
  built once outside the timing;
- SDPA (flash backend) on a padded batch ``[B, N, Lmax, D]``, timing the attention only (padding
  and unpadding not counted, which flatters the anchor), where padding costs at most
  ``PADDED_LIMIT``× the real tokens;
- SDPA on nested jagged tensors (``torch.nested`` layout ``jagged``) where it runs.

The project is timed called eagerly over a ``JaggedBatch`` built once per batch, as a model
calls it (the host-cost table below also times calls with plain offsets tensors, which build and
check a batch per call), and inside ``torch.compile(fullgraph=True)`` (the ratios use
the compiled figure, the anchors being compiled too), and its step replayed as a CUDA graph (the
op is capturable: no host synchronisation), which removes the host's launch cost and shows what
the kernels sustain; FA4, varlen, FlexAttention and padded SDPA are replayed the same way where
they can be captured, and the "graphed x" ratios compare replay with replay (device time against
device time). The goal rows use graph against graph where both sides replayed, else eager.

``--quick`` keeps the rows the goals name: the project eager and graph-replayed beside FA4,
varlen and padded SDPA on every workload, FlexAttention on J1 and J2 only; no compiled project
(the ratios then use the eager figure) and no nested SDPA. ``--smoke`` runs tiny sizes on the
CPU (Triton interpreter, eager anchors) to catch errors fast. ``--sweep`` also times kernel
configurations of the project on J1, J2 and J3 (graph replays, each beside its largest
deviation from the default configuration's output and gradients); ``--variants TEXT ...`` keeps
the configurations whose names contain one of the texts. ``--rel-bias R`` gives the project a
learned relative bias of radius R (the trainer's setting); the anchors have none.

The forward + backward ratio to the strongest anchor that ran (FA4, else FlexAttention) is also
measured alternately, project then anchor, five rounds of a full-length ``do_bench`` each, eager
and graph-replayed, so that a drift of the GPU's clocks reaches both sides of every ratio and
the spread shows how far one figure can be trusted; and as a training loop would run the step:
each side replayed back to back for a second, three rounds, with its SM clock (``nvidia-smi``)
and energy per step (NVML's counter, read only). The H200 holds its board power to its limit by
lowering the clock, so a step that draws the limit runs slower there than in a short
``do_bench``. Where matplotlib is installed the first round is drawn (``jfa_sustained.png``
under ``$OUT`` or the current directory).

Every GPU run also times each self-attention workload under both query schedules (the
default per-sequence tiles and ``Schedule.TOKEN_TILES``, which packs many short sequences into
one tile; with ``--rel-bias`` the bias too), and prints the host's cost per call (the CPU time to issue one step without
waiting for the device): the public function with the forward's K/V through TMA descriptors and
by pointers, and over a prebuilt ``JaggedBatch``, beside the step's device time. A step whose
host time exceeds its device time is host-bound when called eagerly.
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
    Schedule,
    arch_of,
    config_for,
    regime_for,
)

CANDIDATES = 64  # J3: keys per sample
WORKLOAD_IDS = ("J1", "J2", "J3", "J6", "J7")
QUICK_FLEX = ("J1", "J2")  # --quick: FlexAttention only where its compile pays for itself
PADDED_LIMIT = 8  # padded SDPA runs where B·Lmax is at most this many times the real tokens
# The goals (forward + backward, no bias): FlashAttention-4's time / the project's, at least.
FA4_TARGETS = {"J1": 1.15, "J2": 1.15, "J3": 1.0, "J6": 1.0, "J7": 5.0}


def workloads(smoke: bool, only: tuple[str, ...] = ()) -> list[Workload]:
    """J1, J2, J3, J6, J7 with their heads and head dims (tiny stand-ins for J1, J3 and J7
    with ``smoke``, at 2 heads of 32); ``only`` keeps those named."""
    if smoke:
        lengths, tiny = np.array([5, 20, 0, 9]), np.array([1, 3, 0, 2, 7, 1, 1, 4])
        found = [
            Workload("J1", lengths, lengths, True, heads=2, head_dim=32),
            Workload("J3", lengths, np.full(4, 8), False, heads=2, head_dim=32),
            Workload("J7", tiny, tiny, True, heads=2, head_dim=32),
        ]
    else:
        j1, j2, j6, j7 = (common.workload_lengths(j) for j in ("J1", "J2", "J6", "J7"))
        found = [
            Workload("J1", j1, j1, True),
            Workload("J2", j2, j2, True),
            Workload("J3", j1, np.full(len(j1), CANDIDATES), False),
            Workload("J6", j6, j6, True, heads=8, head_dim=64),
            Workload("J7", j7, j7, True, heads=4, head_dim=64),
        ]
    return [w for w in found if not only or w.name in only]


def detail_workloads(only: tuple[str, ...]) -> list[Workload]:
    """The workloads the host-cost table and the sweep run: J1, J2, J3 among ``only``."""
    return [w for w in workloads(False, only) if w.name in ("J1", "J2", "J3")]


def pads_cheaply(w: Workload) -> bool:
    """Whether a padded batch holds at most ``PADDED_LIMIT``× the real tokens of ``w``."""
    lengths = (w.q_lengths, w.kv_lengths)
    real = max(int(n.sum()) for n in lengths)
    return max(len(n) * int(n.max()) for n in lengths) <= PADDED_LIMIT * max(real, 1)


def project_fn(w, q, k, v, device, *, rel_bias_radius=None, config=None, prebuilt=False):
    """The project's call; with ``rel_bias_radius`` R it also learns a relative bias
    ``[N, 2R+1]`` (the trainer's setting; its gradient is part of the backward). ``config``: the
    kernels' ``JaggedAttentionConfig`` (None: the op picks). ``prebuilt``: the call takes one
    ``JaggedBatch`` built beforehand (a model's way) instead of offsets tensors; a self-attention
    workload's batch holds one side (``kv_offsets`` None), as a model's does."""
    q_off = common.offsets_of(w.q_lengths, device)
    kv_off = common.offsets_of(w.kv_lengths, device)
    hints = dict(max_q_len=int(w.q_lengths.max()), max_kv_len=int(w.kv_lengths.max()))
    if prebuilt:
        self_attention = np.array_equal(w.q_lengths, w.kv_lengths)
        batch = JaggedBatch(q_off, None if self_attention else kv_off, **_batch_hints(hints))
        q_off, kv_off, hints = batch, None, {}
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


def default_config(w, rel_bias: bool, dtype, device="cuda"):
    """The config the op picks for ``w`` on ``device`` (``config_for``)."""
    return config_for(
        arch=arch_of(torch.device(device)), dtype=dtype, head_dim=w.head_dim,
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


ANCHORS = ("fa4", "varlen", "flex", "padded", "nested")
ANCHOR_NAMES = {"fa4": "FlashAttention-4", "varlen": "varlen_attn (FA2)", "flex": "FlexAttention",
                "padded": "padded SDPA", "nested": "nested SDPA"}  # fmt: skip
# Timed again as CUDA-graph replays (device time, no host cost), each against the others.
GRAPHED = ("project", "fa4", "varlen", "flex", "padded")


def anchor_fns(w, q, k, v, do, device, *, smoke: bool, quick: bool) -> dict:
    """Every anchor that runs on ``w`` here: ``name: (fn, (q, k, v, do))``."""
    fns = {}
    for name, fn in (("fa4", ab.fa4_fn(w, device)), ("varlen", ab.torch_varlen_fn(w, device))):
        if fn is not None:
            fns[name] = (fn, (q, k, v, do))
    if not quick or w.name in QUICK_FLEX:
        mask = ab.document_mask(w.q_lengths, w.kv_lengths, device, causal=w.causal)
        fns["flex"] = (ab.flex_fn(mask, len(q), len(k), device=device, smoke=smoke), (q, k, v, do))
    if pads_cheaply(w):
        lengths = (w.q_lengths, w.kv_lengths, w.kv_lengths, w.q_lengths)
        padded = [ab.pad_heads(t, n, device) for t, n in zip((q, k, v, do), lengths)]  # noqa: B905
        fns["padded"] = (ab.padded_sdpa_fn(causal=w.causal), padded)
    if not quick:
        fns["nested"] = (nested_fn(w, device), (q, k, v, do))
    return fns


def strongest(fns: dict) -> str | None:
    """The anchor the alternating and sustained rounds compare against: FA4, else Flex."""
    return next((name for name in ("fa4", "flex") if name in fns), None)


def run(
    smoke: bool, sweep: bool, project_only: bool = False, quick: bool = False, only=(),
    rel_bias_radius: int | None = None, variants: tuple[str, ...] = (),
) -> None:  # fmt: skip
    device, dtype = ab.device_and_dtype()
    bench, anchor_bench = ab.benches(smoke, quick=quick)
    bias_note = "" if rel_bias_radius is None else f", project with rel_bias R={rel_bias_radius}"
    print(f"# jagged flash attention, {common.environment()}, {dtype}{bias_note} "
          "(anchors without bias)")  # fmt: skip
    rows, headline, alternating, sustained = [], {}, [], []
    for w in workloads(smoke, only):
        heads, head_dim = w.heads, w.head_dim
        q, k, v, do = ab.make_inputs(w, device, dtype, heads, head_dim)
        project = project_fn(w, q, k, v, device, rel_bias_radius=rel_bias_radius, prebuilt=True)
        fns = {"project": (project, (q, k, v, do))}
        if not smoke and not quick:  # smoke mode leaves compilation to the compile test
            plain = project_fn(w, q, k, v, device, rel_bias_radius=rel_bias_radius)
            fns["compiled"] = (torch.compile(plain, fullgraph=True), (q, k, v, do))
        if not project_only:
            fns |= anchor_fns(w, q, k, v, do, device, smoke=smoke, quick=quick)
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
                [w.name, label, f"{heads}x{head_dim}", ms["project"], tf["project"],
                 tf["compiled"], *(tf[a] for a in ANCHORS),
                 *(_ratio(ms[a] / best) for a in ANCHORS),
                 tf["project (graph)"], *(tf[f"{a} (graph)"] for a in GRAPHED[1:]),
                 *(_ratio(ms[f"{a} (graph)"] / graphed) for a in GRAPHED[1:])]
            )  # fmt: skip
            common.record(
                "jagged_flash_attention",
                workload=f"{w.name} {label}",
                tflops=tf[base],
                tflops_eager=tf["project"],
                tflops_graphed=tf["project (graph)"],
                **{f"x_{a}": ms[a] / best for a in ANCHORS},
                **{f"graph_x_{a}": ms[f"{a} (graph)"] / graphed for a in GRAPHED[1:]},
            )
            if backward and rel_bias_radius is None and "fa4" in fns and w.name in FA4_TARGETS:
                mine, theirs, basis = common.graphed_or_eager(ms, "project", "fa4")
                common.record_goal(
                    benchmark="jagged_flash_attention",
                    goal="jagged flash attention vs FlashAttention-4",
                    workload=f"{w.name} {label}",
                    gemkit=mine,
                    anchor=ANCHOR_NAMES["fa4"],
                    anchor_value=theirs,
                    ratio=theirs / mine,
                    unit="ms",
                    basis=basis,
                    target=FA4_TARGETS[w.name],
                )
            key = f"{w.name.lower()}_{'fwdbwd' if backward else 'fwd'}"
            for anchor in GRAPHED[1:]:
                if anchor in fns:
                    headline[f"{key}_x_{anchor}"] = ms[anchor] / best
                    headline[f"{key}_graph_x_{anchor}"] = ms[f"{anchor} (graph)"] / graphed
        anchor = strongest(fns)
        if device == "cuda" and anchor is not None:
            for graph in (False, True):
                ratios = alternating_ratios(fns["project"], fns[anchor], graph=graph)
                mode = "graphed" if graph else "eager"
                alternating.append((w.name, ANCHOR_NAMES[anchor], mode, ratios))
                headline[f"{w.name.lower()}_fwdbwd_{mode}_x_{anchor}_alternating"] = float(
                    np.median(ratios)
                )
            rounds = sustained_rounds(fns["project"], fns[anchor])
            sustained.append((w.name, ANCHOR_NAMES[anchor], rounds))
            headline[f"{w.name.lower()}_fwdbwd_sustained_x_{anchor}"] = float(
                np.median([r.anchor_ms / r.project_ms for r in rounds])
            )
        del fns, q, k, v, do
    short = {"fa4": "FA4", "varlen": "varlen", "flex": "flex", "padded": "padded",
             "nested": "nested"}  # fmt: skip
    common.print_table(
        f"jagged flash attention, useful TFLOP/s ({common.environment()}); "
        f"x = anchor time / {'compiled' if not (quick or smoke) else 'eager'} project time",
        ["workload", "pass", "NxD", "eager ms", "eager", "compiled",
         *(short[a] for a in ANCHORS), *(f"x {short[a]}" for a in ANCHORS), "graphed",
         *(f"{short[a]} graphed" for a in GRAPHED[1:]),
         *(f"graphed x {short[a]}" for a in GRAPHED[1:])],
        rows,
    )  # fmt: skip
    if alternating:
        rounds = [f"round {i + 1}" for i in range(ALTERNATING_ROUNDS)]
        common.print_table(
            "forward + backward, anchor time / project time, measured alternately "
            f"({ALTERNATING_ROUNDS} rounds of a full-length do_bench each, project first)",
            ["workload", "anchor", "mode", "min", "median", "max", *rounds],
            [
                [name, anchor, mode, *map(_ratio, (min(r), float(np.median(r)), max(r), *r))]
                for name, anchor, mode, r in alternating
            ],
        )
    if sustained:
        print_sustained(sustained)
        folder = Path(os.environ.get("OUT", "."))
        print(plot_sustained(sustained, folder, title=common.environment()))
    if headline:
        basis = "eager" if quick or smoke else "compiled"
        common.record("jagged_flash_attention", workload="headline", basis=basis, **headline)
    run_schedules(device, dtype, only, rel_bias_radius, smoke=smoke)
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
    for ax, (name, anchor, rounds) in zip(axes[0], sustained, strict=True):
        first = rounds[0]
        for label, windows, mhz in (
            ("project", first.project_windows, first.project_mhz),
            (anchor, first.anchor_windows, first.anchor_mhz),
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
        [name, anchor, i + 1, f"{r.project_ms:.4f}", f"{r.project_mhz:.0f}",
         f"{r.project_mj:.0f}", f"{r.anchor_ms:.4f}", f"{r.anchor_mhz:.0f}",
         f"{r.anchor_mj:.0f}", _ratio(r.anchor_ms / r.project_ms)]
        for name, anchor, rounds in sustained
        for i, r in enumerate(rounds)
    ]  # fmt: skip
    common.print_table(
        f"forward + backward replayed back to back for {SUSTAINED_S:g} s a side, alternately "
        "(median ms of the second half; mean SM MHz from nvidia-smi; mJ per step from NVML's "
        "energy counter)",
        [
            "workload",
            "anchor",
            "round",
            "project ms",
            "project MHz",
            "project mJ",
            "anchor ms",
            "anchor MHz",
            "anchor mJ",
            "x anchor",
        ],
        rows,
    )


def _ratio(x: float) -> str:
    """A ratio to three decimals (a goal at 1.15 needs the third to say which side)."""
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


def run_schedules(device, dtype, only=(), rel_bias_radius=None, *, smoke=False) -> None:
    """Each self-attention workload under the two query schedules: the default (per-sequence
    tiles, what ``config_for`` picks) against ``Schedule.TOKEN_TILES`` (tiles of consecutive
    tokens, masked block-diagonally), graph-replayed and eager, over a prebuilt ``JaggedBatch``,
    with the relative bias of ``--rel-bias`` if given; with the largest difference between
    their outputs. ``smoke``: the tiny workloads on the CPU, each step timed once and no
    graph (NaN)."""
    bias = "no bias" if rel_bias_radius is None else f"rel_bias R={rel_bias_radius}"
    cuda = device == "cuda"
    rows = []
    for w in workloads(smoke, only):
        if not np.array_equal(w.q_lengths, w.kv_lengths):
            continue  # token tiles are self-attention only
        q, k, v, do = ab.make_inputs(w, device, dtype, w.heads, w.head_dim)
        base = default_config(w, rel_bias_radius is not None, dtype, device)
        fns = {
            schedule: project_fn(
                w, q, k, v, device, config=dataclasses.replace(base, schedule=schedule),
                prebuilt=True, rel_bias_radius=rel_bias_radius,
            )
            for schedule in Schedule
        }  # fmt: skip
        with torch.no_grad():
            outs = [fn(q, k, v).float() for fn in fns.values()]
        deviation = (outs[0] - outs[1]).abs().max().item()
        for backward in (False, True):
            flops = common.attention_flops(
                w.pairs(), heads=w.heads, head_dim=w.head_dim, backward=backward
            )
            bench = common.bench_ms if cuda else ab.once
            graph = {s: ab.timed(fn, q, k, v, do, backward=backward, bench=bench, graph=True)
                     if cuda else float("nan") for s, fn in fns.items()}  # fmt: skip
            eager = {s: ab.timed(fn, q, k, v, do, backward=backward, bench=bench)
                     for s, fn in fns.items()}  # fmt: skip
            label = "fwd+bwd" if backward else "fwd"
            per, tiles = Schedule.PER_SEQUENCE, Schedule.TOKEN_TILES
            rows.append(
                [w.name, label, common.tflops(flops, graph[per]),
                 common.tflops(flops, graph[tiles]), _ratio(graph[per] / graph[tiles]),
                 common.tflops(flops, eager[per]), common.tflops(flops, eager[tiles]),
                 _ratio(eager[per] / eager[tiles]), f"{deviation:.2g}"]
            )  # fmt: skip
            common.record(
                "jagged_flash_attention", workload=f"{w.name} {label} token tiles", bias=bias,
                tflops_graphed=common.tflops(flops, graph[tiles]),
                tflops_eager=common.tflops(flops, eager[tiles]),
                graph_x_per_sequence=graph[per] / graph[tiles],
                eager_x_per_sequence=eager[per] / eager[tiles],
            )  # fmt: skip
        del fns, q, k, v, do
    common.print_table(
        f"query schedules, {bias}, useful TFLOP/s: per-sequence tiles (the default) and token "
        "tiles (Schedule.TOKEN_TILES); x = per-sequence time / token-tile time",
        ["workload", "pass", "per-seq graphed", "token graphed", "graphed x", "per-seq eager",
         "token eager", "eager x", "max |out diff|"],
        rows,
    )  # fmt: skip


def run_host_cost(dtype, only=()) -> None:
    """Host cost per call against device time, eager: the public function with the forward's
    K/V through TMA descriptors and by pointers (offsets tensors: a batch built per call), and
    over a prebuilt ``JaggedBatch`` (its work lists built once); without a relative bias."""
    rows = []
    for w in detail_workloads(only):
        q, k, v, do = ab.make_inputs(w, "cuda", dtype, w.heads, w.head_dim)
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
    for w in detail_workloads(only):
        q, k, v, do = ab.make_inputs(w, "cuda", dtype, w.heads, w.head_dim)
        flops_f, flops_b = (
            common.attention_flops(w.pairs(), heads=w.heads, head_dim=w.head_dim, backward=b)
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
    if unknown := set(only) - set(WORKLOAD_IDS):
        parser.error(
            f"--only: unknown workload(s) {sorted(unknown)}; choose from {', '.join(WORKLOAD_IDS)}"
        )
    run(
        args.smoke, args.sweep, args.project_only, args.quick, only, args.rel_bias,
        tuple(args.variants),
    )  # fmt: skip

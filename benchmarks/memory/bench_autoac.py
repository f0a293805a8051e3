"""AutoAC against PyTorch's global activation-memory knob on a GEM-like dense stack.

The stack: an input projection, ``--blocks`` blocks of (RMSNorm, QKV, causal jagged attention,
output projection, RMSNorm, GELU MLP) with residuals, and a head, over a local batch of J1
lengths (log-normal, median 512, workloads.md) at ``--batch`` samples (1024 by default: about
840K real tokens). Attention is ``gem_jagged.jagged_flash_attention`` when it imports, else SDPA
on a padded batch (the table says which; padded SDPA at 1024 J1 samples needs ~13x the tokens,
so the fallback scales the batch down to 128 and says so).

Measured in one run, every region's forward compiled (``torch.compile`` per region, the
policy inside; the step includes the loss and the backward, gradients set to None first):

- no checkpointing, full checkpointing of every region;
- the global knob: ``torch._functorch.config.activation_memory_budget`` at each ``--knob``
  value (it applies to each compiled region graph);
- AutoAC (``gem_memory.plan_checkpointing``, profiled once with the regions compiled) with
  ``budget_bytes`` set to each peak the knob reached, and to full checkpointing's peak.

Peak memory is ``torch.cuda.max_memory_allocated`` over the step (everything allocated: weights,
inputs, activations, gradients), time the median of ``--reps`` steps after a warm-up. The plot
``autoac_peak_vs_time.png`` (under $OUT if set, else the working directory) draws step time
against peak for all of them.

Then the largest local batch within 10% step-time overhead: batches grow along a ladder; no
checkpointing runs until it runs out of memory; AutoAC, planned at each batch with a budget of
90% of the device, runs while its time per sample stays within 10% of no checkpointing's at its
largest batch. This part runs eagerly (no per-batch recompiles), both methods alike, and only
while the time limit (``--time-limit``) allows; it says so when it skips.

``--smoke`` runs tiny sizes on the CPU, eagerly (the knob has no effect there) and with padded
SDPA (the jagged reference is slow on the CPU), to catch errors in seconds.
"""

import argparse
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import gem_memory  # noqa: E402
from gem_memory.solver import min_peak  # noqa: E402

try:
    from gem_jagged import jagged_flash_attention  # the lazy export imports the op here

    JAGGED = "gem_jagged.jagged_flash_attention"
except (ImportError, AttributeError):
    jagged_flash_attention = None
    JAGGED = None
PADDED = "padded SDPA"

GIB = 2.0**30


# -- the model ---------------------------------------------------------------------------------
# The batch layout travels as plain arguments: offsets [B+1], and for the padded fallback the row
# of each token in a [B * max_len] padded layout (None with the jagged kernel), and max_len.
def causal_attention(q_TNH, k_TNH, v_TNH, offsets_Bp1, pad_index_T, max_len: int):
    if pad_index_T is None:
        return jagged_flash_attention(
            q_TNH, k_TNH, v_TNH, offsets_Bp1, causal=True, max_q_len=max_len
        )
    T, N, H = q_TNH.shape
    B = offsets_Bp1.shape[0] - 1

    def pad(x_TNH):
        rows = x_TNH.new_zeros(B * max_len, N, H).index_copy(0, pad_index_T, x_TNH)
        return rows.view(B, max_len, N, H).transpose(1, 2)

    # Right padding: causal masking alone keeps real queries off the padded keys.
    out_BNLH = F.scaled_dot_product_attention(pad(q_TNH), pad(k_TNH), pad(v_TNH), is_causal=True)
    return out_BNLH.transpose(1, 2).reshape(B * max_len, N, H).index_select(0, pad_index_T)


class JaggedBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, mlp_ratio * dim)
        self.down = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x_TD, offsets_Bp1, pad_index_T, max_len: int):
        T, D = x_TD.shape
        q, k, v = self.qkv(self.norm1(x_TD)).view(T, 3, self.heads, D // self.heads).unbind(1)
        attn_TNH = causal_attention(q, k, v, offsets_Bp1, pad_index_T, max_len)
        x_TD = x_TD + self.proj(attn_TNH.reshape(T, D))
        return x_TD + self.down(F.gelu(self.up(self.norm2(x_TD))))


class GemStack(nn.Module):
    def __init__(self, *, dim: int, heads: int, blocks: int, mlp_ratio: int = 4):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(JaggedBlock(dim, heads, mlp_ratio) for _ in range(blocks))
        self.head = nn.Sequential(nn.RMSNorm(dim), nn.Linear(dim, 1))

    def forward(self, features_TD, offsets_Bp1, pad_index_T, max_len: int):
        x_TD = self.embed(features_TD)
        for block in self.blocks:
            x_TD = block(x_TD, offsets_Bp1, pad_index_T, max_len)
        return self.head(x_TD)


def loss_fn(out):
    return out.float().square().mean()


def make_batch(batch: int, *, median: int, dim: int, device, dtype, padded: bool, seed=0):
    # J1's shape with the median (and the shortest history with it) scaled to ``median``.
    j1 = common.WORKLOADS["J1"].lengths
    shape = dataclasses.replace(j1, median=median, lo=j1.lo * median // j1.median)
    lengths = shape.draw(np.random.default_rng(seed), batch)
    offsets = common.offsets_of(lengths, device)
    total, max_len = int(lengths.sum()), int(lengths.max())
    pad_index = None
    if padded:
        starts = torch.repeat_interleave(offsets[:-1], torch.as_tensor(lengths, device=device))
        rows = torch.repeat_interleave(
            torch.arange(batch, device=device) * max_len, torch.as_tensor(lengths, device=device)
        )
        pad_index = rows + torch.arange(total, device=device) - starts
    gen = torch.Generator(device=device).manual_seed(seed)
    features = torch.randn(total, dim, device=device, dtype=dtype, generator=gen)
    return (features, offsets, pad_index, max_len), total


# -- measuring a step --------------------------------------------------------------------------
def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_step(model, inputs):
    for p in model.parameters():
        p.grad = None
    loss_fn(model(*inputs)).backward()


def measure(model, inputs, *, reps: int):
    """(peak bytes, median ms) of a training step, or None when it runs out of memory."""
    try:
        train_step(model, inputs)  # warm-up (and compilation)
        _sync()
        if inputs[0].is_cuda:
            torch.cuda.reset_peak_memory_stats()
            train_step(model, inputs)
            _sync()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = gem_memory.measure_peak(model, inputs, loss_fn=loss_fn)
        times = []
        for _ in range(reps):
            _sync()
            t0 = time.perf_counter()
            train_step(model, inputs)
            _sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return peak, statistics.median(times)
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        for p in model.parameters():
            p.grad = None
        _free()


def set_all(model, policy: str, compile_fn):
    for name in gem_memory.default_regions(model):
        gem_memory.set_policy(model.get_submodule(name), policy, compile=compile_fn)


def reset_compiler(knob: float = 1.0):
    torch._dynamo.reset()
    torch._functorch.config.activation_memory_budget = knob


# -- the parts of the run ----------------------------------------------------------------------
def peak_time_sweep(model, inputs, args, compile_fn, rows, points):
    def run(name, policy=None, knob=1.0, predicted=float("nan")):
        reset_compiler(knob)
        set_all(model, policy, compile_fn)
        result = measure(model, inputs, reps=args.reps)
        peak, ms = result if result else (float("nan"), float("nan"))
        rows.append([name, peak / GIB, predicted / GIB, ms])
        points.setdefault(name.split(" ")[0], []).append((peak / GIB, ms))
        return peak

    run("none", "keep")
    full_peak = run("full checkpoint", "full")
    knob_peaks = [(k, run(f"knob {k:g}", "keep", k)) for k in args.knob]
    reset_compiler(1.0)
    set_all(model, "keep", None)
    t0 = time.perf_counter()
    profile = gem_memory.profile_model(
        model, inputs, loss_fn=loss_fn, compile=compile_fn, timing_reps=min(args.reps, 2)
    )
    print(f"AutoAC profile: {time.perf_counter() - t0:.1f} s")
    floor, _ = min_peak(profile, policies=gem_memory.POLICIES)
    targets = [(f"knob {k:g}", p) for k, p in knob_peaks] + [("full", full_peak), ("floor", floor)]
    for label, target in targets:
        if math.isnan(target):
            continue
        if target < floor:
            name = f"AutoAC @ {label} peak (below its floor, {floor / GIB:.2f} GiB)"
            rows.append([name, float("nan"), float("nan"), float("nan")])
            continue
        plan = gem_memory.plan_checkpointing(
            model, inputs, budget_bytes=int(target), profile=profile
        )
        print(f"\nAutoAC at the peak of {label} ({target / GIB:.2f} GiB):\n{plan}")
        plan.apply(model, compile=compile_fn)
        result = measure(model, inputs, reps=args.reps)
        peak, ms = result if result else (float("nan"), float("nan"))
        rows.append([f"AutoAC @ {label} peak", peak / GIB, plan.predicted_peak_bytes / GIB, ms])
        points.setdefault("AutoAC", []).append((peak / GIB, ms))
        plan.remove(model)
    set_all(model, "keep", None)


def largest_batch(model, args, device, dtype, deadline):
    """Largest batch of no checkpointing, and of AutoAC within 10% time per sample (eager)."""
    reset_compiler(1.0)
    set_all(model, "keep", None)
    factors = (1, 2, 3) if args.smoke else (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6)
    ladder = [int(args.batch * f) for f in factors]
    padded = args.attention == PADDED
    on_gpu = device.type == "cuda"
    capacity = torch.cuda.mem_get_info()[1] if on_gpu else args.cpu_capacity_gib * GIB
    none_best = None
    for b in ladder:
        if time.perf_counter() > deadline:
            return none_best, None, "time limit reached"
        inputs, _ = make_batch(
            b, median=args.median, dim=args.dim, device=device, dtype=dtype, padded=padded
        )
        result = measure(model, inputs, reps=1)
        del inputs
        if result is None or result[0] > capacity:  # the CPU (--smoke) has a pretend capacity
            break
        none_best = (b, result[1] / b)
    if none_best is None:
        return None, None, "no checkpointing ran out of memory at the smallest batch"
    auto_best = None
    for b in [b for b in ladder if b > none_best[0]]:
        if time.perf_counter() > deadline - (0 if args.smoke else 25):  # a profile takes ~20 s
            return none_best, auto_best, "time limit reached"
        inputs, _ = make_batch(
            b, median=args.median, dim=args.dim, device=device, dtype=dtype, padded=padded
        )
        try:
            profile = gem_memory.profile_model(model, inputs, loss_fn=loss_fn, timing_reps=1)
            plan = gem_memory.plan_checkpointing(
                model, inputs, budget_bytes=int(0.9 * capacity), profile=profile
            )
        except (ValueError, torch.cuda.OutOfMemoryError) as exc:
            # profiling needs each region's ``full`` step to fit alone (policies that do not fit
            # are left out of the plan); planning fails when no plan fits the budget
            stage = "profiling" if isinstance(exc, torch.cuda.OutOfMemoryError) else "planning"
            print(f"AutoAC at batch {b}, {stage}: {str(exc).splitlines()[0]}")
            break
        plan.apply(model)
        result = measure(model, inputs, reps=1)
        plan.remove(model)
        del inputs
        _free()
        if result is None:
            print(
                f"AutoAC at batch {b}: out of memory (predicted {plan.predicted_peak_bytes / GIB:.1f} GiB)"
            )
            break
        per_sample = result[1] / b
        print(f"AutoAC at batch {b}: {per_sample / none_best[1] - 1:+.1%} time per sample")
        if per_sample <= 1.1 * none_best[1]:
            auto_best = (b, per_sample)
    return none_best, auto_best, ""


def plot(points, path: Path, *, attention: str) -> str:
    plt = common.pyplot()
    if plt is None:
        return common.NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in points.items():
        pts = sorted(p for p in pts if not math.isnan(p[0]))
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax.set_xlabel("peak memory (GiB)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"AutoAC vs activation_memory_budget\nattention: {attention}", fontsize=10)
    ax.legend()
    return common.save_figure(fig, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--attention",
        choices=("auto", "padded"),
        default=None,
        help="auto: the jagged kernel when it imports (default); padded: SDPA on a padded batch "
        "(the default with --smoke: the jagged reference is slow on the CPU)",
    )
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--median", type=int, default=512)
    parser.add_argument("--knob", type=float, nargs="+", default=[0.5, 0.2, 0.05])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=170.0)
    parser.add_argument("--no-batch-search", action="store_true")
    parser.add_argument(
        "--cpu-capacity-gib", type=float, default=0.0027, help="--smoke: pretend device memory"
    )
    args = parser.parse_args()
    start = time.perf_counter()
    on_gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    # From here on args.attention names the attention that runs.
    chosen = args.attention or ("padded" if args.smoke else "auto")
    args.attention = PADDED if chosen == "padded" else (JAGGED or PADDED)
    note = ""
    if args.smoke:
        args.batch = args.batch or 4
        args.dim, args.heads, args.blocks, args.median = 64, 2, 2, 16
        args.knob, args.reps = [0.5], 1
        torch.set_num_threads(1)
        compile_fn = None  # eager: the compiled paths are covered by tests/memory on the CPU
    else:
        if args.batch is None:
            args.batch = 1024 if args.attention != PADDED else 128
            if args.attention == PADDED:
                note = " (scaled down from 1024: padded SDPA needs ~13x the tokens)"
        compile_fn = torch.compile
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)

    torch.manual_seed(0)
    model = GemStack(dim=args.dim, heads=args.heads, blocks=args.blocks).to(device, dtype)
    inputs, tokens = make_batch(
        args.batch,
        median=args.median,
        dim=args.dim,
        device=device,
        dtype=dtype,
        padded=args.attention == PADDED,
    )
    print(
        f"{common.environment()}; attention: {args.attention}; batch {args.batch}{note}, "
        f"{tokens} tokens, {args.blocks} blocks, dim {args.dim}"
    )

    rows, points = [], {}
    peak_time_sweep(model, inputs, args, compile_fn, rows, points)
    none_ms = rows[0][3]
    table = [
        [name, args.attention, args.batch, peak, pred, ms, ms / none_ms]
        for name, peak, pred, ms in rows
    ]
    common.print_table(
        f"Peak memory vs step time, {args.blocks} blocks, batch {args.batch} J1{note}",
        ["config", "attention", "batch", "peak GiB", "AutoAC predicted GiB", "step ms", "vs none"],
        table,
    )
    knob_ms = {r[0].removeprefix("knob "): r[3] for r in rows if r[0].startswith("knob")}
    auto_vs_knob = [
        r[3] / knob_ms[r[0].split("knob ")[1].split(" ")[0]]
        for r in rows
        if r[0].startswith("AutoAC @ knob") and "floor" not in r[0]
    ]
    out_dir = Path(os.environ.get("OUT", "."))
    print(plot(points, out_dir / "autoac_peak_vs_time.png", attention=args.attention))

    record = {
        "none_ms": none_ms,
        "none_peak_gib": rows[0][1],
        "worst_autoac_over_knob": max(auto_vs_knob) if auto_vs_knob else float("nan"),
    }
    if not args.no_batch_search:
        deadline = start + args.time_limit
        none_best, auto_best, why = largest_batch(model, args, device, dtype, deadline)
        ratio = auto_best[0] / none_best[0] if none_best and auto_best else float("nan")
        common.print_table(
            "Largest local batch within 10% step-time overhead (eager)"
            + (f": {why}" if why else ""),
            ["method", "largest batch", "ms per sample", "overhead", "vs none"],
            [
                ["none", *(none_best or ("-", float("nan"))), 0.0, 1.0],
                [
                    "AutoAC",
                    *(auto_best or ("-", float("nan"))),
                    auto_best[1] / none_best[1] - 1 if auto_best else float("nan"),
                    ratio,
                ],
            ],
        )
        record["max_batch_ratio"] = ratio
    goals = [
        f"AutoAC step time <= the knob's at every budget: {record['worst_autoac_over_knob'] <= 1.0}"
    ]
    if "max_batch_ratio" in record:
        goals.append(
            f"largest batch >= 1.5x no checkpointing's: {record['max_batch_ratio'] >= 1.5}"
        )
    print("goals: " + "; ".join(goals))
    common.record("autoac", **record)
    workload = f"{args.blocks} blocks, dim {args.dim}, batch {args.batch} J1"
    at_budget = [  # (AutoAC ms, knob ms) at each knob budget
        (r[3], knob_ms[r[0].split("knob ")[1].split(" ")[0]])
        for r in rows
        if r[0].startswith("AutoAC @ knob") and "floor" not in r[0]
    ]
    if at_budget:
        auto_ms, knob_at = max(at_budget, key=lambda pair: pair[0] / pair[1])
        common.record_goal(
            benchmark="autoac",
            goal="AutoAC vs the memory-budget knob (worst budget)",
            workload=workload,
            gemkit=auto_ms,
            anchor="memory-budget knob",
            anchor_value=knob_at,
            ratio=knob_at / auto_ms,
            unit="ms per step",
            basis="compiled step" if compile_fn else "eager step",
            target=1.0,
        )
    if not math.isnan(record.get("max_batch_ratio", math.nan)):
        common.record_goal(
            benchmark="autoac",
            goal="AutoAC largest batch within 10% step-time overhead",
            workload=workload,
            gemkit=auto_best[0],
            anchor="no checkpointing",
            anchor_value=none_best[0],
            ratio=record["max_batch_ratio"],
            unit="samples",
            basis="eager step",
            target=1.5,
        )
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

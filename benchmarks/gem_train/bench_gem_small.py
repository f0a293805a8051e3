"""A2: gem-small on one GPU, every optimisation on, then each switched off in turn.

Rows (each variant in its own process, one after another, same data, same steps):

- ``all on``: jagged kernels (gem_jagged), MXFP8 linears (gem_lowprec) under BF16 autocast,
  AutoAC (gem_memory), Base Batch Shuffling (gem_loadbalance);
- ``all on, token tiles``: the same with the history attention's queries cut into tiles of
  consecutive tokens across sequences (``model.jagged_schedule=token_tiles``);
- ``jagged → padded SDPA``: history attention by ``scaled_dot_product_attention`` on a padded
  batch with the causal + relative-bias mask, PMA / cross-attention by padded PyTorch GDPA;
- ``low precision → BF16``: no gem_lowprec conversion (and no token alignment), BF16 autocast;
- ``AutoAC → none``: every activation kept;
- ``shuffling → none``: sub-batches concatenated in order;
- ``fused embedding optimizer → dense AdamW``: the tables join the dense AdamW (a dense table
  gradient and a whole-table update each step) instead of updating their touched rows in the
  lookups' backward (gem_parallel's RowwiseAdagrad);
- ``PyTorch-native``: the padded anchor, the same model from PyTorch pieces: padded SDPA, BF16, no
  checkpointing, no shuffling, AdamW for every parameter, PyTorch's SwiGLU gate;
- ``PyTorch-native FlexAttention``: the strong anchor, what a careful torchtitan user builds:
  ``model.attention=flex`` (FlexAttention on the packed history, a document + causal BlockMask
  per batch, the relative bias as a score_mod, flex_attention compiled once at module level),
  ``model.pooling_attention=flex`` (PMA and cross-attention as flex *softmax* attention: flex
  cannot express GDPA's SiLU), every block ``torch.compile``d, BF16 autocast, no checkpointing,
  no shuffling, PyTorch's SwiGLU gate, and dense AdamW for every parameter (a torchrec user would
  fuse the table update into torchrec's backward; the trainer has no torchrec fused optimizer and
  the GPU image no torchrec, so the tables take the dense AdamW as in the padded anchor);
- ``all on, no bias`` and ``PyTorch-native FlexAttention, no bias``: the same pair with
  ``model.rel_bias_radius=0`` (no relative bias): FlexAttention's gradient of a captured bias
  tensor (summed into its few entries) is the likely cost of the strong anchor's step, so this pair
  compares the two where flex runs at its own speed.

Each row runs the trainer's own loop (``train_step`` and the ``Reporter``), warms up for
``--warmup`` steps and then until a step compiles no Triton kernel variant (at most 12 more: the
first row's process also fills Triton's disk cache, and one compile costs a second of host time),
restarts its timed window after any step that still compiled one (a path first met late, at
most 12 times, counted in the output), and reports QPS (samples/s after warm-up), E2E MFU (useful FLOPs of the real tokens per second over the datasheet
BF16 peak, 989 TFLOP/s for the H200), Local MFU (each layer alone, FLOP-weighted; ``gem-train
mfu``; measured once per distinct numerics and reused by the rows that share them), Scaling Ratio
= E2E / Local, peak memory and the QPS ratio over each anchor. Goals
(docs/history/performance.md): all-on QPS ≥ 1.5× the padded anchor and ≥ 1.5× the strong anchor
(with and without the bias), E2E MFU ≥ 0.55.

Where the time goes, per row: a ``profiling.StepTimer`` splits each timed step into data, forward,
backward, optimizer and metrics, on the GPU timeline and on the host; a few extra steps run under
CUDA's sync debug mode and count the host syncs by source line. ``--profile DIR`` adds, for every
row, the top kernels of one step from ``torch.profiler`` (and a Chrome trace per row in DIR).

A variant runs in its own process so that a crash (a sticky CUDA error) cannot poison the others;
a variant that dies of a CUDA error is run again with ``CUDA_LAUNCH_BLOCKING=1`` for one step to
name the operation that failed. When inductor's FlexAttention backward (with what it fused around
it) needs more shared memory than the GPU has, the strong anchor runs again with
``model.flex_bwd_stages`` 2, then 1, as a careful user would; the row's notes say so. ``--gpus N`` runs up to N variants at once, each on its own GPU of
the host (the variants then share the host's CPU cores; the rows say nothing else about each
other).

Runtime on an H200 with ``--steps 8 --warmup 3``: about 40 s per jagged variant (the first one
also compiles the Triton kernels) and longer for the padded ones, whose attention runs on every
padded position of an 80 × ~8000-token batch. ``--smoke`` runs a shrunken model for a few steps
on the CPU (reference kernels, uncompiled blocks, flex in its dense form) to catch errors.
"""

import argparse
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

PADDED_ANCHOR, STRONG_ANCHOR = "PyTorch-native", "PyTorch-native FlexAttention"
ALL_ON_NO_BIAS, STRONG_ANCHOR_NO_BIAS = "all on, no bias", "PyTorch-native FlexAttention, no bias"
NO_BIAS = {"model.rel_bias_radius": "0"}
VARIANTS = {
    "all on": {},
    "all on, token tiles": {"model.jagged_schedule": "token_tiles"},
    "jagged → padded SDPA": {"model.attention": "padded", "model.pooling_attention": "padded"},
    "low precision → BF16": {"lowprec.recipe": "none", "lowprec.token_multiple": "0"},
    "AutoAC → none": {"memory.autoac": "false"},
    "shuffling → none": {"data.shuffle": "false"},
    "fused embedding optimizer → dense AdamW": {"optim.embedding_optimizer": "adamw"},
    PADDED_ANCHOR: {
        "model.attention": "padded", "model.pooling_attention": "padded", "lowprec.recipe": "none",
        "lowprec.token_multiple": "0", "memory.autoac": "false", "data.shuffle": "false",
        "optim.embedding_optimizer": "adamw", "model.fused_swiglu": "false",
    },
    STRONG_ANCHOR: {
        "model.attention": "flex", "model.pooling_attention": "flex", "compile": "true",
        "lowprec.recipe": "none", "lowprec.token_multiple": "0", "memory.autoac": "false",
        "data.shuffle": "false", "optim.embedding_optimizer": "adamw", "model.fused_swiglu": "false",
    },
}  # fmt: skip
# The same pair without the learned relative bias: FlexAttention differentiates a captured bias
# tensor by summing into its few entries, the likely cost of the anchor's step; without it the
# anchor runs at flex's own speed.
VARIANTS[ALL_ON_NO_BIAS] = dict(NO_BIAS)
VARIANTS[STRONG_ANCHOR_NO_BIAS] = VARIANTS[STRONG_ANCHOR] | NO_BIAS
NO_BIAS_ROWS = (ALL_ON_NO_BIAS, STRONG_ANCHOR_NO_BIAS)
NUMERICS = (
    "model.attention",
    "model.pooling_attention",
    "lowprec.recipe",
    "lowprec.token_multiple",
    "model.rel_bias_radius",
    "model.jagged_schedule",
)

SMOKE = {
    "device": "cpu", "model.d_model": "64", "model.n_heads": "2", "model.n_layers": "1",
    "model.ffn_hidden": "128", "model.mlp_hidden": "64", "model.emb_dim": "16",
    "model.item_vocab": "1000", "model.user_vocab": "1000", "model.segment_vocab": "100",
    "model.advertiser_vocab": "100", "model.category_vocab": "32", "data.batch_size": "8",
    "data.sub_batch_size": "4", "data.median_len": "16", "data.min_len": "2", "data.max_len": "128",
    "memory.budget_gib": "2", "lowprec.autocast_bf16": "false", "model.embeddings": "native",
    "lowprec.token_multiple": "128",
}  # fmt: skip
RESULT = "A2-RESULT "  # the line a variant's process ends with
# What a careful user tries when inductor's FlexAttention backward does not fit in shared
# memory: fewer software-pipeline stages, the fewest last (the row records what it ran with).
FLEX_BWD_STAGES_TO_TRY = (2, 1)
MAX_EXTRA_WARMUP = 12  # warm-up steps beyond --warmup while steps still compile kernels


def config_of(flags: dict, *, steps: int, smoke: bool):
    from gem_train.config import apply_overrides, named_config

    overrides = {**(SMOKE if smoke else {}), **flags}  # a variant's own flags win
    if smoke:  # inductor's CPU compile takes a minute; on the CPU flex runs its dense form anyway
        overrides["compile"] = "false"
    overrides.update({"steps": str(steps), "metrics.progress": "false", "data.eval_batches": "0"})
    overrides.setdefault("model.embeddings", "native")  # the GPU image has no torchrec
    return apply_overrides(named_config("gem-small"), overrides)


def run_variant(flags: dict, *, steps: int, warmup: int, smoke: bool, local: bool,
                sync_steps: int, profile: str | None) -> dict:  # fmt: skip
    """Train ``warmup + steps`` steps of the variant with the trainer's loop; time the last ``steps``."""
    import torch
    from gem_jagged.testing import compiled_kernel_variants
    from gem_train.components import build_run
    from gem_train.metrics import batch_flops, peak_flops
    from gem_train.mfu import local_mfu_of
    from gem_train.profiling import StepTimer, count_syncs
    from gem_train.reporting import Reporter
    from gem_train.train import train_step

    # one spare step: the run's last step closes the reporter's window (a sync by design),
    # which must not be counted as a step's syncs
    extra = sync_steps + (1 if profile else 0) + 1
    # warm-up (at most MAX_EXTRA_WARMUP extra), then a timed window that may restart as often
    most_timed = (MAX_EXTRA_WARMUP + 1) * steps
    cfg = config_of(flags, steps=warmup + MAX_EXTRA_WARMUP + most_timed + extra, smoke=smoke)
    t_build = time.perf_counter()
    run = build_run(cfg)
    build_s = time.perf_counter() - t_build
    notes = "; ".join(run.notes) or "no optimisations"
    print(f"built in {build_s:.1f} s ({notes})", flush=True)
    device, cuda = run.device, run.device.type == "cuda"
    reporter = Reporter(run, start_step=0, t_start=time.perf_counter())
    timer = StepTimer(device, enabled=False)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def step(i: int):
        timer.begin()
        prepared = next(run.batches)
        batch, logits, loss = train_step(run, prepared, i, timer)
        reporter.step(i, logits, batch, loss, prepared)
        timer.mark("metrics")
        return prepared, loss

    # Warm up for ``warmup`` steps, then on until a step compiles no Triton kernel variant (a
    # compile costs the host a second or more; the first process also fills the disk cache).
    warmed, variants = 0, compiled_kernel_variants()
    while warmed < warmup + MAX_EXTRA_WARMUP:
        step(warmed)
        warmed, compiled = warmed + 1, compiled_kernel_variants() - variants
        variants += compiled
        if warmed >= warmup and not compiled:
            break
    print(f"warmed up in {warmed} steps ({variants} compiled kernel variants)", flush=True)
    # The timed window restarts after any step that compiled a kernel variant: a path first met
    # late (a batch with a longer user, say) compiles once per process, which is no step rate.
    # Such restarts are counted and printed; at most MAX_EXTRA_WARMUP of them.
    restarts, i = 0, warmed

    def start_window():
        if cuda:
            torch.cuda.synchronize(device)
        timer.reset()
        return time.perf_counter(), 0, 0.0, 0.0

    t0, timed, samples, flops = start_window()
    timer.enabled = True
    while timed < steps:
        prepared, loss = step(i)
        i, timed = i + 1, timed + 1
        samples += prepared.real_samples
        flops += batch_flops(cfg.model, prepared.lengths)
        compiled = compiled_kernel_variants() - variants
        if compiled and restarts < MAX_EXTRA_WARMUP:
            variants, restarts = variants + compiled, restarts + 1
            print(f"step {i - 1} compiled {compiled} kernel variants: timing restarts", flush=True)
            t0, timed, samples, flops = start_window()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    late = compiled_kernel_variants() - variants
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    phases = timer.summary()
    timer.enabled = False
    print(f"timed {steps} steps in {seconds:.1f} s; counting syncs, then Local MFU", flush=True)
    first = i
    _, syncs = count_syncs(lambda: [step(first + k) for k in range(sync_steps)])
    kernels = profile_step(lambda: step(first + sync_steps), profile) if profile else None
    last_loss = loss.item()
    run = reporter = loss = prepared = None  # free the training run before timing layers alone
    if cuda:
        torch.cuda.empty_cache()
    layers, local_mfu = [], float("nan")
    if local:  # no recompute, by definition
        measured = local_mfu_of(cfg, reps=3 if smoke else 5)
        layers, local_mfu = measured["layers"], measured["local_mfu"]
    peak = peak_flops(device)
    return {
        "qps": samples / seconds, "step_ms": seconds / steps * 1e3,
        "e2e_mfu": flops / seconds / peak if peak else float("nan"), "local_mfu": local_mfu,
        "layers": layers, "peak_gib": memory, "loss": last_loss, "build_s": build_s,
        "phases": phases, "syncs_per_step": sum(syncs.values()) / max(1, sync_steps),
        "sync_sites": syncs.most_common(6), "kernels": kernels, "notes": notes,
        "warmup_steps": warmed, "timing_restarts": restarts, "compiled_while_timed": late,
    }  # fmt: skip


def profile_step(fn, folder: str) -> list:
    """Top CUDA kernels of one step by device time, and a Chrome trace in ``folder``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    with profile(activities=activities) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    Path(folder).mkdir(parents=True, exist_ok=True)
    trace = Path(folder) / "a2_step.json"
    prof.export_chrome_trace(str(trace))
    rows = [
        (e.key, e.count, e.self_device_time_total / 1e3)
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r[2])
    return {"top": rows[:15], "split": gpu_time_split(trace)}


KERNEL_KINDS = {  # kernel name fragments → what the time was spent on
    "attention": ("_jfa_", "gdpa", "fmha", "flash", "attention", "_block_attn"),
    "GEMM": ("nvjet", "gemm", "cutlass", "scaled_mm", "matmul", "_mm_"),
}


def gpu_time_split(trace: Path) -> dict[str, float]:
    """Milliseconds of one profiled step: GPU span, kernel time by kind, and idle time."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )  # fmt: skip
    if not gpu:
        return {}
    split = {"span": 0.0, "attention": 0.0, "GEMM": 0.0, "other": 0.0, "idle": 0.0}
    end = gpu[0]["ts"]
    for e in gpu:
        split["idle"] += max(0.0, e["ts"] - end) / 1e3
        end = max(end, e["ts"] + e["dur"])
        name = e["name"].lower()
        kind = next(
            (k for k, parts in KERNEL_KINDS.items() if any(p in name for p in parts)), "other"
        )
        split[kind] += e["dur"] / 1e3
    split["span"] = (end - gpu[0]["ts"]) / 1e3
    return split


def child_main(args) -> None:
    flags = {**VARIANTS[args.child], **dict(args.set)}
    result = run_variant(
        flags, steps=args.steps, warmup=args.warmup, smoke=args.smoke, local=args.local,
        sync_steps=args.sync_steps, profile=args.profile,
    )  # fmt: skip
    if args.set:
        result["notes"] += "; with " + ", ".join(f"{k}={v}" for k, v in args.set)
    print(RESULT + json.dumps(result, allow_nan=True), flush=True)


def launch(
    name: str, args, *, local: bool, gpu: int | None, blocking: bool = False,
    extra: dict[str, str] | None = None,
) -> tuple[dict | None, str]:  # fmt: skip
    """Run one variant in a fresh process (on GPU ``gpu`` of the host when given), with
    ``extra`` flags over the variant's; ``(result or None, the output's tail)``."""
    command = [sys.executable, __file__, "--child", name, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--sync-steps", str(args.sync_steps)]  # fmt: skip
    for key, value in (extra or {}).items():
        command += ["--set", f"{key}={value}"]
    if args.smoke:
        command.append("--smoke")
    if local:
        command.append("--local")
    if args.profile:
        command += [
            "--profile",
            str(Path(args.profile) / "".join(c if c.isalnum() else "_" for c in name)),
        ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    if blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
        command[command.index("--steps") + 1] = "1"
        command[command.index("--warmup") + 1] = "0"
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=args.variant_timeout
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return None, f"{out[-1500:]}\n(timed out after {args.variant_timeout} s)"
    lines = done.stdout.splitlines()
    result = next((json.loads(x[len(RESULT) :]) for x in lines if x.startswith(RESULT)), None)
    tail = _failure_summary((done.stdout + done.stderr).splitlines())
    return (result if done.returncode == 0 else None), tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, seconds")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per variant")
    parser.add_argument("--only", nargs="*", default=None, help="variants to run (default: all)")
    parser.add_argument("--sync-steps", type=int, default=2, help="steps counted for host syncs")
    parser.add_argument(
        "--local-for", nargs="*", default=None,
        help="variants whose numerics get a Local MFU (default: all); the padded anchor's layers "
        "alone take minutes at gem-small sizes",
    )  # fmt: skip
    parser.add_argument(
        "--profile", default=None, help="folder: profile one step of each row there"
    )
    parser.add_argument("--variant-timeout", type=int, default=420, help="seconds per variant")
    parser.add_argument(
        "--gpus", type=int, default=1, help="variants run at once, one GPU of the host each"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--set", action="append", default=[], type=lambda kv: tuple(kv.split("=", 1)),
        help=argparse.SUPPRESS,
    )  # fmt: skip
    parser.add_argument("--local", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if args.child is None and not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: running the smoke sizes on the CPU")
    args.smoke = args.smoke or not torch.cuda.is_available()
    args.steps = args.steps or (2 if args.smoke else 15)
    args.warmup = args.warmup or (1 if args.smoke else 3)
    if args.child is not None:
        return child_main(args)
    if args.gpus < 1:
        raise SystemExit(f"--gpus: expected at least 1, got {args.gpus}")
    if not args.smoke and args.gpus > torch.cuda.device_count():
        raise SystemExit(f"--gpus {args.gpus}: only {torch.cuda.device_count()} GPUs are visible")
    unknown = (set(args.only or ()) | set(args.local_for or ())) - set(VARIANTS)
    if unknown:
        raise SystemExit(
            f"--only/--local-for: unknown variants {sorted(unknown)}; known: {list(VARIANTS)}"
        )
    print(f"A2 gem-small: {common.environment()}; {args.warmup} warm-up + {args.steps} timed "
          "steps per variant, each variant in its own process")  # fmt: skip
    names = [n for n in VARIANTS if not args.only or n in args.only]
    numerics_of = {n: tuple(VARIANTS[n].get(k) for k in NUMERICS) for n in names}
    measures_local = {}  # the first variant of each numerics setup measures its Local MFU
    for name in names:
        if args.local_for is None or name in args.local_for:
            measures_local.setdefault(numerics_of[name], name)
    gpus = queue.Queue()
    for gpu in range(args.gpus):
        gpus.put(gpu if args.gpus > 1 else None)
    printing = threading.Lock()

    def run_one(name: str) -> dict:
        gpu = gpus.get()
        try:
            local = measures_local.get(numerics_of[name]) == name
            t0 = time.perf_counter()
            result, tail = launch(name, args, local=local, gpu=gpu)
            lines = [f"  {name}: {time.perf_counter() - t0:.0f} s"]
            for stages in FLEX_BWD_STAGES_TO_TRY:
                if result is not None or not flex_backward_out_of_shared_memory(tail):
                    break
                lines.append(f"  {name}: inductor's FlexAttention backward needs more shared "
                             f"memory than the GPU has; again with model.flex_bwd_stages={stages}")  # fmt: skip
                result, tail = launch(
                    name, args, local=local, gpu=gpu, extra={"model.flex_bwd_stages": str(stages)}
                )
            if result is None:
                lines.append(f"  {name} FAILED; the end of its output:\n{_indent(tail)}")
                if "CUDA error" in tail or "illegal memory access" in tail:
                    _, again = launch(name, args, local=False, gpu=gpu, blocking=True)
                    lines.append(f"  {name} again with CUDA_LAUNCH_BLOCKING=1:\n{_indent(again)}")
                result = {"qps": float("nan")}
            else:
                lines.append(_one_line(result))
                lines.append(f"    built with: {result['notes']}; warmed up in "
                             f"{result['warmup_steps']} steps; timing restarted after a compile "
                             f"{result['timing_restarts']} times; kernel variants compiled while "
                             f"timed: {result['compiled_while_timed']}")  # fmt: skip
            with printing:  # each finished variant's lines at once, kept if a later one stops
                print("\n".join(lines), flush=True)
            return result
        finally:
            gpus.put(gpu)

    with ThreadPoolExecutor(max_workers=args.gpus) as pool:
        finished = dict(zip(names, pool.map(run_one, names), strict=True))
    results = {name: (finished[name], numerics_of[name]) for name in names}
    local_of = {
        numerics: (finished[name]["local_mfu"], finished[name]["layers"])
        for numerics, name in measures_local.items()
        if "local_mfu" in finished[name]
    }
    report(results, local_of)


def _one_line(r: dict) -> str:
    phases = ", ".join(
        f"{p} {v['device_ms']:.1f}/{v['host_ms']:.1f}" for p, v in r["phases"].items()
    )
    return (f"    {r['qps']:.0f} QPS, {r['step_ms']:.1f} ms/step, E2E MFU {r['e2e_mfu']:.3f}, "
            f"Local MFU {r['local_mfu']:.3f}, peak {r['peak_gib']:.1f} GiB; ms GPU/host: {phases}; "
            f"{r['syncs_per_step']:.0f} host syncs/step")  # fmt: skip


def flex_backward_out_of_shared_memory(output: str) -> bool:
    """Whether a variant died because inductor's FlexAttention backward kernel (with what it
    fused around it) needs more shared memory than the GPU has."""
    return "out of resource" in output and "flex_attention_backward" in output


def _failure_summary(lines: list[str]) -> str:
    """The output's last 25 lines, preceded by each earlier exception with the frames just above
    it: a chained exception (say, a CUDA error re-raised while an RNG state is restored)
    otherwise hides the first error above the tail."""
    tail_start = max(0, len(lines) - 25)
    earlier = []
    for i, line in enumerate(lines[:tail_start]):
        if line and not line[0].isspace() and ("Error" in line or "Exception" in line):
            earlier += ["(earlier)"] + lines[max(0, i - 6) : i + 1]
    return "\n".join(earlier[-42:] + lines[tail_start:])


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


BASIS = "timed training steps after warm-up"


def qps_goal(goal: str, workload: str, qps: float, anchor: str, anchor_qps: float) -> None:
    """Record a QPS-over-an-anchor goal row (target 1.5x), where the anchor ran."""
    if math.isfinite(anchor_qps):
        common.record_goal(
            benchmark="gem_train_a2", goal=goal, workload=workload, gemkit=qps, anchor=anchor,
            anchor_value=anchor_qps, ratio=qps / anchor_qps, unit="samples/s", basis=BASIS,
            target=1.5,
        )  # fmt: skip


def report(results: dict, local_of: dict) -> None:
    nan = float("nan")
    anchor = results.get(PADDED_ANCHOR, ({"qps": nan}, None))[0]["qps"]
    strong = results.get(STRONG_ANCHOR, ({"qps": nan}, None))[0]["qps"]
    strong_no_bias = results.get(STRONG_ANCHOR_NO_BIAS, ({"qps": nan}, None))[0]["qps"]
    rows = []
    for name, (r, numerics) in results.items():
        local = local_of.get(numerics, (nan, []))[0]
        e2e = r.get("e2e_mfu", nan)
        scaling = e2e / local if local and not math.isnan(local) else nan
        rows.append([name, r["qps"], r.get("step_ms", nan), e2e, local, scaling,
                     r.get("peak_gib", nan), r.get("syncs_per_step", nan), r["qps"] / anchor,
                     r["qps"] / (strong_no_bias if name in NO_BIAS_ROWS else strong)])  # fmt: skip
    ok = {name: r for name, (r, _) in results.items() if "phases" in r}
    phases = list(dict.fromkeys(p for r in ok.values() for p in r["phases"]))
    if ok:
        common.print_table(
            "A2 per-phase time of a step, ms: GPU timeline / host (StepTimer; GPU ≈ host means "
            "the GPU waited for the host)",
            ["variant", *phases],
            [[name] + [f"{r['phases'][p]['device_ms']:.1f} / {r['phases'][p]['host_ms']:.1f}"
                       if p in r["phases"] else "-" for p in phases] for name, r in ok.items()],
        )  # fmt: skip
        for name, r in ok.items():
            sites = ", ".join(f"{site} ×{n}" for site, n in r["sync_sites"]) or "none"
            print(f"host syncs, {name}: {r['syncs_per_step']:.1f} per step: {sites}")
    for numerics, (local, layers) in local_of.items():
        if layers:
            label = ", ".join(f"{k}={v}" for k, v in zip(NUMERICS, numerics, strict=True) if v)
            common.print_table(
                f"Local MFU by layer ({label or 'gem-small defaults'}): {local:.3f}",
                ["layer", "GFLOP", "ms", "TFLOP/s", "MFU"],
                [[x["layer"], x["gflop"], x["ms"], x["tflops"], x["mfu"]] for x in layers],
            )
    for name, r in ok.items():
        profiled = r.get("kernels")
        if not profiled or not profiled["top"]:
            continue
        common.print_table(
            f"{name}: top kernels of one profiled step (device time)",
            ["kernel", "calls", "ms"],
            [[k[:70], n, ms] for k, n, ms in profiled["top"]],
        )
        if profiled["split"]:
            print(f"{name}, one profiled step, ms: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in profiled["split"].items())
                  + " (span = kernels + idle; idle = the GPU waiting for the host)")  # fmt: skip
    common.print_table(
        "A2: gem-small, one GPU (MFU against the datasheet BF16 peak)",
        ["variant", "QPS", "step ms", "E2E MFU", "Local MFU", "scaling", "peak GiB",
         "syncs/step", "vs padded native", "vs flex native"],
        rows,
    )  # fmt: skip
    print("vs padded native: QPS over the padded-SDPA anchor; vs flex native: over the strong "
          "anchor (FlexAttention on the packed history, softmax pooling, compiled blocks, BF16 "
          "autocast, dense AdamW for every parameter: the trainer has no torchrec fused "
          "optimizer, and the GPU image no torchrec), the no-bias rows over its no-bias row")  # fmt: skip
    print(plot({row[0]: (row[1], row[3]) for row in rows}, Path(os.environ.get("OUT", "."))))
    if "all on" in results:
        all_on, numerics = results["all on"]
        common.record(
            "gem_train_a2", qps=all_on["qps"], e2e_mfu=all_on.get("e2e_mfu", nan),
            local_mfu=local_of.get(numerics, (nan,))[0], speedup_vs_native=all_on["qps"] / anchor,
            speedup_vs_flex_native=all_on["qps"] / strong,
        )  # fmt: skip
        qps_goal("gem-small QPS vs PyTorch-native pieces", "A2 all on", all_on["qps"],
                 PADDED_ANCHOR, anchor)  # fmt: skip
        qps_goal("gem-small QPS vs PyTorch-native FlexAttention", "A2 all on", all_on["qps"],
                 STRONG_ANCHOR, strong)  # fmt: skip
        e2e = all_on.get("e2e_mfu", nan)
        common.record_goal(
            benchmark="gem_train_a2",
            goal="gem-small E2E MFU",
            workload="A2 all on",
            gemkit=e2e,
            anchor="datasheet BF16 peak",
            anchor_value=1.0,
            ratio=e2e,
            unit="MFU",
            basis=BASIS,
            target=0.55,
        )
    if ALL_ON_NO_BIAS in results:
        qps_goal("gem-small QPS vs PyTorch-native FlexAttention", "A2 all on, no relative bias",
                 results[ALL_ON_NO_BIAS][0]["qps"], STRONG_ANCHOR_NO_BIAS, strong_no_bias)  # fmt: skip
    if any(math.isnan(r["qps"]) for r, _ in results.values()):
        raise SystemExit(1)


def plot(
    by_variant: dict[str, tuple[float, float]],
    folder: Path,
    *,
    title: str | None = None,
    name: str = "a2_ablation.png",
) -> str:
    """``name`` in ``folder``: QPS (log scale when the rows span more than 10×) and E2E MFU per
    variant of one run; ``title`` defaults to this machine's environment."""
    plt = common.pyplot()
    if plt is None:
        return common.NO_MATPLOTLIB
    measured = {n: v for n, v in by_variant.items() if not math.isnan(v[0])}
    if not measured:
        return "no variant finished: no plot"
    names = list(measured)
    fig, (ax_qps, ax_mfu) = plt.subplots(1, 2, figsize=(10, 0.45 * len(names) + 1.5), sharey=True)
    qps = [measured[n][0] for n in names]
    ax_qps.barh(names, qps, color="tab:blue")
    log = max(qps) > 10 * min(qps)
    if log:
        ax_qps.set_xscale("log")
    ax_qps.set_xlabel("samples / s" + (" (log)" if log else ""))
    ax_mfu.barh(names, [measured[n][1] for n in names], color="tab:green")
    ax_mfu.axvline(0.55, color="k", linestyle="--", linewidth=1, label="goal 0.55")
    ax_mfu.set_xlabel("E2E MFU (datasheet BF16 peak)")
    ax_mfu.legend(loc="lower right", fontsize=8)
    ax_qps.invert_yaxis()
    fig.suptitle(f"A2 gem-small, one run: {title or common.environment()}", fontsize=9)
    return common.save_figure(fig, folder / name)


if __name__ == "__main__":
    main()

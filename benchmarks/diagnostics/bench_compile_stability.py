"""Do training steps stop compiling Triton kernels? Per step of a gem-small run: the step time
and every Triton kernel (of any package) that compiled a new variant during it, with the
specialisation key of the newest variant.

A kernel that specialises on something batch-dependent (an integer's divisibility, a pointer's
alignment, a constexpr computed from the batch) compiles again on many steps and makes them
hundreds of ms slower on the host; that is what this script is for finding. Flags are the
trainer's overrides (``section.field=value``), applied to gem-small.

    python benchmarks/diagnostics/bench_compile_stability.py --steps 8 memory.autoac=true

``--cprofile`` also profiles each step's Python (cProfile) and, for every step slower than 1.5×
the fastest one, prints the functions that took the most time: where a slow step's host time
went when it was not a compile.

``--smoke`` runs a tiny config on the CPU (nothing compiles there: the interpreter runs).
"""

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402


def _top_functions(profiler: cProfile.Profile, count: int = 12) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(count)
    stats.sort_stats("cumulative").print_stats(count)
    lines = [x for x in out.getvalue().splitlines() if x.strip() and "function calls" not in x]
    return "\n".join("    " + x[:160] for x in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--cprofile", action="store_true", help="cProfile the slow steps")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    from gem_jagged.testing import kernel_variants
    from gem_train.profiling import StepTimer
    from gem_train.train import train_step

    overrides = [*args.overrides, f"steps={args.steps}"]
    print(f"compile stability: {common.environment()}; overrides {overrides}", flush=True)
    run = common.trainer_run(overrides, smoke=args.smoke)
    print(f"built: {'; '.join(run.notes)}", flush=True)
    try:
        timer = StepTimer(run.device, enabled=False)
        prefixes = ("gem_", "triton_")
        before = kernel_variants(prefixes)
        fastest = float("inf")
        for step in range(args.steps):
            profiler = cProfile.Profile() if args.cprofile else None
            t0 = time.perf_counter()
            if profiler:
                profiler.enable()
            train_step(run, next(run.batches), step, timer)
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            if profiler:
                profiler.disable()
            ms = (time.perf_counter() - t0) * 1e3
            fastest = min(fastest, ms)
            if profiler and ms > 1.5 * fastest:
                print(f"step {step} took {ms / fastest:.1f}× the fastest step; its Python:")
                print(_top_functions(profiler))
            after = kernel_variants(prefixes)
            grew = {k: v for k, v in after.items() if v[0] > before.get(k, (0, ""))[0]}
            print(f"step {step}: {ms:.0f} ms, {sum(v[0] for v in after.values())} variants, "
                  f"{len(grew)} kernels compiled", flush=True)  # fmt: skip
            for name, (count, key) in grew.items():
                print(f"    {name}: {count} variants; newest {key[:400]}", flush=True)
            before = after
    finally:
        run.batches.close()  # a loader thread left running aborts the process at exit


if __name__ == "__main__":
    main()

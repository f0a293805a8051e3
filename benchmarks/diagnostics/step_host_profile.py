"""Where the host time of a training step goes: a training step's Python, profiled while the GPU
is kept busy, so that no call waits for the device and every microsecond counted is the host's.

A2 measures gem-small's forward as host-bound (its GPU timeline ≈ its host time). This script
names the functions that time goes to: it warms the trainer up, queues a long sleep kernel on the
GPU, then issues ``--steps`` steps under ``cProfile`` (autograd's backward on the calling thread,
so that the backward's Python is profiled too) and prints

- host ms per step, the whole step and each phase (data, forward, backward, optimizer);
- the functions with the most own time, and with the most cumulative time, per step.

    python benchmarks/diagnostics/step_host_profile.py                  # gem-small, all on
    python benchmarks/diagnostics/step_host_profile.py model.rel_bias_radius=0

Flags after the options are the trainer's overrides (``section.field=value``) on ``--base``.
The batches are built before the profile (``data.prefetch=0``: no loader thread runs meanwhile).
``--smoke`` runs tiny sizes on the CPU, where the figures mean little: it checks the script.
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


class PhaseClock:
    """A ``StepTimer`` stand-in that records host time between marks, per phase."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self._last = time.perf_counter()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self._last
        self._last = now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps profiled")
    parser.add_argument("--warmup", type=int, default=4, help="steps before (kernels compile)")
    parser.add_argument("--sleep-s", type=float, default=20.0, help="GPU sleep, seconds")
    parser.add_argument("--top", type=int, default=35, help="functions listed per table")
    parser.add_argument("--base", default="gem-small", help="the named config overridden")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    from gem_train.train import train_step

    on_gpu = torch.cuda.is_available() and not args.smoke
    run = common.trainer_run(["data.prefetch=0", *args.overrides], base=args.base, smoke=args.smoke)
    try:
        clock = PhaseClock()
        for step in range(args.warmup):
            train_step(run, next(run.batches), step, clock)
        prepared = [next(run.batches) for _ in range(args.steps)]
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda._sleep(int(args.sleep_s * torch.cuda.clock_rate() * 1e6))
        clock = PhaseClock()
        profile = cProfile.Profile()
        start = time.perf_counter()
        with torch.autograd.set_multithreading_enabled(False):
            for i, batch in enumerate(prepared):
                clock.restart()
                profile.enable()
                train_step(run, batch, args.warmup + i, clock)
                profile.disable()
        host_s = time.perf_counter() - start
        waited = on_gpu and torch.cuda.Event().query()  # recorded now: true if the GPU drained
        if on_gpu:
            torch.cuda.synchronize()
    finally:
        run.batches.close()
    per_step = {phase: 1e3 * s / args.steps for phase, s in clock.totals.items()}
    print(
        f"{common.environment()}: {args.base} {' '.join(args.overrides)}; {args.steps} steps "
        f"issued in {host_s:.2f} s behind a {args.sleep_s:g} s GPU sleep (profiler on)"
    )
    if waited:
        print("warning: the GPU finished its sleep before the steps were issued: some call "
              "waited for it (benchmarks/diagnostics/host_waits.py names it); raise --sleep-s")  # fmt: skip
    print("host ms per step: " + ", ".join(f"{p} {ms:.2f}" for p, ms in per_step.items())
          + f", total {sum(per_step.values()):.2f}")  # fmt: skip
    for key, title in (("tottime", "own time"), ("cumulative", "cumulative time")):
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats(key).print_stats(args.top)
        print(f"\n## functions by {title} (all {args.steps} steps)\n")
        print(out.getvalue().split("\n\n", 2)[-1].rstrip())


if __name__ == "__main__":
    main()

"""Which calls of a training step make the host wait for the GPU? With the GPU kept busy by a
long sleep kernel, a step should queue all its work and return at once; any call that blocks
instead (a sync, a copy from pageable host memory, an allocator wait, a ``.item()``) is printed
with the Python stack that made it.

CUDA's sync debug mode counts explicit syncs only; a host-to-device copy from pageable memory
waits for every queued kernel without being counted. This script finds every kind by timing
each C call of the step (in every thread, the autograd engine's included) while the GPU sleeps:
a call that lasts longer than ``--threshold-ms`` is one the host waited in.

    python benchmarks/diagnostics/host_waits.py --steps 2 lowprec.recipe=none
    python benchmarks/diagnostics/host_waits.py --base tiny device=cuda model.d_model=256

Flags after the options are the trainer's overrides (``section.field=value``) on ``--base``
(gem-small by default).
It also prints how many device allocations (``cudaMalloc``, new segments) the caching
allocator made while the steps were queued. ``--seen-sizes`` first trains once on copies of the queued steps' batches, so that the timed
steps meet only sizes the run has met (the caching allocator's blocks, the GEMMs' choices): run
with and without it to tell a one-off of a new size from a wait of every step.
``--smoke`` runs on the CPU, where nothing waits: it checks the script itself.
"""

import argparse
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402


class LongCalls:
    """A profile hook that records every C call lasting over ``threshold_s``, with its stack."""

    def __init__(self, threshold_s: float):
        self.threshold_s = threshold_s
        self.found: list[tuple[float, str, str, list[str]]] = []
        self._open = threading.local()

    def __call__(self, frame, event, arg):
        if event == "c_call":
            stack = getattr(self._open, "stack", None)
            if stack is None:
                stack = self._open.stack = []
            stack.append(time.perf_counter())
        elif event in ("c_return", "c_exception"):
            stack = getattr(self._open, "stack", None)
            if not stack:
                return
            took = time.perf_counter() - stack.pop()
            if took > self.threshold_s:
                name = getattr(arg, "__qualname__", None) or repr(arg)
                where = traceback.format_stack(frame, limit=8)
                self.found.append((took, threading.current_thread().name, name, where))

    def install(self):
        if hasattr(threading, "setprofile_all_threads"):  # Python >= 3.12: running threads too
            threading.setprofile_all_threads(self)
        else:
            threading.setprofile(self)
        sys.setprofile(self)

    def remove(self):
        if hasattr(threading, "setprofile_all_threads"):
            threading.setprofile_all_threads(None)
        else:
            threading.setprofile(None)
        sys.setprofile(None)


def device_allocations() -> dict[str, int]:
    """The caching allocator's cumulative counts of device memory requests (``cudaMalloc``
    calls, new segments, retries after a failed request), whose deltas say whether queued steps
    asked the driver for memory."""
    stats = torch.cuda.memory_stats()
    return {
        "device allocations (cudaMalloc)": stats.get("num_device_alloc", 0),
        "new segments": stats.get("segment.all.allocated", 0),
        "allocation retries": stats.get("num_alloc_retries", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="steps queued behind the sleep")
    parser.add_argument("--warmup", type=int, default=4, help="steps before (kernels compile)")
    parser.add_argument("--sleep-s", type=float, default=10.0, help="GPU sleep, seconds")
    parser.add_argument("--threshold-ms", type=float, default=200.0)
    parser.add_argument("--base", default="gem-small", help="the named config overridden")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument(
        "--seen-sizes", action="store_true", help="train once on the queued batches' sizes first"
    )
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    from gem_train.profiling import StepTimer
    from gem_train.train import train_step

    on_gpu = torch.cuda.is_available() and not args.smoke
    run = common.trainer_run(args.overrides, base=args.base, smoke=args.smoke)
    try:
        timer = StepTimer(run.device, enabled=False)
        for step in range(args.warmup):
            train_step(run, next(run.batches), step, timer)
        prepared = [next(run.batches) for _ in range(args.steps)]
        if args.seen_sizes:
            from gem_train.data.loader import StepBatch

            for i, batch in enumerate(prepared):
                copy = StepBatch.of(batch.batch, staging=run.batches.staging)
                train_step(run, copy, args.warmup + i, timer)
        hook = LongCalls(args.threshold_ms / 1e3)
        if on_gpu:
            torch.cuda.synchronize()
            before = device_allocations()
            torch.cuda._sleep(int(args.sleep_s * torch.cuda.clock_rate() * 1e6))
        start = time.perf_counter()
        hook.install()
        try:
            for i, batch in enumerate(prepared):
                train_step(run, batch, args.warmup + i, timer)
        finally:
            hook.remove()
        queued_s = time.perf_counter() - start
        grown = {}
        if on_gpu:
            grown = {k: v - before[k] for k, v in device_allocations().items()}
            torch.cuda.synchronize()
    finally:
        run.batches.close()
    print(f"{common.environment()}: {args.steps} steps queued in {queued_s:.2f} s behind a "
          f"{args.sleep_s:g} s GPU sleep; calls over {args.threshold_ms:g} ms: {len(hook.found)}")  # fmt: skip
    if grown:
        print("while queued, the caching allocator made " + ", ".join(
            f"{n} {what}" for what, n in grown.items()))  # fmt: skip
    for took, thread, name, where in sorted(hook.found, key=lambda f: -f[0]):
        print(f"\n{took * 1e3:9.1f} ms  {name}  (thread {thread})")
        print("".join(where).rstrip())


if __name__ == "__main__":
    main()

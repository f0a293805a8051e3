"""Where a training step's time goes: host and device time per phase, and host syncs.

The training loop closes each phase of a step with ``timer.mark(phase)``: ``data`` (waiting for
the prepared batch and issuing its copy to the device), ``forward`` (model and loss),
``backward``, ``optimizer`` (clipping and AdamW) and ``metrics`` (the reporter). Two clocks:

- *host*: how long the Python thread spent issuing the phase (``time.perf_counter``);
- *device*: on CUDA each mark also records an event on the current stream, so a phase's device
  time is the GPU timeline between its two marks. The phases add up to the step's wall time on
  the GPU, and an idle gap where the GPU waited for the host is charged to the phase whose work
  arrived late: a phase whose device time is close to its host time is host-bound.

Marks never synchronise (an event record costs microseconds); ``summary()`` synchronises once.
A disabled timer (the trainer's default) does nothing.

``count_syncs(fn)`` runs ``fn`` under CUDA's sync debug mode and returns where the host waited
for the device (``.item()``, ``.cpu()``, data-dependent shapes): each such wait drains the launch
queue, so the GPU idles while the host catches up.

``ProfileTrace`` records a few chosen steps with ``torch.profiler`` (the host's ops, and the
kernels on CUDA) and writes them as a Chrome trace (``chrome://tracing``, Perfetto), one file per
rank, each step inside a ``gem-train step <n>`` range (``--profile-trace DIR``).
"""

import collections
import time
import warnings
from pathlib import Path

import torch

PHASES = ("data", "forward", "backward", "optimizer", "metrics")


class StepTimer:
    def __init__(self, device: torch.device, *, enabled: bool = True):
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self.host_ms: dict[str, float] = collections.defaultdict(float)
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.steps = 0
        self._t = 0.0
        self._event = None

    def reset(self) -> None:
        """Forget every step timed so far (a benchmark restarting its window)."""
        self.host_ms.clear()
        self.events.clear()
        self.steps = 0
        self._event = None

    def begin(self) -> None:
        """Start a step (its first phase is ``data``)."""
        if not self.enabled:
            return
        self.steps += 1
        self._t = time.perf_counter()
        self._event = self._record()

    def mark(self, phase: str) -> None:
        """Close ``phase``: it ran from the previous mark (or ``begin``) until now."""
        if not self.enabled or self._event is None:
            return
        now = time.perf_counter()
        self.host_ms[phase] += (now - self._t) * 1e3
        self._t = now
        event = self._record()
        if event is not None:
            self.events.append((phase, self._event, event))
        self._event = event

    def _record(self):
        if not self.cuda:
            return True  # a placeholder: on the CPU the host clock is the only clock
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def summary(self) -> dict[str, dict[str, float]]:
        """``{phase: {"host_ms": mean per step, "device_ms": mean per step or NaN}}``."""
        device_ms: dict[str, float] = collections.defaultdict(float)
        if self.cuda and self.events:
            torch.cuda.synchronize()
            for phase, start, end in self.events:
                device_ms[phase] += start.elapsed_time(end)
        steps = max(1, self.steps)
        phases = [p for p in PHASES if p in self.host_ms] + [
            p for p in self.host_ms if p not in PHASES
        ]
        return {
            p: {
                "host_ms": self.host_ms[p] / steps,
                "device_ms": device_ms[p] / steps if self.cuda else float("nan"),
            }
            for p in phases
        }


def count_syncs(fn) -> tuple[object, collections.Counter]:
    """``(fn(), Counter of "file:line" → host syncs)``; an empty counter off CUDA."""
    if not torch.cuda.is_available():
        return fn(), collections.Counter()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    where = collections.Counter(
        f"{w.filename.rsplit('/src/', 1)[-1]}:{w.lineno}"
        for w in caught
        if "synchroniz" in str(w.message)
    )
    return result, where


class ProfileTrace:
    """A ``torch.profiler`` trace of steps ``first`` to ``first + count - 1`` (counted from 1, as
    the logged steps are) of a run of ``total`` steps, written on the last of them (or the run's
    last step, or ``close``) to ``folder/trace_rank<r>_steps<a>-<b>.json``.

    Args:
        folder: where the trace goes; empty: nothing is recorded.
        first, count: the steps to record.
        total: the run's last step.
        rank: this process's rank, in the file name.
        device: the run's device; on CUDA the trace also records the kernels.
    """

    def __init__(
        self, folder: str, *, first: int, count: int, total: int, rank: int, device: torch.device
    ):
        self.folder, self.first, self.last = folder, first, min(first + count - 1, total)
        self.rank, self.cuda = rank, device.type == "cuda"
        self.profiler, self.steps, self._range = None, [], None

    def begin(self, step: int) -> None:
        """Before the 0-based ``step``: start recording when it is one of the chosen steps."""
        if not self.folder or not self.first <= step + 1 <= self.last:
            return
        if self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        self._range = torch.profiler.record_function(f"gem-train step {step + 1}")
        self._range.__enter__()
        self.steps.append(step + 1)

    def end(self, step: int) -> Path | None:
        """After the 0-based ``step``; returns the trace's path once it is written."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self.profiler is not None and step + 1 == self.last:
            return self.close()
        return None

    def close(self) -> Path | None:
        """Stop recording and write what was recorded (a run that fails part-way writes the
        steps it reached); returns the file, or None when nothing was recorded."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self.profiler is None:
            return None
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"trace_rank{self.rank}_steps{self.steps[0]}-{self.steps[-1]}.json"
        profiler.export_chrome_trace(str(path))
        return path

"""Shared pieces of every benchmark: the workloads of docs/workloads, timing, FLOP counting, tables.

Each benchmark script imports this module (``sys.path`` gets ``benchmarks/`` added by the
script), measures the project and its anchors in one run, prints one table and, when
``GEMKIT_RESULTS`` names a file, appends its rows there as JSON lines so that
``scripts/gpu_check.sh`` can print one summary table at the end of a GPU run. Among them, the
goal rows of ``record_goal`` are what the README's results table is made from
(benchmarks/README.md).
"""

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import functools
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import time

import numpy as np
import torch

# The workloads (docs/workloads) are defined once, in gem_loadbalance.workloads: ``WORKLOADS`` by
# id, and ``workload_lengths(id)`` draws a workload's lengths with its own seed.
from gem_loadbalance.workloads import WORKLOADS  # noqa: F401
from gem_loadbalance.workloads import lengths as workload_lengths  # noqa: F401


def offsets_of(lengths, device) -> torch.Tensor:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    return torch.as_tensor(offsets, device=device)


def attention_pairs(q_lengths, kv_lengths=None, *, causal=False) -> int:
    q = np.asarray(q_lengths, dtype=np.int64)
    if causal:
        return int((q * (q + 1) // 2).sum())
    k = q if kv_lengths is None else np.asarray(kv_lengths, dtype=np.int64)
    return int((q * k).sum())


def attention_flops(pairs: int, *, heads: int, head_dim: int, backward: bool) -> float:
    """4·N·H·pairs forward; forward+backward is 3.5× that."""
    forward = 4.0 * heads * head_dim * pairs
    return forward * 3.5 if backward else forward


def bench_ms(fn, *, warmup_ms=25, rep_ms=100) -> float:
    """Median time of ``fn()`` in milliseconds (CUDA events via triton's do_bench on a GPU)."""
    if torch.cuda.is_available():
        import triton.testing

        return float(
            triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        )
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def gpu_clocks(period_ms: int = 50):
    """Sample the current GPU's SM clock (MHz) while the block runs, from ``nvidia-smi`` in the
    background (reading only); the yielded list holds the samples on exit. A chip that draws
    its power limit lowers its clock, so a kernel's time in a long loop can differ from a
    short measurement's: the samples say so. Empty without ``nvidia-smi`` or a GPU."""
    samples: list[float] = []
    smi = shutil.which("nvidia-smi")
    if smi is None or not torch.cuda.is_available():
        yield samples
        return
    monitor = subprocess.Popen(
        [smi, "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i", _pci_bus_id(),
         "-lms", str(period_ms)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        yield samples
    finally:
        monitor.terminate()
        for line in monitor.communicate()[0].splitlines():
            with contextlib.suppress(ValueError):
                samples.append(float(line))


def _pci_bus_id() -> str:
    """The current GPU as nvidia-smi names it, whatever ``CUDA_VISIBLE_DEVICES`` says."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


def gpu_energy_mj() -> float:
    """The current GPU's energy counter (mJ since the driver loaded) from NVML, read only: the
    difference over a loop of steps, divided by their count, is the energy of a step. NaN
    where there is no GPU, no NVML or no counter."""
    if not torch.cuda.is_available():
        return float("nan")
    handle = _nvml_handle(_pci_bus_id())
    if handle is None:
        return float("nan")
    nvml, device = handle
    energy = ctypes.c_ulonglong()
    if nvml.nvmlDeviceGetTotalEnergyConsumption(device, ctypes.byref(energy)) != 0:
        return float("nan")
    return float(energy.value)


@functools.cache
def _nvml_handle(pci_bus_id: str):
    """(NVML library, device handle) of the GPU at ``pci_bus_id``, or None."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    device = ctypes.c_void_p()
    if (
        nvml.nvmlInit_v2() != 0
        or nvml.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(device)) != 0
    ):
        return None
    return nvml, device


def mean_mhz(samples: list[float]) -> float:
    """The mean of ``gpu_clocks``' samples; NaN when there are none."""
    return statistics.fmean(samples) if samples else float("nan")


def back_to_back_ms(fn, *, seconds: float, window: int = 20) -> list[float]:
    """Call ``fn`` (device work) back to back for about ``seconds`` of device time, never
    waiting for the device in between; returns ms per call of each window of ``window`` calls
    (CUDA events), in order. The first window, waited for, sizes the loop: bounding it by host
    time instead would let the device run on through the launch queue (about 900 queued graph
    replays, 0.8-1.6 s more on J1's steps)."""
    timed = [_timed_window(fn, window)]
    sync()
    first_ms = timed[0][0].elapsed_time(timed[0][1])
    timed += [
        _timed_window(fn, window) for _ in range(max(1, math.ceil(seconds * 1e3 / first_ms) - 1))
    ]
    sync()
    return [begin.elapsed_time(end) / window for begin, end in timed]


def _timed_window(fn, calls: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """``calls`` calls of ``fn`` between two recorded CUDA events."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    return begin, end


@dataclasses.dataclass
class Sustained:
    """``fn`` run back to back for a while (``sustained``)."""

    ms: float  # median ms per call over the second half of the windows
    mhz: float  # mean SM clock meanwhile (NaN without nvidia-smi)
    mj: float  # energy per call (NVML's counter; NaN without it)
    windows: list[float]  # ms per call of each window of calls, in order


def sustained(fn, *, seconds: float, window: int) -> Sustained:
    """``fn`` (device work) back to back for ``seconds`` with its SM clock and energy per call:
    how a loop of this work runs once the chip holds its board power to its limit."""
    start_mj = gpu_energy_mj()
    with gpu_clocks() as clocks:
        windows = back_to_back_ms(fn, seconds=seconds, window=window)
    mj = (gpu_energy_mj() - start_mj) / (len(windows) * window)
    ms = float(np.median(windows[len(windows) // 2 :]))
    return Sustained(ms, mean_mhz(clocks), mj, windows)


def sync() -> None:
    """Wait for the GPU (nothing to wait for on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_and_wall_us(step, calls: int) -> tuple[float, float]:
    """(host, wall) µs per call of ``step`` called back to back: ``host`` until the last call
    returns, without a sync (what issuing costs the CPU); ``wall`` including the final sync
    (about max(host, device))."""
    step()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    issued = time.perf_counter()
    sync()
    return (issued - start) / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


def cuda_graph_of(step):
    """``step`` captured once in a CUDA graph (after two warm-up calls on a side stream); returns
    the replay, which re-runs the step's kernels with no host work but the launch of the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def device_kernel_times(step, steps: int) -> list[tuple[str, float, float]]:
    """(kernel, device µs per step, launches per step) of ``step`` under ``torch.profiler``,
    longest first: what the GPU itself spends, whatever the host costs around it."""
    step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    rows = [
        (e.key, e.self_device_time_total / steps, e.count / steps)
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
    ]
    return sorted(rows, key=lambda row: row[1], reverse=True)


def try_bench(fn, **kwargs) -> float:
    """Like ``bench_ms`` but returns NaN (and prints why) when the anchor cannot run."""
    try:
        return bench_ms(fn, **kwargs)
    except Exception as exc:  # an anchor failing must not hide the project's numbers
        print(f"  anchor failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return float("nan")


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms and not math.isnan(ms) else float("nan")


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)
    ]
    print(f"\n## {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


NO_MATPLOTLIB = "matplotlib not installed: no plot"


def pyplot():
    """matplotlib's pyplot, drawing to files only (the Agg backend), or None where matplotlib is
    not installed: the benchmarks then print ``NO_MATPLOTLIB`` instead of a plot's path."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path) -> str:
    """Lay ``fig`` out, write it to ``path`` (120 dpi) and close it; returns the line to print."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def record(benchmark: str, **row) -> None:
    """Append one summary row for the GPU runner's final table."""
    path = os.environ.get("GEMKIT_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"benchmark": benchmark, **row}) + "\n")


GRAPHED = "graph-replayed device time"
EAGER = "eager"
TARGET_OF = ("ratio", "gemkit")


def record_goal(
    *,
    benchmark: str,
    goal: str,
    workload: str,
    gemkit: float | None,
    anchor: str,
    anchor_value: float | None,
    ratio: float,
    unit: str,
    basis: str,
    target: float | None,
    target_of: str = "ratio",
) -> dict:
    """Append one *goal row* to ``GEMKIT_RESULTS`` (when set) and return it.

    Goal rows are what the README's results table is made from (``scripts/results_table.py``
    reads the run files committed under ``benchmarks/results/`` and keeps, for each
    ``(goal, workload)``, the newest row); ``benchmarks/README.md`` describes the format. The
    device, the torch and triton versions and today's date (UTC) are filled in here.

    Args:
        benchmark: the script's name in the summary (as ``record``'s first argument).
        goal: what is compared, the same text in every run (it keys the table's row), e.g.
            ``"jagged flash attention vs FlexAttention"``.
        workload: the workload id of docs/workloads.md and the pass, e.g. ``"J1 fwd+bwd"``.
        gemkit: the project's figure in ``unit`` (None where a source gave only the ratio).
        anchor: the anchor the goal names, e.g. ``"FlexAttention"``.
        anchor_value: the anchor's figure in ``unit``, measured in the same run (or None).
        ratio: how the project compares, greater is better (anchor time / project time for
            times; project / anchor for rates and shares). NaN where the anchor failed.
        unit: the unit of ``gemkit`` and ``anchor_value`` ("ms", "TB/s", "MFU", ...).
        basis: how both were timed: ``GRAPHED`` (CUDA-graph replays, device time against
            device time), ``EAGER``, or a short phrase of its own.
        target: the goal's threshold, or None where the comparison has no goal.
        target_of: what ``target`` bounds: ``"ratio"`` (the default) or ``"gemkit"``, for
            goals stated in the unit itself (a bandwidth of 3.5 TB/s). Met means ≥ target.

    Returns:
        The row as written (a dict of JSON values, ``"kind": "goal"``).

    Raises:
        ValueError: if ``target_of`` is neither ``"ratio"`` nor ``"gemkit"``, or a text field
            is empty.
    """
    if target_of not in TARGET_OF:
        raise ValueError(f"target_of must be one of {TARGET_OF}, got {target_of!r}")
    for name, text in dict(benchmark=benchmark, goal=goal, workload=workload, anchor=anchor,
                           unit=unit, basis=basis).items():  # fmt: skip
        if not text:
            raise ValueError(f"{name} must be a non-empty text")
    import triton

    number = lambda v: None if v is None else float(v)  # noqa: E731
    row = {
        "benchmark": benchmark,
        "kind": "goal",
        "goal": goal,
        "workload": workload,
        "gemkit": number(gemkit),
        "anchor": anchor,
        "anchor_value": number(anchor_value),
        "unit": unit,
        "ratio": float(ratio),
        "target": number(target),
        "target_of": target_of,
        "basis": basis,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
    }
    path = os.environ.get("GEMKIT_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def graphed_or_eager(ms: dict, project: str, anchor: str) -> tuple[float, float, str]:
    """(project ms, anchor ms, basis) for a goal row from a benchmark's ``ms`` by name: graph
    against graph (``"<name> (graph)"`` entries) where both sides were replayed, since device
    time does not move with the host's speed; otherwise the eager times."""
    graphed = ms.get(f"{project} (graph)", math.nan), ms.get(f"{anchor} (graph)", math.nan)
    if all(math.isfinite(t) for t in graphed):
        return *graphed, GRAPHED
    return ms[project], ms[anchor], EAGER


def environment() -> str:
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{dev}, torch {torch.__version__}, triton {triton.__version__}"


def free_port() -> int:
    """A free TCP port on this host, for the rendezvous of processes a benchmark spawns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def positive_int(text: str) -> int:
    """argparse type of a count (steps, calls, rows): an integer ≥ 1."""
    if not text.lstrip("-").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def radius(text: str) -> int:
    """argparse type of ``--rel-bias R``: a relative-bias radius, an integer ≥ 0."""
    if not text.lstrip("-").isdigit() or int(text) < 0:
        raise argparse.ArgumentTypeError(f"expected a radius R, an integer >= 0, got {text!r}")
    return int(text)


# A shrunken gem-small for the CPU: the diagnostics' smoke runs check their own Python.
SMOKE_TRAINER_FLAGS = {
    "device": "cpu", "model.d_model": "64", "model.n_heads": "2", "model.n_layers": "1",
    "model.ffn_hidden": "128", "model.mlp_hidden": "64", "data.batch_size": "8",
    "data.sub_batch_size": "4", "data.max_len": "128", "memory.budget_gib": "4",
    "lowprec.autocast_bf16": "false",
}  # fmt: skip


def trainer_run(overrides: list[str], *, base: str = "gem-small", smoke: bool = False):
    """A trainer run (``gem_train.components.build_run``) of the named config ``base`` with
    ``section.field=value`` overrides, native embeddings, no progress bar and no evaluation;
    shrunken to ``SMOKE_TRAINER_FLAGS`` with ``smoke`` or without a GPU. The caller closes
    ``run.batches``."""
    from gem_train.components import build_run
    from gem_train.config import apply_overrides, named_config

    flags = {"model.embeddings": "native", "metrics.progress": "false", "data.eval_batches": "0"}
    if smoke or not torch.cuda.is_available():
        flags |= SMOKE_TRAINER_FLAGS
    flags |= dict(o.split("=", 1) for o in overrides)
    return build_run(apply_overrides(named_config(base), flags))

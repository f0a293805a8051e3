"""The diagnostic benchmarks run (``--smoke``: tiny sizes on the CPU, interpreted kernels)."""

import contextlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
DIAGNOSTICS = BENCHMARKS / "diagnostics"


def assert_plotted(message: str, path: Path) -> None:
    """The figure at ``path`` was drawn, or, without matplotlib, the message says why not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert message == "matplotlib not installed: no plot"
    else:
        assert path.stat().st_size > 0


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("host_profile.py", ["--top", "3"], "launch paths"),
        ("bench_kernel_breakdown.py", ["--only", "J3"], "kernel time per fwd+bwd step"),
        ("bench_energy.py", ["--rounds", "1"], "energy per call, CPU smoke run"),
        ("host_waits.py", ["--steps", "1", "--warmup", "1", "--seen-sizes"], "steps queued in"),
        ("step_host_profile.py", ["--steps", "1", "--warmup", "1"], "functions by own time"),
    ],
)
def test_diagnostic_benchmark_smoke_runs(script, args, expected):
    result = subprocess.run(
        [sys.executable, str(DIAGNOSTICS / script), "--smoke", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert expected in result.stdout


def test_kernel_breakdown_groups_kernels_by_stage_and_plots(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    sys.path.insert(0, str(BENCHMARKS / "jagged"))
    sys.path.insert(0, str(DIAGNOSTICS))
    import bench_kernel_breakdown as breakdown

    names = {
        "_gdpa_fwd_seq_kernel": "forward",
        "_jfa_dq_kernel": "dQ",
        "_gdpa_bwd_dq_seq_kernel": "dQ",
        "_jfa_dkdv_finish_kernel": "dK/dV",
        "void at::native::reduce_kernel<128, 4>": "other",
    }
    assert {name: breakdown.part_of(name) for name in names} == names
    message = breakdown.plot({"J3 gdpa": [("_gdpa_fwd_seq_kernel", 67.0)]}, tmp_path, title="t")
    assert_plotted(message, tmp_path / "kernel_breakdown.png")


def test_jfa_benchmark_plots_the_sustained_rounds(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    sys.path.insert(0, str(BENCHMARKS / "jagged"))
    import bench_jagged_flash_attention as bench

    windows = dict(project_windows=[0.81, 0.85, 0.9, 0.91], anchor_windows=[1.7, 1.68, 1.68])
    rounds = [
        bench.SustainedRound(
            0.905, 1.68, 1720.0, 1975.0, **windows, project_mj=620.0, anchor_mj=1018.0
        )
    ]
    message = bench.plot_sustained([("J1", rounds), ("J2", rounds)], tmp_path, title="t")
    assert_plotted(message, tmp_path / "jfa_sustained.png")


def test_custom_op_share_times_the_ops_implementations_and_restores_them():
    sys.path.insert(0, str(BENCHMARKS))
    sys.path.insert(0, str(BENCHMARKS / "jagged"))
    sys.path.insert(0, str(DIAGNOSTICS))
    import host_profile
    from gem_jagged import jagged_flash_attention
    from gem_jagged.ops.jagged_flash_attention import _op

    before = [dict(op._backend_fns) for op in (_op.attention_forward, _op.attention_backward)]
    offsets = torch.tensor([0, 3, 8])
    leaves = [torch.randn(8, 2, 32, requires_grad=True) for _ in range(3)]

    def step():  # the reference backend always goes through the custom ops
        out = jagged_flash_attention(*leaves, offsets, causal=True, backend="reference")
        return torch.autograd.grad(out, leaves, torch.ones_like(out))

    share = host_profile.custom_op_share(step, 3)
    assert set(share) == {
        "step", *(f"{op} op, {where}" for op in ("forward", "backward")
                  for where in ("inside the step", "called directly")),
    }  # fmt: skip
    assert all(us > 0 for us in share.values())
    assert share["forward op, inside the step"] < share["step"]
    after = [dict(op._backend_fns) for op in (_op.attention_forward, _op.attention_backward)]
    assert after == before


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks what the GPU readings give where there is no GPU"
)
def test_gpu_readings_are_nan_or_empty_without_a_gpu():
    sys.path.insert(0, str(BENCHMARKS))
    import common

    assert math.isnan(common.gpu_energy_mj())
    with common.gpu_clocks() as samples:
        pass
    assert samples == [] and math.isnan(common.mean_mhz(samples))


def test_diagnostic_benchmarks_refuse_a_count_below_one():
    result = subprocess.run(
        [sys.executable, str(DIAGNOSTICS / "bench_kernel_breakdown.py"), "--steps", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert "argument --steps: expected an integer >= 1, got '0'" in result.stderr


def test_energy_bench_counts_the_tile_pairs_a_causal_kernel_computes():
    sys.path.insert(0, str(BENCHMARKS))
    sys.path.insert(0, str(BENCHMARKS / "jagged"))
    sys.path.insert(0, str(DIAGNOSTICS))
    import bench_energy

    # tiles per sequence 0, 1, 1, 2, 2, 3 -> t(t+1)/2 pairs: 0 + 1 + 1 + 3 + 3 + 6
    assert bench_energy.computed_tile_pairs([0, 1, 64, 65, 128, 129]) == 14


def test_energy_bench_derives_the_backward_and_plots(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    sys.path.insert(0, str(BENCHMARKS / "jagged"))
    sys.path.insert(0, str(DIAGNOSTICS))
    import bench_energy

    measured = [
        bench_energy.Measured(1, "gemm", 1.6, 1536.0, 1144.0, 1.1e12, None),
        bench_energy.Measured(1, "project fwd", 0.24, 1770.0, 164.0, 9.2e10, 8.5e10),
        bench_energy.Measured(1, "project fwd+bwd", 0.88, 1720.0, 630.0, 4.1e11, 3.0e11),
    ]
    (backward,) = [m for m in bench_energy.with_backward(measured) if "bwd (difference)" in m.case]
    assert (backward.ms, backward.mj) == pytest.approx((0.64, 466.0))
    assert backward.pj_per(backward.computed) == pytest.approx(466.0e9 / 3.18e11)
    assert math.isnan(backward.mhz) and math.isnan(measured[0].pj_per(None))
    message = bench_energy.plot(bench_energy.with_backward(measured), tmp_path, title="t")
    assert_plotted(message, tmp_path / "energy_per_flop.png")


def test_sustained_reads_time_clock_and_energy_per_call(monkeypatch):
    sys.path.insert(0, str(BENCHMARKS))
    import common

    energy = iter([1000.0, 1600.0])  # mJ at the start and at the end
    monkeypatch.setattr(common, "gpu_energy_mj", lambda: next(energy))
    monkeypatch.setattr(common, "back_to_back_ms", lambda fn, *, seconds, window: [1, 2, 3, 4])

    @contextlib.contextmanager
    def clocks():
        samples = []
        yield samples
        samples.extend([1700.0, 1720.0])

    monkeypatch.setattr(common, "gpu_clocks", clocks)
    run = common.sustained(lambda: None, seconds=1.0, window=10)
    # median of the second half of the windows; 600 mJ over 4 windows of 10 calls
    assert (run.ms, run.mhz, run.mj, run.windows) == (3.5, 1710.0, 15.0, [1, 2, 3, 4])


def test_back_to_back_loop_is_sized_by_the_first_windows_device_time(monkeypatch):
    sys.path.insert(0, str(BENCHMARKS))
    import common

    class Event:  # every window of calls takes 40 ms on the "device"
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            pass

        def elapsed_time(self, end):
            return 40.0

    calls = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(common, "sync", lambda: None)
    windows = common.back_to_back_ms(lambda: calls.append(1), seconds=1.0, window=20)
    # 1 s of device time at 40 ms a window: 25 windows of 20 calls, the sizing window included
    assert (windows, len(calls)) == ([2.0] * 25, 500)


def test_long_calls_finds_a_blocking_call_with_its_stack_in_any_thread():
    sys.path.insert(0, str(DIAGNOSTICS))
    import threading
    import time

    from host_waits import LongCalls

    def blocks_in_a_thread():
        time.sleep(0.06)

    hook = LongCalls(0.04)
    hook.install()
    try:
        time.sleep(0.001)  # short: not reported
        time.sleep(0.05)
        thread = threading.Thread(target=blocks_in_a_thread, name="worker")
        thread.start()
        thread.join()
    finally:
        hook.remove()
    found = {(name, thread) for _, thread, name, _ in hook.found if name == "sleep"}
    assert found == {("sleep", "MainThread"), ("sleep", "worker")}
    worker = next(where for _, thread, _, where in hook.found if thread == "worker")
    assert "blocks_in_a_thread" in "".join(worker)

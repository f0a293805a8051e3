"""The A2 benchmark runs on the CPU at smoke sizes (Python errors are caught before GPU time)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gem_train" / "bench_gem_small.py"


def test_a2_smoke_runs_the_optimised_and_native_models():
    """Both variants at once (``--gpus 2``: on the CPU, two processes side by side)."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--steps", "1", "--sync-steps", "0", "--gpus", "2",
         "--only", "all on", "PyTorch-native"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "| all on" in done.stdout and "| PyTorch-native" in done.stdout


def test_compile_stability_smoke_reports_each_step():
    script = SCRIPT.parents[1] / "diagnostics" / "bench_compile_stability.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--steps", "1", "memory.autoac=false"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "step 0:" in done.stdout and "kernels compiled" in done.stdout

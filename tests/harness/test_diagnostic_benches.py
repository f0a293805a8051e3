"""The diagnostic benchmarks run (``--smoke``: tiny sizes on the CPU, interpreted kernels)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("host_profile.py", ["--top", "3"], "launch paths"),
        ("jagged/bench_kernel_breakdown.py", ["--only", "J3"], "kernel time per fwd+bwd step"),
    ],
)
def test_diagnostic_benchmark_smoke_runs(script, args, expected):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert expected in result.stdout

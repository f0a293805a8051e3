"""The launch-overhead benchmark runs (``--smoke``: a few interpreted calls on the CPU)."""

import subprocess
import sys
from pathlib import Path


def test_launch_overhead_benchmark_smoke_runs():
    script = Path(__file__).resolve().parents[2] / "benchmarks/jagged/bench_launch_overhead.py"
    result = subprocess.run(
        [sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "inside backward" in result.stdout

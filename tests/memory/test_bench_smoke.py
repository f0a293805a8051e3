"""The AutoAC benchmark runs end to end at tiny sizes on the CPU (catches errors before GPU time)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "memory" / "bench_autoac.py"


@pytest.mark.slow
def test_bench_autoac_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "GEMKIT_RESULTS": str(tmp_path / "results.jsonl")}
    run = subprocess.run(
        [sys.executable, str(BENCH), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Peak memory vs step time" in run.stdout
    assert "AutoAC @ knob 0.5 peak" in run.stdout
    assert "Largest local batch" in run.stdout
    assert "AutoAC at batch" in run.stdout  # the planner ran past the no-checkpointing limit
    assert "autoac" in (tmp_path / "results.jsonl").read_text()

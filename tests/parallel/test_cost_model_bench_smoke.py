"""The collectives benchmark runs end to end (``--smoke``: tiny sizes, CPU, gloo)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_collectives_model_smoke():
    env = dict(os.environ, MASTER_PORT="29547")
    env.pop("GEMKIT_RESULTS", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/parallel/bench_collectives_model.py"), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "device copy vs latency + bytes/bandwidth" in result.stdout
    assert "NOT measured here (needs several GPUs)" in result.stdout

"""The A2 benchmark runs on the CPU at smoke sizes (Python errors are caught before GPU time)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gem_train" / "bench_gem_small.py"


def test_a2_smoke_runs_the_optimised_and_both_native_models(tmp_path):
    """The all-on row and both anchors (``--gpus 2``: on the CPU, two processes side by side);
    the all-on QPS is recorded as a goal row against each anchor."""
    results = tmp_path / "results.jsonl"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--steps", "1", "--sync-steps", "0", "--gpus", "2",
         "--only", "all on", "PyTorch-native", "PyTorch-native FlexAttention"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, GEMKIT_RESULTS=str(results)),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for row in ("| all on", "| PyTorch-native ", "| PyTorch-native FlexAttention"):
        assert row in done.stdout
    assert "vs flex native" in done.stdout
    goals = [json.loads(line) for line in results.read_text().splitlines()]
    anchors = {
        g["anchor"]: g for g in goals if g.get("kind") == "goal" and g["unit"] == "samples/s"
    }
    assert anchors.keys() == {"PyTorch-native", "PyTorch-native FlexAttention"}
    assert all(math.isfinite(g["ratio"]) for g in anchors.values())


def test_compile_stability_smoke_reports_each_step():
    script = SCRIPT.parents[1] / "diagnostics" / "bench_compile_stability.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--steps", "1", "memory.autoac=false"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "step 0:" in done.stdout and "kernels compiled" in done.stdout

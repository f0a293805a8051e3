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


def test_fp8_quality_smoke_records_a_goal_per_fp8_recipe(tmp_path):
    results = tmp_path / "results.jsonl"
    done = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "bench_fp8_quality.py"), "--smoke"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, GEMKIT_RESULTS=str(results)),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    goals = [json.loads(line) for line in results.read_text().splitlines()]
    assert {g["goal"] for g in goals} == {
        "fp8 training NE vs BF16, mxfp8",
        "fp8 training NE vs BF16, fp8_rowwise",
    }
    assert all(math.isfinite(g["ratio"]) and g["target"] == 0.999 for g in goals)
    # every recipe but the anchor ran linears in fp8 (the rule plan): the table says how many
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if "|" in line}
    assert int(rows["bf16"].split("|")[2]) == 0
    assert int(rows["mxfp8"].split("|")[2]) > 0 and int(rows["fp8_rowwise"].split("|")[2]) > 0


def test_compile_stability_smoke_reports_each_step():
    script = SCRIPT.parents[1] / "diagnostics" / "bench_compile_stability.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--steps", "1", "memory.autoac=false"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "step 0:" in done.stdout and "kernels compiled" in done.stdout


def test_a2_reruns_flex_with_fewer_backward_stages_only_when_it_ran_out_of_shared_memory():
    """The strong anchor is run again with ``model.flex_bwd_stages`` only for inductor's
    out-of-shared-memory FlexAttention backward, and the row records the flag it ran with."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_gem_small as bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    message = (
        "RuntimeError: No valid triton configs. OutOfMemoryError: out of resource: "
        "triton_tem_fused_flex_attention_backward_select_backward_transpose_view_6 Required: "
        "235008 Hardware limit:232448 Reducing block sizes or `num_stages` may help."
    )
    assert bench.flex_backward_out_of_shared_memory(message)
    assert not bench.flex_backward_out_of_shared_memory("CUDA error: an illegal memory access")
    assert not bench.flex_backward_out_of_shared_memory("out of resource: triton_mm_3")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--child", bench.STRONG_ANCHOR, "--smoke", "--steps", "1",
         "--warmup", "1", "--sync-steps", "0", "--set", "model.flex_bwd_stages=2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith(bench.RESULT)]
    assert json.loads(line[len(bench.RESULT) :])["notes"].endswith("with model.flex_bwd_stages=2")

"""The GPU runner (scripts/gpu_check.sh) deals test paths and benchmarks out to parallel streams
and gathers one summary; checked on the CPU with smoke-sized benchmarks and deselected tests."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_two_streams_each_run_their_share_and_one_summary_gathers_them(tmp_path):
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        GEMKIT_GPUS="2",
        GEMKIT_LOG_DIR=str(tmp_path),
        GEMKIT_TEST_PATHS="tests/harness/test_harness.py tests/harness/test_packaging.py",
    )
    done = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_check.sh"), "benchmarks/loadbalance/bench_b1.py --smoke",
         "benchmarks/jagged/bench_jagged_flash_attention.py --smoke"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    stream0 = (tmp_path / "stream0" / "gpu_check.log").read_text()
    stream1 = (tmp_path / "stream1" / "gpu_check.log").read_text()
    assert "bench_b1.py" in stream0 and "bench_jagged_flash_attention" not in stream0
    assert "bench_jagged_flash_attention.py" in stream1 and "bench_b1" not in stream1
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    names = [row["benchmark"] for row in rows]
    assert names.count("gpu tests") == 2
    assert "loadbalance_b1" in names and "jagged_flash_attention" in names
    summary = done.stdout.split("## summary")[1] if "## summary" in done.stdout else ""
    assert "jagged_flash_attention" in summary


def test_a_benchmark_argument_with_spaces_arrives_whole(tmp_path):
    script = tmp_path / "print_args.py"
    script.write_text("import json, sys\nprint('ARGS', json.dumps(sys.argv[1:]))\n")
    env = dict(
        os.environ, PYTHON=sys.executable, GEMKIT_SKIP_TESTS="1", GEMKIT_LOG_DIR=str(tmp_path)
    )
    done = subprocess.run(
        ["bash", str(REPO / "scripts/gpu_check.sh"), f"{script} --only 'all on' 'AutoAC → none' -n 2"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    printed = next(line for line in done.stdout.splitlines() if line.startswith("ARGS "))
    assert json.loads(printed[5:]) == ["--only", "all on", "AutoAC → none", "-n", "2"]

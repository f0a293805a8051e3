"""The simulator: the balance goal on a small B1-like setting, and the command line with --plot."""

import importlib.util
import runpy
import subprocess
import sys
from pathlib import Path

from gem_loadbalance.simulate import (
    AGREED,
    NO_MATPLOTLIB,
    SimulationConfig,
    format_table,
    main,
    simulate,
)


def test_shuffler_captures_most_of_the_possible_improvement():
    # B1 scaled down: 16 ranks, local batch 256 from 64-sample sub-batches, 40 steps.
    cfg = SimulationConfig(
        ranks=16, steps=40, local_batch=256, sub_batch=64, warm_steps=0, calibration_samples=2**16
    )
    result = simulate(cfg)
    none = result.ratios["no shuffling"].mean()
    assert none > 1.3  # the imbalance being fixed is real
    assert result.optimum.mean() < 1.001
    assert result.captured("shuffler, calibrated expected_cost") >= 0.95
    # The default: the mean agreed once over every rank's first look-ahead.
    assert result.captured(AGREED) >= 0.96
    # With nothing shared and a cold estimate the ranks' targets still disagree early on.
    assert result.captured("shuffler, running estimate (cold)") >= 0.75
    for name, delays in result.delay_counts.items():
        assert max(delays) <= cfg.max_delay and min(delays) >= -cfg.lookahead, name
        assert sum(delays.values()) == cfg.ranks * cfg.steps * cfg.local_batch
    table = format_table(cfg, result)
    assert "captured" in table and "global lpt_capped" in table


def test_command_line_prints_the_table_and_draws_the_plot(tmp_path, capsys):
    plot = tmp_path / "imbalance.png"
    main(
        [
            "--ranks", "4", "--steps", "3", "--local-batch", "64", "--sub-batch", "16",
            "--warm-steps", "2", "--calibration-samples", "1000",
            "--optimum", "lpt_capped,kk,greedy", "--plot", str(plot),
        ]
    )  # fmt: skip
    out, err = capsys.readouterr()
    for setting in (
        "no shuffling",
        "shuffler, running estimate (cold)",
        "shuffler, running estimate after 2 steps",
        "shuffler, calibrated expected_cost",
        "global kk",
    ):
        assert setting in out
    assert "step 3/3" in err
    last = out.strip().splitlines()[-1]
    if importlib.util.find_spec("matplotlib") is None:
        assert last == NO_MATPLOTLIB and not plot.exists()
    else:
        assert last == f"plot written to {plot}" and plot.stat().st_size > 0


def test_module_runs_as_a_script():
    run = subprocess.run(
        [sys.executable, "-m", "gem_loadbalance.simulate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "--plot" in run.stdout and "--ranks" in run.stdout


def test_benchmark_smoke(monkeypatch, capsys):
    # The environment names the results file of a GPU run; a smoke run must not add to it.
    monkeypatch.delenv("GEMKIT_RESULTS", raising=False)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "loadbalance" / "bench_b1.py"
    bench = runpy.run_path(str(script))  # defines main() without running it
    bench["main"](["--smoke"])
    out = capsys.readouterr().out
    assert "B1 simulation" in out and "partition methods" in out and "planning time" in out

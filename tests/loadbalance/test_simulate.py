"""The simulator: the balance goal on a small B1-like setting, and the command line with --plot."""

import runpy
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from gem_loadbalance.simulate import SimulationConfig, format_table, main, simulate


def test_shuffler_captures_most_of_the_possible_improvement():
    # B1 scaled down: 16 ranks, local batch 256 from 64-sample sub-batches, 40 steps.
    cfg = SimulationConfig(
        ranks=16, steps=40, local_batch=256, sub_batch=64, warm_steps=0, calibration_samples=2**16
    )
    result = simulate(cfg)
    none = result.ratios["no shuffling"].mean()
    assert none > 1.3  # the imbalance being fixed is real
    assert result.optimum.mean() < 1.001
    assert result.captured("shuffler, calibrated expected_cost") >= 0.9
    # With nothing shared and a cold estimate the ranks' targets still disagree early on.
    assert result.captured("shuffler, running estimate (cold)") >= 0.7
    for name, delays in result.delay_counts.items():
        assert max(delays) <= cfg.max_delay and min(delays) >= -cfg.lookahead, name
        assert sum(delays.values()) == cfg.ranks * cfg.steps * cfg.local_batch
    table = format_table(cfg, result)
    assert "captured" in table and "global lpt_capped" in table


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    idat = data.index(b"IDAT")
    (idat_length,) = struct.unpack(">I", data[idat - 4 : idat])
    pixels = zlib.decompress(data[idat + 4 : idat + 4 + idat_length])
    assert len(pixels) == height * (1 + 3 * width)
    rows = np.frombuffer(pixels, np.uint8).reshape(height, 1 + 3 * width)[:, 1:]
    assert len(np.unique(rows.reshape(-1, 3), axis=0)) > 4  # lines and text, not a blank canvas
    return width, height


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
    width, height = _png_size(plot.read_bytes())
    assert width == 1000 and height > 500


# runpy warns that the module is already imported (by this file); running it again is the point.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_module_runs_as_a_script(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["simulate", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("gem_loadbalance.simulate", run_name="__main__")
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--plot" in out and "--ranks" in out


def test_benchmark_smoke(monkeypatch, capsys):
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "loadbalance" / "bench_b1.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--smoke"])
    monkeypatch.delenv("GEMKIT_RESULTS", raising=False)
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "B1 simulation" in out and "partition methods" in out and "planning time" in out

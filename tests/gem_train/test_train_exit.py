"""Every way out of a run closes what it started: the data loader's thread is joined, the
progress bar and TensorBoard writer are closed, and the process exits with its code and without
"terminate called" (a thread still inside C++ when the interpreter shuts down)."""

import os
import subprocess
import sys
import threading

import pytest
from gem_train.finite import NonFiniteError
from gem_train.train import train


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gem-train-data" and t.is_alive()]


def test_a_finished_run_joins_its_loader_thread(small):
    before = _loader_threads()  # other tests in this process may have left theirs
    train(small(steps=2, data__prefetch=2))
    assert [t for t in _loader_threads() if t not in before] == []


def test_a_failed_run_joins_its_loader_thread(small):
    before = _loader_threads()
    with pytest.raises(NonFiniteError):
        train(small(optim__lr="1e6", optim__warmup_steps=0, data__prefetch=4))
    assert [t for t in _loader_threads() if t not in before] == []


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "gem_train.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        ({"data.sigma": "-1"}, 2, "data.sigma must be finite and ≥ 0, got -1.0"),
        ({"optim.lr": "1e6", "optim.warmup_steps": "0"}, 1, "the loss is non-finite"),
        ({"steps": "2", "tensorboard": "TB"}, 0, ""),
    ],
    ids=["config-error", "non-finite", "tiny-run"],
)
def test_the_command_line_exits_cleanly(flags, tmp_path, extra, code, message):
    extra = {k: str(tmp_path / v) if v == "TB" else v for k, v in extra.items()}
    done = _cli(flags(**{"data.prefetch": 2, **extra}))
    assert done.returncode == code, done.stderr[-3000:]
    assert message in done.stderr
    assert "terminate called" not in done.stderr and "Traceback" not in done.stderr


def test_plan_that_fits_nowhere_is_an_error_without_a_traceback():
    done = _cli(["plan", "--config", "gem-large"])
    assert done.returncode == 1
    assert "gem-train plan: error: gem-large fits nowhere" in done.stderr
    assert "Traceback" not in done.stderr

"""A worker whose torchrun agent is killed (``kill -9``) notices and stops with a message,
instead of training on to the end unsupervised."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from gem_train.supervision import Supervision, SupervisorLost


def test_outside_torchrun_nothing_is_watched(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert Supervision().parent is None
    Supervision().check(0)


def test_a_new_parent_means_the_agent_is_gone(monkeypatch):
    supervision = Supervision(watch=True)
    monkeypatch.setattr(os, "getppid", lambda: supervision.parent + 1)
    with pytest.raises(SupervisorLost, match=rf"agent \(pid {supervision.parent}\) .* step 7"):
        supervision.check(7)


# An agent stand-in: starts the trainer as its child with torchrun's environment, writes the
# child's pid, and waits (to be killed with SIGKILL, as `kill -9` of a torchrun agent).
AGENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    out = open(sys.argv[2], "w")
    env = dict(os.environ, TORCHELASTIC_RUN_ID="test", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    child = subprocess.Popen(
        [sys.executable, "-m", "gem_train.cli", "--steps", "100000", "--data.prefetch", "0",
         "--metrics.progress", "false", "--metrics.log_every", "10"],
        stdout=out, stderr=subprocess.STDOUT, env=env,
    )
    open(sys.argv[1], "w").write(str(child.pid))
    time.sleep(600)
    """
)


def test_the_worker_of_a_killed_agent_stops(tmp_path):
    pid_file, log = tmp_path / "pid", tmp_path / "worker.log"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(pid_file), str(log)])
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        worker = int(pid_file.read_text())
        while "step " not in _text(log) and time.monotonic() < deadline:
            time.sleep(0.2)  # until the worker trains (it watches from the built run on)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 60
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = _alive(worker)
    finally:
        agent.kill()
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, "the worker trained on after its agent was killed"
    assert "gem-train: error: the torchrun agent (pid" in log.read_text()


def _text(path) -> str:
    return path.read_text() if path.exists() else ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited; it only waits for a parent to reap it
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"

"""The tree passes ruff (the rules of the root pyproject.toml): an undefined name on a path the
CPU never runs (a CUDA-only branch, say) fails here rather than on the GPU."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = pytest.importorskip("ruff", reason="ruff is in the workspace's dev group")
    from ruff.__main__ import find_ruff_bin

    del ruff
    result = subprocess.run(
        [find_ruff_bin(), "check", "--no-cache", "packages", "apps", "benchmarks", "tests",
         "scripts"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr

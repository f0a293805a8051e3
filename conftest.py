"""Test harness shared by every package's tests.

- Chooses the hypothesis profile: ``ci`` (derandomized, modest examples, no deadline) when the
  environment says ``CI=true``, else ``dev``; ``HYPOTHESIS_PROFILE`` overrides both.
- Without a CUDA device, sets ``TRITON_INTERPRET=1`` *before* anything imports triton, so the
  Triton kernels run on the CPU through Triton's interpreter.
- Skips ``gpu`` tests without CUDA and ``multigpu`` tests without at least two devices.
- Stops at once, naming the extras, where torchrec is installed without FBGEMM: the workspace
  was synced without ``--extra cpu`` or ``--extra cuda``, and every torchrec test would fail on
  an import deep inside torchrec.
"""

import importlib.util
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=12,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(
    os.environ.get(
        "HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI", "").lower() == "true" else "dev"
    )
)


def pytest_configure(config):
    if importlib.util.find_spec("torchrec") and not importlib.util.find_spec("fbgemm_gpu"):
        pytest.exit(
            "torchrec is installed without FBGEMM (fbgemm_gpu), so the environment was synced "
            "without an extra: run the tests as `uv run --extra cpu pytest`, or with "
            "`--extra cuda` on a CUDA machine",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if HAS_CUDA else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none is present")
    skip_multi = pytest.mark.skip(reason=f"needs at least 2 CUDA devices; {n_gpus} present")
    for item in items:
        if "gpu" in item.keywords and n_gpus == 0:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)

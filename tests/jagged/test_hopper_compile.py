"""The project's Triton and Gluon kernels compile for Hopper (sm_90) with their GPU tile
configs and code paths, checked on a machine without a GPU through
``scripts/hopper_compile.py`` (Triton compiles ahead of time)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "scripts" / "hopper_compile.py"


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for kernel in (
        "_jfa_fwd_kernel", "_jfa_dq_kernel", "_jfa_dkdv_kernel", "_jfa_dkdv_finish_kernel",
        "_jfa_fwd_hopper_kernel", "_jfa_dq_hopper_kernel", "_jfa_dkdv_hopper_kernel",
        "_gdpa_fwd_kernel", "_gdpa_bwd_dq_kernel", "_gdpa_bwd_dkdv_kernel",
        "_block_attention_fwd_kernel", "_block_attention_bwd_kernel", "_swiglu_fwd_kernel",
        "_swiglu_bwd_kernel", "cast_rows_kernel", "cast_both_kernel", "cast_columns_kernel",
        "mx_rowcol_k128_kernel", "mx_quantize_rows_kernel", "mx_quantize_tile2d_kernel",
        "rmsnorm_mx_kernel",
    ):  # fmt: skip
        assert f"| {kernel} |" in done.stdout, kernel
    assert "| jfa_bias | _jfa_dq_kernel |" in done.stdout
    assert "| jfa_hopper | _jfa_dkdv_hopper_kernel |" in done.stdout
    # The Gluon kernels pipeline their MMAs by hand: ptxas must not serialize them (C7514).
    for kernel in ("_jfa_fwd_hopper_kernel", "_jfa_dq_hopper_kernel", "_jfa_dkdv_hopper_kernel"):
        rows = re.findall(rf"^\| \w+ \| {kernel} \|.*\| (yes|no) \|$", done.stdout, re.MULTILINE)
        assert rows and set(rows) == {"no"}, (kernel, rows)

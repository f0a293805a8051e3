"""The harness itself: profiles load, markers skip correctly, the Triton interpreter computes."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st


def test_hypothesis_profile_is_registered_and_loaded():
    expected = os.environ.get(
        "HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI", "").lower() == "true" else "dev"
    )
    assert settings.get_profile(expected) is not None
    assert settings.default.deadline is None
    if expected == "ci":
        assert settings.default.derandomize


@given(st.integers(min_value=0, max_value=10))
def test_hypothesis_runs(n):
    assert torch.arange(n).sum().item() == n * (n - 1) // 2


@pytest.mark.gpu
def test_gpu_marker_runs_only_with_cuda():
    # Reaching this line without CUDA would mean the marker failed to skip.
    assert torch.cuda.is_available()
    x = torch.ones(4, device="cuda")
    assert x.sum().item() == 4


def test_gpu_marker_is_skipped_without_cuda(pytestconfig):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the gpu test runs instead")
    assert os.environ.get("TRITON_INTERPRET") == "1"


def test_triton_kernel_matches_torch():
    import triton
    import triton.language as tl

    @triton.jit
    def scaled_add_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x * alpha + y, mask=mask)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=gen).to(device)
    y = torch.randn(1000, generator=gen).to(device)
    out = torch.full_like(x, float("nan"))
    scaled_add_kernel[(triton.cdiv(1000, 128),)](x, y, out, 1000, 0.5, BLOCK=128)
    torch.testing.assert_close(out, x * 0.5 + y, rtol=0, atol=0)


def test_triton_interpreter_dot_fp32():
    import triton
    import triton.language as tl

    @triton.jit
    def matmul_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        rm = tl.arange(0, M)
        rn = tl.arange(0, N)
        rk = tl.arange(0, K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(16, 32, generator=gen).to(device)
    b = torch.randn(32, 16, generator=gen).to(device)
    c = torch.empty(16, 16, device=device)
    matmul_kernel[(1,)](a, b, c, 16, 16, 32)
    torch.testing.assert_close(c, a @ b, rtol=2e-3, atol=2e-3)

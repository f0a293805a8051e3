"""The fused SwiGLU gate: the Triton kernels (interpreter on the CPU) and the op against fp64,
under the project's tolerance rule (kernel error ≤ 2× / 5× the reference's in the same dtype)."""

import pytest
import torch
from gem_lowprec import swiglu
from gem_lowprec.ops.swiglu import swiglu_backward_reference, swiglu_op, swiglu_reference
from gem_lowprec.ops.swiglu.triton import swiglu_backward_triton, swiglu_forward_triton
from gem_lowprec.testing import assert_within_reference_error
from hypothesis import given
from hypothesis import strategies as st

IMPLEMENTATIONS = {
    "triton": (swiglu_forward_triton, swiglu_backward_triton),
    "reference": (swiglu_reference, swiglu_backward_reference),  # the CPU path of the op
}


def _case(rows, width, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(rows, 2 * width, generator=gen, dtype=torch.float64) * 3
    dh = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    return u.to(device), dh.to(device)


def _truth(u, dh):
    leaf = u.double().requires_grad_()
    h = swiglu_reference(leaf)
    (du,) = torch.autograd.grad(h, leaf, dh.double())
    return h.detach(), du


def _reference_in(dtype, u, dh):
    leaf = u.to(dtype).requires_grad_()
    h = swiglu_reference(leaf)
    (du,) = torch.autograd.grad(h, leaf, dh.to(dtype))
    return h.detach(), du


def _check_kernels(u, dh, dtype, forward, backward):
    h_true, du_true = _truth(u, dh)
    h_ref, du_ref = _reference_in(dtype, u, dh)
    h = forward(u.to(dtype))
    du = backward(u.to(dtype), dh.to(dtype))
    assert h.dtype == du.dtype == dtype
    assert_within_reference_error(h, h_ref, h_true, factor=2.0, name="h")
    assert_within_reference_error(du, du_ref, du_true, factor=5.0, name="du")


@given(
    rows=st.sampled_from([0, 1, 7, 8, 9, 33]),
    width=st.sampled_from([1, 3, 511, 512, 513]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
    implementation=st.sampled_from(sorted(IMPLEMENTATIONS)),
)
def test_kernels_match_fp64_within_reference_error(rows, width, dtype, seed, implementation):
    u, dh = _case(rows, width, seed)
    _check_kernels(u, dh, dtype, *IMPLEMENTATIONS[implementation])


def test_gate_at_large_and_tiny_inputs():
    """Saturated sigmoids (|a| up to 30) and values near zero keep the kernels finite and close."""
    a = torch.tensor([[-30.0, -5.0, -1e-4, 0.0, 1e-4, 5.0, 30.0, 2.0]], dtype=torch.float64)
    u = torch.cat([a, torch.full_like(a, 1.5)], dim=1)
    dh = torch.ones(1, 8, dtype=torch.float64)
    _check_kernels(u, dh, torch.float32, swiglu_forward_triton, swiglu_backward_triton)


def test_op_runs_the_reference_on_the_cpu_with_autograd():
    u, dh = _case(5, 6, seed=1)
    leaf = u.float().reshape(5, 1, 12).requires_grad_()  # leading dims are flattened and restored
    h = swiglu(leaf)
    assert h.shape == (5, 1, 6)
    (du,) = torch.autograd.grad(h, leaf, dh.float().reshape(5, 1, 6))
    h_ref, du_ref = _reference_in(torch.float32, u, dh)
    torch.testing.assert_close(h.reshape(5, 6), h_ref)
    torch.testing.assert_close(du.reshape(5, 12), du_ref)


def test_opcheck():
    u = torch.randn(4, 10, requires_grad=True)
    torch.library.opcheck(swiglu_op, (u, "reference"))


def test_triton_backend_on_cpu_tensors_runs_the_kernels_with_autograd():
    """``backend="triton"`` on CPU tensors (the interpreter), forward and backward through the
    op, equals the kernels called directly."""
    u, dh = _case(9, 513, seed=2)
    leaf = u.float().requires_grad_()
    h = swiglu(leaf, backend="triton")
    (du,) = torch.autograd.grad(h, leaf, dh.float())
    assert torch.equal(h, swiglu_forward_triton(u.float()))
    assert torch.equal(du, swiglu_backward_triton(u.float(), dh.float()))


@pytest.mark.parametrize(
    ("u", "match"),
    [
        (torch.zeros(3, 5), r"u: expected \[T, 2F\] \(an even last dim\), got \(3, 5\)"),
        (torch.zeros(3, 4, dtype=torch.int64), "u: expected a floating dtype, got torch.int64"),
    ],
)
def test_bad_input_is_named(u, match):
    with pytest.raises(ValueError, match=match):
        swiglu(u)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_kernels_match_fp64_within_reference_error(dtype):
    u, dh = _case(3000, 2816, seed=3, device="cuda")

    def forward(u_):
        return swiglu(u_)

    def backward(u_, dh_):
        leaf = u_.detach().requires_grad_()
        (du,) = torch.autograd.grad(swiglu(leaf), leaf, dh_)
        return du

    _check_kernels(u, dh, dtype, forward, backward)

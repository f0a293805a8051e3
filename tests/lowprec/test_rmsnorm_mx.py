"""Fused RMSNorm + MX quantize: quantization bit-exact on the kernel's own float32 activation,
the activation within the tolerance rule of an fp64 RMSNorm."""

import pytest
import torch
from gem_lowprec import rmsnorm_to_mx
from gem_lowprec.codec import E4M3, E5M2
from gem_lowprec.ops.mx_quantize import reference as mx_reference
from gem_lowprec.ops.rmsnorm_mx import reference
from gem_lowprec.ops.rmsnorm_mx import triton as kernels
from hypothesis import given
from hypothesis import strategies as st


@given(
    seed=st.integers(0, 2**31 - 1),
    m=st.sampled_from([1, 7, 33]),
    n=st.sampled_from([32, 96, 256]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    fmt=st.sampled_from([E4M3, E5M2]),
    mode=st.sampled_from(["rceil", "floor"]),
)
def test_kernel_quantizes_its_activation_exactly(seed, m, n, dtype, fmt, mode):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=gen) * 3).to(dtype)
    w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    data, scale, y = kernels.rmsnorm_mx(x, w, 1e-6, fmt, mode, store_y=True)
    ref_data, ref_scale = mx_reference.quantize_1d(y, fmt, axis=-1, scale_mode=mode, seed=None)
    assert torch.equal(data, ref_data) and torch.equal(scale, ref_scale.contiguous())
    y64 = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    # The project's tolerance rule (2x the fp32 reference's error against fp64, plus a floor of a
    # few ulps), written out here because gem-lowprec's tests must not need gem-jagged.
    err_kernel = (y.double() - y64).abs().max().item()
    err_reference = (reference.rmsnorm_fp32(x, w, 1e-6).double() - y64).abs().max().item()
    floor = 4 * torch.finfo(y.dtype).eps * max(1.0, y64.abs().max().item())
    assert err_kernel <= 2.0 * err_reference + floor, (err_kernel, err_reference)


def test_public_op_matches_reference_and_dequantizes():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w = torch.ones(128, dtype=torch.bfloat16)
    mx = rmsnorm_to_mx(x, w)
    y = reference.rmsnorm_fp32(x, w, 1e-6)
    rel = (mx.dequantize() - y).norm() / y.norm()
    assert rel < 0.04
    tri = rmsnorm_to_mx(x, w, backend="triton")
    assert (tri.data.view(torch.uint8) != mx.data.view(torch.uint8)).float().mean() < 0.01


def test_custom_op_opcheck():
    from gem_lowprec.ops.rmsnorm_mx import rmsnorm_mx_op

    x = torch.randn(4, 64).to(torch.bfloat16)
    torch.library.opcheck(
        rmsnorm_mx_op,
        (x, torch.ones(64, dtype=torch.bfloat16), 1e-6, "float8_e4m3fn", "rceil", "reference"),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_errors():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight must have shape"):
        rmsnorm_to_mx(x, torch.ones(32))
    with pytest.raises(ValueError, match="multiple of the block size"):
        rmsnorm_to_mx(torch.randn(4, 48), torch.ones(48))


@pytest.mark.gpu
def test_gpu_fused_kernel_bit_exact_on_its_activation():
    x = torch.randn(4096, 1024, device="cuda").to(torch.bfloat16) * 4
    w = torch.rand(1024, device="cuda").to(torch.bfloat16) + 0.5
    for fmt in (E4M3, E5M2):
        data, scale, y = kernels.rmsnorm_mx(x, w, 1e-6, fmt, "rceil", store_y=True)
        ref_data, ref_scale = mx_reference.quantize_1d(
            y.cpu(), fmt, axis=-1, scale_mode="rceil", seed=None
        )
        assert torch.equal(data.cpu(), ref_data) and torch.equal(
            scale.cpu(), ref_scale.contiguous()
        )

"""MX quantization at the end of a dtype's range: every finite input dequantizes to a finite
value (in float32 and in its own dtype), in the reference and bit for bit in every kernel, for
every input dtype, element format, scale mode and rounding; and empty tensors."""

import pytest
import torch
from gem_lowprec import MXTensor, rmsnorm_to_mx, to_mx, to_mx_2d, to_mx_rowcol
from gem_lowprec.codec import E4M3, E5M2
from gem_lowprec.ops.mx_quantize import quantize_mx_k128, quantize_mx_k128_rowcol
from gem_lowprec.ops.mx_quantize import reference as mx_reference
from gem_lowprec.ops.rmsnorm_mx import triton as rmsnorm_kernels
from gem_lowprec.testing import top_binade_matrix

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
MODES = ["rceil", "floor"]


def same_bits(a: MXTensor, b: MXTensor) -> bool:
    return (
        a.layout == b.layout
        and torch.equal(
            a.data.contiguous().view(torch.uint8), b.data.contiguous().view(torch.uint8)
        )
        and torch.equal(a.scale.contiguous(), b.scale.contiguous())
    )


def assert_finite(mx: MXTensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(mx.dequantize()).all(), "an element dequantizes to ±inf in float32"
    assert torch.isfinite(mx.dequantize(dtype)).all(), f"an element dequantizes to ±inf in {dtype}"


def quantized(x: torch.Tensor, backend: str, **kw) -> list[MXTensor]:
    """Every 1×32 and 32×32 layout of ``x`` on ``backend``: rows, columns, both from one read,
    tiles, and stochastic rows and columns."""
    rows, cols = to_mx_rowcol(x, backend=backend, **kw)
    stochastic = dict(rounding="stochastic", seed=5, backend=backend, **kw)
    return [
        to_mx(x, axis=1, backend=backend, **kw),
        to_mx(x, axis=0, backend=backend, **kw),
        rows,
        cols,
        to_mx_2d(x, backend=backend, **kw),
        to_mx(x, axis=1, **stochastic),
        to_mx(x, axis=0, **stochastic),
        *to_mx_rowcol(x, **stochastic),
    ]


def merged(x: torch.Tensor, elem: torch.dtype, mode: str, backend: str) -> list:
    """(fp8 data, float32 scales) of both quantizers merged into 1×128 blocks: x along its
    columns, and along its columns and its rows from one read."""
    rows = quantize_mx_k128(x, elem, scale_mode=mode, backend=backend)
    return [rows, *quantize_mx_k128_rowcol(x, elem, scale_mode=mode, backend=backend)]


def assert_same_merged(got: list, want: list) -> None:
    for (data, scale), (want_data, want_scale) in zip(got, want, strict=True):
        assert torch.equal(data.cpu().view(torch.uint8), want_data.view(torch.uint8))
        assert torch.equal(scale.cpu(), want_scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("elem", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
def test_largest_magnitudes_dequantize_finite_and_kernels_match(dtype, elem, mode):
    x = top_binade_matrix(dtype)
    kw = dict(elem_dtype=elem, scale_mode=mode)
    reference = quantized(x, "reference", **kw)
    for mx in reference:
        assert_finite(mx, dtype)
    for got, want in zip(quantized(x, "triton", **kw), reference, strict=True):
        assert same_bits(got, want)
    # merged to 1×128: the fused kernels give merge_k128 of the reference's bits, finite
    want = merged(x, elem, mode, "reference")
    assert_same_merged(merged(x, elem, mode, "triton"), want)
    for data, scale in want:
        assert torch.isfinite(data.float() * scale.repeat_interleave(128, dim=1)).all()


@pytest.mark.parametrize(
    "dtype, elem, mode, expected",
    [
        # RCEIL: e = 120 (E4M3) / 113 (E5M2); 1.99 · 2^127 would round to 2^8 / 2^15 · 2^e =
        # 2^128 and saturates at the largest element below it instead
        (torch.bfloat16, torch.float8_e4m3fn, "rceil", 240.0 * 2.0**120),
        (torch.bfloat16, torch.float8_e5m2, "rceil", 28672.0 * 2.0**113),
        (torch.float32, torch.float8_e4m3fn, "rceil", 240.0 * 2.0**120),
        (torch.float16, torch.float8_e4m3fn, "rceil", 61440.0),  # 2^16 is past float16
        (torch.float16, torch.float8_e5m2, "rceil", 57344.0),
        # FLOOR: e = 119 saturates 510 at 448 by the format's own maximum, as before
        (torch.bfloat16, torch.float8_e4m3fn, "floor", 448.0 * 2.0**119),
    ],
)
def test_a_block_of_the_largest_value_saturates_below_the_end_of_the_range(
    dtype, elem, mode, expected
):
    x = torch.full((1, 32), torch.finfo(dtype).max, dtype=dtype)
    x[0, 1] = -x[0, 1]
    for backend in ("reference", "triton"):
        mx = to_mx(x, axis=1, elem_dtype=elem, scale_mode=mode, backend=backend)
        deq = mx.dequantize(torch.float64)
        assert deq[0, 0] == expected and deq[0, 1] == -expected
        assert torch.isfinite(mx.dequantize(dtype)).all()


def test_rmsnorm_activation_at_the_float32_limit_stays_finite_and_bit_exact():
    """The fused RMSNorm quantizes its float32 activation: a weight at float32's largest
    magnitudes takes it there; the kernel's quantization of it is the reference's, finite."""
    top = top_binade_matrix(torch.float32)
    w = torch.cat([top[0, :64], top[32, :64]])  # ±max, then the binade mixed with ordinary values
    x = torch.ones(4, 128)  # rstd = 1 with eps = 0: y = w
    for fmt in (E4M3, E5M2):
        for mode in MODES:
            data, scale, y = rmsnorm_kernels.rmsnorm_mx(x, w, 0.0, fmt, mode, store_y=True)
            ref = mx_reference.quantize_1d(y, fmt, axis=-1, scale_mode=mode, seed=None)
            assert torch.equal(data, ref[0]) and torch.equal(scale, ref[1].contiguous())
            mx = rmsnorm_to_mx(x, w, eps=0.0, elem_dtype=fmt.dtype, scale_mode=mode)
            assert torch.isfinite(mx.dequantize()).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(
    "shape, axis",
    [((4, 0), 1), ((4, 0), -1), ((0, 64), 0), ((0, 64), 1), ((32, 0), 0), ((2, 0, 64), 1),
     ((2, 64, 0), 1), ((0, 3, 32), 2)],
)  # fmt: skip
def test_an_empty_tensor_gives_an_empty_mx_tensor(backend, shape, axis):
    x = torch.zeros(shape, dtype=torch.bfloat16)
    mx = to_mx(x, axis=axis, backend=backend)
    scale_shape = list(shape)
    scale_shape[axis] //= 32
    assert mx.shape == x.shape and tuple(mx.scale.shape) == tuple(scale_shape)
    deq = mx.dequantize(torch.bfloat16)
    assert deq.shape == x.shape and deq.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (0, 0)])
def test_empty_matrices_in_every_layout(backend, shape):
    x = torch.zeros(shape)
    rows, cols = to_mx_rowcol(x, backend=backend)
    tiles = to_mx_2d(x, backend=backend)
    for mx in (rows, cols, tiles):
        assert mx.shape == x.shape and mx.dequantize().shape == x.shape
    assert rows.scale.shape == (shape[0], shape[1] // 32)
    assert cols.scale.shape == (shape[0] // 32, shape[1])
    assert tiles.scale.shape == (shape[0] // 32, shape[1] // 32)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_inputs_of_the_merged_and_fused_quantizers(backend):
    data, scale = quantize_mx_k128(torch.zeros(4, 0), backend=backend)
    assert data.shape == (4, 0) and scale.shape == (4, 0)
    (d, s), (dt, st) = quantize_mx_k128_rowcol(torch.zeros(0, 128), backend=backend)
    assert (
        d.shape == (0, 128) and s.shape == (0, 1) and dt.shape == (128, 0) and st.shape == (128, 0)
    )
    for x in (torch.zeros(0, 64), torch.zeros(4, 0)):
        mx = rmsnorm_to_mx(x, torch.ones(x.shape[1]), backend=backend)
        assert mx.shape == x.shape and mx.dequantize().shape == x.shape


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_gpu_hardware_cast_saturates_as_the_reference(dtype):
    """On the GPU the kernels' hardware fp8 cast saturates at the range limit too."""
    x = top_binade_matrix(dtype)
    top = top_binade_matrix(torch.float32)
    w = torch.cat([top[0, :64], top[32, :64]])
    for fmt in (E4M3, E5M2):
        for mode in MODES:
            kw = dict(elem_dtype=fmt.dtype, scale_mode=mode)
            got = quantized(x.cuda(), "auto", **kw)
            for g, want in zip(got, quantized(x, "auto", **kw), strict=True):
                assert same_bits(MXTensor(g.data.cpu(), g.scale.cpu(), g.layout), want)
            assert_same_merged(
                merged(x.cuda(), fmt.dtype, mode, "auto"), merged(x, fmt.dtype, mode, "auto")
            )
            ones = torch.ones(4, 128, device="cuda")
            data, scale, y = rmsnorm_kernels.rmsnorm_mx(
                ones, w.cuda(), 0.0, fmt, mode, store_y=True
            )
            ref = mx_reference.quantize_1d(y.cpu(), fmt, axis=-1, scale_mode=mode, seed=None)
            assert torch.equal(data.cpu(), ref[0]) and torch.equal(scale.cpu(), ref[1].contiguous())

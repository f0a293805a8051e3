"""MX quantizers: bit-exact kernels, the reference against torch's own casts, special values,
SQNR yardsticks, stochastic rounding and input errors."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from gem_lowprec import MXTensor, to_mx, to_mx_2d, to_mx_rowcol
from gem_lowprec.formats import E4M3, E5M2
from gem_lowprec.ops.mx_quantize import reference
from gem_lowprec.testing import all_finite_bf16, every_pattern_matrix, special_matrix
from hypothesis import given
from hypothesis import strategies as st

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
MODES = ["rceil", "floor"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def assert_same_mx(a: MXTensor, b: MXTensor):
    assert a.layout == b.layout and a.shape == b.shape
    assert torch.equal(bits(a.data.contiguous()), bits(b.data.contiguous())), "data bytes differ"
    assert torch.equal(a.scale.contiguous(), b.scale.contiguous()), "scale bytes differ"


@pytest.mark.parametrize("elem", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", ["every_pattern", "special"])
def test_triton_bit_exact(elem, mode, source):
    x = every_pattern_matrix() if source == "every_pattern" else special_matrix()
    kw = dict(elem_dtype=elem, scale_mode=mode)
    rows, cols = to_mx_rowcol(x, backend="triton", **kw)
    assert_same_mx(rows, to_mx(x, axis=1, backend="reference", **kw))
    assert_same_mx(cols, to_mx(x, axis=0, backend="reference", **kw))
    assert_same_mx(to_mx_2d(x, backend="triton", **kw), to_mx_2d(x, backend="reference", **kw))
    assert_same_mx(to_mx(x, backend="triton", **kw), rows)  # the row-only block-slab kernel


@pytest.mark.parametrize("elem", FORMATS, ids=["e4m3", "e5m2"])
def test_reference_elements_match_torch_cast(elem):
    """With scale 2^0 the reference's integer RNE is torch's own fp32 -> fp8 cast (after the
    saturation torch's cast does not do), on every bf16 pattern and on random float32."""
    fmt = E4M3 if elem == torch.float8_e4m3fn else E5M2
    gen = torch.Generator().manual_seed(2)
    rand32 = torch.randn(1 << 16, generator=gen) * torch.exp2(
        torch.randint(-40, 16, (1 << 16,), generator=gen).float()
    )
    for v in (all_finite_bf16().float(), rand32):
        v = v.clamp(-fmt.max_value, fmt.max_value)
        got = reference.encode(reference.fp32_bits(v), torch.full(v.shape, 127), fmt)
        assert torch.equal(got, v.to(elem).view(torch.uint8))


@pytest.mark.parametrize("elem", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
def test_scale_rule_against_definition(elem, mode):
    """The integer scale rule equals the definition evaluated exactly in float64."""
    fmt = E4M3 if elem == torch.float8_e4m3fn else E5M2
    amax = all_finite_bf16().float().abs().unique()
    got = reference.scale_bytes(reference.fp32_bits(amax), fmt, mode).to(torch.int64) - 127
    a = amax.double()
    if mode == "rceil":  # smallest e with amax / 2^e <= max_value
        e = torch.ceil(torch.log2(a / fmt.max_value))
        e = torch.where(a / torch.exp2(e - 1) <= fmt.max_value, e - 1, e)
        e = torch.where(a / torch.exp2(e) > fmt.max_value, e + 1, e)
    else:
        e = torch.floor(torch.log2(a)) - fmt.emax_exp
    e = torch.where(a == 0, torch.full_like(e, -127), e).clamp(-127, 127)
    assert torch.equal(got, e.to(torch.int64))


def test_special_values_semantics():
    x = special_matrix()
    mx = to_mx(x, backend="reference")
    assert mx.scale[0, 0] == 0  # all-zero block: e = -127
    assert mx.scale[32, 0] == 0xFF and mx.scale[40, 1] == 0xFF and mx.scale[0, 1] == 0xFF
    assert torch.isnan(mx.data[32, :32].float()).all()
    assert torch.isnan(mx.dequantize()[40, 32:]).all()
    finite_rows = torch.ones(64, dtype=torch.bool)
    finite_rows[[0, 32, 40, 10, 11]] = False
    deq = mx.dequantize()
    assert torch.isfinite(deq[finite_rows]).all()
    # the largest bf16 (1.99 * 2^127) has e = 120 and rounds to 256 * 2^120 = 2^128, past float32
    assert (
        mx.scale[10, 1] == 127 + 120
        and deq[10, 35] == float("inf")
        and deq[11, 36] == -float("inf")
    )
    assert mx.data[10, 35].float() == 256.0
    # subnormal inputs survive: a block of 2^-130 scales to e = -127 and keeps its values
    assert torch.equal(mx.dequantize()[33, 32:], x[33, 32:].float())
    assert mx.data[5, 5].view(torch.uint8) == 0x80  # -0 keeps its sign
    t = to_mx_2d(x, backend="reference")
    assert t.scale[0, 0] == 0 and t.scale[1, 0] == 0xFF and t.scale[0, 1] == 0xFF
    assert t.scale[1, 1] == 0xFF


@pytest.mark.parametrize("mode,expected", [("rceil", 31.5), ("floor", 30.6)])
def test_sqnr_yardstick_gaussian(mode, expected):
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(3))
    deq = to_mx(x.to(torch.bfloat16), scale_mode=mode).dequantize()
    xb = x.to(torch.bfloat16).float()
    err = (deq - xb).pow(2)
    sqnr = 10 * math.log10(xb.pow(2).sum() / err.sum())
    worst_row = 10 * torch.log10(xb.pow(2).sum(1) / err.sum(1)).min().item()
    assert abs(sqnr - expected) <= 0.3 if mode == "rceil" else abs(sqnr - expected) <= 0.5
    assert worst_row > sqnr - 1.5  # no row is starved (1024-element rows vary by ~1 dB)


def test_stochastic_rounding_unbiased_and_seeded():
    # 1.3 sits between the E4M3 grid points 1.25 and 1.375 (block scale set by 3.9): nearest
    # always gives 1.25, stochastic rounding gives 1.3 in the mean, within 4 standard errors.
    x = torch.full((256, 32), 1.3)
    x[:, 0] = 3.9
    draws = to_mx(x, rounding="stochastic", seed=3).dequantize()[:, 1:]
    assert set(draws.unique().tolist()) == {1.25, 1.375}
    stderr = draws.std().item() / draws.numel() ** 0.5
    assert abs(draws.mean().item() - 1.3) < 4 * stderr
    assert to_mx(x).dequantize()[0, 1] == 1.25
    # random values in [1, 4]: the mean error over all elements and draws is ~0 in standard errors
    x = torch.rand(64, 256, generator=torch.Generator().manual_seed(4)) * 3 + 1
    err = torch.stack([to_mx(x, rounding="stochastic", seed=s).dequantize() - x for s in range(8)])
    assert abs(err.mean().item()) < 4 * err.std().item() / err.numel() ** 0.5
    a = to_mx(x, rounding="stochastic", seed=7)
    assert_same_mx(a, to_mx(x, rounding="stochastic", seed=7))
    assert not torch.equal(bits(a.data), bits(to_mx(x, rounding="stochastic", seed=8).data))


@pytest.mark.parametrize("axis", [0, 1])
def test_stochastic_triton_matches_reference(axis):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    kw = dict(rounding="stochastic", seed=11, axis=axis, elem_dtype=torch.float8_e5m2)
    assert_same_mx(to_mx(x, backend="triton", **kw), to_mx(x, backend="reference", **kw))


@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(32,), (3, 64), (2, 32, 96), (64, 2, 32)]),
    axis_pick=st.integers(0, 2),
    log_scale=st.integers(-60, 60),
)
def test_property_any_axis_roundtrip(seed, shape, axis_pick, log_scale):
    """Any axis of any rank: the Triton kernel equals the reference, data keeps x's shape, and
    the dequantized value is within half a step of the top binade (2^e · 2^(8−3−1)) of x."""
    axes = [d for d in range(len(shape)) if shape[d] % 32 == 0]
    axis = axes[axis_pick % len(axes)]
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2.0**log_scale).to(torch.bfloat16)
    ref = to_mx(x, axis=axis, backend="reference")
    assert_same_mx(to_mx(x, axis=axis, backend="triton"), ref)
    assert ref.data.shape == x.shape
    half_step = ref.scale_float().repeat_interleave(32, dim=axis) * 16.0
    assert ((ref.dequantize() - x.float()).abs() <= half_step).all()


def test_transposed_view_reuses_bytes():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    mx = to_mx_2d(x)
    t = mx.t()
    assert t.data.data_ptr() == mx.data.data_ptr() and t.scale.data_ptr() == mx.scale.data_ptr()
    assert torch.equal(t.dequantize(), mx.dequantize().t())
    assert_same_mx(
        MXTensor(t.data.contiguous(), t.scale.contiguous(), t.layout), to_mx_2d(x.t().contiguous())
    )
    rows = to_mx(x, axis=1)
    assert rows.t().layout.axis == 0 and torch.equal(rows.t().dequantize(), rows.dequantize().t())


def test_clear_errors():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        to_mx(torch.randn(4, 48))
    with pytest.raises(ValueError, match="multiple of the tile edge 32"):
        to_mx_2d(torch.randn(48, 64))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        to_mx(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(TypeError, match="elem_dtype"):
        to_mx(x, elem_dtype=torch.float16)
    with pytest.raises(ValueError, match="block_size must be 32"):
        to_mx(x, block_size=16)
    with pytest.raises(ValueError, match="scale_mode"):
        to_mx(x, scale_mode="ceil")
    with pytest.raises(ValueError, match="rounding"):
        to_mx(x, rounding="up")
    with pytest.raises(ValueError, match="axis"):
        to_mx(x, axis=2)
    with pytest.raises(ValueError, match="backend"):
        to_mx(x, backend="cuda")


def test_custom_op_opcheck_and_compile():
    from gem_lowprec.ops.mx_quantize import mx_quantize_op

    x = torch.randn(32, 64).to(torch.bfloat16)
    torch.library.opcheck(
        mx_quantize_op,
        (x, "float8_e4m3fn", "rceil", "rowcol", -1, "reference"),
        test_utils=("test_schema", "test_faketensor"),
    )
    compiled = torch.compile(lambda t: to_mx(t).dequantize(), fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), to_mx(x).dequantize())


@pytest.mark.gpu
@pytest.mark.parametrize("elem", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_hardware_cast_bit_exact(elem, mode):
    """On the GPU the kernels use the hardware fp8 cast: still bit for bit the reference."""
    for x in (every_pattern_matrix(), special_matrix()):
        kw = dict(elem_dtype=elem, scale_mode=mode)
        xc = x.cuda()
        rows, cols = to_mx_rowcol(xc, **kw)
        for got, ref in (
            (rows, to_mx(x, axis=1, **kw)),
            (to_mx(xc, **kw), to_mx(x, **kw)),
            (cols, to_mx(x, axis=0, **kw)),
            (to_mx_2d(xc, **kw), to_mx_2d(x, **kw)),
            (to_mx(xc.float(), **kw), to_mx(x.float(), **kw)),
            (
                to_mx(xc, rounding="stochastic", seed=5, **kw),
                to_mx(x, rounding="stochastic", seed=5, **kw),
            ),
        ):
            assert_same_mx(MXTensor(got.data.cpu(), got.scale.cpu(), got.layout), ref)


def test_benchmark_smoke(monkeypatch, capsys):
    """``bench_mx_quantize.py --smoke --sweep`` runs (tiny shapes, CPU, kernels interpreted)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "lowprec" / "bench_mx_quantize.py"
    spec = importlib.util.spec_from_file_location("bench_mx_quantize", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", [str(path), "--smoke", "--sweep"])
    bench.main()
    out = capsys.readouterr().out
    assert "launch-shape sweep" in out and "Q3 rmsnorm+1x32" in out


def test_eager_fast_path_and_dispatch_modes():
    """Plain eager calls skip the custom op's dispatcher; under a dispatch mode (fake tensors)
    the op runs, so shapes propagate without touching data; both paths give the same bytes."""
    from gem_lowprec.ops.mx_quantize import eager_path_allowed, mx_quantize_op
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    assert eager_path_allowed(x)
    via_op = mx_quantize_op(x, "float8_e4m3fn", "rceil", "rows", -1, "triton")
    fast = to_mx(x, backend="triton")
    assert torch.equal(bits(fast.data), via_op[0]) and torch.equal(fast.scale, via_op[1])
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert not eager_path_allowed(fake)
        mx = to_mx_2d(fake)
        assert mx.data.shape == (64, 96) and mx.scale.shape == (2, 3)

"""MX quantizers: bit-exact kernels (1×32, 32×32, both ways, and merged to 1×128 blocks),
special values, SQNR yardsticks, stochastic rounding, launch shapes and input errors."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from gem_lowprec import MXTensor, to_mx, to_mx_2d, to_mx_rowcol
from gem_lowprec.ops.mx_quantize import quantize_mx_k128, quantize_mx_k128_rowcol
from gem_lowprec.ops.mx_quantize.reference import merge_k128
from gem_lowprec.testing import every_pattern_matrix, special_matrix
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


def test_special_values_semantics():
    x = special_matrix()
    mx = to_mx(x, backend="reference")
    assert mx.scale[0, 0] == 0  # all-zero block: e = -127
    assert mx.scale[32, 0] == 0xFF and mx.scale[40, 1] == 0xFF and mx.scale[0, 1] == 0xFF
    assert torch.isnan(mx.data[32, :32].float()).all()
    assert torch.isnan(mx.dequantize()[40, 32:]).all()
    finite_rows = torch.ones(64, dtype=torch.bool)
    finite_rows[[0, 32, 40]] = False
    deq = mx.dequantize()
    assert torch.isfinite(deq[finite_rows]).all()
    # the largest bf16 (1.99 * 2^127) has e = 120; rounded it would be 256 * 2^120 = 2^128, past
    # float32, so it saturates at the largest element below that, 240 * 2^120
    assert mx.scale[10, 1] == 127 + 120 and mx.data[10, 35].float() == 240.0
    assert deq[10, 35] == 240.0 * 2.0**120 and deq[11, 36] == -(240.0 * 2.0**120)
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


def test_benchmark_smoke(capsys):
    """``bench_mx_quantize.py --smoke --sweep`` runs (tiny shapes, CPU, kernels interpreted)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "lowprec" / "bench_mx_quantize.py"
    spec = importlib.util.spec_from_file_location("bench_mx_quantize", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke", "--sweep"])
    out = capsys.readouterr().out
    assert "launch-shape sweep" in out and "Q3 rmsnorm+1x32" in out


def test_eager_fast_path_and_dispatch_modes():
    """Plain eager calls skip the custom op's dispatcher; under a dispatch mode (fake tensors)
    the op runs, so shapes propagate without touching data; both paths give the same bytes."""
    from gem_lowprec._checks import eager_path_allowed
    from gem_lowprec.ops.mx_quantize import mx_quantize_op
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    assert eager_path_allowed(x)
    assert eager_path_allowed(x, torch.nn.Parameter(torch.ones(96)))  # a norm's weight
    via_op = mx_quantize_op(x, "float8_e4m3fn", "rceil", "rows", -1, "triton")
    fast = to_mx(x, backend="triton")
    assert torch.equal(bits(fast.data), via_op[0]) and torch.equal(fast.scale, via_op[1])
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert not eager_path_allowed(fake)
        mx = to_mx_2d(fake)
        assert mx.data.shape == (64, 96) and mx.scale.shape == (2, 3)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8 if t.element_size() == 1 else torch.int32)


def _assert_same(got, want) -> None:
    for field, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = _bits(g), _bits(w)
        assert g.shape == w.shape, (field, g.shape, w.shape)
        bad = (g != w).nonzero()
        assert not len(bad), (
            f"output {field} {tuple(g.shape)}: {len(bad)} differ, first at "
            f"{bad[:6].tolist()}: got {[hex(g[tuple(i)]) for i in bad[:6]]} "
            f"want {[hex(w[tuple(i)]) for i in bad[:6]]}"
        )


def test_merge_k128_is_exact_while_values_stay_normal():
    gen = torch.Generator().manual_seed(0)
    # four blocks per 128 with magnitudes 1, 2, 4, 8: shifts of at most 3 binades stay normal
    x = torch.randn(8, 256, generator=gen) * torch.tensor([1.0, 2, 4, 8]).repeat_interleave(
        32
    ).repeat(2)
    mx = to_mx(x)
    data, scale = merge_k128(mx)
    merged = data.float() * scale.repeat_interleave(128, dim=1)
    assert torch.equal(merged, mx.dequantize())
    # a block 2^20 below its neighbours loses its values to the shift (rounded, not garbage)
    x[:, 0:32] *= 2.0**-20
    mx = to_mx(x)
    data, scale = merge_k128(mx)
    merged = data.float() * scale.repeat_interleave(128, dim=1)
    assert torch.equal(merged[:, 32:], mx.dequantize()[:, 32:])
    assert (
        merged[:, :32].abs() <= mx.dequantize()[:, :32].abs() * 2 + 2.0**-9 * scale[:, :1]
    ).all()


@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fused_quantize_merge_kernel_bit_exact(elem):
    """The Triton quantize+merge kernel equals merge_k128(to_mx(x)) on every finite bf16 pattern
    (shuffled so that blocks of very different magnitude share a 1x128 group) and specials."""
    x = every_pattern_matrix().reshape(-1, 128)
    for t in (x, special_matrix().reshape(-1, 128)):
        data, scale = quantize_mx_k128(t, elem, backend="triton")
        ref_data, ref_scale = merge_k128(to_mx(t, elem_dtype=elem, backend="reference"))
        assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
        assert torch.allclose(scale, ref_scale, rtol=0, atol=0, equal_nan=True)


def _rowcol_inputs():
    every = every_pattern_matrix().reshape(-1, 128)  # 1020 rows: pad to a multiple of 128
    every = torch.cat([every, torch.zeros(1024 - every.shape[0], 128, dtype=every.dtype)])
    sp = special_matrix()
    sp = torch.cat([torch.cat([sp, sp.flip(0)]), torch.cat([sp.flip(1), sp * 3])], dim=1)
    return [every, sp, torch.randn(256, 384, generator=torch.Generator().manual_seed(5))]


def _check_rowcol(elem, device: str, backend: str) -> None:
    every, *small = _rowcol_inputs()
    for scale_mode, inputs in (("rceil", [every, *small]), ("floor", small)):
        for x in inputs:
            got = quantize_mx_k128_rowcol(
                x.to(device), elem, scale_mode=scale_mode, backend=backend
            )
            want = quantize_mx_k128_rowcol(x, elem, scale_mode=scale_mode, backend="reference")
            for g, w in zip(got, want, strict=True):
                _assert_same(g, w)


@pytest.mark.parametrize("elem", FORMATS, ids=["e4m3", "e5m2"])
def test_triton_mx_rowcol_k128_matches_reference_bit_for_bit(elem):
    """Both 1×128-merged MX copies from one read equal merge_k128(to_mx(x)) and
    merge_k128(to_mx(xᵀ)) on every finite bf16 pattern (sorted and shuffled), specials, floats."""
    _check_rowcol(elem, "cpu", "triton")


def test_mx_rowcol_k128_refuses_unaligned_shapes():
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_mx_k128_rowcol(torch.zeros(128, 96))


@pytest.mark.gpu
@pytest.mark.parametrize("elem", FORMATS, ids=["e4m3", "e5m2"])
def test_gpu_mx_rowcol_k128_matches_reference_bit_for_bit(elem):
    _check_rowcol(elem, "cuda", "auto")


@pytest.mark.gpu
@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_gpu_fused_quantize_merge_bit_exact(elem):
    x = every_pattern_matrix().reshape(-1, 128)
    for t in (x, special_matrix().reshape(-1, 128)):
        data, scale = quantize_mx_k128(t.cuda(), elem)
        ref_data, ref_scale = merge_k128(to_mx(t, elem_dtype=elem, backend="reference"))
        assert torch.equal(data.cpu().view(torch.uint8), ref_data.view(torch.uint8))
        assert torch.allclose(scale.cpu(), ref_scale, rtol=0, atol=0, equal_nan=True)


def test_launch_shapes_are_arguments_and_change_no_byte():
    """Launch shapes passed to the public functions (the benchmark's sweep winners) reach the
    kernels through the custom op and give the reference's bytes; so do the GPU launch shapes
    and the integer encoder chosen explicitly by ``Launch`` under the interpreter."""
    from gem_lowprec.codec import E4M3
    from gem_lowprec.ops.launch import Launch
    from gem_lowprec.ops.mx_quantize import triton as kernels
    from gem_lowprec.ops.mx_quantize import triton_k128

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    ref = to_mx(x, backend="reference")
    assert_same_mx(to_mx(x, backend="triton", tiles=kernels.RowsTiles(64, 4)), ref)
    assert_same_mx(to_mx_2d(x, backend="triton", tiles=kernels.Tile2dTiles(128, 4, 2)),
                   to_mx_2d(x, backend="reference"))  # fmt: skip
    rows, cols = to_mx_rowcol(x, backend="triton", tiles=kernels.RowColTiles(64, 128, 4))
    assert_same_mx(rows, ref)
    assert_same_mx(cols, to_mx(x, axis=0, backend="reference"))
    assert kernels.tiles_from_ints("rows", kernels.tiles_as_ints(kernels.RowsTiles(64, 2))) == (
        kernels.RowsTiles(64, 2)
    )
    gpu = Launch(shapes="gpu", encoder="integer")
    got = kernels.mx_quantize(
        x, E4M3, rows=True, cols=False, tile_2d=False, scale_mode="rceil", seed=None, launch=gpu
    )
    assert torch.equal(got[0], bits(ref.data)) and torch.equal(got[1], ref.scale)
    data, scale = triton_k128.mx_quantize_merged_k128(x, E4M3, scale_mode="rceil", launch=gpu)
    ref_data, ref_scale = merge_k128(ref)
    assert torch.equal(data, bits(ref_data)) and torch.equal(scale, ref_scale)
    with pytest.raises(ValueError):
        Launch(shapes="tpu")


def test_a_bool_axis_is_refused():
    # True is an int to Python and once quantized along axis 1
    with pytest.raises(TypeError, match="axis must be an int, got True"):
        to_mx(torch.ones(32, 32), axis=True)


@pytest.mark.parametrize("seed", [2**32, -1, True, 1.0])
def test_out_of_range_seeds_are_refused_naming_the_range(seed):
    # 2**32 once wrapped silently to seed 0
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32 - 1\]"):
        to_mx(torch.ones(4, 32), rounding="stochastic", seed=seed)


def test_a_seed_with_nearest_rounding_is_refused():
    with pytest.raises(ValueError, match='seed only makes sense with rounding="stochastic"'):
        to_mx(torch.ones(4, 32), seed=3)

"""The fp8 row-wise / column-wise / both-ways casts of the fp8_rowwise linear: Triton (the
interpreter on the CPU, the hardware cast on a GPU) against the reference, bit for bit."""

import pytest
import torch
from gem_lowprec.codec import E4M3
from gem_lowprec.ops.fp8_cast import cast_both, cast_columns, cast_rows, reference
from gem_lowprec.testing import every_pattern_matrix, special_matrix
from hypothesis import given, settings
from hypothesis import strategies as st

ELEMS = pytest.mark.parametrize(
    "elem", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"]
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8 if t.element_size() == 1 else torch.int32)


def _assert_same(got, want) -> None:
    for field, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (w is None)
        if g is None:
            continue
        g, w = _bits(g), _bits(w)
        assert g.shape == w.shape, (field, g.shape, w.shape)
        bad = (g != w).nonzero()
        assert not len(bad), (
            f"output {field} {tuple(g.shape)}: {len(bad)} differ, first at "
            f"{bad[:6].tolist()}: got {[hex(g[tuple(i)]) for i in bad[:6]]} "
            f"want {[hex(w[tuple(i)]) for i in bad[:6]]}"
        )


def _row_mult(rows: int, seed: int) -> torch.Tensor:
    exps = torch.randint(-30, 30, (rows,), generator=torch.Generator().manual_seed(seed))
    return 2.0 ** exps.to(torch.float32)


def _inputs():
    gen = torch.Generator().manual_seed(4)
    return [
        every_pattern_matrix().reshape(-1, 128),  # every finite bf16, sorted and shuffled
        special_matrix(),  # zero rows/columns, NaN, ±Inf, subnormals, the largest bf16
        (torch.randn(37, 70, generator=gen) * 3).to(torch.float16),  # ragged shape, fp16
        torch.randn(20, 33, generator=gen) * 1e-3,  # float32
    ]


def _check_all(elem, device: str, backend: str) -> None:
    for i, x in enumerate(_inputs()):
        x = x.to(device)
        mult = _row_mult(x.shape[0], i).to(device)
        got = cast_rows(x, elem, transposed=True, col_amax_row_mult=mult, backend=backend)
        want = cast_rows(
            x.cpu(), elem, transposed=True, col_amax_row_mult=mult.cpu(), backend="reference"
        )
        _assert_same(got, want)
        for m in (None, mult):
            got = cast_columns(x, elem, row_mult=m, backend=backend)
            ref_m = None if m is None else m.cpu()
            _assert_same(got, cast_columns(x.cpu(), elem, row_mult=ref_m, backend="reference"))
        _assert_same(
            cast_both(x, elem, backend=backend), cast_both(x.cpu(), elem, backend="reference")
        )


@ELEMS
def test_triton_casts_match_reference_bit_for_bit(elem):
    _check_all(elem, "cpu", "triton")


def test_reference_semantics():
    """Power-of-two scale per row (the smallest with amax/scale <= 448), RNE, saturation; the
    column cast is the row cast of xᵀ; NaN rows give NaN scales."""
    x = torch.tensor(
        [[448.0, -1.0, 0.5], [449.0, 3.0, 0.0], [0.0, 0.0, 0.0], [1.0, float("nan"), 2.0]]
    )
    data, scale = reference.cast_rows(x, E4M3)
    assert scale[:2].tolist() == [1.0, 2.0] and scale[2] == 2.0**-127 and scale[3].isnan()
    values = data.view(torch.float8_e4m3fn).float()
    assert values[0].tolist() == [448.0, -1.0, 0.5] and values[1].tolist() == [224.0, 1.5, 0.0]
    assert values[3].isnan().all()
    rows = cast_rows(x.t().contiguous(), backend="reference")
    cols = cast_columns(x, backend="reference")
    assert torch.equal(_bits(rows.data), _bits(cols[0])) and torch.equal(
        _bits(rows.scale), _bits(cols[1])
    )
    both = cast_both(x, backend="reference")
    _assert_same(both, (*cast_rows(x, backend="reference")[:2], *cols))
    # a NaN column's amax is the canonical quiet NaN whatever the payload (GPUs drop payloads)
    payload = torch.tensor([0x7FC00001, 0x3F800000], dtype=torch.int32).view(torch.float32)
    amax = reference.column_amax(payload[:, None], torch.ones(2))
    assert amax.view(torch.int32).tolist() == [0x7FC00000]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="2-D"):
        cast_rows(torch.zeros(4))
    with pytest.raises(ValueError, match="row_mult must be float32 of shape"):
        cast_columns(torch.zeros(4, 4), row_mult=torch.ones(3))
    with pytest.raises(TypeError, match="elem_dtype"):
        cast_rows(torch.zeros(4, 4), torch.int8)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        cast_rows(torch.zeros(4, 4, dtype=torch.int32))


@settings(max_examples=12, deadline=None)
@given(
    rows=st.sampled_from([0, 1, 63, 64, 65, 130]),
    cols=st.sampled_from([0, 1, 31, 64, 129]),
    seed=st.integers(0, 2**31 - 1),
)
def test_byte_transpose_of_any_shape(rows, cols, seed):
    """The transposed copy's kernel (interpreter) on shapes at and around its tile edges,
    empty included: every byte lands at its transposed place, nothing else is written."""
    from gem_lowprec.ops.fp8_cast import triton as kernels

    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    got = kernels.transpose_bytes(src)
    assert got.shape == (cols, rows) and torch.equal(got, src.t())


@pytest.mark.gpu
@ELEMS
def test_gpu_casts_match_reference_bit_for_bit(elem):
    _check_all(elem, "cuda", "auto")


# The GPU launch shapes under the interpreter: explicit choices, with the integer encoder (the
# interpreter's fp8 cast rounds wrongly) and a few persistent programs.
GPU_SHAPES_ON_CPU = dict(shapes="gpu", encoder="integer", sm_count=2)


@pytest.mark.parametrize("cols", [1024, 4096, 8192, 10000])
def test_gpu_launch_shapes_of_the_rows_cast_under_the_interpreter(cols):
    """The rows cast's GPU launch shapes, run by the interpreter: at 1024 columns 16-row chunks;
    from 4096 the wide launch (2048-column chunks); with a column amax, whole rows per chunk up
    to 8192 (2 rows a chunk at 4096, 1 at 8192) and chunks with atomics past it (10000). The
    encoder stays the integer one (the interpreter's fp8 cast rounds wrongly)."""
    from gem_lowprec.ops.fp8_cast import triton as kernels
    from gem_lowprec.ops.launch import Launch

    launch = Launch(**GPU_SHAPES_ON_CPU)
    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(37, cols, generator=gen) * 4).to(torch.bfloat16)
    mult = _row_mult(x.shape[0], 3)
    for transposed, m in ((True, None), (False, mult)):
        got = kernels.cast_rows(x, E4M3, transposed=transposed, col_amax_row_mult=m, launch=launch)
        want = cast_rows(x, transposed=transposed, col_amax_row_mult=m, backend="reference")
        _assert_same(got, want)


def test_gpu_launch_shapes_of_the_column_cast_under_the_interpreter():
    """The column-wise cast's GPU launch shape (64 × 128 tiles, two row tiles per amax program),
    run by the interpreter over ragged row and column edges, matches the reference; so does the
    weight's both-ways cast in its GPU tiles."""
    from gem_lowprec.ops.fp8_cast import triton_columns as kernels
    from gem_lowprec.ops.launch import Launch

    launch = Launch(**GPU_SHAPES_ON_CPU)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(300, 160, generator=gen) * 4).to(torch.bfloat16)
    mult = _row_mult(x.shape[0], 7)
    amax = kernels.column_amax(x, mult, launch=launch)
    got = kernels.cast_columns(x, E4M3, row_mult=mult, col_amax=amax, launch=launch)
    _assert_same(got, cast_columns(x, row_mult=mult, backend="reference"))
    _assert_same(kernels.cast_both(x, E4M3, launch=launch), cast_both(x, backend="reference"))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("rows", "cols"), [(16384 + 40, 1024), (4096 + 40, 4096), (1024 + 8, 10000)]
)
def test_gpu_rows_cast_of_a_tall_tensor_loops_over_row_blocks(rows, cols):
    """Past 32 MiB the rows kernel's persistent programs take several row blocks each (and keep
    the column amax over them): the G1 shapes' path, with and without the transposed copy; at
    4096 columns the wide launch and whole-row column amax, at 10000 (past both, not a power of
    two) the chunked column amax."""
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(rows, cols, generator=gen) * 4).to(torch.bfloat16)
    mult = _row_mult(x.shape[0], 7)
    for transposed, m in ((True, None), (False, mult)):
        got = cast_rows(x.cuda(), transposed=transposed, col_amax_row_mult=_to(m, "cuda"))
        want = cast_rows(x, transposed=transposed, col_amax_row_mult=m, backend="reference")
        _assert_same(got, want)


def _to(t, device):
    return None if t is None else t.to(device)


_CODEGEN_SCRIPT = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import torch
from gem_lowprec.codec import elem_format
from gem_lowprec.ops.fp8_cast import triton as K

def ptx(fn, signature, constants, num_warps):
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in signature}
    src = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps}).asm["ptx"]

rows = ptx(K.cast_rows_kernel,
           {"x_ptr": "*i16", "row_mult_ptr": "*fp32", "data_ptr": "*u8", "scale_ptr": "*fp32",
            "col_amax_ptr": "*i32", "R": "i32", "C": "i32"},
           dict(BLOCK_R=16, BLOCK_C=512, COL_AMAX=False, ONE_CHUNK=False, NUM_STAGES=1, HW_CONVERT=True,
                IN_BF16=True, **elem_format(torch.float8_e4m3fn).kernel_constants), 8)
t = K.RowsTiles()
transpose = ptx(K.transpose_bytes_kernel,
                {"src_ptr": "*u8", "dst_ptr": "*u8", "R": "i32", "C": "i32"},
                dict(BLOCK_R=t.transpose_block, BLOCK_C=t.transpose_block), t.transpose_warps)
print(json.dumps({name: {"casts": code.count("cvt.rn.satfinite.e4m3x2.f32"),
                         "byte_stores": code.count("st.global.b8"),
                         "vector_stores": code.count("st.global.v4")}
                  for name, code in (("rows", rows), ("transpose", transpose))}))
"""


def test_fp8_casts_store_each_byte_tile_once_and_vectorized_in_sm90_code():
    """The H200 trap: a tile of fp8 bytes stored twice (row-major and, through a layout
    conversion, transposed) came out with foreign bytes in the transposed copy. Compiled for
    sm_90 (no GPU needed): the rows kernel casts and stores once, the transposed copy is a
    separate byte transpose that casts nothing, and neither stores single bytes (a transposed
    store of single bytes would be the 1 TB/s copy this layout replaced)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}  # real @triton.jit functions, not interpreted
    done = subprocess.run(
        [sys.executable, "-c", _CODEGEN_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    rows, transpose = counts["rows"], counts["transpose"]
    assert rows["casts"] > 0 and transpose["casts"] == 0, counts
    assert rows["byte_stores"] == transpose["byte_stores"] == 0, counts
    assert transpose["vector_stores"] > 0, counts

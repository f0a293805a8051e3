"""GDPA: the Triton kernels (interpreter on the CPU, bf16/fp16 on a GPU) and the reference
against fp64, forward and every gradient, with the tolerance rule of DESIGN.md; the custom op
(opcheck, torch.compile, CUDA graphs) and every input error."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gem_jagged import gdpa
from gem_jagged.batch import JaggedBatch
from gem_jagged.ops.gdpa import ACTIVATIONS, GdpaTiles, Regime, SigmoidForm, regime_for, tiles_for
from gem_jagged.ops.gdpa import triton as kernels
from gem_jagged.ops.gdpa._op import gdpa_op
from gem_jagged.ops.gdpa.reference import gdpa_reference
from gem_jagged.testing import assert_within_reference_error, jagged_lengths, offsets_from_lengths
from hypothesis import assume, given
from hypothesis import strategies as st

HAS_CUDA = torch.cuda.is_available()


def _case(
    lengths, *, mode, heads, head_dim, dtype, device, seed, bias, kv_len=None, seeds=3, radius=4
):
    """Inputs of one case: (q, k, v, q_offsets, kv_offsets, rel_bias [heads, 2·radius+1],
    grad_out)."""
    gen = torch.Generator().manual_seed(seed)
    if mode == "cross" and isinstance(kv_len, list):
        kv_lengths = kv_len
    elif mode == "cross":
        kv_lengths = [kv_len if kv_len is not None else (n * 7 + 3) % 23 for n in lengths]
    else:
        kv_lengths = list(lengths)
    tq = seeds if mode == "pma" else sum(lengths)
    tk = sum(kv_lengths)
    out_rows = seeds * len(lengths) if mode == "pma" else tq

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)

    q, k, v = rand(tq, heads, head_dim), rand(tk, heads, head_dim), rand(tk, heads, head_dim)
    rel_bias = rand(heads, 2 * radius + 1) * 0.5 if bias else None
    q_off = None if mode == "pma" else offsets_from_lengths(lengths, device=device)
    kv_off = None if mode == "self" else offsets_from_lengths(kv_lengths, device=device)
    grad_out = rand(out_rows, heads, head_dim)
    return q, k, v, q_off, kv_off, rel_bias, grad_out


def _run(q, k, v, q_off, kv_off, rel_bias, grad_out, *, dtype, backend, **options):
    """Output and gradients of ``gdpa`` with inputs cast to ``dtype``."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    bias = None if rel_bias is None else rel_bias.to(dtype).requires_grad_()
    out = gdpa(*leaves, q_off, kv_off, rel_bias=bias, backend=backend, **options)
    wrt = leaves + ([bias] if bias is not None else [])
    grads = torch.autograd.grad(out, wrt, grad_out.to(dtype))
    return [out, *grads]


def _reference_autograd(q, k, v, q_off, kv_off, rel_bias, grad_out, *, dtype, **options):
    """The reference's forward in ``dtype`` differentiated by autograd (not by the op)."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    bias = None if rel_bias is None else rel_bias.to(dtype).requires_grad_()
    kv = kv_off if kv_off is not None else q_off
    out = gdpa_reference(*leaves, q_off, kv, rel_bias=bias, **options)
    wrt = leaves + ([bias] if bias is not None else [])
    if not out.requires_grad:  # the plain reference on a batch without tokens
        return [out, *(torch.zeros_like(t) for t in wrt)]
    grads = torch.autograd.grad(
        out, wrt, grad_out.to(dtype), allow_unused=True, materialize_grads=True
    )
    return [out, *grads]


NAMES = ["out", "dq", "dk", "dv", "d_rel_bias"]


INTERPRETER_TILES = tiles_for(
    arch="interpreter", dtype=torch.float32, head_dim=32, regime=Regime.PLAIN
)


def _batch(q_off, kv_off):
    """The ``JaggedBatch`` the launchers keep their work lists in (PMA: the key offsets)."""
    q_off = kv_off if q_off is None else q_off
    return JaggedBatch.of_owned(q_off, q_off if kv_off is None else kv_off, max_len=None)


def _check_against_fp64(case, *, dtype, options, tiles=None):
    exact = _reference_autograd(*case, dtype=torch.float64, **options)
    lowp = _reference_autograd(*case, dtype=dtype, **options)
    kernel = _run(*case, dtype=dtype, backend="triton", tiles=tiles, **options)
    for name, got, ref_lowp, ref64 in zip(NAMES, kernel, lowp, exact, strict=False):
        factor = 2.0 if name == "out" else 5.0
        assert_within_reference_error(got, ref_lowp, ref64, factor=factor, name=name)


def _smallest_score(q, k, q_off, kv_off, rel_bias, *, broadcast_q):
    """The smallest ``|scale·q·k + bias|`` over every (query, key) pair of a sequence, in fp64
    (masked pairs included: a bound, not the exact figure)."""
    kv_off = q_off if kv_off is None else kv_off
    radius = 0 if rel_bias is None else (rel_bias.shape[1] - 1) // 2
    smallest = math.inf
    for b in range(kv_off.numel() - 1):
        keys = k[kv_off[b] : kv_off[b + 1]].double()
        queries = q.double() if broadcast_q else q[q_off[b] : q_off[b + 1]].double()
        if not len(keys) or not len(queries):
            continue
        scores = torch.einsum("qnh,knh->nqk", queries, keys) / math.sqrt(q.shape[-1])
        if rel_bias is not None:
            rel = torch.arange(len(keys))[None, :] - torch.arange(len(queries))[:, None]
            scores = scores + rel_bias.double()[:, rel.clamp(-radius, radius) + radius]
        smallest = min(smallest, scores.abs().min().item())
    return smallest


@given(
    lengths=jagged_lengths(max_batch=4, max_len=40, block=16),
    mode=st.sampled_from(["self", "cross", "pma"]),
    activation=st.sampled_from(ACTIVATIONS),
    causal=st.booleans(),
    bias=st.booleans(),
    radius=st.sampled_from([0, 1, 4, 20]),  # 20: band tiles need two skewed reads of dS
    dtype=st.sampled_from([torch.float16, torch.float32]),
    offsets_dtype=st.sampled_from([torch.int32, torch.int64]),
    head_dim=st.sampled_from([32, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_forward_and_gradients_match_fp64(
    lengths, mode, activation, causal, bias, radius, dtype, offsets_dtype, head_dim, seed
):
    q, k, v, q_off, kv_off, rel_bias, grad_out = _case(
        lengths, mode=mode, heads=2, head_dim=head_dim, dtype=dtype, device="cpu", seed=seed,
        bias=bias, radius=radius,
    )  # fmt: skip
    if activation == "relu" and dtype == torch.float16:
        # relu's derivative jumps at 0: a score within fp16 rounding of 0 (products summed in
        # half precision by the interpreter or the fp16 reference) may take either side in the
        # kernel and the references, and no tolerance bounds the difference there; fp32 keeps
        # every draw
        low = rel_bias.to(dtype) if rel_bias is not None else None
        assume(_smallest_score(q, k, q_off, kv_off, low, broadcast_q=mode == "pma") > 2e-3)
    q_off = None if q_off is None else q_off.to(offsets_dtype)
    kv_off = None if kv_off is None else kv_off.to(offsets_dtype)
    options = dict(activation=activation, causal=causal, broadcast_q=mode == "pma", out_scale=0.5)
    _check_against_fp64((q, k, v, q_off, kv_off, rel_bias, grad_out), dtype=dtype, options=options)


@pytest.mark.parametrize(
    ("lengths", "mode", "causal"),
    [([300, 129, 1, 0, 200], "self", True), ([150, 9, 0, 70], "cross", False)],
)
def test_gpu_tile_shapes_with_a_wide_bias_under_the_interpreter(lengths, mode, causal):
    """The GPU tiles of head dim 64 (128 × 64 forward and dQ, 64 × 64 dK/dV) on the CPU with
    R = 40: band tiles reach both clamped edges and need two skewed reads of dS for their
    interior diagonals, as on the GPU. (The exact sigmoid: the interpreter has no inline asm.)"""
    gpu_tiles = dataclasses.replace(
        tiles_for(arch="cuda", dtype=torch.bfloat16, head_dim=64, regime=Regime.RELATIVE_BIAS),
        sigmoid=SigmoidForm.EXACT,
    )
    case = _case(
        lengths, mode=mode, heads=2, head_dim=64, dtype=torch.float32, device="cpu", seed=5,
        bias=True, radius=40, kv_len=100,
    )  # fmt: skip
    options = dict(activation="silu", causal=causal, broadcast_q=False, out_scale=0.5)
    _check_against_fp64(case, dtype=torch.float32, options=options, tiles=gpu_tiles)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_backward_matches_autograd(activation):
    """The written-out backward of the reference op equals autograd of its forward (fp64)."""
    for mode in ("self", "cross", "pma"):
        case = _case(
            [3, 0, 9, 1], mode=mode, heads=2, head_dim=32, dtype=torch.float64, device="cpu",
            seed=1, bias=True,
        )  # fmt: skip
        options = dict(activation=activation, causal=True, broadcast_q=mode == "pma", scale=0.3)
        expected = _reference_autograd(*case, dtype=torch.float64, **options)
        got = _run(*case, dtype=torch.float64, backend="reference", **options)
        for name, a, b in zip(NAMES, got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def test_pma_one_seed_and_head_dim_128():
    case = _case(
        [0, 1, 33, 16], mode="pma", heads=1, head_dim=128, dtype=torch.float32, device="cpu",
        seed=3, bias=False, seeds=1,
    )  # fmt: skip
    _check_against_fp64(case, dtype=torch.float32, options=dict(broadcast_q=True))
    out = gdpa(case[0].float(), case[1].float(), case[2].float(), None, case[4], broadcast_q=True)
    assert out.shape == (4, 1, 128)
    assert out[0].abs().max() == 0  # an empty sequence pools to zeros


@pytest.mark.parametrize("mode", ["cross", "pma"])
def test_prototype_work_list_schedule_matches_per_sequence(mode):
    """Cross-attention and PMA on the prototype's work-list entry points give what production's
    per-sequence schedule gives."""
    from gem_jagged.prototype.gdpa import (
        gdpa_backward_work_list,
        gdpa_forward_work_list,
        work_list_options_for,
    )

    q, k, v, q_off, kv_off, rel_bias, do = (
        t if t is None or not t.is_floating_point() else t.float()
        for t in _case(
            [20, 0, 5], mode=mode, heads=1, head_dim=32, dtype=torch.float32, device="cpu",
            seed=13, bias=True,
        )
    )  # fmt: skip
    q_off = kv_off if q_off is None else q_off
    options = dict(
        activation="silu", causal=True, scale=0.2, out_scale=1.0, broadcast_q=mode == "pma",
        rel_bias_NB=rel_bias, tiles=INTERPRETER_TILES,
    )  # fmt: skip
    batch = _batch(q_off, kv_off)
    production = [
        kernels.gdpa_forward(q, k, v, q_off, kv_off, is_cross=True, batch=batch, **options),
        *kernels.gdpa_backward(do, q, k, v, q_off, kv_off, is_cross=True, batch=batch, **options),
    ]
    work_list = work_list_options_for(arch="interpreter")
    batch = _batch(q_off, kv_off)
    prototype = [
        gdpa_forward_work_list(q, k, v, q_off, kv_off, batch=batch, options=work_list, **options),
        *gdpa_backward_work_list(
            do, q, k, v, q_off, kv_off, batch=batch, options=work_list, **options
        ),
    ]
    for name, a, b in zip(NAMES, production, prototype, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_cross_backward_is_the_same_for_every_chunking_of_the_queries(causal):
    """Cross-attention dK/dV sums chunks of query tiles in fp32; chunks of 1, 2 or 3 tiles and a
    single chunk give the same gradients (lengths of 0 to 11 tiles of 16, keys of 1 to 70)."""
    q, k, v, q_off, kv_off, rel_bias, do = (
        t if not t.is_floating_point() else t.float()
        for t in _case(
            [170, 0, 33, 1, 16, 90], mode="cross", heads=2, head_dim=32, dtype=torch.float32,
            device="cpu", seed=17, bias=True, kv_len=None,
        )
    )  # fmt: skip
    options = dict(
        activation="silu", causal=causal, scale=0.2, out_scale=1.0, broadcast_q=False,
        rel_bias_NB=rel_bias, is_cross=True, batch=_batch(q_off, kv_off),
    )  # fmt: skip
    results = []
    for min_tiles in (1, 2, 3, 100):
        tiles = dataclasses.replace(INTERPRETER_TILES, cross_min_part_tiles=min_tiles, max_split=4)
        results.append(kernels.gdpa_backward(do, q, k, v, q_off, kv_off, tiles=tiles, **options))
    for grads in results[1:]:
        for name, a, b in zip(NAMES[1:], results[0], grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_cross_forward_with_its_own_tiles_matches_the_shared_ones(causal):
    """``GdpaTiles.cross_fwd_*`` (the GPU default for head dim 128 uses them: 64-row tiles where
    everything else has 128) give the per-sequence cross forward other query tiles and another
    split than the rest: the same outputs, with keys that fit one tile (kept on chip) and keys
    that do not, whether one program takes a sequence's every tile or most programs exit."""
    q, k, v, q_off, kv_off, rel_bias, _ = (
        t if not t.is_floating_point() else t.float()
        for t in _case(
            [70, 0, 33, 1, 16], mode="cross", heads=2, head_dim=32, dtype=torch.float32,
            device="cpu", seed=19, bias=True, kv_len=[5, 0, 40, 1, 16],
        )
    )  # fmt: skip
    assert int((kv_off[1:] - kv_off[:-1]).max()) > INTERPRETER_TILES.fwd_n  # both paths
    options = dict(
        activation="silu", causal=causal, scale=0.2, out_scale=1.0, broadcast_q=False,
        rel_bias_NB=rel_bias, is_cross=True, batch=_batch(q_off, kv_off),
    )  # fmt: skip
    shared = kernels.gdpa_forward(q, k, v, q_off, kv_off, tiles=INTERPRETER_TILES, **options)
    base = INTERPRETER_TILES
    own = [
        dataclasses.replace(base, cross_fwd_m=32, cross_fwd_warps=2, cross_fwd_stages=1),
        dataclasses.replace(base, cross_fwd_split_target=1),  # every tile in one program
        dataclasses.replace(base, cross_fwd_split_target=80, max_split=8),  # most parts exit
    ]
    for tiles in own:
        torch.testing.assert_close(
            kernels.gdpa_forward(q, k, v, q_off, kv_off, tiles=tiles, **options),
            shared,
            rtol=1e-5,
            atol=1e-5,
            msg=str(tiles),
        )


def test_reference_gradcheck_fp64():
    q, k, v, q_off, kv_off, rel_bias, _ = _case(
        [2, 0, 3], mode="cross", heads=1, head_dim=32, dtype=torch.float64, device="cpu",
        seed=5, bias=True,
    )  # fmt: skip
    inputs = [t.requires_grad_() for t in (q, k, v, rel_bias)]

    def fn(q, k, v, rb):
        return gdpa(q, k, v, q_off, kv_off, rel_bias=rb, activation="gelu", causal=True)

    assert torch.autograd.gradcheck(fn, inputs)


def test_opcheck():
    q, k, v, q_off, kv_off, rel_bias, _ = _case(
        [3, 0, 5], mode="cross", heads=2, head_dim=32, dtype=torch.float32, device="cpu",
        seed=7, bias=True,
    )  # fmt: skip
    args = (
        q.float().requires_grad_(), k.float().requires_grad_(), v.float().requires_grad_(),
        q_off, kv_off, rel_bias.float().requires_grad_(), "silu", True, 0.2, 1.0, False, True,
        "reference",
    )  # fmt: skip
    torch.library.opcheck(gdpa_op, args)


def _compiled_matches_eager(device, backend, dtype, compile_backend):
    case = _case(
        [5, 0, 17], mode="self", heads=2, head_dim=32, dtype=dtype, device=device, seed=9,
        bias=True,
    )  # fmt: skip
    q, k, v, q_off, _, rel_bias, grad_out = case

    def step(q, k, v, rb):
        out = gdpa(q, k, v, q_off, causal=True, rel_bias=rb, backend=backend)
        return (out * grad_out.to(dtype)).sum()

    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, rel_bias)]
    eager = torch.autograd.grad(step(*leaves), leaves)
    compiled = torch.compile(step, fullgraph=True, backend=compile_backend)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b)


def test_torch_compile_fullgraph_cpu_reference():
    _compiled_matches_eager("cpu", "reference", torch.float32, "aot_eager")


BAD_INPUTS = {
    "offsets not 1-D": (dict(q_offsets=lambda o: o[None]), "must be 1-D"),
    "offsets not from 0": (
        dict(q_offsets=lambda o: o + 1),
        r"offsets\[0\] must be 0, got 1",
    ),
    "decreasing offsets": (
        dict(q_offsets=lambda o: torch.tensor([0, 6, 4, 8])),
        "non-decreasing",
    ),
    "last offset != tokens": (
        dict(q_offsets=lambda o: torch.tensor([0, 2, 4, 7])),
        r"q_offsets\[-1\] = 7 must equal the number of tokens of q \(8\)",
    ),
    "float offsets": (dict(q_offsets=lambda o: o.float()), "int32 or int64"),
    "dtype mismatch": (dict(k=lambda t: t.double()), "k has dtype torch.float64"),
    "device mismatch": (dict(v=lambda t: t.to("meta")), "v is on meta"),
    "head count": (dict(k=lambda t: t[:, :1], v=lambda t: t[:, :1]), "same number of heads"),
    "head dim": (
        dict(q=lambda t: t[..., :16], k=lambda t: t[..., :16], v=lambda t: t[..., :16]),
        r"head dim 16; supported head dims are \(32, 64, 128\)",
    ),
    "activation": (dict(activation="tanh"), "activation must be one of"),
    "pma without kv_offsets": (
        dict(broadcast_q=True),
        "broadcast_q=True \\(PMA\\) needs kv_offsets",
    ),
    "q_offsets None": (dict(q_offsets=lambda o: None), "q_offsets is required"),
    "self-attention token mismatch": (
        dict(k=lambda t: t[:6], v=lambda t: t[:6]),
        "self-attention \\(kv_offsets=None\\) needs k and v with the 8 query tokens",
    ),
    "cross batch mismatch": (
        dict(kv_offsets=lambda o: torch.tensor([0, 8])),
        "kv_offsets has 1 sequences but q_offsets has 3; they must match",
    ),
    "rel_bias shape": (dict(rel_bias=torch.zeros(2, 4)), "rel_bias must have shape"),
    "backend": (dict(backend="cuda"), "backend must be one of"),
    "2-D values": (dict(q=lambda t: t[:, 0]), "q must have 3 dimensions"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_clear_errors(case):
    changes, message = BAD_INPUTS[case]
    q, k, v = (torch.randn(8, 2, 32) for _ in range(3))
    args = dict(q=q, k=k, v=v, q_offsets=torch.tensor([0, 3, 3, 8]), kv_offsets=None)
    options = {}
    for key, change in changes.items():
        if key in args:
            base = args[key] if args[key] is not None else args["q_offsets"]
            args[key] = change(base) if callable(change) else change
        else:
            options[key] = change
    with pytest.raises((ValueError, TypeError), match=message):
        gdpa(args["q"], args["k"], args["v"], args["q_offsets"], args["kv_offsets"], **options)


def test_benchmark_smoke_quick_runs_and_records_the_headline(tmp_path):
    """``--smoke --quick``, with the project's call learning a relative bias (``--rel-bias``)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "jagged" / "bench_gdpa.py"
    results = tmp_path / "results.jsonl"
    result = subprocess.run(
        [sys.executable, str(script), "--smoke", "--quick", "--rel-bias", "3"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "GEMKIT_RESULTS": str(results)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "GDPA useful TFLOP/s" in result.stdout
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    headline = [r for r in rows if r["workload"] == "headline"]
    assert len(headline) == 1 and "j1_fwdbwd_x_jfa" in headline[0], headline


# ------------------------------------------------------------------------------------------------
# GPU: bf16/fp16 kernels against fp64, compile with the Triton backend, CUDA-graph capture.
# ------------------------------------------------------------------------------------------------


GPU_CASES = [  # (dtype, head dim, mode, activation, causal, bias): every axis covered once
    (torch.bfloat16, 128, "self", "silu", True, False),
    (torch.bfloat16, 128, "cross", "silu", False, False),
    (torch.bfloat16, 128, "pma", "silu", False, False),
    (torch.float16, 64, "self", "gelu", False, True),
    (torch.bfloat16, 32, "cross", "gelu_tanh", True, True),
    (torch.float16, 128, "pma", "sigmoid", True, True),
    (torch.bfloat16, 64, "self", "relu", True, False),
    (torch.bfloat16, 64, "pma", "identity", False, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim, mode, activation, causal, bias", GPU_CASES)
def test_gpu_matches_fp64(dtype, head_dim, mode, activation, causal, bias):
    lengths = [0, 1, 127, 128, 129, 300, 1000, 5]
    # R = 32: tiles off the bias band, on it, and band tiles needing two skewed reads of dS
    case = _case(
        lengths, mode=mode, heads=2, head_dim=head_dim, dtype=dtype, device="cuda", seed=1,
        bias=bias, kv_len=64 if mode == "cross" else None, seeds=32, radius=32,
    )  # fmt: skip
    options = dict(activation=activation, causal=causal, broadcast_q=mode == "pma")
    _check_against_fp64(case, dtype=dtype, options=options)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kv_lengths", [[64, 1, 128, 7], [64, 0, 128, 7], [64, 3, 129, 7]], ids=["fit", "empty", "long"]
)
def test_gpu_cross_dq_with_and_without_its_own_kernel(kv_lengths):
    """Keys of 1 to 128 per sequence (known from the offsets' host check): the dK/dV kernel
    writes every dQ row and the dQ kernel is not launched. A sequence without keys or one longer
    than a tile needs it (zeros, or dS K over several key tiles)."""
    case = _case(
        [300, 5, 129, 0], mode="cross", heads=2, head_dim=128, dtype=torch.bfloat16,
        device="cuda", seed=4, bias=True, kv_len=kv_lengths,
    )  # fmt: skip
    _check_against_fp64(case, dtype=torch.bfloat16, options=dict(activation="silu"))
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        _run(*case, dtype=torch.bfloat16, backend="triton", activation="silu")
        torch.cuda.synchronize()
    launched = {e.key for e in prof.key_averages()}
    needs_dq_kernel = min(kv_lengths) == 0 or max(kv_lengths) > 128
    assert any("_gdpa_bwd_dq_seq_kernel" in name for name in launched) == needs_dq_kernel


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["self", "cross", "pma"])
def test_gpu_fp32_head_dim_128_fits_and_matches_fp64(mode):
    """fp32 operands take twice the shared memory per tile: their tiles must still launch."""
    lengths = [0, 1, 127, 300, 5]
    case = _case(
        lengths, mode=mode, heads=2, head_dim=128, dtype=torch.float32, device="cuda", seed=2,
        bias=True, kv_len=64 if mode == "cross" else None, seeds=32,
    )  # fmt: skip
    options = dict(activation="silu", causal=True, broadcast_q=mode == "pma")
    _check_against_fp64(case, dtype=torch.float32, options=options)


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph_triton():
    _compiled_matches_eager("cuda", "triton", torch.bfloat16, "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["self", "cross", "pma"])
def test_gpu_cuda_graph_capture(mode):
    """A replay sees new values and new lengths copied into the captured inputs and offsets
    (work lists are built inside the graph, never taken from the eager cache)."""
    lengths = [100, 0, 257, 3]
    case = _case(
        lengths, mode=mode, heads=2, head_dim=64, dtype=torch.bfloat16, device="cuda",
        seed=11, bias=False, kv_len=64 if mode == "cross" else None,
    )  # fmt: skip
    q, k, v, q_off, kv_off, _, grad_out = case
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    do = grad_out.to(torch.bfloat16)
    options = dict(causal=True, broadcast_q=mode == "pma")

    def step():
        out = gdpa(*leaves, q_off, kv_off, **options)
        return (out.detach(), *torch.autograd.grad(out, leaves, do))

    expected = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up (compiles kernels) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for leaf in leaves:  # new values in place: the replay must see them
        leaf.data.mul_(0.5)
    moved = [7, 200, 0, 153]  # new lengths, same totals
    for offsets in (q_off, kv_off):  # the jagged side (cross K/V keep 64 keys each)
        if offsets is not None and int(offsets[-1]) == sum(lengths):
            offsets.copy_(offsets_from_lengths(moved, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    for a, b in zip(captured, fresh, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(fresh[0], expected[0])
    assert math.isfinite(float(fresh[0].float().abs().sum()))


def test_tiles_for_pins_the_measured_table():
    """Every cell of ``tiles_for`` (the table the GPU measurements chose; the same values the
    launchers used before the configuration became an argument). Fields in ``PIN_FIELDS`` order,
    then the sigmoid form."""
    for (arch, dtype, head_dim, regime), expected in PINNED_TILES.items():
        tiles = tiles_for(arch=arch, dtype=dtype, head_dim=head_dim, regime=regime)
        got = (*(getattr(tiles, name) for name in PIN_FIELDS), tiles.sigmoid)
        assert got == expected, (arch, dtype, head_dim, regime)
    assert len(PINNED_TILES) == 36


def test_the_bias_regime_changes_only_the_dq_tiles():
    """A learned relative bias picks the bias regime, whose head-dim-128 GPU tiles keep dQ at 128
    rows on 8 warps (64 on 4 spill in the bias gradient); everything else is the same."""
    assert regime_for(rel_bias_NB=None) == Regime.PLAIN
    assert regime_for(rel_bias_NB=torch.zeros(2, 9)) == Regime.RELATIVE_BIAS
    plain, with_bias = (
        tiles_for(arch="cuda", dtype=torch.bfloat16, head_dim=128, regime=r)
        for r in (Regime.PLAIN, Regime.RELATIVE_BIAS)
    )
    assert (plain.dq_m, plain.dq_warps, with_bias.dq_m, with_bias.dq_warps) == (64, 4, 128, 8)
    assert plain == dataclasses.replace(with_bias, dq_m=64, dq_warps=4)


def test_tiles_round_trip_through_the_custom_op_form():
    for tiles in _pinned_configs():
        assert GdpaTiles.from_ints(tiles.as_ints()) == tiles


def test_explicit_tiles_reach_the_launchers():
    """``gdpa(..., tiles=)`` runs with the given tiles: the GPU's head-dim-64 tiles on the
    interpreter match the reference; anything but a ``GdpaTiles`` is refused."""
    case = _case(
        [40, 0, 17], mode="self", heads=2, head_dim=64, dtype=torch.float32, device="cpu",
        seed=3, bias=True,
    )  # fmt: skip
    q, k, v, q_off, _, rel_bias, _ = case
    tiles = dataclasses.replace(
        tiles_for(arch="cuda", dtype=torch.bfloat16, head_dim=64, regime=Regime.RELATIVE_BIAS),
        sigmoid=SigmoidForm.EXACT,
    )
    q, k, v, rb = (t.float() for t in (q, k, v, rel_bias))
    expected = gdpa(q, k, v, q_off, causal=True, rel_bias=rb, backend="reference")
    got = gdpa(q, k, v, q_off, causal=True, rel_bias=rb, backend="triton", tiles=tiles)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="tiles must be a GdpaTiles"):
        gdpa(q, k, v, q_off, tiles={"fwd_m": 16})


def _pinned_configs():
    return [
        tiles_for(arch=arch, dtype=dtype, head_dim=hd, regime=regime)
        for arch, dtype, hd, regime in PINNED_TILES
    ]


PIN_FIELDS = (
    "fwd_m", "fwd_n", "fwd_warps", "fwd_stages", "dkdv_m", "dkdv_n", "dkdv_warps", "dkdv_stages",
    "dq_m", "dq_n", "dq_warps", "dq_stages", "split_target", "max_split", "cross_min_part_tiles",
    "cross_fwd_m", "cross_fwd_warps", "cross_fwd_stages", "cross_fwd_split_target",
)  # fmt: skip
EXACT, TANH = SigmoidForm.EXACT, SigmoidForm.TANH_APPROX
# fmt: off
PINNED_TILES = {
    ("interpreter", torch.float16, 32, Regime.PLAIN):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.float16, 32, Regime.RELATIVE_BIAS):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.float16, 64, Regime.PLAIN):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.float16, 64, Regime.RELATIVE_BIAS):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.float16, 128, Regime.PLAIN):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.float16, 128, Regime.RELATIVE_BIAS):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.bfloat16, 32, Regime.PLAIN):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.bfloat16, 32, Regime.RELATIVE_BIAS):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.bfloat16, 64, Regime.PLAIN):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.bfloat16, 64, Regime.RELATIVE_BIAS):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.bfloat16, 128, Regime.PLAIN):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.bfloat16, 128, Regime.RELATIVE_BIAS):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.float32, 32, Regime.PLAIN):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.float32, 32, Regime.RELATIVE_BIAS):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.float32, 64, Regime.PLAIN):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.float32, 64, Regime.RELATIVE_BIAS):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.float32, 128, Regime.PLAIN):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("interpreter", torch.float32, 128, Regime.RELATIVE_BIAS):
        (16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 64, 3, 2, None, None, None, None, EXACT),
    ("cuda", torch.float16, 32, Regime.PLAIN):
        (128, 64, 4, 3, 64, 64, 4, 2, 128, 64, 4, 2, 1024, 16, 4, None, None, None, None, EXACT),
    ("cuda", torch.float16, 32, Regime.RELATIVE_BIAS):
        (128, 64, 4, 3, 64, 64, 4, 2, 128, 64, 4, 2, 1024, 16, 4, None, None, None, None, EXACT),
    ("cuda", torch.float16, 64, Regime.PLAIN):
        (128, 64, 4, 3, 64, 64, 4, 2, 128, 64, 4, 2, 1024, 16, 4, None, None, None, None, EXACT),
    ("cuda", torch.float16, 64, Regime.RELATIVE_BIAS):
        (128, 64, 4, 3, 64, 64, 4, 2, 128, 64, 4, 2, 1024, 16, 4, None, None, None, None, EXACT),
    ("cuda", torch.float16, 128, Regime.PLAIN):
        (128, 64, 8, 3, 64, 128, 8, 2, 64, 64, 4, 2, 1024, 16, 4, 64, 4, 1, 4096, EXACT),
    ("cuda", torch.float16, 128, Regime.RELATIVE_BIAS):
        (128, 64, 8, 3, 64, 128, 8, 2, 128, 64, 8, 2, 1024, 16, 4, 64, 4, 1, 4096, EXACT),
    ("cuda", torch.bfloat16, 32, Regime.PLAIN):
        (128, 64, 4, 3, 64, 64, 4, 2, 128, 64, 4, 2, 1024, 16, 4, None, None, None, None, TANH),
    ("cuda", torch.bfloat16, 32, Regime.RELATIVE_BIAS):
        (128, 64, 4, 3, 64, 64, 4, 2, 128, 64, 4, 2, 1024, 16, 4, None, None, None, None, TANH),
    ("cuda", torch.bfloat16, 64, Regime.PLAIN):
        (128, 64, 4, 3, 64, 64, 4, 2, 128, 64, 4, 2, 1024, 16, 4, None, None, None, None, TANH),
    ("cuda", torch.bfloat16, 64, Regime.RELATIVE_BIAS):
        (128, 64, 4, 3, 64, 64, 4, 2, 128, 64, 4, 2, 1024, 16, 4, None, None, None, None, TANH),
    ("cuda", torch.bfloat16, 128, Regime.PLAIN):
        (128, 64, 8, 3, 64, 128, 8, 2, 64, 64, 4, 2, 1024, 16, 4, 64, 4, 1, 4096, TANH),
    ("cuda", torch.bfloat16, 128, Regime.RELATIVE_BIAS):
        (128, 64, 8, 3, 64, 128, 8, 2, 128, 64, 8, 2, 1024, 16, 4, 64, 4, 1, 4096, TANH),
    ("cuda", torch.float32, 32, Regime.PLAIN):
        (64, 32, 4, 2, 32, 64, 4, 1, 64, 32, 4, 1, 1024, 16, 4, None, None, None, None, EXACT),
    ("cuda", torch.float32, 32, Regime.RELATIVE_BIAS):
        (64, 32, 4, 2, 32, 64, 4, 1, 64, 32, 4, 1, 1024, 16, 4, None, None, None, None, EXACT),
    ("cuda", torch.float32, 64, Regime.PLAIN):
        (64, 32, 4, 2, 32, 64, 4, 1, 64, 32, 4, 1, 1024, 16, 4, None, None, None, None, EXACT),
    ("cuda", torch.float32, 64, Regime.RELATIVE_BIAS):
        (64, 32, 4, 2, 32, 64, 4, 1, 64, 32, 4, 1, 1024, 16, 4, None, None, None, None, EXACT),
    ("cuda", torch.float32, 128, Regime.PLAIN):
        (64, 32, 4, 2, 32, 64, 4, 1, 64, 32, 4, 1, 1024, 16, 4, None, None, None, None, EXACT),
    ("cuda", torch.float32, 128, Regime.RELATIVE_BIAS):
        (64, 32, 4, 2, 32, 64, 4, 1, 64, 32, 4, 1, 1024, 16, 4, None, None, None, None, EXACT),
}
# fmt: on

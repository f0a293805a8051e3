"""BlockAttention: the fused-RoPE Triton kernels (interpreter on the CPU, bf16/fp16 on a GPU) and
the reference against fp64, forward and every gradient, with the tolerance rule of DESIGN.md;
RoPE against an explicit rotation; the custom op (opcheck, torch.compile, CUDA graphs); errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gem_jagged import block_attention
from gem_jagged.ops.block_attention import BlockAttentionConfig, config_for
from gem_jagged.ops.block_attention._op import block_attention_op
from gem_jagged.ops.block_attention.reference import block_attention_reference
from gem_jagged.testing import assert_within_reference_error, jagged_lengths, offsets_from_lengths
from hypothesis import given
from hypothesis import strategies as st

NAMES = ["out", "dq", "dk", "dv"]


def _case(lengths, *, heads, head_dim, device, seed):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v, do = (
        torch.randn(total, heads, head_dim, generator=gen, dtype=torch.float64).to(device)
        for _ in range(4)
    )
    return q, k, v, offsets_from_lengths(lengths, device=device), do


def _grads(fn, q, k, v, offsets, do, *, dtype, **options):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, offsets, **options)
    if not out.requires_grad:  # the plain reference on a batch without tokens
        return [out, *(torch.zeros_like(t) for t in leaves)]
    return [out, *torch.autograd.grad(out, leaves, do.to(dtype))]


def _check_against_fp64(case, *, dtype, **options):
    exact = _grads(block_attention_reference, *case, dtype=torch.float64, **options)
    lowp = _grads(block_attention_reference, *case, dtype=dtype, **options)
    kernel = _grads(block_attention, *case, dtype=dtype, backend="triton", **options)
    for name, got, ref_lowp, ref64 in zip(NAMES, kernel, lowp, exact, strict=True):
        factor = 2.0 if name == "out" else 5.0
        assert_within_reference_error(got, ref_lowp, ref64, factor=factor, name=name)


@given(
    lengths=jagged_lengths(max_batch=4, max_len=40, block=16),
    block_size=st.sampled_from([16, 5, 32]),
    causal=st.booleans(),
    rope_theta=st.sampled_from([None, 10000.0, 7.5]),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    offsets_dtype=st.sampled_from([torch.int32, torch.int64]),
    head_dim=st.sampled_from([32, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_forward_and_gradients_match_fp64(
    lengths, block_size, causal, rope_theta, dtype, offsets_dtype, head_dim, seed
):
    q, k, v, offsets, do = _case(lengths, heads=2, head_dim=head_dim, device="cpu", seed=seed)
    _check_against_fp64(
        (q, k, v, offsets.to(offsets_dtype), do), dtype=dtype, block_size=block_size,
        causal=causal, rope_theta=rope_theta,
    )  # fmt: skip


def test_head_dim_128_fp32():
    case = _case([1, 0, 20], heads=1, head_dim=128, device="cpu", seed=2)
    _check_against_fp64(case, dtype=torch.float32, block_size=16, rope_theta=10000.0)


def test_rope_is_the_llama_half_split_rotation_from_each_sequence_start():
    """Block size 1 makes attention the identity on v; use q·k of a 2-token block instead:
    the score between positions p and p+1 of a sequence depends only on their offset."""
    lengths = [6, 2]
    q, k, v, offsets, _ = _case(lengths, heads=1, head_dim=32, device="cpu", seed=4)
    theta = 100.0
    half = 16
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / 32)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1], dtype=torch.float64)
    angle = pos[:, None] * inv_freq
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]

    def rot(x):
        return torch.cat([x[..., :half] * cos - x[..., half:] * sin,
                          x[..., half:] * cos + x[..., :half] * sin], -1)  # fmt: skip

    qr, kr = rot(q), rot(k)
    out = block_attention(q, k, v, offsets, block_size=2, causal=True, rope_theta=theta)
    # second token of each block: softmax over (its block's first key, itself)
    for row in (1, 3, 5, 7):
        s = torch.stack([(qr[row] * kr[row - 1]).sum(), (qr[row] * kr[row]).sum()]) / 32**0.5
        p = torch.softmax(s, 0)
        torch.testing.assert_close(out[row], p[0] * v[row - 1] + p[1] * v[row])
    torch.testing.assert_close(out[[0, 2, 4, 6]], v[[0, 2, 4, 6]])  # first token sees itself


def test_reference_backward_matches_autograd():
    case = _case([7, 0, 23, 1], heads=2, head_dim=32, device="cpu", seed=5)
    for causal in (True, False):
        options = dict(block_size=8, causal=causal, rope_theta=50.0)
        expected = _grads(block_attention_reference, *case, dtype=torch.float64, **options)
        got = _grads(block_attention, *case, dtype=torch.float64, backend="reference", **options)
        for name, a, b in zip(NAMES, got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def test_opcheck():
    q, k, v, offsets, _ = _case([3, 0, 9], heads=2, head_dim=32, device="cpu", seed=7)
    args = (
        q.float().requires_grad_(), k.float().requires_grad_(), v.float().requires_grad_(),
        offsets, 4, True, 10000.0, 0.2, "reference",
    )  # fmt: skip
    torch.library.opcheck(block_attention_op, args)


# (block_size, head_dim) -> warps of forward and backward; every cell of ``config_for``, the
# values the launchers used before the configuration became an argument.
PINNED_WARPS = {
    (1, 32): 4, (16, 32): 4, (64, 32): 4, (128, 32): 4,
    (1, 64): 4, (16, 64): 4, (64, 64): 4, (65, 64): 8, (128, 64): 8,
    (1, 128): 4, (32, 128): 4, (33, 128): 8, (64, 128): 8, (128, 128): 8,
}  # fmt: skip


def test_config_for_pins_the_warps():
    for (block_size, head_dim), warps in PINNED_WARPS.items():
        config = config_for(block_size=block_size, head_dim=head_dim)
        expected = BlockAttentionConfig(fwd_warps=warps, bwd_warps=warps, stages=1)
        assert config == expected, (block_size, head_dim)
        assert BlockAttentionConfig.from_ints(config.as_ints()) == config


def test_explicit_config_reaches_the_kernels():
    """``config=`` is used as given (through the custom op too); anything else is refused."""
    q, k, v, offsets, _ = _case([9, 0, 20], heads=2, head_dim=32, device="cpu", seed=4)
    q, k, v = q.float(), k.float(), v.float()
    config = BlockAttentionConfig(fwd_warps=2, bwd_warps=8, stages=2)
    expected = block_attention(q, k, v, offsets, block_size=8, backend="reference")
    got = block_attention(q, k, v, offsets, block_size=8, backend="triton", config=config)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    args = (q, k, v, offsets, 8, True, None, 32**-0.5, "triton", config.as_ints())
    torch.testing.assert_close(block_attention_op(*args), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="config must be a BlockAttentionConfig"):
        block_attention(q, k, v, offsets, config={"fwd_warps": 4})


def _compiled_matches_eager(device, backend, dtype, compile_backend):
    q, k, v, offsets, do = _case([5, 0, 17], heads=2, head_dim=32, device=device, seed=9)

    def step(q, k, v):
        out = block_attention(q, k, v, offsets, block_size=4, rope_theta=500.0, backend=backend)
        return (out * do.to(dtype)).sum()

    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    eager = torch.autograd.grad(step(*leaves), leaves)
    compiled = torch.compile(step, fullgraph=True, backend=compile_backend)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b)


def test_torch_compile_fullgraph_cpu_reference():
    _compiled_matches_eager("cpu", "reference", torch.float32, "aot_eager")


BAD_INPUTS = {
    "offsets not 1-D": (dict(offsets=lambda o: o[None]), "must be 1-D"),
    "offsets not from 0": (dict(offsets=lambda o: o + 1), r"offsets\[0\] must be 0"),
    "decreasing offsets": (dict(offsets=lambda o: torch.tensor([0, 6, 4, 8])), "non-decreasing"),
    "last offset != tokens": (
        dict(offsets=lambda o: torch.tensor([0, 2, 4, 7])),
        r"offsets\[-1\] = 7 must equal the number of tokens of q \(8\)",
    ),
    "dtype mismatch": (dict(v=lambda t: t.half()), "v has dtype torch.float16"),
    "device mismatch": (dict(k=lambda t: t.to("meta")), "k is on meta"),
    "shape mismatch": (dict(k=lambda t: t[:, :1]), "same shape"),
    "head dim": (
        dict(q=lambda t: t[..., :48], k=lambda t: t[..., :48], v=lambda t: t[..., :48]),
        r"head dim 48; supported head dims are \(32, 64, 128\)",
    ),
    "block size 0": (dict(block_size=0), r"block_size must be in \[1, 128\]"),
    "block size float": (dict(block_size=64.0), "block_size must be an int"),
    "rope_theta": (dict(rope_theta=-1.0), "rope_theta must be a finite number > 1"),
    "backend": (dict(backend="gpu"), "backend must be one of"),
    "fp32 block over 64 on triton": (
        dict(block_size=65, backend="triton"),
        "fp32 inputs support block_size up to 64 on the Triton backend, got 65",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_clear_errors(case):
    changes, message = BAD_INPUTS[case]
    args = dict(
        q=torch.randn(8, 2, 64), k=torch.randn(8, 2, 64), v=torch.randn(8, 2, 64),
        offsets=torch.tensor([0, 3, 3, 8]),
    )  # fmt: skip
    options = {}
    for key, change in changes.items():
        if key in args:
            args[key] = change(args[key])
        else:
            options[key] = change
    with pytest.raises((ValueError, TypeError), match=message):
        block_attention(args["q"], args["k"], args["v"], args["offsets"], **options)


def test_benchmark_smoke_quick_runs_and_records_the_headline(tmp_path):
    script = (
        Path(__file__).resolve().parents[2] / "benchmarks" / "jagged" / "bench_block_attention.py"
    )
    results = tmp_path / "results.jsonl"
    result = subprocess.run(
        [sys.executable, str(script), "--smoke", "--quick"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "GEMKIT_RESULTS": str(results)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "BlockAttention" in result.stdout
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    headline = [r for r in rows if r["workload"] == "headline"]
    assert len(headline) == 1 and "j5_fwdbwd_x_padded_sdpa" in headline[0], headline


# ------------------------------------------------------------------------------------------------
# GPU: bf16/fp16 kernels against fp64, compile with the Triton backend, CUDA-graph capture.
# ------------------------------------------------------------------------------------------------


GPU_CASES = [  # (dtype, head dim, block size, causal, rope_theta)
    (torch.bfloat16, 128, 64, True, 10000.0),
    (torch.float16, 128, 128, False, 500000.0),
    (torch.bfloat16, 64, 50, True, None),
    (torch.float16, 32, 64, True, 10000.0),
    (torch.float32, 128, 64, True, 10000.0),  # fp32: twice the on-chip bytes per block
    (torch.float32, 64, 50, False, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim, block_size, causal, rope_theta", GPU_CASES)
def test_gpu_matches_fp64(dtype, head_dim, block_size, causal, rope_theta):
    lengths = [0, 1, 63, 64, 65, 300, 2000, 5]
    case = _case(lengths, heads=2, head_dim=head_dim, device="cuda", seed=1)
    _check_against_fp64(
        case, dtype=dtype, block_size=block_size, causal=causal, rope_theta=rope_theta
    )


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph_triton():
    _compiled_matches_eager("cuda", "triton", torch.bfloat16, "inductor")


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    q, k, v, offsets, do = _case([100, 0, 257, 3], heads=2, head_dim=64, device="cuda", seed=11)
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    do = do.to(torch.bfloat16)

    def step():
        out = block_attention(*leaves, offsets, rope_theta=10000.0)
        return (out.detach(), *torch.autograd.grad(out, leaves, do))

    expected = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for leaf in leaves:
        leaf.data.mul_(0.5)
    offsets.copy_(offsets_from_lengths([7, 200, 0, 153], device="cuda"))  # same total
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    for a, b in zip(captured, fresh, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(fresh[0], expected[0])

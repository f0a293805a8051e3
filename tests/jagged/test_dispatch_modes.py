"""One rule for when an op bypasses its custom op, tested per op and per mode.

Plain eager calls of the Triton backend run a plain ``autograd.Function``; under
``torch.compile``, selective activation checkpointing and ``FlopCounterMode`` every op must go
through its custom op, so that the compiler traces it, the checkpoint policy sees it (and a
"save" decision means it is not run again in the backward) and the counter counts it.
"""

import functools

import pytest
import torch
from gem_jagged import JaggedBatch, block_attention, gdpa, jagged_flash_attention
from gem_jagged.testing import offsets_from_lengths
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

LENGTHS = [5, 0, 19, 3]
TOTAL = sum(LENGTHS)


def _call_jfa(q, k, v, offsets):
    return jagged_flash_attention(q, k, v, offsets, causal=True, backend="triton")


def _call_gdpa(q, k, v, offsets):
    return gdpa(q, k, v, offsets, causal=True, backend="triton")


def _call_block(q, k, v, offsets):
    return block_attention(q, k, v, offsets, block_size=8, backend="triton")


# (name, call, forward custom op, backward custom op, eager Function's backward node name)
OPS = [
    ("jfa", _call_jfa, "jagged_flash_attention_fwd", "jagged_flash_attention_bwd", "_TritonAttention"),
    ("gdpa", _call_gdpa, "gdpa", "gdpa_backward", "GdpaTritonFunction"),
    ("block", _call_block, "block_attention", "block_attention_backward", "BlockAttentionTritonFunction"),
]  # fmt: skip


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(TOTAL, 2, 32, generator=gen, requires_grad=True) for _ in range(3)]


def _offsets():
    return JaggedBatch(offsets_from_lengths(LENGTHS))


@pytest.mark.parametrize("name, call, fwd, bwd, function", OPS, ids=[o[0] for o in OPS])
def test_plain_eager_takes_the_function(name, call, fwd, bwd, function):
    q, k, v = _inputs()
    out = call(q, k, v, _offsets())
    assert type(out.grad_fn).__name__ == function + "Backward"


@pytest.mark.parametrize("op", [jagged_flash_attention, gdpa], ids=["jfa", "gdpa"])
def test_a_learned_bias_parameter_keeps_the_eager_path(op):
    """A model's relative bias is an ``nn.Parameter``: it must not send each call through the
    custom op's dispatcher (a plain-tensor rule would, as Parameter is a subclass)."""
    q, k, v = _inputs()
    bias = torch.nn.Parameter(torch.zeros(2, 2 * 4 + 1))
    out = op(q, k, v, _offsets(), causal=True, rel_bias=bias, backend="triton")
    names = {"jagged_flash_attention": "_TritonAttention", "gdpa": "GdpaTritonFunction"}
    assert type(out.grad_fn).__name__ == names[op.__name__] + "Backward"
    out.sum().backward()
    assert bias.grad is not None and bias.grad.shape == bias.shape


@pytest.mark.parametrize("name, call, fwd, bwd, function", OPS, ids=[o[0] for o in OPS])
def test_compile_traces_the_custom_op(name, call, fwd, bwd, function):
    q, k, v = _inputs()
    offsets = offsets_from_lengths(LENGTHS)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    compiled = torch.compile(call, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, offsets), call(q, k, v, offsets))
    assert any(f"gem_jagged.{fwd}" in target for target in seen), seen


@pytest.mark.parametrize("name, call, fwd, bwd, function", OPS, ids=[o[0] for o in OPS])
def test_selective_checkpointing_sees_the_op_and_saves_it(name, call, fwd, bwd, function):
    q, k, v = _inputs()
    offsets = _offsets()
    op = getattr(torch.ops.gem_jagged, fwd).default
    calls = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func is op:
            calls["recompute" if ctx.is_recompute else "forward"] += 1
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    out = checkpoint(call, q, k, v, offsets, use_reentrant=False, context_fn=context_fn)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(call(q, k, v, offsets).square().sum(), (q, k, v))
    assert calls == {"forward": 1, "recompute": 0}
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name, call, fwd, bwd, function", OPS, ids=[o[0] for o in OPS])
def test_flop_counter_counts_the_op(name, call, fwd, bwd, function):
    q, k, v = _inputs()
    offsets = _offsets()
    call(
        q, k, v, offsets
    )  # imports the op, registering its formulas before the counter copies them
    with FlopCounterMode(display=False) as counter:
        out = call(q, k, v, offsets)
        out.sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    forward = counts[f"gem_jagged.{fwd}"]
    if name == "block":
        pairs = 15 + (36 + 36 + 6) + 6  # causal blocks of 8: [5], [8, 8, 3], [3]
    else:
        pairs = sum(n * (n + 1) // 2 for n in LENGTHS)
    assert forward == 4 * 2 * 32 * pairs
    assert counts[f"gem_jagged.{bwd}"] == 2.5 * forward

"""torchrec ``JaggedTensor`` and jagged nested tensors in place of values + offsets: the three
ops give the plain call's output and gradients (reference backend, and the Triton kernels
through the interpreter in fp32 and fp16), return the inputs' kind with q's offsets, and name
the argument of every misuse. gem_jagged itself never imports torchrec."""

import subprocess
import sys

import pytest
import torch
from gem_jagged import JaggedBatch, block_attention, gdpa, jagged_flash_attention
from gem_jagged.testing import jagged_lengths, offsets_from_lengths
from hypothesis import given
from hypothesis import strategies as st

KINDS = ["nested", "torchrec"]
USES = ["jfa", "jfa_cross", "gdpa", "gdpa_cross", "gdpa_pma", "block"]
SEEDS = 3


def _jagged_class(kind):
    if kind == "torchrec":
        return pytest.importorskip(
            "torchrec.sparse.jagged_tensor", reason="torchrec is not installed"
        ).JaggedTensor
    return None


def _wrap(kind, values, offsets):
    if kind == "nested":
        return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    return _jagged_class(kind)(values=values, offsets=offsets)


def _call(use, q, k, v, q_off, kv_off, *, backend):
    """The op of ``use`` on q, k, v with the offsets arguments given (None for jagged)."""
    if use.startswith("jfa"):
        return jagged_flash_attention(q, k, v, q_off, kv_off, causal=True, backend=backend)
    if use.startswith("gdpa"):
        pma = use == "gdpa_pma"
        return gdpa(q, k, v, q_off, kv_off, causal=not pma, broadcast_q=pma, backend=backend)
    return block_attention(q, k, v, q_off, block_size=16, rope_theta=100.0, backend=backend)


def _case(lengths, use, *, dtype, seed, heads=2, head_dim=32):
    gen = torch.Generator().manual_seed(seed)
    # cross-attention's keys: other lengths than the queries' in every sequence
    kv_lengths = [n + 1 + n * 7 % 5 for n in lengths] if use.endswith("cross") else lengths
    tq = SEEDS if use == "gdpa_pma" else sum(lengths)

    def rand(rows):
        return torch.randn(rows, heads, head_dim, generator=gen).to(dtype)

    q, k, v = rand(tq), rand(sum(kv_lengths)), rand(sum(kv_lengths))
    q_off = offsets_from_lengths(lengths)
    kv_off = offsets_from_lengths(kv_lengths) if use.endswith("cross") else q_off
    return q, k, v, q_off, kv_off


def _plain_and_jagged(use, kind, case, *, backend):
    """(output, dq, dk, dv) of the plain call and of the call on ``kind`` inputs."""
    q, k, v, q_off, kv_off = case
    results = []
    for jagged in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        lq, lk, lv = leaves
        if jagged:
            if use != "gdpa_pma":
                lq = _wrap(kind, lq, q_off)
            lk, lv = _wrap(kind, lk, kv_off), _wrap(kind, lv, kv_off)
            out = _call(use, lq, lk, lv, None, None, backend=backend).values()
        else:
            pma = use == "gdpa_pma"
            cross = use.endswith("cross") or pma
            out = _call(
                use, lq, lk, lv, None if pma else q_off, kv_off if cross else None, backend=backend
            )
        grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True, materialize_grads=True)
        results.append([out.detach(), *grads])
    return results


@pytest.mark.parametrize("kind", KINDS)
@given(
    lengths=jagged_lengths(max_batch=4, max_len=40, block=16),
    use=st.sampled_from(USES),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_the_plain_call(kind, lengths, use, seed):
    case = _case(lengths, use, dtype=torch.float64, seed=seed)
    plain, jagged = _plain_and_jagged(use, kind, case, backend="reference")
    for name, a, b in zip(("out", "dq", "dk", "dv"), jagged, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", KINDS)
@given(
    lengths=jagged_lengths(max_batch=3, max_len=40, block=16),
    use=st.sampled_from(USES),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_matches_the_plain_call(kind, lengths, use, dtype, seed):
    case = _case(lengths, use, dtype=dtype, seed=seed)
    plain, jagged = _plain_and_jagged(use, kind, case, backend="triton")
    for name, a, b in zip(("out", "dq", "dk", "dv"), jagged, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_nested_outputs_share_the_ragged_dimension_and_gradients_stay_nested():
    """A residual ``x + attention(x, x, x)`` adds (one ragged dimension), and a nested leaf
    gets a nested gradient equal to the plain call's."""
    parts = [torch.randn(n, 2, 32, dtype=torch.float64) for n in (5, 0, 9)]
    x = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
    y = x + jagged_flash_attention(x, x, x, causal=True)
    assert y.is_nested and y.shape[0] == 3
    y.values().square().sum().backward()
    values = torch.cat(parts).requires_grad_()
    offsets = offsets_from_lengths([5, 0, 9])
    plain = values + jagged_flash_attention(values, values, values, offsets, causal=True)
    plain.square().sum().backward()
    assert x.grad.is_nested
    torch.testing.assert_close(x.grad.values(), values.grad)


def test_torchrec_outputs_carry_the_queries_offsets():
    jagged_tensor = _jagged_class("torchrec")
    offsets = offsets_from_lengths([3, 0, 4])
    q, k, v = (jagged_tensor(values=torch.randn(7, 1, 32), offsets=offsets) for _ in range(3))
    for out in (jagged_flash_attention(q, k, v), gdpa(q, k, v), block_attention(q, k, v)):
        assert type(out) is jagged_tensor and out.offsets() is q.offsets()
    cands = jagged_tensor(values=torch.randn(6, 1, 32), lengths=torch.tensor([2, 2, 2]))
    cross = gdpa(cands, k, v)  # candidates over histories: k's offsets are not the queries'
    assert cross.offsets() is cands.offsets()
    pooled = gdpa(torch.randn(SEEDS, 1, 32), k, v, broadcast_q=True)
    assert type(pooled) is jagged_tensor
    assert pooled.offsets().tolist() == [0, SEEDS, 2 * SEEDS, 3 * SEEDS]


def test_key_offsets_equal_to_the_queries_make_self_attention():
    """Separate JaggedTensors with equal offsets: self-attention, as one offsets tensor."""
    jagged_tensor = _jagged_class("torchrec")
    q, k, v = (torch.randn(12, 2, 32, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([5, 7])
    out = jagged_flash_attention(
        *(jagged_tensor(values=t, lengths=lengths) for t in (q, k, v)), causal=True
    )
    expected = jagged_flash_attention(q, k, v, offsets_from_lengths([5, 7]), causal=True)
    torch.testing.assert_close(out.values(), expected, rtol=0, atol=0)


def _bad_inputs():
    offsets = offsets_from_lengths([3, 4])
    plain = torch.randn(7, 1, 32)
    nested = torch.nested.nested_tensor_from_jagged(plain, offsets=offsets)
    other = torch.nested.nested_tensor_from_jagged(plain, offsets=offsets_from_lengths([4, 3]))
    holes = torch.nested.nested_tensor_from_jagged(
        plain, offsets=offsets, lengths=torch.tensor([2, 4])
    )
    batch = JaggedBatch(offsets)
    jfa, ba = jagged_flash_attention, block_attention
    return [
        (lambda: jfa(nested, plain, plain), "k is a plain tensor but q is a jagged nested"),
        (lambda: jfa(plain, nested, nested, offsets), "k is a jagged nested tensor but q is a"),
        (lambda: jfa(nested, nested, nested, offsets), "q_offsets: q is a jagged nested tensor"),
        (lambda: jfa(nested, nested, nested, batch), "q_offsets: q is a jagged nested tensor"),
        (lambda: jfa(nested, other, nested), "v's offsets differ from k's"),
        (lambda: jfa(nested, nested, nested, kv_offsets=offsets), "kv_offsets: q is a jagged"),
        (lambda: jfa(plain, plain, plain), "q_offsets is required for plain q, k, v"),
        (lambda: jfa(holes, holes, holes), "q is a nested tensor with holes"),
        (lambda: jfa(nested.transpose(1, 2), nested, nested), "ragged dimension 1"),
        (lambda: gdpa(nested, nested, nested, broadcast_q=True), "q holds the \\[S, N, H\\] seeds"),
        (lambda: gdpa(plain, nested, nested, offsets, broadcast_q=True), "q_offsets: k is a"),
        (lambda: ba(nested, other, other), "k's offsets differ from q's; the op is self-"),
        (lambda: ba(plain, plain, plain), "offsets is required for plain q, k, v"),
        (lambda: ba(nested, nested, nested, offsets), "offsets: q is a jagged nested tensor"),
    ]


@pytest.mark.parametrize(("call", "match"), _bad_inputs())
def test_misuse_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_torchrec_misuse_is_named():
    jagged_tensor = _jagged_class("torchrec")
    offsets = offsets_from_lengths([3, 4])
    q = jagged_tensor(values=torch.randn(7, 1, 32), offsets=offsets)
    weighted = jagged_tensor(values=torch.randn(7, 1, 32), offsets=offsets, weights=torch.ones(7))
    nested = torch.nested.nested_tensor_from_jagged(torch.randn(7, 1, 32), offsets=offsets)
    with pytest.raises(ValueError, match="k is a jagged nested tensor but q is a torchrec"):
        gdpa(q, nested, nested)
    with pytest.raises(ValueError, match="q is a weighted JaggedTensor"):
        gdpa(weighted, q, q)


def test_gem_jagged_never_imports_torchrec():
    code = (
        "import sys, torch\n"
        "from gem_jagged import gdpa\n"
        "x = torch.nested.nested_tensor([torch.randn(3, 1, 32)], layout=torch.jagged)\n"
        "gdpa(x, x, x)\n"
        "assert 'torchrec' not in sys.modules, 'gem_jagged imported torchrec'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]

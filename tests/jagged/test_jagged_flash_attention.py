"""jagged_flash_attention: Triton kernels (interpreter on the CPU) and reference against fp64.

The tolerance rule of the project: the kernel's error against fp64 is at most 2x (forward) or
5x (gradients) the error of the reference computed in the kernel's dtype.
"""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gem_jagged import JaggedBatch, jagged_flash_attention
from gem_jagged._worklist import tile_slot_bound
from gem_jagged.ops.jagged_flash_attention import _op, hopper
from gem_jagged.ops.jagged_flash_attention import triton as jfa_triton
from gem_jagged.ops.jagged_flash_attention.config import (
    DqPlacement,
    KernelImpl,
    Regime,
    config_for,
    regime_for,
)
from gem_jagged.ops.jagged_flash_attention.hopper import launch as hopper_launch
from gem_jagged.ops.jagged_flash_attention.reference import jagged_flash_attention_reference
from gem_jagged.testing import assert_within_reference_error, jagged_lengths, offsets_from_lengths
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]


def _case(lq, lk, *, heads, head_dim, radius, seed, dtype, device="cpu", offsets_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lq), sum(lk)
    tensors = {
        "q": torch.randn(tq, heads, head_dim, generator=gen, dtype=torch.float64),
        "k": torch.randn(tk, heads, head_dim, generator=gen, dtype=torch.float64),
        "v": torch.randn(tk, heads, head_dim, generator=gen, dtype=torch.float64),
        "do": torch.randn(tq, heads, head_dim, generator=gen, dtype=torch.float64),
    }
    if radius is not None:
        tensors["rel_bias"] = torch.randn(heads, 2 * radius + 1, generator=gen, dtype=torch.float64)
    tensors = {n: t.to(device=device, dtype=dtype) for n, t in tensors.items()}
    q_off = offsets_from_lengths(lq, dtype=offsets_dtype, device=device)
    kv_off = offsets_from_lengths(lk, dtype=offsets_dtype, device=device)
    return tensors, q_off, kv_off


def _run(tensors, q_off, kv_off, *, causal, backend, dtype, **kwargs):
    """Output and gradients (q, k, v[, rel_bias]) of the public op in ``dtype``."""
    leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in tensors.items() if n != "do"}
    out = jagged_flash_attention(
        leaves["q"], leaves["k"], leaves["v"], q_off, kv_off,
        causal=causal, rel_bias=leaves.get("rel_bias"), backend=backend, **kwargs,
    )  # fmt: skip
    grads = torch.autograd.grad(out, list(leaves.values()), tensors["do"].to(dtype))
    return [out, *grads], list(leaves)


def _fp64_truth(tensors, q_off, kv_off, *, causal, scale=None):
    """Autograd straight through the reference function in fp64 (not through the custom op);
    ``scale`` None is the default 1/√D."""
    leaves = {n: t.detach().double().requires_grad_() for n, t in tensors.items() if n != "do"}
    out, _ = jagged_flash_attention_reference(
        leaves["q"], leaves["k"], leaves["v"], q_off, kv_off, causal=causal,
        scale=1.0 / math.sqrt(tensors["q"].shape[-1]) if scale is None else scale,
        rel_bias=leaves.get("rel_bias"),
    )  # fmt: skip
    if out.numel() == 0 or not out.requires_grad:
        return [out, *(torch.zeros_like(t) for t in leaves.values())]
    grads = torch.autograd.grad(
        out, list(leaves.values()), tensors["do"].double(), allow_unused=True
    )
    zeros = (torch.zeros_like(t) for t in leaves.values())
    return [out, *(z if g is None else g for g, z in zip(grads, zeros, strict=True))]


def _assert_results_within_reference_error(got, ref, truth, names):
    """The tolerance rule on the output (2×) and every gradient (5×) of ``_run``'s results."""
    for i, name in enumerate(["out", *(f"d{n}" for n in names)]):
        assert_within_reference_error(
            got[i], ref[i], truth[i], factor=2.0 if i == 0 else 5.0, name=name
        )


def _sm90_config(*, head_dim, dtype, lk, rel_bias, gluon=False, stages=None, **changes):
    """The sm_90 config of a batch whose key lengths are ``lk``; ``gluon``: every kernel asks
    for its Gluon twin (else the Triton kernels); ``stages``: every kernel's stages."""
    config = config_for(
        arch="sm90", dtype=dtype, head_dim=head_dim,
        regime=regime_for(total_kv=sum(lk), num_seqs=len(lk)), rel_bias=rel_bias,
    )  # fmt: skip
    impl = KernelImpl.GLUON_HOPPER if gluon else KernelImpl.TRITON
    if stages is not None:
        for kernel in ("forward", "dkdv", "dq"):
            changes[kernel] = dataclasses.replace(getattr(config, kernel), stages=stages)
    return dataclasses.replace(
        config, forward_impl=impl, dkdv_impl=impl, dq_impl=impl, **changes
    )  # fmt: skip


def _check_against_fp64(
    lq, lk, *, causal, radius, seed, dtype, head_dim=32, heads=2, config=None, batch=None
):  # fmt: skip
    """The Triton kernels (with ``config``, over ``batch`` in place of the offsets, where
    given) against fp64 by the tolerance rule."""
    tensors, q_off, kv_off = _case(
        lq, lk, heads=heads, head_dim=head_dim, radius=radius, seed=seed, dtype=torch.float64
    )
    truth = _fp64_truth(tensors, q_off, kv_off, causal=causal)
    ref_lowp, names = _run(tensors, q_off, kv_off, causal=causal, backend="reference", dtype=dtype)
    kernel_offsets = (q_off, kv_off) if batch is None else (batch, None)
    kernel, _ = _run(
        tensors, *kernel_offsets, causal=causal, backend="triton", dtype=dtype, config=config
    )
    # A bias bucket sums dS over up to Lq·Lk pairs, terms that cancel (with R = 0 each row's
    # sum is exactly 0), so its rounding error scales with the terms, not with the small result
    # the default floor is measured against: the floor grows with √(pairs) there.
    bias_floor = 4.0 * math.sqrt(max([1] + [a * b for a, b in zip(lq, lk, strict=True)]))
    # The gradients through dS = P ⊙ (dP − δ) can be cancellations too: with one visible key
    # dS is exactly 0, while dP and δ are as large as |dO · V|, so dQ, dK and the bias
    # gradient hold rounding of that size. Their floor is measured against it.
    dp = torch.einsum("tnh,snh->nts", tensors["do"], tensors["v"]).abs()
    dp_scale = max(1.0, dp.max().item() if dp.numel() else 0.0)
    floors = {"dq": 4.0 * dp_scale, "dk": 4.0 * dp_scale, "drel_bias": bias_floor * dp_scale}
    for i, name in enumerate(["out", *(f"d{n}" for n in names)]):
        assert kernel[i].dtype == dtype, name
        assert_within_reference_error(
            kernel[i], ref_lowp[i], truth[i], factor=2.0 if i == 0 else 5.0, name=name,
            floor_ulps=floors.get(name, 4.0),
        )  # fmt: skip


@given(
    lq=jagged_lengths(max_batch=3, max_len=34, block=16),
    kv_delta=st.lists(st.integers(-20, 20), min_size=3, max_size=3),
    cross=st.booleans(),
    causal=st.booleans(),
    radius=st.sampled_from([None, 0, 3, 40]),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float16, torch.float32]),
)
def test_triton_matches_fp64_within_reference_error(
    lq, kv_delta, cross, causal, radius, seed, dtype
):
    lk = [max(0, n + d) for n, d in zip(lq, kv_delta, strict=False)] if cross else lq
    _check_against_fp64(lq, lk, causal=causal, radius=radius, seed=seed, dtype=dtype)


@pytest.mark.parametrize(
    ("head_dim", "lq", "lk", "causal", "radius"),
    [
        (64, [17, 40], [17, 40], True, 2),
        (128, [33, 1, 0], [20, 5, 7], False, None),
        (128, [30, 9], [12, 9], True, None),
    ],
)
def test_head_dims_64_and_128(head_dim, lq, lk, causal, radius):
    _check_against_fp64(
        lq, lk, causal=causal, radius=radius, seed=7, dtype=torch.float16, head_dim=head_dim
    )


@pytest.mark.parametrize(
    ("lq", "lk", "causal", "radius"),
    [
        ([130, 97, 16], [130, 97, 16], True, 2),  # most tiles left of the band
        ([130, 40], [130, 40], True, 17),  # the band spans tile edges
        ([70, 50], [90, 50], True, 5),  # cross, bottom-right causal
        ([81, 33], [64, 100], False, 3),  # non-causal: tiles right of the band gather
    ],
)
def test_relative_bias_off_the_band(lq, lk, causal, radius):
    """Tiles wholly left of the bias band (every pair in bucket 0) take the scalar path in the
    forward, dK/dV and dQ kernels; the rest gather. Long sequences with a small radius make
    most tiles far ones."""
    _check_against_fp64(lq, lk, causal=causal, radius=radius, seed=11, dtype=torch.float32)


@pytest.mark.parametrize(
    "table", ["plain", "plain, head dim 128", "short keys, head dim 128", "bias, head dim 128"]
)
@pytest.mark.parametrize(
    ("lq", "lk", "causal"),
    [([300, 129, 1, 0, 450], None, True), ([200, 9, 0, 330], [130, 200, 3, 70], False)],
)
def test_gpu_tile_shapes_under_the_interpreter(lq, lk, causal, table):
    """The bf16 GPU tiles on the CPU, with R = 40: bias tiles of step 64, far, band and
    right-of-band tiles and two skewed reads on the diagonal tile, as the GPU runs them. Head dims
    32/64: 128 × 64 queries × keys, 64 × 128 for dK/dV. Head dim 128: 64 × 64 for the forward
    (K/V through TMA) and dQ (one work list), 64 × 128 or, for short keys, 32 × 64 for dK/dV;
    with a bias, 128 × 64 for the forward and 64 × 64 for dQ (a work list each)."""
    head_dim, regime, bias = {
        "plain": (32, Regime.LONG, False),
        "plain, head dim 128": (128, Regime.LONG, False),
        "short keys, head dim 128": (128, Regime.SHORT_KEYS, False),
        "bias, head dim 128": (128, Regime.LONG, True),
    }[table]
    gpu_config = config_for(
        arch="sm90", dtype=torch.bfloat16, head_dim=head_dim, regime=regime, rel_bias=bias
    )
    _check_against_fp64(
        lq, lk or lq, causal=causal, radius=40, seed=5, dtype=torch.float32, config=gpu_config
    )


def test_the_fake_implementation_sizes_the_work_list_as_the_launchers_do():
    """The compiled op's fake shape and the forward's work list agree, with the config passed
    (the bias path's 128-row forward tiles and the plain path's 64-row ones at head dim 128)
    and with the config the op picks itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for radius in (3, None):
        tensors, q_off, kv_off = _case(
            [5, 11], [5, 11], heads=2, head_dim=32, radius=radius, seed=4, dtype=torch.float32
        )
        config = _sm90_config(head_dim=128, dtype=torch.bfloat16, lk=[5, 11], rel_bias=True)
        for ints in (config.as_ints(), None):
            args = (
                tensors["q"], tensors["k"], tensors["v"], q_off, kv_off,
                tensors.get("rel_bias"), True, 0.1, None, "triton", ints,
            )  # fmt: skip
            _, _, work = torch.ops.gem_jagged.jagged_flash_attention_fwd(*args)
            with FakeTensorMode() as mode:  # the fake implementation a compiler traces
                fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
                _, _, fake_work = torch.ops.gem_jagged.jagged_flash_attention_fwd(*fake)
            assert tuple(fake_work.shape) == tuple(work.shape), (radius, ints)
            rows = config.forward.block_m if ints is not None else 16
            assert work.shape[1] == tile_slot_bound(16, 2, rows)


def test_long_sequence_split_backward_and_int32_offsets_and_short_hint():
    """One long sequence (its key tiles are split across programs) with int32 offsets; a
    max_q_len hint shorter than the real length changes the launch, never the result."""
    lq = [90, 3]
    tensors, q_off, kv_off = _case(
        lq, lq, heads=1, head_dim=32, radius=None, seed=3, dtype=torch.float64,
        offsets_dtype=torch.int32,
    )  # fmt: skip
    truth = _fp64_truth(tensors, q_off, kv_off, causal=True)
    ref, _ = _run(tensors, q_off, kv_off, causal=True, backend="reference", dtype=torch.float32)
    for hint in (None, 1):
        got, _ = _run(
            tensors, q_off, kv_off, causal=True, backend="triton", dtype=torch.float32,
            max_q_len=hint, max_kv_len=hint,
        )  # fmt: skip
        for i in range(4):
            assert_within_reference_error(got[i], ref[i], truth[i], factor=5.0, name=f"{i}")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_rows_without_visible_keys_output_zeros(backend):
    # Sequence 0: causal with 6 queries over 2 keys (the first 4 rows see nothing);
    # sequence 1: no keys at all; sequence 2: empty.
    tensors, q_off, kv_off = _case(
        [6, 3, 0], [2, 0, 4], heads=2, head_dim=32, radius=1, seed=0, dtype=torch.float32
    )
    got, _ = _run(tensors, q_off, kv_off, causal=True, backend=backend, dtype=torch.float32)
    out, dq = got[0], got[1]
    assert torch.all(out[:4] == 0) and torch.all(out[6:9] == 0)
    assert torch.all(out[4:6] != 0)
    assert torch.all(dq[:4] == 0) and torch.all(
        torch.isfinite(torch.cat([g.flatten() for g in got]))
    )


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_empty_batch(backend):
    tensors, q_off, kv_off = _case(
        [], [], heads=2, head_dim=32, radius=None, seed=0, dtype=torch.float32
    )
    got, _ = _run(tensors, q_off, kv_off, causal=False, backend=backend, dtype=torch.float32)
    assert got[0].shape == (0, 2, 32) and all(g.numel() == 0 for g in got)


def test_reference_backward_matches_autograd_and_gradcheck():
    """The reference backend's hand-written backward against autograd (fp64 gradcheck)."""
    tensors, q_off, kv_off = _case(
        [3, 0, 4], [4, 2, 4], heads=1, head_dim=32, radius=2, seed=1, dtype=torch.float64
    )
    leaves = [tensors[n].clone().requires_grad_() for n in ("q", "k", "v", "rel_bias")]

    def fn(q, k, v, bias):
        return jagged_flash_attention(
            q, k, v, q_off, kv_off, causal=True, rel_bias=bias, backend="reference"
        )

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8, fast_mode=True)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_opcheck(backend):
    tensors, q_off, kv_off = _case(
        [5, 0, 9], [5, 0, 9], heads=2, head_dim=32, radius=1, seed=2, dtype=torch.float32
    )
    q, k, v, bias = (tensors[n].requires_grad_() for n in ("q", "k", "v", "rel_bias"))
    args = (q, k, v, q_off, kv_off, bias, True, 0.2, None, backend)
    # The interpreter is slow: the Triton backend skips the (re-tracing) aot-dispatch checks,
    # which test the op's registration, already covered by the reference backend's full check.
    cheap = {"test_utils": ("test_schema", "test_autograd_registration", "test_faketensor")}
    torch.library.opcheck(_op.attention_forward, args, **(cheap if backend == "triton" else {}))


def test_compile_fullgraph_matches_eager():
    tensors, q_off, kv_off = _case(
        [5, 11], [5, 11], heads=2, head_dim=32, radius=2, seed=4, dtype=torch.float32
    )

    def fn(q, k, v, bias):
        return jagged_flash_attention(
            q, k, v, q_off, causal=True, rel_bias=bias, backend="reference"
        )

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    leaves = [tensors[n].clone().requires_grad_() for n in ("q", "k", "v", "rel_bias")]
    out = compiled(*leaves)
    grads = torch.autograd.grad(out, leaves, tensors["do"])
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ref_out = fn(*ref_leaves)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, tensors["do"])
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_eager_fast_path_matches_the_custom_op_and_dispatch_modes_see_the_op():
    """Eager Triton calls skip the custom op; the kernels, hence the bits, are the same. Under a
    TorchDispatchMode (selective checkpointing identifies the op by name) the op is used."""
    from torch.utils._python_dispatch import TorchDispatchMode

    tensors, q_off, kv_off = _case(
        [20, 0, 9], [20, 0, 9], heads=1, head_dim=32, radius=2, seed=6, dtype=torch.float32
    )
    leaves = [tensors[n].clone().requires_grad_() for n in ("q", "k", "v", "rel_bias")]
    q, k, v, bias = leaves
    fast = jagged_flash_attention(q, k, v, q_off, causal=True, rel_bias=bias, backend="triton")
    fast_grads = torch.autograd.grad(fast, leaves, tensors["do"])
    op_out = _op.attention_forward(q, k, v, q_off, q_off, bias, True, 32**-0.5, None, "triton")[0]
    op_grads = torch.autograd.grad(op_out, leaves, tensors["do"])
    for got, want in zip((fast, *fast_grads), (op_out, *op_grads), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Names() as mode:
        jagged_flash_attention(q, k, v, q_off, causal=True, rel_bias=bias, backend="triton")
    assert "gem_jagged.jagged_flash_attention_fwd.default" in mode.names


def test_dkdv_split_only_where_the_longest_tile_is_the_tail():
    """The split rule on the benchmark's shapes (132 SMs), each with the tile table its keys per
    sequence pick: J1 and J2 stay whole, J3 (64 keys per sequence, one key tile each, a
    3635-row longest query range) is cut into 3 chunks."""
    shapes = {  # (Tq, Tk, B, longest, causal)
        "J1": (52498, 52498, 64, 3635, True),
        "J2": (43129, 43129, 16, 5064, True),
        "J3": (52498, 4096, 64, 3635, False),
        "short": (4000, 4000, 8, 1000, True),
    }
    splits = {
        name: jfa_triton.dkdv_splits(
            config_for(
                arch="sm90",
                dtype=torch.bfloat16,
                head_dim=128,
                regime=regime_for(total_kv=tk, num_seqs=b),
                rel_bias=False,
            ),
            total_q=tq,
            total_kv=tk,
            num_seqs=b,
            num_heads=4,
            longest_q=longest,
            causal=causal,
            sm_count=132,
        )  # fmt: skip
        for name, (tq, tk, b, longest, causal) in shapes.items()
    }
    assert splits == {"J1": 1, "J2": 1, "J3": 3, "short": 1}


@pytest.mark.parametrize(
    ("validate", "hint", "expected"),
    [(True, None, 37), (True, 20, 37), (False, 20, 20), (False, None, 59)],
)
def test_dkdv_split_sees_the_longest_sequence_without_a_hint(validate, hint, expected):
    """The backward sizes its split from the longest sequence the batch's host check saw (on
    J1 without it, it had assumed one sequence of all 52k tokens and split every long key
    tile); an unchecked batch takes the hint, else the token count."""
    t, q_off, _ = _case(
        [37, 0, 22], [37, 0, 22], heads=1, head_dim=32, radius=None, seed=3, dtype=torch.float32
    )
    batch = JaggedBatch(q_off, max_len=hint, validate=validate)
    assert jfa_triton.longest_query_rows(batch, total_q=59) == expected
    leaves = [t[name].requires_grad_() for name in ("q", "k", "v")]
    out = jagged_flash_attention(*leaves, batch, causal=True, backend="triton")
    grads = torch.autograd.grad(out, leaves, t["do"])
    expected_results, _ = _run(t, q_off, q_off, causal=True, backend="triton", dtype=torch.float32)
    for got, want in zip([out, *grads], expected_results, strict=True):
        torch.testing.assert_close(got, want)


class _LaunchCounter:
    """Stands in for a Triton kernel and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("lk", "checked", "dq_launches"),
    [
        ([16, 3, 9, 5], True, 0),  # every sequence fits one key tile, as the host check showed
        ([16, 3, 9, 5], False, 1),  # the same, unknown: the dQ kernel runs and skips them all
        ([16, 0, 40, 5], False, 1),  # no keys, or more than a tile: the dQ kernel's sequences
    ],
)
def test_short_keys_dkdv_kernel_writes_dq(monkeypatch, causal, lk, checked, dq_launches):
    """Short keys without a bias (J3): the dK/dV kernel sums δ itself and writes dQ of every
    sequence whose keys fit its one key tile (16 rows here), over query ranges split across
    programs whose last arrival casts dK/dV; causal rows above the diagonal get zero dQ. The
    dQ kernel handles the other sequences and is not launched when every sequence is known to
    fit (a checked batch)."""
    interpreter = config_for(
        arch="interpreter", dtype=torch.float32, head_dim=32, regime=Regime.LONG, rel_bias=False
    )
    assert interpreter.dq_placement == DqPlacement.IN_DKDV
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):  # a row nobody writes reads NaN, not a lucky zero
        t = real_empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    from gem_jagged.ops.jagged_flash_attention.triton import dq as jfa_dq

    counter = _LaunchCounter(jfa_dq._jfa_dq_kernel)  # a spy: counts, launches the kernel
    monkeypatch.setattr(jfa_dq, "_jfa_dq_kernel", counter)
    lq = [70, 1, 45, 33]
    batch = JaggedBatch(offsets_from_lengths(lq), offsets_from_lengths(lk), validate=checked)
    _check_against_fp64(
        lq, lk, causal=causal, radius=None, seed=13, dtype=torch.float32, batch=batch
    )
    assert counter.launches == dq_launches


def _bad_inputs():
    t, q_off, _ = _case(
        [3, 4], [3, 4], heads=2, head_dim=32, radius=None, seed=0, dtype=torch.float32
    )
    q, k, v = t["q"], t["k"], t["v"]
    ok = dict(q=q, k=k, v=v, q_offsets=q_off)
    cases = [
        (dict(q_offsets=q_off[None]), ValueError, "q_offsets must be 1-D"),
        (dict(q_offsets=torch.tensor([1, 3, 7])), ValueError, r"q_offsets\[0\] must be 0"),
        (dict(q_offsets=torch.tensor([0, 5, 4, 7])), ValueError, "non-decreasing"),
        (
            dict(q_offsets=torch.tensor([0, 3, 6])),
            ValueError,
            r"must equal the number of tokens of q \(7\)",
        ),
        (dict(q_offsets=q_off.float()), TypeError, "int32 or int64"),
        (dict(k=k.half()), TypeError, "k has dtype torch.float16"),
        (dict(v=v[:, :1]), ValueError, "k and v must have the same shape"),
        (dict(k=k[:, :1], v=v[:, :1]), ValueError, "k has 1 heads but q has 2"),
        (dict(q=q[..., :16], k=k[..., :16], v=v[..., :16]), ValueError, "head dim 16; supported"),
        (dict(q=q[0]), ValueError, "q must have 3 dimensions"),
        (dict(k=k[:5], v=v[:5]), ValueError, "kv_offsets=None means self-attention"),
        (dict(kv_offsets=torch.tensor([0, 7])), ValueError, "kv_offsets has 1 sequences"),
        (dict(kv_offsets=torch.tensor([0, 3, 8])), ValueError, r"kv_offsets\[-1\] = 8"),
        (dict(rel_bias=torch.zeros(2, 4)), ValueError, "rel_bias must have shape"),
        (dict(rel_bias=torch.zeros(3, 5)), ValueError, "rel_bias must have shape"),
        (dict(max_q_len=-1), ValueError, "max_q_len must be None or a non-negative int"),
        (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
        (
            dict(q=q.double(), k=k.double(), v=v.double(), backend="triton"),
            TypeError,
            "triton backend supports",
        ),
    ]
    return [({**ok, **change}, err, match) for change, err, match in cases]


@pytest.mark.parametrize(("kwargs", "error", "match"), _bad_inputs())
def test_bad_input_is_named(kwargs, error, match):
    kwargs = dict(kwargs)
    args = [kwargs.pop(n) for n in ("q", "k", "v", "q_offsets")]
    with pytest.raises(error, match=match):
        jagged_flash_attention(*args, **kwargs)


def test_benchmark_smoke_runs():
    script = REPO / "benchmarks" / "jagged" / "bench_jagged_flash_attention.py"
    result = subprocess.run(
        [sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "jagged flash attention" in result.stdout


# ----------------------------------------------------------------------------------------------
# GPU: bf16/fp16 kernels, compile and CUDA-graph capture of the Triton backend
# ----------------------------------------------------------------------------------------------

GPU_CASES = [
    # (q lengths, kv lengths or None for self, causal, radius, head dim)
    ([1, 127, 128, 129, 700, 0, 3000], None, True, None, 128),
    ([1, 127, 128, 129, 700, 0, 3000], None, False, 16, 64),
    ([300, 5, 0, 1000], [64, 64, 64, 64], False, None, 128),
    ([300, 5, 17, 1000], [200, 9, 0, 1500], True, 8, 32),
    # gem-small's bias on long histories: tiles left of the band, crossing it, and a diagonal
    # tile with more interior bias diagonals (79) than one skewed read of dS takes (64)
    ([1, 127, 128, 129, 700, 0, 3000], None, True, 40, 128),
    # not causal, Lq != Lk: tiles wholly right of the band (bucket 2R) too
    ([300, 5, 17, 1000], [200, 9, 0, 1500], False, 40, 64),
    # short keys (the J3 table, whose dK/dV kernel writes dQ): query ranges split three ways,
    # causal rows above the diagonal, and sequences with no keys or more than a key tile's (the
    # dQ kernel's)
    ([3000, 5, 0, 2500, 64], [64, 64, 64, 30, 1], False, None, 128),
    ([3000, 5, 0, 2500, 64], [64, 64, 64, 30, 1], True, None, 128),
    ([3000, 5, 0, 2500], [64, 0, 64, 100], False, None, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("lq", "lk", "causal", "radius", "head_dim"), GPU_CASES)
def test_gpu_matches_fp64_within_reference_error(dtype, lq, lk, causal, radius, head_dim):
    lk = lq if lk is None else lk
    tensors, q_off, kv_off = _case(
        lq, lk, heads=2, head_dim=head_dim, radius=radius, seed=11, dtype=torch.float64,
        device="cuda",
    )  # fmt: skip
    truth = _fp64_truth(tensors, q_off, kv_off, causal=causal)
    ref, names = _run(tensors, q_off, kv_off, causal=causal, backend="reference", dtype=dtype)
    got, _ = _run(
        tensors, q_off, kv_off, causal=causal, backend="triton", dtype=dtype, max_q_len=max(lq)
    )
    _assert_results_within_reference_error(got, ref, truth, names)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64])
def test_gpu_float32_fits_the_shared_memory_and_matches_fp64(head_dim):
    """float32 on the GPU takes smaller tiles (bf16's ran out of shared memory) and IEEE dots."""
    lq, lk = [700, 1, 0, 130], [650, 9, 4, 130]
    tensors, q_off, kv_off = _case(
        lq, lk, heads=2, head_dim=head_dim, radius=5, seed=13, dtype=torch.float64, device="cuda"
    )
    truth = _fp64_truth(tensors, q_off, kv_off, causal=True)
    ref, names = _run(tensors, q_off, kv_off, causal=True, backend="reference", dtype=torch.float32)
    got, _ = _run(tensors, q_off, kv_off, causal=True, backend="triton", dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in got)
    _assert_results_within_reference_error(got, ref, truth, names)


@pytest.mark.gpu
@pytest.mark.parametrize("pad", [0, 1])
def test_gpu_a_non_finite_sequence_never_reaches_its_neighbours(pad):
    """As on the CPU, with the GPU's tiles: TMA descriptors (``pad`` 0) or pointers (1)."""
    _assert_other_sequences_untouched(
        [37, 300, 20], head_dim=128, dtype=torch.bfloat16, device="cuda", pad=pad
    )


@pytest.mark.gpu
def test_gpu_compile_and_cuda_graph_capture():
    tensors, q_off, kv_off = _case(
        [100, 0, 2500, 7], [100, 0, 2500, 7], heads=2, head_dim=128, radius=4, seed=5,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    q, k, v, bias = (tensors[n].requires_grad_() for n in ("q", "k", "v", "rel_bias"))

    def fn(q, k, v, bias):
        return jagged_flash_attention(q, k, v, q_off, causal=True, rel_bias=bias, max_q_len=2500)

    eager = fn(q, k, v, bias)
    eager_grads = torch.autograd.grad(eager, [q, k, v, bias], tensors["do"])
    compiled = torch.compile(fn, fullgraph=True)
    out = compiled(q, k, v, bias)
    grads = torch.autograd.grad(out, [q, k, v, bias], tensors["do"])
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)

    static = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (compiles the kernels) outside the capture
            torch.autograd.grad(fn(*static), static, tensors["do"])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = fn(*static)
        graph_grads = torch.autograd.grad(graph_out, static, tensors["do"])
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graph_out, eager, atol=0, rtol=0)
    for g, e in zip(graph_grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_the_tma_forward():
    """Without a bias at head dim 128 the forward reads K/V through TMA descriptors (on Hopper
    the Gluon kernels run the whole step), encoded on the host at launch: a captured step
    replays them (new values copied into the same q, k, v) and matches a fresh eager step."""
    lengths = [100, 0, 2500, 7]
    tensors, q_off, _ = _case(
        lengths, lengths, heads=2, head_dim=128, radius=None, seed=8, dtype=torch.bfloat16,
        device="cuda",
    )  # fmt: skip
    static = [tensors[n].clone().requires_grad_() for n in ("q", "k", "v")]

    def step():
        out = jagged_flash_attention(*static, q_off, causal=True, max_q_len=max(lengths))
        return [out, *torch.autograd.grad(out, static, tensors["do"])]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (compiles the kernels) outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for t in static:
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    torch.testing.assert_close(captured[0], fresh[0], atol=0, rtol=0)
    torch.testing.assert_close(captured[1], fresh[1], atol=0, rtol=0)
    for got, want in zip(captured[2:], fresh[2:], strict=True):  # split key tiles: fp32 atomics
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_new_offsets_without_a_hint():
    """Captured without ``max_q_len``, where eager calls size the backward's split from the
    offsets' host check: the capture must not bake one batch's lengths in. A replay with new
    lengths copied into the captured offsets (same totals) equals a fresh eager step."""
    lengths = [100, 0, 2500, 7]
    tensors, q_off, _ = _case(
        lengths, lengths, heads=2, head_dim=128, radius=4, seed=6, dtype=torch.bfloat16,
        device="cuda",
    )  # fmt: skip
    leaves = [tensors[n].requires_grad_() for n in ("q", "k", "v", "rel_bias")]

    def step():
        out = jagged_flash_attention(*leaves[:3], q_off, causal=True, rel_bias=leaves[3])
        return (out.detach(), *torch.autograd.grad(out, leaves, tensors["do"]))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up (compiles the kernels) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    q_off.copy_(offsets_from_lengths([2400, 200, 0, 7], device="cuda"))  # one long sequence moved
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    for a, b in zip(captured, fresh, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(("rows", "cols", "keys_on_rows"), [(128, 64, False), (128, 64, True)])
@pytest.mark.parametrize("radius", [0, 2, 5, 32, 200])
def test_relative_bias_tiles_hold_each_offsets_bias(rows, cols, keys_on_rows, radius):
    """Entry t is the bias of a tile whose first key minus first query is o_lo + t·step; the
    first entry is all bucket 0, the last all bucket 2R, so clamping an offset into the table is
    exact. In the inputs' dtype, as the reference adds it."""
    from gem_jagged.ops.jagged_flash_attention.bias_tiles import relative_bias_tiles

    bias = torch.randn(3, 2 * radius + 1, dtype=torch.float64)
    tiles, o_lo, count = relative_bias_tiles(
        bias, rows=rows, cols=cols, keys_on_rows=keys_on_rows, dtype=torch.float16
    )
    step = math.gcd(rows, cols)
    assert tiles.shape == (3, count, rows, cols) and tiles.dtype == torch.float16
    a, b = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    for t in range(count):
        offset = o_lo + t * step
        key_minus_query = offset + ((a - b) if keys_on_rows else (b - a))
        expected = bias.half()[:, key_minus_query.clamp(-radius, radius) + radius]
        assert torch.equal(tiles[:, t], expected), t
    assert torch.equal(tiles[:, 0], bias.half()[:, :1, None].expand(3, rows, cols))
    assert torch.equal(tiles[:, -1], bias.half()[:, -1:, None].expand(3, rows, cols))


@pytest.mark.parametrize("radius", [None, 3])
def test_views_of_a_fused_qkv_projection_are_read_in_place(radius):
    """q, k, v as views of one ``[T, 3, N, H]`` tensor (rows 3·N·H apart): no copy is made, and
    outputs and gradients equal those of contiguous inputs."""
    from gem_jagged.ops.jagged_flash_attention.triton import _rows_of_heads

    lengths = [37, 0, 16, 90]
    tensors, q_off, _ = _case(
        lengths, lengths, heads=2, head_dim=32, radius=radius, seed=9, dtype=torch.float32
    )
    qkv = torch.stack([tensors["q"], tensors["k"], tensors["v"]], dim=1).requires_grad_()
    q, k, v = qkv.unbind(1)
    kept = zip(_rows_of_heads(q, k, v), (q, k, v), strict=True)
    assert all(a.data_ptr() == b.data_ptr() for a, b in kept)
    bias = tensors.get("rel_bias")
    bias = None if bias is None else bias.clone().requires_grad_()
    out = jagged_flash_attention(q, k, v, q_off, causal=True, rel_bias=bias, backend="triton")
    grads = torch.autograd.grad(out, [qkv] + ([bias] if bias is not None else []), tensors["do"])
    expected, names = _run(
        tensors, q_off, q_off, causal=True, backend="triton", dtype=torch.float32
    )
    torch.testing.assert_close(out, expected[0])
    torch.testing.assert_close(grads[0], torch.stack(expected[1:4], dim=1))
    if bias is not None:
        torch.testing.assert_close(grads[1], expected[4])


def _padded_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t [T, N, H]`` as a view into rows of ``N·H + pad`` elements (heads dense)."""
    rows = torch.zeros(t.shape[0], t.shape[1] * t.shape[2] + pad, dtype=t.dtype, device=t.device)
    rows[:, : t.shape[1] * t.shape[2]] = t.flatten(1)
    return rows[:, : t.shape[1] * t.shape[2]].view(t.shape)


def test_forward_streams_through_tma_only_where_the_layout_allows():
    """A TMA descriptor needs a 16-byte aligned base and row stride and at least one row; other
    layouts take the pointer loads (checked for results in the next test)."""
    from gem_jagged.ops.jagged_flash_attention.triton import _tma_ready

    t = torch.randn(10, 2, 16, dtype=torch.float16)
    assert _tma_ready(t)
    assert _tma_ready(_padded_rows(t, 8))  # rows 80 bytes apart
    assert not _tma_ready(_padded_rows(t, 1))  # rows 66 bytes apart
    assert not _tma_ready(torch.randn(10 * 32 + 1, dtype=torch.float16)[1:].view(10, 2, 16))
    assert not _tma_ready(t[:0])


def _isolation_case(lengths, *, head_dim, dtype, device, pad):
    """Sequences whose middle one holds Inf and NaN in q, k, v, and its finite twin."""
    tensors, q_off, _ = _case(
        lengths, lengths, heads=2, head_dim=head_dim, radius=None, seed=21, dtype=dtype,
        device=device,
    )  # fmt: skip
    middle = slice(lengths[0], lengths[0] + lengths[1])
    poisoned = {n: t.clone() for n, t in tensors.items()}
    for name in ("q", "k", "v"):
        poisoned[name][middle][::2] = float("inf")
        poisoned[name][middle][1::2] = float("nan")
    if pad:
        for case in (tensors, poisoned):
            case.update({n: _padded_rows(case[n], pad) for n in ("q", "k", "v")})
    return tensors, poisoned, q_off, middle


def _assert_other_sequences_untouched(lengths, *, head_dim, dtype, device, pad, config=None):
    tensors, poisoned, q_off, middle = _isolation_case(
        lengths, head_dim=head_dim, dtype=dtype, device=device, pad=pad
    )
    options = dict(causal=True, backend="triton", dtype=dtype, config=config)
    clean, _ = _run(tensors, q_off, q_off, **options)
    dirty, _ = _run(poisoned, q_off, q_off, **options)
    others = torch.ones(sum(lengths), dtype=torch.bool)
    others[middle] = False
    for name, want, got in zip(("out", "dq", "dk", "dv"), clean, dirty, strict=True):
        assert torch.equal(got[others], want[others]), name


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter, on NaN
@pytest.mark.parametrize("pad", [0, 1])
def test_a_non_finite_sequence_never_reaches_its_neighbours(pad):
    """The forward's descriptor reads a sequence's last key block past its end, into the next
    sequence's rows: those rows must count as zeros, so Inf and NaN there change nothing
    elsewhere, bit for bit, forward and backward; likewise on the pointer path (``pad`` 1: rows
    whose stride a descriptor cannot take)."""
    _assert_other_sequences_untouched(
        [5, 40, 9], head_dim=32, dtype=torch.float32, device="cpu", pad=pad
    )


# ----------------------------------------------------------------------------------------------
# GPU: the Gluon kernels (``hopper/``). Gluon has no CPU interpreter: these need an
# sm_90 GPU. Each runs the public op with a config asking for the Gluon kernels, checks (by
# a spy) that they ran, and holds the results to the tolerance rule against fp64.
# ----------------------------------------------------------------------------------------------

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the Gluon kernels target Hopper (sm_90)",
)


def _spy_on_hopper(monkeypatch) -> list:
    """Record the Gluon kernels' launches as ``(kernel, launch options)`` (a spy: the launches
    still run; the config passed picks the path)."""
    launches = []
    for kernel in ("forward", "dkdv", "dq"):
        launch = getattr(hopper_launch, f"launch_{kernel}")

        def spy(*args, _kernel=kernel, _launch=launch, **kwargs):
            launches.append((_kernel, kwargs))
            return _launch(*args, **kwargs)

        monkeypatch.setattr(hopper_launch, f"launch_{kernel}", spy)
    return launches


def _all_ran(launches) -> bool:
    return {kernel for kernel, _ in launches} == {"forward", "dkdv", "dq"}


def test_hopper_kernels_take_only_rows_16_byte_copies_can_tile():
    """The rule that sends rows to the Triton kernels (checked here on the CPU; the GPU test
    below runs the fallback): aligned rows at a stride of a multiple of 16 elements only."""
    base = torch.zeros(64, 3 * 2 * 128 + 16, dtype=torch.bfloat16)
    fused_qkv = base[:, :768].view(64, 3, 2, 128)  # q, k, v as views of one projection
    assert all(hopper.tileable_rows(fused_qkv[:, i]) for i in range(3))
    assert hopper.tileable_rows(torch.zeros(64, 2, 128, dtype=torch.bfloat16))
    padded = torch.zeros(64, 2 * 128 + 1, dtype=torch.bfloat16)[:, :256].view(64, 2, 128)
    assert not hopper.tileable_rows(padded)  # a row stride of 257 elements
    shifted = torch.zeros(64 * 256 + 8, dtype=torch.bfloat16)[1 : 1 + 64 * 256].view(64, 2, 128)
    assert not hopper.tileable_rows(shifted)  # rows 2 bytes off alignment
    assert hopper.tma_reachable(shifted) and not hopper.tma_reachable(shifted[:0])


def test_hopper_descriptor_memo_hands_back_only_what_describes_the_same_rows():
    """An eager forward makes K's and V's TMA descriptors once for its backward's dQ launch
    (``hopper_launch.row_descriptor`` with a memo); a descriptor is reused only for the same memory,
    shape, strides, dtype and block height."""
    k = torch.zeros(256, 2, 128, dtype=torch.bfloat16)
    memo = {}
    first = hopper_launch.row_descriptor(k, 64, memo)
    assert hopper_launch.row_descriptor(k, 64, memo) is first
    assert hopper_launch.row_descriptor(k.view(256, 2, 128), 64, memo) is first  # same rows
    assert first.block_shape == [64, 128] and first.shape == [256, 256]
    others = [
        hopper_launch.row_descriptor(k, 32, memo),  # another block height
        hopper_launch.row_descriptor(k[64:], 64, memo),  # other memory
        hopper_launch.row_descriptor(k[:128], 64, memo),  # same start, fewer rows
        hopper_launch.row_descriptor(torch.zeros_like(k), 64, memo),
        hopper_launch.row_descriptor(k.view(torch.float16), 64, memo),  # another dtype
        hopper_launch.row_descriptor(k, 64, None),  # no memo: always a new one
    ]
    assert all(d is not first for d in others)
    assert len({id(d) for d in others}) == len(others)


HOPPER_CASES = [
    # (q lengths, kv lengths or None for self, causal, head dim): empty and length-1 sequences,
    # block edges ± 1, a long one, cross-attention over short and over longer keys
    ([1, 63, 64, 65, 127, 128, 129, 700, 0, 3000], None, True, 128),
    ([1, 63, 64, 65, 127, 128, 129, 700, 0, 3000], None, False, 64),
    ([300, 5, 0, 1000], [64, 64, 64, 64], False, 128),
    ([300, 5, 17, 1000], [200, 9, 0, 1500], True, 128),
    ([300, 5, 17, 1000], [200, 9, 0, 1500], False, 64),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("lq", "lk", "causal", "head_dim"), HOPPER_CASES)
def test_hopper_kernels_match_fp64_within_reference_error(
    monkeypatch, dtype, lq, lk, causal, head_dim
):
    lk = lq if lk is None else lk
    tensors, q_off, kv_off = _case(
        lq, lk, heads=2, head_dim=head_dim, radius=None, seed=3, dtype=torch.float64,
        device="cuda",
    )  # fmt: skip
    truth = _fp64_truth(tensors, q_off, kv_off, causal=causal)
    ref, names = _run(tensors, q_off, kv_off, causal=causal, backend="reference", dtype=dtype)
    launches = _spy_on_hopper(monkeypatch)
    options = dict(head_dim=head_dim, dtype=dtype, lk=lk, rel_bias=False)
    triton_results, _ = _run(
        tensors, q_off, kv_off, causal=causal, backend="triton", dtype=dtype,
        config=_sm90_config(**options),
    )  # fmt: skip
    assert not launches
    got, _ = _run(
        tensors, q_off, kv_off, causal=causal, backend="triton", dtype=dtype,
        config=_sm90_config(**options, gluon=True),
    )  # fmt: skip
    assert _all_ran(launches), launches
    _assert_results_within_reference_error(got, ref, truth, names)
    # Same inputs, same math, another schedule: within a few bf16/fp16 steps of Triton's.
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, triton_results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("scale", [0.3, -0.2, 0.0])
def test_hopper_kernels_take_any_scale(monkeypatch, scale):
    """The forward takes each block's row maximum of the raw scores times the scale's sign
    (``SCALE_SIGN``): a larger scale than the default, a negative one and zero."""
    lq = [1, 63, 64, 65, 700, 0, 1500]
    tensors, q_off, kv_off = _case(
        lq, lq, heads=2, head_dim=128, radius=None, seed=7, dtype=torch.float64, device="cuda"
    )
    truth = _fp64_truth(tensors, q_off, kv_off, causal=True, scale=scale)
    ref, names = _run(
        tensors, q_off, kv_off, causal=True, backend="reference", dtype=torch.bfloat16,
        scale=scale,
    )  # fmt: skip
    launches = _spy_on_hopper(monkeypatch)
    config = _sm90_config(head_dim=128, dtype=torch.bfloat16, lk=lq, rel_bias=False, gluon=True)
    got, _ = _run(
        tensors, q_off, kv_off, causal=True, backend="triton", dtype=torch.bfloat16, scale=scale,
        config=config,
    )  # fmt: skip
    assert _all_ran(launches), launches
    _assert_results_within_reference_error(got, ref, truth, names)


def _rising_and_falling_keys(lq, *, head_dim, device):
    """A self-attention case whose keys change size block by block (32 keys a block), so that
    each row's running maximum keeps moving and O is rescaled at nearly every key block: by
    small steps in sequences 0, 4, … (the rows' earlier keys keep a say), by steps of 2¹⁰ or
    more in 1, 5, … (they lose it); keys shrink in 2, 6, … (the maximum stays after the first
    block) and stay as drawn in 3, 7, …."""
    tensors, q_off, kv_off = _case(
        lq, lq, heads=2, head_dim=head_dim, radius=None, seed=11, dtype=torch.float64,
        device=device,
    )  # fmt: skip
    growth = []
    for i, length in enumerate(lq):
        blocks = torch.arange(length, device=device, dtype=torch.float64) // 32
        rate = (0.3, 4.0, 0.3, 0.0)[i % 4]
        growth.append(1 + rate * (blocks.flip(0) if i % 4 == 2 else blocks))
    tensors["k"] = tensors["k"] * torch.cat(growth)[:, None, None]
    return tensors, q_off, kv_off


@pytest.mark.parametrize("causal", [True, False])
def test_triton_kernels_follow_row_maxima_that_rise_block_by_block(causal):
    tensors, q_off, kv_off = _rising_and_falling_keys([150, 70, 96, 1], head_dim=32, device="cpu")
    truth = _fp64_truth(tensors, q_off, kv_off, causal=causal)
    ref, names = _run(
        tensors, q_off, kv_off, causal=causal, backend="reference", dtype=torch.float16
    )
    got, _ = _run(tensors, q_off, kv_off, causal=causal, backend="triton", dtype=torch.float16)
    _assert_results_within_reference_error(got, ref, truth, names)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_hopper_kernels_follow_row_maxima_that_rise_block_by_block(monkeypatch, head_dim, causal):
    tensors, q_off, kv_off = _rising_and_falling_keys(
        [1500, 65, 700, 1], head_dim=head_dim, device="cuda"
    )
    truth = _fp64_truth(tensors, q_off, kv_off, causal=causal)
    ref, names = _run(
        tensors, q_off, kv_off, causal=causal, backend="reference", dtype=torch.bfloat16
    )
    launches = _spy_on_hopper(monkeypatch)
    config = _sm90_config(
        head_dim=head_dim, dtype=torch.bfloat16, lk=[1500, 65, 700, 1], rel_bias=False, gluon=True
    )
    got, _ = _run(
        tensors, q_off, kv_off, causal=causal, backend="triton", dtype=torch.bfloat16,
        config=config,
    )  # fmt: skip
    assert _all_ran(launches), launches
    _assert_results_within_reference_error(got, ref, truth, names)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("stages", [2, 3])
def test_hopper_kernels_split_key_tiles_and_ring_depths(monkeypatch, stages):
    """Split key tiles (partial sums through the float32 scratch) and each ring depth."""
    lq = [4000, 1, 130, 0, 64]
    tensors, q_off, kv_off = _case(
        lq, lq, heads=2, head_dim=128, radius=None, seed=5, dtype=torch.float64, device="cuda"
    )
    # The longest key tile streams 4000 query rows, over 10 times an SM's share: split into
    # max_splits chunks.
    launches = _spy_on_hopper(monkeypatch)
    config = _sm90_config(
        head_dim=128, dtype=torch.bfloat16, lk=lq, rel_bias=False, gluon=True, stages=stages,
        max_splits=3,
    )  # fmt: skip
    truth = _fp64_truth(tensors, q_off, kv_off, causal=True)
    ref, names = _run(
        tensors, q_off, kv_off, causal=True, backend="reference", dtype=torch.bfloat16
    )
    got, _ = _run(
        tensors, q_off, kv_off, causal=True, backend="triton", dtype=torch.bfloat16, config=config
    )
    tiles = {"forward": "forward", "dkdv": "dkdv", "dq": "dq"}
    assert _all_ran(launches)
    assert all(getattr(kw["config"], tiles[k]).stages == stages for k, kw in launches)
    _assert_results_within_reference_error(got, ref, truth, names)


@pytest.mark.gpu
@needs_hopper
def test_hopper_kernels_keep_a_non_finite_sequence_to_itself(monkeypatch):
    launches = _spy_on_hopper(monkeypatch)
    _assert_other_sequences_untouched(
        [37, 300, 20], head_dim=128, dtype=torch.bfloat16, device="cuda", pad=0,
        config=_sm90_config(
            head_dim=128, dtype=torch.bfloat16, lk=[37, 300, 20], rel_bias=False, gluon=True
        ),
    )  # fmt: skip
    assert _all_ran(launches)


@pytest.mark.gpu
@needs_hopper
def test_hopper_kernels_read_views_of_a_fused_qkv_projection_in_place(monkeypatch):
    """q, k, v as views of one ``[T, 3, N, H]`` projection (rows 3·N·H apart) reach the Gluon
    kernels' copies and TMA descriptors as they lie: outputs and gradients equal, bit for bit,
    those of contiguous inputs."""
    launches = _spy_on_hopper(monkeypatch)
    lengths = [300, 0, 65, 1000, 1]
    config = _sm90_config(
        head_dim=128, dtype=torch.bfloat16, lk=lengths, rel_bias=False, gluon=True
    )
    tensors, q_off, _ = _case(
        lengths, lengths, heads=2, head_dim=128, radius=None, seed=9, dtype=torch.bfloat16,
        device="cuda",
    )  # fmt: skip
    qkv = torch.stack([tensors["q"], tensors["k"], tensors["v"]], dim=1).requires_grad_()
    out = jagged_flash_attention(
        *qkv.unbind(1), q_off, causal=True, backend="triton", config=config
    )
    (grad,) = torch.autograd.grad(out, [qkv], tensors["do"])
    assert _all_ran(launches)
    expected, _ = _run(
        tensors, q_off, q_off, causal=True, backend="triton", dtype=torch.bfloat16, config=config
    )
    assert torch.equal(out, expected[0])
    assert torch.equal(grad, torch.stack(expected[1:4], dim=1))


@pytest.mark.gpu
@needs_hopper
def test_hopper_kernels_unused_for_rows_they_cannot_copy(monkeypatch):
    """Rows 16-byte vectors cannot tile (a row stride one element past the heads: ``pad``
    1) take the Triton kernels, with the same isolation of a non-finite sequence."""
    launches = _spy_on_hopper(monkeypatch)
    _assert_other_sequences_untouched(
        [37, 300, 20], head_dim=128, dtype=torch.bfloat16, device="cuda", pad=1,
        config=_sm90_config(
            head_dim=128, dtype=torch.bfloat16, lk=[37, 300, 20], rel_bias=False, gluon=True
        ),
    )  # fmt: skip
    assert not launches


@pytest.mark.gpu
@needs_hopper
def test_hopper_kernels_unused_with_a_relative_bias(monkeypatch):
    """The bias path keeps the Triton kernels even where its config asks for the Gluon ones."""
    launches = _spy_on_hopper(monkeypatch)
    config = _sm90_config(
        head_dim=128, dtype=torch.bfloat16, lk=[100, 3], rel_bias=True, gluon=True
    )
    tensors, q_off, kv_off = _case(
        [100, 3], [100, 3], heads=2, head_dim=128, radius=4, seed=1, dtype=torch.bfloat16,
        device="cuda",
    )  # fmt: skip
    _run(tensors, q_off, kv_off, causal=True, backend="triton", dtype=torch.bfloat16, config=config)
    assert not launches

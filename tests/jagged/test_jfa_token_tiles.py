"""Jagged flash attention with ``Schedule.TOKEN_TILES`` (tiles of consecutive tokens across
sequences, masked block-diagonally) against fp64 by the tolerance rule, forward and every
gradient (the relative bias's included), over length distributions that put many sequences in one tile, sequences across tile
edges, empty sequences inside a tile and a lone long sequence among tiny ones (the interpreter's
tiles are 16 rows)."""

import dataclasses

import pytest
import torch
from gem_jagged import JaggedBatch, jagged_flash_attention
from gem_jagged.ops.jagged_flash_attention.config import (
    JaggedAttentionConfig,
    Schedule,
    config_for,
    regime_for,
)
from gem_jagged.testing import jagged_lengths, offsets_from_lengths
from hypothesis import given
from hypothesis import strategies as st

from .test_jagged_flash_attention import _check_against_fp64

TOKEN_TILES = dataclasses.replace(
    config_for(arch="interpreter", dtype=torch.float32, head_dim=32, regime=None, rel_bias=False),
    schedule=Schedule.TOKEN_TILES,
)


@given(
    lengths=jagged_lengths(max_batch=12, max_len=40, block=16),
    causal=st.booleans(),
    radius=st.sampled_from([None, 0, 3, 40]),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float16, torch.float32]),
)
def test_token_tiles_match_fp64_within_reference_error(lengths, causal, radius, seed, dtype):
    _check_against_fp64(
        lengths, lengths, causal=causal, radius=radius, seed=seed, dtype=dtype, config=TOKEN_TILES,
        batch=JaggedBatch(offsets_from_lengths(lengths)),
    )  # fmt: skip


@pytest.mark.parametrize(
    "lengths",
    [
        [3, 0, 5, 1, 0, 7],  # several sequences and empty ones inside one tile
        [15, 2, 30, 1, 1],  # sequences across tile edges
        [1] * 40 + [70] + [2] * 9,  # a lone long sequence among tiny ones
        [0, 0, 4],
    ],
    ids=["packed", "across-edges", "lone-long", "leading-empties"],
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("radius", [None, 4])
def test_token_tiles_packing_cases(lengths, causal, radius):
    _check_against_fp64(
        lengths, lengths, causal=causal, radius=radius, seed=3, dtype=torch.float16,
        config=TOKEN_TILES, batch=JaggedBatch(offsets_from_lengths(lengths)),
    )  # fmt: skip


@pytest.mark.parametrize("radius", [None, 5])
def test_token_tiles_equal_the_per_sequence_schedule(radius):
    lengths = [5, 17, 0, 1, 33, 2, 2]
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(sum(lengths), 2, 32, generator=gen) for _ in range(4))
    bias = None if radius is None else torch.randn(2, 2 * radius + 1, generator=gen)
    offsets = offsets_from_lengths(lengths)
    results = []
    for schedule in Schedule:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if bias is not None:
            leaves.append(bias.clone().requires_grad_())
        config = dataclasses.replace(TOKEN_TILES, schedule=schedule)
        out = jagged_flash_attention(
            *leaves[:3], offsets, causal=True, rel_bias=leaves[3] if bias is not None else None,
            backend="triton", config=config,
        )  # fmt: skip
        results.append([out, *torch.autograd.grad(out, leaves, do)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_the_config_round_trips_through_ints():
    assert JaggedAttentionConfig.from_ints(TOKEN_TILES.as_ints()) == TOKEN_TILES


def test_token_tiles_refuse_cross_attention():
    q = torch.randn(6, 2, 32)
    offsets = offsets_from_lengths([2, 4])
    with pytest.raises(ValueError, match="TOKEN_TILES runs self-attention only"):
        jagged_flash_attention(q, q, q, offsets, offsets, backend="triton", config=TOKEN_TILES)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("radius", [None, 32])
def test_gpu_token_tiles_match_fp64(dtype, head_dim, causal, radius):
    """The GPU tiles (``config_for``'s shapes with token tiles) over J7-like tiny histories,
    empty ones and a lone long one among them."""
    from .test_jagged_flash_attention import (
        _assert_results_within_reference_error,
        _case,
        _fp64_truth,
        _run,
    )

    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 49, (300,), generator=gen).tolist() + [700] + [1, 0, 2] * 20
    tensors, offsets, _ = _case(
        lengths, lengths, heads=2, head_dim=head_dim, radius=radius, seed=11,
        dtype=torch.float64, device="cuda",
    )  # fmt: skip
    config = dataclasses.replace(
        config_for(arch="sm90", dtype=dtype, head_dim=head_dim, regime=regime_for(
            total_kv=sum(lengths), num_seqs=len(lengths)), rel_bias=radius is not None),
        schedule=Schedule.TOKEN_TILES,
    )  # fmt: skip
    batch = JaggedBatch(offsets)
    truth = _fp64_truth(tensors, offsets, offsets, causal=causal)
    ref, names = _run(tensors, offsets, offsets, causal=causal, backend="reference", dtype=dtype)
    got, _ = _run(tensors, batch, None, causal=causal, backend="triton", dtype=dtype, config=config)
    _assert_results_within_reference_error(got, ref, truth, names)

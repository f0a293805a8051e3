"""The shared tile work list against a plain host-side enumeration of the same tiles."""

import pytest
import torch
from gem_jagged import _worklist
from gem_jagged._worklist import TileWorkList, key_tiles, query_tiles, tile_slot_bound
from gem_jagged.testing import jagged_lengths, offsets_from_lengths
from hypothesis import given
from hypothesis import strategies as st


def _items(work):
    """The real items as a sorted list of tuples, and the slots' validity in launch order."""
    seq = work.seq_W.tolist()
    rows = zip(seq, work.start_W.tolist(), work.lo_W.tolist(), work.hi_W.tolist(), strict=True)
    items = sorted(r for r in rows if r[0] >= 0)
    valid = [s >= 0 for s in seq]
    return items, valid


def _expected_query_tiles(lq, lk, block, causal):
    out = []
    for b, (q, k) in enumerate(zip(lq, lk, strict=True)):
        for start in range(0, q, block):
            rows = min(block, q - start)
            hi = min(k, max(0, start + rows + k - q)) if causal else k
            out.append((b, start, 0, hi))
    return sorted(out)


def _expected_key_tiles(lq, lk, block, causal, align, split_rows, max_splits):
    out = []
    for b, (q, k) in enumerate(zip(lq, lk, strict=True)):
        for start in range(0, k, block):
            lo = max(0, start - (k - q)) if causal else 0
            lo = min(lo // align * align, q)
            span = q - lo
            splits = 1 if split_rows is None else min(max_splits, max(1, -(-span // split_rows)))
            chunk = -(-span // splits)
            chunk = -(-chunk // align) * align
            for s in range(splits):
                c_lo = min(lo + s * chunk, q)
                out.append((b, start, c_lo, min(c_lo + chunk, q)))
    return sorted(out)


@given(
    lq=jagged_lengths(max_batch=5, max_len=70, block=16),
    extra=st.lists(st.integers(-20, 20), min_size=5, max_size=5),
    causal=st.booleans(),
    cross=st.booleans(),
)
def test_query_tiles_cover_every_tile_once_heaviest_first(lq, extra, causal, cross):
    lk = [max(0, q + e) for q, e in zip(lq, extra, strict=False)] if cross else lq
    q_off = offsets_from_lengths(lq, dtype=torch.int32)
    kv_off = offsets_from_lengths(lk) if cross else None
    work = query_tiles(q_off, kv_off, total_q=sum(lq), block=16, causal=causal)
    assert work.num_slots == tile_slot_bound(sum(lq), len(lq), 16) == work.seq_W.numel()
    items, valid = _items(work)
    assert items == _expected_query_tiles(lq, lk, 16, causal)
    assert valid == sorted(valid, reverse=True), "padding slots must come after every real tile"
    # Heaviest first: the visited pair count never increases along the launch order.
    rows = [
        min(16, lq[s] - st_) * (hi - lo)
        for s, st_, lo, hi in zip(
            work.seq_W.tolist(),
            work.start_W.tolist(),
            work.lo_W.tolist(),
            work.hi_W.tolist(),
            strict=True,
        )
        if s >= 0
    ]
    assert rows == sorted(rows, reverse=True)


@given(
    lq=jagged_lengths(max_batch=5, max_len=90, block=16),
    causal=st.booleans(),
    split=st.sampled_from([None, 16, 32]),
    max_splits=st.integers(1, 4),
)
def test_key_tiles_split_the_query_range_without_gaps(lq, causal, split, max_splits):
    lk = lq
    work = key_tiles(
        offsets_from_lengths(lq),
        None,
        total_kv=sum(lk),
        block=16,
        causal=causal,
        align=8,
        split_rows=split,
        max_splits=max_splits,
    )
    items, valid = _items(work)
    expected = _expected_key_tiles(lq, lk, 16, causal, 8, split, max_splits if split else 1)
    assert items == expected
    assert valid == sorted(valid, reverse=True)
    # The chunks of one key tile tile its query range exactly, and splits_W counts them.
    splits = {}
    for s, st_, n in zip(
        work.seq_W.tolist(), work.start_W.tolist(), work.splits_W.tolist(), strict=True
    ):
        if s >= 0:
            splits.setdefault((s, st_), []).append(n)
    for counts in splits.values():
        assert all(n == len(counts) for n in counts)


def test_ranking_kernel_orders_exactly_like_a_stable_sort():
    """The heaviest-first order of the O(W²) ranking kernel equals a stable descending sort's,
    across program boundaries and comparison chunks, with many ties (equal lengths)."""
    lengths = [100, 37, 100, 0, 1, 250, 100, 16, 17, 100, 600, 33] * 12
    off = offsets_from_lengths(lengths)
    fields_FT, cost_T = _worklist._tile_slots(
        off, off, total=sum(lengths), block=16, causal=True, key_tiles_=True, align=1,
        split_rows=1 << 30, max_splits=1,
    )  # fmt: skip
    assert cost_T.shape[0] > 2 * _worklist._RANK_OTHERS
    assert len(set(cost_T.tolist())) < cost_T.shape[0] // 4  # ties across program boundaries
    ranked = _worklist._ranked(fields_FT, cost_T, 16)
    sorted_ = _worklist._argsorted(fields_FT, cost_T, 16)
    assert torch.equal(ranked.packed_5W, sorted_.packed_5W)


def test_empty_batch_and_empty_sequences_give_only_padding_slots():
    off = offsets_from_lengths([0, 0])
    for work in (
        query_tiles(off, total_q=0, block=16),
        key_tiles(off, total_kv=0, block=16, split_rows=16, max_splits=3),
        query_tiles(torch.zeros(1, dtype=torch.int64), total_q=0, block=16),
    ):
        assert work.num_slots >= 1
        assert (work.seq_W == -1).all()


@pytest.mark.gpu
def test_building_the_list_needs_no_host_sync():
    off = offsets_from_lengths([5, 300, 17, 0, 4000], device="cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda.set_sync_debug_mode("error")
        try:
            query_tiles(off, total_q=4322, block=128, causal=True)
            key_tiles(off, total_kv=4322, block=128, causal=True, split_rows=512, max_splits=4)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_a_packed_list_must_be_a_contiguous_5_by_w_tensor():
    """Kernels read field f of slot w at ``packed[f * W + w]``: anything else is refused."""
    work = query_tiles(offsets_from_lengths([5, 40]), total_q=45, block=16)
    assert TileWorkList(work.packed_5W, 16).num_slots == work.num_slots
    wider = torch.zeros(5, 2 * work.num_slots, dtype=torch.int32)
    for bad in (work.packed_5W[:4], work.packed_5W.t(), wider[:, ::2]):
        with pytest.raises(ValueError, match="contiguous \\[5, W\\]"):
            TileWorkList(bad, 16)

"""Tile work lists for jagged kernels, built on the device without a host synchronisation.

A jagged kernel launches one program per tile of one sequence, but how many tiles there are
depends on the lengths, which live on the device. Reading them back (``.item()``) would stall the
stream, break CUDA-graph capture and force a graph break under ``torch.compile``. Instead the grid
is sized by an upper bound computed from host-known shapes only: a batch of ``B`` sequences
holding ``T`` tokens in total has at most

    Σ_b ceil(L_b / BLOCK) ≤ Σ_b (L_b / BLOCK + 1) < cdiv(T, BLOCK) + B

tiles (rounded up to a multiple of 16, see ``SLOT_MULTIPLE``). The list is built with a handful of device ops:

1. ``tiles_b = cdiv(L_b, BLOCK)`` and their running sum ``tile_ends``;
2. work slot ``w`` belongs to the sequence ``searchsorted(tile_ends, w, right=True)`` and starts
   at row ``(w - first_tile_of_that_sequence) · BLOCK``;
3. every real tile gets an estimated cost (rows times the span of the other side it will visit)
   and the list is sorted by descending cost, so the heaviest tiles start first and the short
   ones fill the gaps at the end of the launch (longest-processing-time-first scheduling). Slots
   past the real count sort last and carry ``seq = -1``: their programs return at once.

Two shapes of list are offered, general enough for every attention kernel of the package:

``query_tiles``
    one item per ``block``-row tile of the queries of each sequence, with the range of keys it
    must visit (all keys, or up to the bottom-right causal diagonal). Forward passes and the dQ
    half of a backward pass use it.

``key_tiles``
    one item per ``block``-row tile of the keys, with the range of queries that can see it. A key
    tile of a long sequence can be split along that query range into at most ``max_splits``
    chunks of at least ``split_rows`` rows (aligned to ``align``), so that one 20k-token sequence
    is spread over many programs instead of becoming the tail of the launch. Items of one key tile
    then accumulate into the same dK/dV rows (atomics or partial buffers); ``splits`` tells the
    kernel whether it owns its rows alone. The bound on slots is ``max_splits`` times the
    key-tile bound.

The slot arithmetic (the search, the ranges, the costs) runs in one small Triton kernel per level
rather than as dozens of tiny PyTorch ops: each launch costs host time, and a work list built from
thirty of them made the whole attention call host-bound. The heaviest-first order is one more
small kernel that ranks every slot against all others and writes it in place (a stable order,
O(W²) comparisons: cheaper than a radix sort plus a gather for the few thousand slots of a batch;
past ``_RANK_MAX_SLOTS`` a sort takes over), and the running sums (tiles per sequence, chunks
per key tile) are one single-program kernel each: a list is three launches and three allocations
(five of each with split key tiles), the rest of its cost is on the device.

Building a list costs a few launches of host time, which matters when the kernels are short. The
ops therefore keep the lists they build in the batch's ``gem_jagged.batch.JaggedBatch``: the
layers of a model that share one batch, and the backward pass after the forward, build each list
once, and the lists go with the batch.

Each item is ``(seq, start, lo, hi)``: the sequence, the first row of the tile on the tiled side,
and the half-open range ``[lo, hi)`` of rows on the other side to visit (``lo`` aligned down to
``align``). All tensors are int32 on the offsets' device, of length ``num_slots`` (a host int).
"""

import dataclasses
from dataclasses import dataclass

import torch
import triton.language as tl

from gem_jagged._intmath import cdiv
from gem_jagged._jit import jit

__all__ = ["TileWorkList", "query_tiles", "key_tiles", "tile_slot_bound"]


@dataclass(frozen=True)
class TileWorkList:
    """A device-resident list of tiles, heaviest first; slots past the real count have seq = -1.

    ``packed_5W`` holds five int32 rows, read through the properties: ``seq_W`` (sequence
    index), ``start_W`` (first row of the tile on the tiled side), ``lo_W`` and ``hi_W`` (rows
    ``[lo, hi)`` of the other side to visit) and ``splits_W`` (how many items share this tile's
    rows: 1 unless a key tile was split). ``num_slots`` is the grid size. Being one tensor, a
    list can be saved (for a backward pass, say) and rebuilt with ``TileWorkList(packed, block)``.
    """

    packed_5W: torch.Tensor
    block: int
    # The five row views, made once: a remembered list serves many launches, and each view
    # costs microseconds of host time.
    _rows: tuple[torch.Tensor, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        packed = self.packed_5W
        if packed.dim() != 2 or packed.shape[0] != 5 or not packed.is_contiguous():
            # Kernels read field f of slot w at packed_5W[f * W + w] (the Gluon kernels take the
            # one pointer), so the rows must lie W apart.
            raise ValueError(
                f"packed_5W must be a contiguous [5, W] tensor, got shape "
                f"{tuple(packed.shape)} and strides {packed.stride()}"
            )
        object.__setattr__(self, "_rows", packed.unbind(0))

    @property
    def num_slots(self) -> int:
        return self.packed_5W.shape[1]

    @property
    def seq_W(self) -> torch.Tensor:
        return self._rows[0]

    @property
    def start_W(self) -> torch.Tensor:
        return self._rows[1]

    @property
    def lo_W(self) -> torch.Tensor:
        return self._rows[2]

    @property
    def hi_W(self) -> torch.Tensor:
        return self._rows[3]

    @property
    def splits_W(self) -> torch.Tensor:
        return self._rows[4]


def tile_slot_bound(total: int, batch: int, block: int) -> int:
    """Upper bound on the tiles of ``batch`` sequences of ``total`` tokens (host ints only),
    rounded up to a multiple of ``SLOT_MULTIPLE``."""
    bound = -(-total // block) + batch
    return max(SLOT_MULTIPLE, -(-bound // SLOT_MULTIPLE) * SLOT_MULTIPLE)


_SLOTS_PER_PROGRAM = 128

# Slot counts are rounded up to this multiple so that neither the count nor the 16-byte alignment
# of a list's rows (slices of one buffer, ``W`` int32 apart) changes with the batch: Triton
# compiles a kernel anew for every combination of argument divisibility and pointer alignment it
# meets, and a list whose rows drift in and out of alignment made every new batch a compile.
SLOT_MULTIPLE = 16


@jit
def _owner_of(ends_E, num_ends, slots_W, search_steps):
    """Index of the first ``ends[e] > slot`` for each slot (binary search; ``num_ends`` if none)."""
    lo_W = tl.zeros_like(slots_W)
    hi_W = tl.zeros_like(slots_W) + num_ends
    for _ in range(search_steps):
        active_W = lo_W < hi_W
        mid_W = (lo_W + hi_W) // 2
        end_W = tl.load(ends_E + mid_W, mask=active_W & (mid_W < num_ends), other=0)
        right_W = active_W & (end_W <= slots_W)
        lo_W = tl.where(right_W, mid_W + 1, lo_W)
        hi_W = tl.where(active_W & ~right_W, mid_W, hi_W)
    return lo_W


@jit
def _tile_slots_kernel(
    tiled_offsets_Bp1, other_offsets_Bp1, tile_ends_B, fields_FW, cost_W,
    num_seqs, num_slots, search_steps, block, align, split_rows, max_splits,
    KEY_TILES: tl.constexpr, CAUSAL: tl.constexpr, SLOTS: tl.constexpr,
):  # fmt: skip
    """Level one: slot -> (seq, start, lo, hi, splits, chunk, rows) for every tile of a side.

    Query tiles (``KEY_TILES`` false) visit keys ``[0, hi)``; key tiles visit the queries that
    can see them, ``[lo, hi)``, and get their split count and chunk length.
    """
    slots_W = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)
    in_range_W = slots_W < num_slots
    seq_W = _owner_of(tile_ends_B, num_seqs, slots_W, search_steps)
    valid_W = in_range_W & (seq_W < num_seqs)
    tiled_len_W = tl.load(tiled_offsets_Bp1 + seq_W + 1, mask=valid_W, other=0) - tl.load(
        tiled_offsets_Bp1 + seq_W, mask=valid_W, other=0
    )
    other_len_W = tl.load(other_offsets_Bp1 + seq_W + 1, mask=valid_W, other=0) - tl.load(
        other_offsets_Bp1 + seq_W, mask=valid_W, other=0
    )
    tiled_len_W = tiled_len_W.to(tl.int64)
    other_len_W = other_len_W.to(tl.int64)
    tile_end_W = tl.load(tile_ends_B + seq_W, mask=valid_W, other=0).to(tl.int64)
    first_tile_W = tile_end_W - (tiled_len_W + block - 1) // block
    start_W = (slots_W - first_tile_W) * block
    rows_W = tl.minimum(tl.maximum(tiled_len_W - start_W, 0), block)
    if KEY_TILES:
        # Keys [start, start + rows) of a sequence with Lq queries and Lk keys.
        lq_W = other_len_W
        lo_W = tl.zeros_like(start_W)
        if CAUSAL:
            lo_W = tl.maximum(start_W - (tiled_len_W - lq_W), 0)
        lo_W = tl.minimum(lo_W // align * align, lq_W)
        hi_W = lq_W
        span_W = hi_W - lo_W
        splits_W = tl.minimum(tl.maximum((span_W + split_rows - 1) // split_rows, 1), max_splits)
        chunk_W = (span_W + splits_W - 1) // splits_W
        chunk_W = (chunk_W + align - 1) // align * align
    else:
        # Queries [start, start + rows) of a sequence with Lq queries and Lk keys.
        lk_W = other_len_W
        lo_W = tl.zeros_like(start_W)
        hi_W = lk_W
        if CAUSAL:
            hi_W = tl.minimum(lk_W, tl.maximum(start_W + rows_W + lk_W - tiled_len_W, 0))
        span_W = hi_W
        splits_W = tl.zeros_like(start_W) + 1
        chunk_W = span_W
    cost_W_ = rows_W * span_W + block * block  # pairs visited plus a per-tile overhead
    seq_W = tl.where(valid_W, seq_W, -1)
    splits_W = tl.where(valid_W, splits_W, 0)
    out_W = fields_FW + slots_W
    tl.store(out_W, seq_W.to(tl.int32), mask=in_range_W)
    tl.store(out_W + num_slots, start_W.to(tl.int32), mask=in_range_W)
    tl.store(out_W + 2 * num_slots, lo_W.to(tl.int32), mask=in_range_W)
    tl.store(out_W + 3 * num_slots, hi_W.to(tl.int32), mask=in_range_W)
    tl.store(out_W + 4 * num_slots, splits_W.to(tl.int32), mask=in_range_W)
    tl.store(out_W + 5 * num_slots, chunk_W.to(tl.int32), mask=in_range_W)
    tl.store(out_W + 6 * num_slots, rows_W.to(tl.int32), mask=in_range_W)
    cost_W_ = tl.minimum(cost_W_, 2147483647)  # int32 keys sort in half the radix passes
    tl.store(cost_W + slots_W, tl.where(valid_W, cost_W_, -1).to(tl.int32), mask=in_range_W)


@jit
def _split_slots_kernel(
    tiles_FT, split_ends_T, fields_FW, cost_W, num_tiles, num_slots, search_steps, block,
    SLOTS: tl.constexpr,
):  # fmt: skip
    """Level two: slot -> (key tile, chunk of its query range) for split key tiles."""
    slots_W = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)
    in_range_W = slots_W < num_slots
    tile_W = _owner_of(split_ends_T, num_tiles, slots_W, search_steps)
    valid_W = in_range_W & (tile_W < num_tiles)
    seq_W = tl.load(tiles_FT + 0 * num_tiles + tile_W, mask=valid_W, other=-1)
    start_W = tl.load(tiles_FT + 1 * num_tiles + tile_W, mask=valid_W, other=0)
    lo_W = tl.load(tiles_FT + 2 * num_tiles + tile_W, mask=valid_W, other=0)
    hi_W = tl.load(tiles_FT + 3 * num_tiles + tile_W, mask=valid_W, other=0)
    splits_W = tl.load(tiles_FT + 4 * num_tiles + tile_W, mask=valid_W, other=0)
    chunk_W = tl.load(tiles_FT + 5 * num_tiles + tile_W, mask=valid_W, other=0)
    rows_W = tl.load(tiles_FT + 6 * num_tiles + tile_W, mask=valid_W, other=0)
    split_end_W = tl.load(split_ends_T + tile_W, mask=valid_W, other=0).to(tl.int32)
    chunk_lo_W = tl.minimum(lo_W + (slots_W - (split_end_W - splits_W)) * chunk_W, hi_W)
    chunk_hi_W = tl.minimum(chunk_lo_W + chunk_W, hi_W)
    cost_W_ = rows_W.to(tl.int64) * (chunk_hi_W - chunk_lo_W) + block * block
    out_W = fields_FW + slots_W
    tl.store(out_W, tl.where(valid_W, seq_W, -1).to(tl.int32), mask=in_range_W)
    tl.store(out_W + num_slots, start_W.to(tl.int32), mask=in_range_W)
    tl.store(out_W + 2 * num_slots, chunk_lo_W.to(tl.int32), mask=in_range_W)
    tl.store(out_W + 3 * num_slots, chunk_hi_W.to(tl.int32), mask=in_range_W)
    tl.store(out_W + 4 * num_slots, splits_W.to(tl.int32), mask=in_range_W)
    cost_W_ = tl.minimum(cost_W_, 2147483647)  # int32 keys sort in half the radix passes
    tl.store(cost_W + slots_W, tl.where(valid_W, cost_W_, -1).to(tl.int32), mask=in_range_W)


@jit
def _running_sum_kernel(
    counts_B, ends_B, num_items, block, FROM_OFFSETS: tl.constexpr, CHUNK: tl.constexpr
):  # fmt: skip
    """``ends[b] = Σ_{c ≤ b} count[c]`` (int64) in one program, ``CHUNK`` items at a time.

    With ``FROM_OFFSETS`` the counts are tiles per sequence, ``cdiv(off[b+1] − off[b], block)``,
    read from an offsets tensor; otherwise they are read as they are.
    """
    carry = tl.sum(tl.zeros([CHUNK], tl.int64), 0)
    for start in range(0, num_items, CHUNK):
        items_C = start + tl.arange(0, CHUNK)
        ok_C = items_C < num_items
        count_C = tl.load(counts_B + items_C, mask=ok_C, other=0).to(tl.int64)
        if FROM_OFFSETS:
            end_C = tl.load(counts_B + items_C + 1, mask=ok_C, other=0).to(tl.int64)
            count_C = (end_C - count_C + block - 1) // block
        tl.store(ends_B + items_C, tl.cumsum(count_C, 0) + carry, mask=ok_C)
        carry += tl.sum(count_C, 0)


def _running_sum(counts, num_items, *, block=1, from_offsets=False):
    """Running sums of ``num_items`` counts as int64 (one zero when there are none)."""
    if num_items == 0:
        return torch.zeros(1, dtype=torch.int64, device=counts.device)
    ends = torch.empty(num_items, dtype=torch.int64, device=counts.device)
    _running_sum_kernel[(1,)](
        counts, ends, num_items, block, FROM_OFFSETS=from_offsets, CHUNK=_SLOTS_PER_PROGRAM
    )
    return ends


def _launch_slots(kernel, inputs, scalars, *, num_slots, num_fields, device, **constexprs):
    """Run a slot kernel: ``kernel(*inputs, fields [F, W] int32, cost [W] int32, *scalars)``."""
    buffer = torch.empty(num_fields + 1, num_slots, dtype=torch.int32, device=device)
    fields_FW, cost_W = buffer[:num_fields], buffer[num_fields]
    grid = (cdiv(num_slots, _SLOTS_PER_PROGRAM),)
    kernel[grid](*inputs, fields_FW, cost_W, *scalars, SLOTS=_SLOTS_PER_PROGRAM, **constexprs)
    return fields_FW, cost_W


def _tile_slots(tiled_offsets, other_offsets, *, total, block, causal, key_tiles_, align=1,
                split_rows=1 << 30, max_splits=1):  # fmt: skip
    num_seqs = tiled_offsets.numel() - 1
    num_slots = tile_slot_bound(total, num_seqs, block)
    tile_ends_B = _running_sum(tiled_offsets, num_seqs, block=block, from_offsets=True)
    return _launch_slots(
        _tile_slots_kernel,
        (tiled_offsets, other_offsets, tile_ends_B),
        (num_seqs, num_slots, num_seqs.bit_length() + 1, block, align, split_rows, max_splits),
        num_slots=num_slots, num_fields=7, device=tiled_offsets.device,
        KEY_TILES=key_tiles_, CAUSAL=causal,
    )  # fmt: skip


@jit
def _rank_scatter_kernel(
    fields_FW, cost_W, out_5W, num_slots, MINE: tl.constexpr, OTHERS: tl.constexpr
):  # fmt: skip
    """Write each slot's five fields at its rank in the heaviest-first order.

    A slot's rank counts the slots that go before it: heavier ones, and equally heavy ones with
    a smaller index (a stable order). Every program ranks ``MINE`` slots against all the others,
    ``OTHERS`` at a time: O(W²) comparisons in one launch, cheaper than a sort plus a gather for
    the few thousand slots of a batch. Programs are kept small (``_RANK_MINE`` slots each) so that the
    launch spreads over the SMs instead of running as a few long programs.
    """
    slots_M = tl.program_id(0) * MINE + tl.arange(0, MINE)
    in_range_M = slots_M < num_slots
    cost_M = tl.load(cost_W + slots_M, mask=in_range_M, other=-2)
    rank_M = tl.zeros([MINE], tl.int32)
    for start in range(0, num_slots, OTHERS):
        others_O = start + tl.arange(0, OTHERS)
        theirs_O = tl.load(cost_W + others_O, mask=others_O < num_slots, other=-3)  # never first
        first_MO = (theirs_O[None, :] > cost_M[:, None]) | (
            (theirs_O[None, :] == cost_M[:, None]) & (others_O[None, :] < slots_M[:, None])
        )
        rank_M += tl.sum(first_MO.to(tl.int32), 1)
    for field in tl.static_range(5):
        value_M = tl.load(fields_FW + field * num_slots + slots_M, mask=in_range_M)
        tl.store(out_5W + field * num_slots + rank_M, value_M, mask=in_range_M)


# The ranking kernel's tile: slots ranked per program, and slots compared per step.
_RANK_MINE, _RANK_OTHERS = 16, 512

# Past this many slots the O(W²) ranking gives way to a sort and a gather.
_RANK_MAX_SLOTS = 32768


def _sorted(fields_FW, cost_W, block) -> TileWorkList:
    """Order the slots heaviest first (stable, so equal costs keep their order)."""
    if cost_W.shape[0] > _RANK_MAX_SLOTS:
        return _argsorted(fields_FW, cost_W, block)
    return _ranked(fields_FW, cost_W, block)


def _argsorted(fields_FW, cost_W, block) -> TileWorkList:
    order_W = torch.argsort(cost_W, descending=True, stable=True)
    return TileWorkList(fields_FW[:5].index_select(1, order_W), block)


def _ranked(fields_FW, cost_W, block) -> TileWorkList:
    num_slots = cost_W.shape[0]
    out_5W = torch.empty(5, num_slots, dtype=torch.int32, device=cost_W.device)
    grid = (cdiv(num_slots, _RANK_MINE),)
    _rank_scatter_kernel[grid](
        fields_FW, cost_W, out_5W, num_slots, MINE=_RANK_MINE, OTHERS=_RANK_OTHERS
    )
    return TileWorkList(out_5W, block)


def query_tiles(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor | None = None,
    *,
    total_q: int,
    block: int,
    causal: bool = False,
) -> TileWorkList:
    """Query tiles of ``block`` rows, each with the key range ``[0, hi)`` it must visit.

    ``total_q`` is the host-known number of query tokens (``q.shape[0]``). With ``causal`` the
    key range ends just after the bottom-right diagonal of the tile's last row.
    """
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    fields_FW, cost_W = _tile_slots(
        q_offsets, kv_offsets, total=total_q, block=block, causal=causal, key_tiles_=False
    )
    return _sorted(fields_FW, cost_W, block)


def key_tiles(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor | None = None,
    *,
    total_kv: int,
    block: int,
    causal: bool = False,
    align: int = 1,
    split_rows: int | None = None,
    max_splits: int = 1,
) -> TileWorkList:
    """Key tiles of ``block`` rows, each with the query range ``[lo, hi)`` that can see it.

    ``total_kv`` is the host-known number of key tokens (``k.shape[0]``). With ``causal`` (bottom
    right) key ``j`` is seen by queries ``i ≥ j − (Lk − Lq)``, so ``lo`` starts there, aligned
    down to ``align``. With ``split_rows`` a tile whose query range is longer than that is split
    into ``min(max_splits, cdiv(range, split_rows))`` chunks of whole ``align`` blocks. A tile
    seen by no query still gets one (empty) item, so that its dK/dV rows are written.
    """
    kv_offsets = q_offsets if kv_offsets is None else kv_offsets
    if split_rows is None or max_splits <= 1:
        split_rows, max_splits = 1 << 30, 1
    return _build_key_tiles(
        q_offsets, kv_offsets, total_kv, block, causal, align, split_rows, max_splits
    )


def _build_key_tiles(q_offsets, kv_offsets, total_kv, block, causal, align, split_rows, max_splits):
    tiles_FT, cost_T = _tile_slots(
        kv_offsets, q_offsets, total=total_kv, block=block, causal=causal, key_tiles_=True,
        align=align, split_rows=split_rows, max_splits=max_splits,
    )  # fmt: skip
    num_tiles = tiles_FT.shape[1]
    if max_splits == 1:
        return _sorted(tiles_FT, cost_T, block)
    num_slots = num_tiles * max_splits
    split_ends_T = _running_sum(tiles_FT[4], num_tiles)
    fields_FW, cost_W = _launch_slots(
        _split_slots_kernel,
        (tiles_FT, split_ends_T),
        (num_tiles, num_slots, num_tiles.bit_length() + 1, block),
        num_slots=num_slots, num_fields=5, device=tiles_FT.device,
    )  # fmt: skip
    return _sorted(fields_FW, cost_W, block)

"""Tile work lists for jagged kernels, built on the device without a host synchronisation.

A jagged kernel launches one program per tile of one sequence, but how many tiles there are
depends on the lengths, which live on the device. Reading them back (``.item()``) would stall the
stream, break CUDA-graph capture and force a graph break under ``torch.compile``. Instead the grid
is sized by an upper bound computed from host-known shapes only: a batch of ``B`` sequences
holding ``T`` tokens in total has at most

    Σ_b ceil(L_b / BLOCK) ≤ Σ_b (L_b / BLOCK + 1) < cdiv(T, BLOCK) + B

tiles. The list is built with a handful of device ops:

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

Each item is ``(seq, start, lo, hi)``: the sequence, the first row of the tile on the tiled side,
and the half-open range ``[lo, hi)`` of rows on the other side to visit (``lo`` aligned down to
``align``). All tensors are int32 on the offsets' device, of length ``num_slots`` (a host int).
"""

from dataclasses import dataclass

import torch

__all__ = ["TileWorkList", "query_tiles", "key_tiles", "tile_slot_bound"]


@dataclass(frozen=True)
class TileWorkList:
    """A device-resident list of tiles, heaviest first; slots past the real count have seq = -1.

    ``seq_W``: sequence index; ``start_W``: first row of the tile on the tiled side;
    ``lo_W``, ``hi_W``: rows ``[lo, hi)`` of the other side to visit; ``splits_W``: how many
    items share this tile's rows (1 unless a key tile was split); ``num_slots``: the grid size.
    """

    seq_W: torch.Tensor
    start_W: torch.Tensor
    lo_W: torch.Tensor
    hi_W: torch.Tensor
    splits_W: torch.Tensor
    num_slots: int
    block: int


def tile_slot_bound(total: int, batch: int, block: int) -> int:
    """Upper bound on the tiles of ``batch`` sequences of ``total`` tokens (host ints only)."""
    return max(1, -(-total // block) + batch)


def _lengths(offsets_Bp1: torch.Tensor) -> torch.Tensor:
    offsets = offsets_Bp1.to(torch.int64)
    return offsets[1:] - offsets[:-1]


def _tiles_of(lengths_B: torch.Tensor, block: int, num_slots: int):
    """(seq, index of the tile within its sequence, valid) for each of ``num_slots`` slots."""
    tiles_B = (lengths_B + block - 1) // block
    tile_ends_B = torch.cumsum(tiles_B, 0)
    slot_W = torch.arange(num_slots, device=lengths_B.device, dtype=torch.int64)
    seq_W = torch.searchsorted(tile_ends_B, slot_W, right=True)
    valid_W = seq_W < lengths_B.numel()
    seq_W = seq_W.clamp(max=max(lengths_B.numel() - 1, 0))
    first_tile_W = tile_ends_B[seq_W] - tiles_B[seq_W] if lengths_B.numel() else slot_W
    return seq_W, slot_W - first_tile_W, valid_W


def _sorted(cost_W, valid_W, seq_W, start_W, lo_W, hi_W, splits_W, num_slots, block):
    """Order the slots heaviest first; one stacked gather keeps the launch count low."""
    cost_W = torch.where(valid_W, cost_W, -1)
    seq_W = torch.where(valid_W, seq_W, -1)
    order_W = torch.argsort(cost_W, descending=True, stable=True)
    fields_5W = torch.stack([seq_W, start_W, lo_W, hi_W, splits_W]).to(torch.int32)
    fields_5W = fields_5W.index_select(1, order_W)
    seq, start, lo, hi, splits = fields_5W.unbind(0)
    return TileWorkList(
        seq_W=seq,
        start_W=start,
        lo_W=lo,
        hi_W=hi,
        splits_W=splits,
        num_slots=num_slots,
        block=block,
    )


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
    lq_B = _lengths(q_offsets)
    lk_B = lq_B if kv_offsets is None else _lengths(kv_offsets)
    num_slots = tile_slot_bound(total_q, lq_B.numel(), block)
    seq_W, tile_W, valid_W = _tiles_of(lq_B, block, num_slots)
    if lq_B.numel() == 0:
        lq_W = lk_W = torch.zeros_like(seq_W)
    else:
        lq_W, lk_W = lq_B[seq_W], lk_B[seq_W]
    start_W = tile_W * block
    rows_W = (lq_W - start_W).clamp(0, block)
    hi_W = lk_W
    if causal:
        hi_W = torch.minimum(lk_W, (start_W + rows_W + lk_W - lq_W).clamp(min=0))
    lo_W = torch.zeros_like(hi_W)
    cost_W = rows_W * hi_W + block * block  # pairs visited plus a per-tile overhead
    ones_W = torch.ones_like(seq_W)
    return _sorted(cost_W, valid_W, seq_W, start_W, lo_W, hi_W, ones_W, num_slots, block)


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
    lq_B = _lengths(q_offsets)
    lk_B = lq_B if kv_offsets is None else _lengths(kv_offsets)
    tile_slots = tile_slot_bound(total_kv, lk_B.numel(), block)
    seq_T, tile_T, valid_T = _tiles_of(lk_B, block, tile_slots)
    if lk_B.numel() == 0:
        lq_T = lk_T = torch.zeros_like(seq_T)
    else:
        lq_T, lk_T = lq_B[seq_T], lk_B[seq_T]
    start_T = tile_T * block
    lo_T = torch.zeros_like(start_T)
    if causal:
        lo_T = (start_T - (lk_T - lq_T)).clamp(min=0)
    lo_T = torch.minimum(lo_T // align * align, lq_T)
    hi_T = lq_T
    span_T = hi_T - lo_T
    if split_rows is None or max_splits <= 1:
        splits_T = torch.ones_like(span_T)
        max_splits = 1
    else:
        splits_T = ((span_T + split_rows - 1) // split_rows).clamp(1, max_splits)
    splits_T = torch.where(valid_T, splits_T, torch.zeros_like(splits_T))
    chunk_T = (span_T + splits_T - 1) // splits_T.clamp(min=1)
    chunk_T = (chunk_T + align - 1) // align * align

    # Second level: slot -> (key tile, chunk of its query range).
    num_slots = tile_slots * max_splits
    split_ends_T = torch.cumsum(splits_T, 0)
    slot_W = torch.arange(num_slots, device=lq_B.device, dtype=torch.int64)
    tile_W = torch.searchsorted(split_ends_T, slot_W, right=True)
    valid_W = slot_W < split_ends_T[-1]
    tile_W = tile_W.clamp(max=tile_slots - 1)
    chunk_index_W = slot_W - (split_ends_T[tile_W] - splits_T[tile_W])
    lo_W = (lo_T[tile_W] + chunk_index_W * chunk_T[tile_W]).clamp(max=hi_T[tile_W])
    hi_W = torch.minimum(lo_W + chunk_T[tile_W], hi_T[tile_W])
    rows_W = (lk_T[tile_W] - start_T[tile_W]).clamp(0, block)
    cost_W = rows_W * (hi_W - lo_W) + block * block
    return _sorted(
        cost_W,
        valid_W,
        seq_T[tile_W],
        start_T[tile_W],
        lo_W,
        hi_W,
        splits_T[tile_W],
        num_slots,
        block,
    )

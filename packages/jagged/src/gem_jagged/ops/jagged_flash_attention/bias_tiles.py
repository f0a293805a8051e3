"""The relative bias of every tile shape a kernel meets, laid out as plain tiles.

The bias of a (query i, key j) pair is ``rel_bias[n, clamp(j − i, −R, R) + R]``. Gathering it
per score (compute the bucket, clamp, form a pointer, load one element) roughly doubled the
per-element work of a tile crossing the band (``docs/design/jagged_flash_attention.md`` has
the numbers). But a tile's bias depends only on the offset
``o = (first key of the tile) − (first query of the tile)``, and the kernels' tiles start on
multiples of their heights, so ``o`` is a multiple of ``step = gcd(tile heights)``. Only a
handful of offsets give a tile that is not constant:

    every pair has j − i ≤ −R   (bucket 0)    iff  o ≤ −R − (keys per tile − 1)
    every pair has j − i ≥ R    (bucket 2R)   iff  o ≥ R + (queries per tile − 1)

So ``relative_bias_tiles`` writes, per head, the tile of each offset from ``o_lo`` (the last
all-bucket-0 one, rounded down to ``step``) to ``o_hi`` (the first all-bucket-2R one, rounded
up): ``[N, num_offsets, rows, cols]`` in the inputs' dtype (the reference adds the bias in that
dtype too; bf16 halves the registers a tile takes), a few hundred KB that stay in L2. A kernel clamps a tile's offset into
``[o_lo, o_hi]`` (exact: the clamped tiles are constant) and loads its tile with one coalesced
load (``add_relative_bias``, which adds it in float32 log2 units, the kernels' exp2 domain),
like a key tile. Entry 0 is all bucket 0: the kernels' scalar for
tiles left of the band is its first element.

Two layouts: ``keys_on_rows=False`` (query rows × key columns: the forward and dQ kernels'
score tiles) and ``True`` (key rows × query columns: the dK/dV kernel's transposed scores).
"""

import math

import torch
import triton.language as tl

from gem_jagged._jit import jit


def _floor_to(value: int, step: int) -> int:
    return value // step * step


def _build_bucket_index(radius, rows, cols, keys_on_rows, device) -> tuple[torch.Tensor, int]:
    """``(bucket [num_offsets, rows, cols] int64, o_lo)`` for one tile geometry."""
    step = math.gcd(rows, cols)
    tile_q, tile_k = (cols, rows) if keys_on_rows else (rows, cols)
    o_lo = _floor_to(-radius - (tile_k - 1), step)
    o_hi = -_floor_to(-(radius + tile_q - 1), step)
    offsets = torch.arange(o_lo, o_hi + 1, step, device=device)
    a = torch.arange(rows, device=device)[:, None]
    b = torch.arange(cols, device=device)[None, :]
    key_minus_query = (a - b) if keys_on_rows else (b - a)
    rel = offsets[:, None, None] + key_minus_query
    return rel.clamp(-radius, radius) + radius, o_lo


_BUCKET_INDEX: dict[tuple, tuple[torch.Tensor, int]] = {}


def _bucket_index(radius, rows, cols, keys_on_rows, device) -> tuple[torch.Tensor, int]:
    """Remembered per geometry and device, except while a CUDA graph is being captured: a
    tensor built then holds no values until the graph is replayed."""
    key = (radius, rows, cols, keys_on_rows, device)
    if key in _BUCKET_INDEX:
        return _BUCKET_INDEX[key]
    built = _build_bucket_index(radius, rows, cols, keys_on_rows, device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _BUCKET_INDEX[key] = built
    return built


def relative_bias_tiles(
    rel_bias_NR2: torch.Tensor, *, rows: int, cols: int, keys_on_rows: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, int, int]:
    """``(tiles [N, num_offsets, rows, cols] in dtype, o_lo, num_offsets)``."""
    radius = (rel_bias_NR2.shape[1] - 1) // 2
    bucket, o_lo = _bucket_index(radius, rows, cols, keys_on_rows, rel_bias_NR2.device)
    return rel_bias_NR2.to(dtype)[:, bucket], o_lo, bucket.shape[0]


@jit
def far_bias_log2(tiles_head):
    """Bucket 0's bias in log2 units: what a tile wholly left of the band adds to every score
    (entry 0 of the tiles is all bucket 0)."""
    return tl.load(tiles_head).to(tl.float32) * 1.4426950408889634


@jit
def add_relative_bias(
    s_RC, far_bias, tiles_head, offset, o_lo, num_offsets,
    HAS_BIAS: tl.constexpr, FAR_BIAS: tl.constexpr,
    ROWS: tl.constexpr, COLS: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """Scores ``s_RC [ROWS, COLS]`` (log2 units) plus their relative bias: nothing without a
    bias, the scalar ``far_bias`` for a tile left of the band (``FAR_BIAS``), else the tile of
    offset ``offset`` (first key minus first query, a multiple of ``STEP``) loaded from one
    head's tiles."""
    if HAS_BIAS:
        if FAR_BIAS:
            s_RC += far_bias
        else:
            o_hi = o_lo + (num_offsets - 1) * STEP
            entry = (tl.minimum(tl.maximum(offset, o_lo), o_hi) - o_lo) // STEP
            tile_RC = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
            tile_RC = tl.load(tiles_head + entry.to(tl.int64) * (ROWS * COLS) + tile_RC)
            s_RC += tile_RC.to(tl.float32) * 1.4426950408889634
    return s_RC

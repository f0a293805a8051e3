"""Pieces the jagged flash attention kernels and launchers share: the key-block ranges of a
query tile, the K/V tile stream (pointers or TMA), and host helpers (row layouts, TMA
descriptors, the bias tiles' arguments, the query work list, device facts).

Legend (shape suffixes): ``Tq``/``Tk`` total query/key tokens, ``B`` sequences, ``N`` heads,
``H`` head dim, ``W`` work-list slots, ``R2`` relative-bias buckets (2R+1), ``M``/``Nk`` rows of
a query/key tile (BLOCK_M/BLOCK_N).
"""

import math

import torch
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gem_jagged._jit import jit
from gem_jagged._worklist import TileWorkList, query_tiles

from ..bias_tiles import relative_bias_tiles

LOG2E = 1.4426950408889634


# SMs per device index: a fact of the hardware, asked once (the query costs host time at every
# backward launch otherwise). Nothing here depends on a batch or a call.
_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


# One never-written float32 element per device: scratch, not state (no launch reads it).
_UNUSED_FLOAT32: dict[torch.device, torch.Tensor] = {}


def _unused_float32(device: torch.device) -> torch.Tensor:
    """A float32 pointer for the scratch arguments of an unsplit launch. Passing ``dk`` there
    instead (bf16) made the split path a second compiled variant of the dK/dV kernel, compiled
    seconds into training at the first batch with a long enough sequence."""
    if device not in _UNUSED_FLOAT32:
        _UNUSED_FLOAT32[device] = torch.empty(1, dtype=torch.float32, device=device)
    return _UNUSED_FLOAT32[device]


@jit
def _online_softmax_step(
    acc_MH, l_M, m_M, s_MN, v_NH, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr
):  # fmt: skip
    """One key block of the online softmax: scores ``s_MN`` (log2 domain, -inf where masked)
    update the running max ``m``, sum ``l`` and output accumulator; ``MASKED``: a row may have
    seen nothing yet (its max stays -inf, safely)."""
    m_new_M = tl.maximum(m_M, tl.max(s_MN, 1))
    if MASKED:
        m_use_M = tl.where(m_new_M == float("-inf"), 0.0, m_new_M)
    else:
        m_use_M = m_new_M
    p_MN = tl.math.exp2(s_MN - m_use_M[:, None])
    alpha_M = tl.math.exp2(m_M - m_use_M)
    l_M = l_M * alpha_M + tl.sum(p_MN, 1)
    # rescale and accumulate P V
    acc_MH = acc_MH * alpha_M[:, None]
    acc_MH = tl.dot(p_MN.to(v_NH.dtype), v_NH, acc_MH, input_precision=DOT_PRECISION)
    return acc_MH, l_M, m_new_M


@jit
def _softmax_epilogue(acc_MH, l_M, m_M):
    """``(out_MH, lse_M)``: the accumulator normalised and the natural log-sum-exp; a row that
    saw no key outputs zeros and saves lse = +inf."""
    seen_M = l_M > 0.0
    out_MH = acc_MH / tl.where(seen_M, l_M, 1.0)[:, None]
    log2_sum_M = m_M + tl.math.log2(tl.where(seen_M, l_M, 1.0))
    return out_MH, tl.where(seen_M, log2_sum_M * 0.6931471805599453, float("inf"))


@jit
def _key_block_stops(
    q_start, k_len, diag, k_stop, radius,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``(far_stop, full_stop)`` for a query tile starting at row ``q_start``: key blocks
    ``[0, full_stop)`` are seen whole by every row of the tile (no mask), and of those
    ``[0, far_stop)`` lie left of the bias band (``j − i < −R`` for every pair: bucket 0)."""
    full_stop = k_len
    if CAUSAL:
        full_stop = tl.minimum(full_stop, q_start + 1 + diag)
    full_stop = tl.minimum(tl.maximum(full_stop, 0) // BLOCK_N * BLOCK_N, k_stop)
    far_stop = 0
    if HAS_BIAS:
        far_stop = tl.minimum(tl.maximum(q_start - radius, 0) // BLOCK_N * BLOCK_N, full_stop)
    return far_stop, full_stop


@jit
def _stream_tile(
    src, seq_row0, first, col0, stride, length,
    MASKED: tl.constexpr, TMA: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Rows ``[first, first + ROWS)`` of one head of a sequence: with ``TMA`` through the tensor
    descriptor ``src`` (sequence rows from token ``seq_row0``, head columns from ``col0``), else
    from the head's base pointer ``src`` (row stride ``stride``). With ``MASKED``, rows at or past
    ``length`` read as zeros: a descriptor reads the next sequence's rows there, whose values
    (an Inf, say) must not reach this sequence through a zero probability."""
    rows_R = first + tl.arange(0, ROWS)
    if TMA:
        tile_RH = src.load([(seq_row0 + first).to(tl.int32), col0])
        if MASKED:
            tile_RH = tl.where((rows_R < length)[:, None], tile_RH, 0.0)
    else:
        offsets_RH = rows_R.to(tl.int64)[:, None] * stride + tl.arange(0, HEAD_DIM)[None, :]
        if MASKED:
            tile_RH = tl.load(src + offsets_RH, mask=(rows_R < length)[:, None], other=0.0)
        else:
            tile_RH = tl.load(src + offsets_RH)
    return tile_RH


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _rows_of_heads(q, k, v):
    """``q, k, v`` whose every row (token) holds its heads densely, ``[N, H]`` with unit stride;
    the rows may be further apart (views of a fused QKV projection: no copy). ``k`` and ``v``
    share one row stride (else both are copied)."""

    def dense_heads(t):
        _, heads_stride, dim_stride = t.stride()
        return t if dim_stride == 1 and heads_stride == t.shape[2] else t.contiguous()

    q, k, v = dense_heads(q), dense_heads(k), dense_heads(v)
    if k.stride(0) != v.stride(0):
        k, v = k.contiguous(), v.contiguous()
    return q, k, v


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can cover ``t [T, N, H]`` (heads dense) as ``[T, N·H]`` rows:
    16-byte aligned base and row stride, between 1 and 2³¹ − 1 rows."""
    aligned = t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
    return aligned and 0 < t.shape[0] < 2**31


def _row_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor over ``t [T, N, H]`` as ``[T, N·H]`` rows, in tiles of ``rows × H``."""
    width = t.shape[1] * t.shape[2]
    return TensorDescriptor(
        t, shape=[t.shape[0], width], strides=[t.stride(0), 1], block_shape=[rows, t.shape[2]]
    )


def _radius(rel_bias):
    return 0 if rel_bias is None else (rel_bias.shape[1] - 1) // 2


def _bias_tile_args(rel_bias, q, *, rows, cols, keys_on_rows):
    """The kernels' bias arguments: ``(tiles, o_lo, num_offsets, step)``; the tiles are in
    ``q``'s dtype, and without a bias ``q`` stands in as a pointer never read."""
    step = math.gcd(rows, cols)
    if rel_bias is None:
        return q, 0, 1, step
    tiles, o_lo, num_offsets = relative_bias_tiles(
        rel_bias, rows=rows, cols=cols, keys_on_rows=keys_on_rows, dtype=q.dtype
    )
    return tiles, o_lo, num_offsets, step


def _query_work(batch, *, total_q, block, causal) -> TileWorkList:
    """The batch's query-tile list for this tile height (built at its first use)."""
    return batch.memo(
        ("jfa.query_tiles", total_q, block, causal),
        lambda: query_tiles(
            batch.offsets, batch.kv_offsets, total_q=total_q, block=block, causal=causal
        ),
    )

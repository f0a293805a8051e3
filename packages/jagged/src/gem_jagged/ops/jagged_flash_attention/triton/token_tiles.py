"""Jagged flash attention over tiles of consecutive tokens (``Schedule.TOKEN_TILES``): many short
sequences share one tile, masked block-diagonally inside it, so no tile is padded to its height.

The per-sequence schedule gives each query tile one sequence: a batch of thousands of 1–48-token
histories then runs thousands of mostly empty 64-row tiles. Here the tiles cut the packed token
range itself: tile ``t`` holds tokens ``[t·M, (t+1)·M)``, whichever sequences they belong to, and
a sequence may cross a tile edge. Each token knows its sequence's bounds (``row_start_T``,
``row_end_T``, built once per batch from the offsets and kept in its ``JaggedBatch``); a pair
``(i, j)`` is visible when ``j`` lies in ``i``'s sequence (and ``j ≤ i`` if causal). A tile's
keys run from its first token's sequence start to its last token (causal) or its last token's
sequence end, so a lone long sequence among short ones is simply a run of tiles that stream its
earlier key blocks, as the per-sequence schedule's tiles would. Self-attention only (the op
checks that before a launch). A relative bias is gathered per score from its ``[N, 2R+1]``
table (a tile of tiny sequences crosses the band everywhere, so no far-bias shortcut), and its
gradient is reduced by bucket in the dQ kernel: each program sums ``dS`` over each bucket its
block spans into its own row of a partial buffer, and one sum over the rows finishes it (no two
programs add into the same address, so the result does not depend on their order).

Kernels (one program per (tile, head); the math is the per-sequence kernels',
``triton/__init__.py``):

- forward: online softmax over the tile's key blocks; saves the natural log-sum-exp;
- dQ: first, per query tile; computes ``δ = rowsum(dO ⊙ O)`` from the tiles it holds and stores
  it for dK/dV, then ``dQ += dS K``;
- dK/dV: per key tile, streams the query blocks that can see it (from the key tile's first token,
  or its first token's sequence start if not causal, to its last token's sequence end),
  ``dV += Pᵀ dO``, ``dK += dSᵀ Q``.

Legend (shape suffixes): ``T`` tokens, ``N`` heads, ``H`` head dim, ``M``/``Nk`` rows of a
query/key tile (BLOCK_M/BLOCK_N).
"""

import torch
import triton
import triton.language as tl

from gem_jagged._jit import jit

from .common import (
    LOG2E,
    _dot_precision,
    _online_softmax_step,
    _rows_of_heads,
    _softmax_epilogue,
)


def token_bounds(batch, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_start_T, row_end_T)``: each token's sequence bounds, int32, kept in ``batch``.
    Built on the device without reading anything back (``total`` is the host-known token
    count)."""

    def build():
        offsets = batch.offsets
        lengths = offsets[1:] - offsets[:-1]
        starts, ends = (
            torch.repeat_interleave(x.to(torch.int32), lengths, output_size=total)
            for x in (offsets[:-1], offsets[1:])
        )
        return starts, ends

    return batch.memo(("token_bounds", total), build)


@jit
def _load_rows(src, rows, row_ok, stride, col0, HEAD_DIM: tl.constexpr):
    """Rows ``rows`` of one head (columns ``col0 …``) of a ``[T, N·H]`` row layout; zeros where
    ``row_ok`` is false."""
    dims_H = tl.arange(0, HEAD_DIM)
    return tl.load(
        src + rows.to(tl.int64)[:, None] * stride + col0 + dims_H[None, :],
        mask=row_ok[:, None], other=0.0,
    )  # fmt: skip


@jit
def _tile_tokens(first, total_q, row_start_T, row_end_T, BLOCK: tl.constexpr):
    """The tokens ``first …`` of a tile: ``(tokens, in_range, sequence start, sequence end)``."""
    tokens = first + tl.arange(0, BLOCK)
    ok = tokens < total_q
    start = tl.load(row_start_T + tokens, mask=ok, other=0)
    end = tl.load(row_end_T + tokens, mask=ok, other=0)
    return tokens, ok, start, end


@jit
def _query_tile_keys(first, total_q, row_start_T, row_end_T, BLOCK_M: tl.constexpr,
                     CAUSAL: tl.constexpr):  # fmt: skip
    """``[k_lo, k_hi)``, the keys a query tile starting at ``first`` may see: from its first
    token's sequence start to its last token (causal) or its last token's sequence end."""
    last = tl.minimum(first + BLOCK_M, total_q) - 1
    k_lo = tl.load(row_start_T + first)
    if CAUSAL:
        k_hi = last + 1
    else:
        k_hi = tl.load(row_end_T + last)
    return k_lo, k_hi


@jit
def _bias_log2(s_log2, bias_NR2, head, offsets, radius):
    """``s_log2`` plus the relative bias of each pair (``offsets``: key − query position), in
    log2 units."""
    bucket = tl.minimum(tl.maximum(offsets, -radius), radius) + radius
    bias = tl.load(bias_NR2 + head * (2 * radius + 1) + bucket).to(tl.float32)
    return s_log2 + bias * LOG2E


@jit
def _visible(rows, cols, start, end, CAUSAL: tl.constexpr):
    """``[len(rows), len(cols)]``: query row ``rows[a]`` sees key ``cols[b]`` (``start``/``end``:
    the query rows' sequence bounds)."""
    visible = (cols[None, :] >= start[:, None]) & (cols[None, :] < end[:, None])
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None])
    return visible


@jit
def _tt_fwd_kernel(
    q_TNH, k_TNH, v_TNH, out_TNH, lse_NT, bias_NR2, row_start_T, row_end_T,
    num_heads, total_q, qk_scale_log2, radius, stride_q, stride_kv,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    first = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    col0 = head * HEAD_DIM
    rows_M, row_ok_M, start_M, end_M = _tile_tokens(first, total_q, row_start_T, row_end_T, BLOCK_M)
    q_MH = _load_rows(q_TNH, rows_M, row_ok_M, stride_q, col0, HEAD_DIM)
    # Stage 1: the tile's key range, from its first token's sequence start.
    k_lo, k_hi = _query_tile_keys(first, total_q, row_start_T, row_end_T, BLOCK_M, CAUSAL)

    m_M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_M = tl.zeros([BLOCK_M], tl.float32)
    acc_MH = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for block_start in tl.range(k_lo, k_hi, BLOCK_N):
        # Stage 2: scores of the block, masked to each row's own sequence.
        cols_N = block_start + tl.arange(0, BLOCK_N)
        col_ok_N = cols_N < k_hi
        k_NH = _load_rows(k_TNH, cols_N, col_ok_N, stride_kv, col0, HEAD_DIM)
        v_NH = _load_rows(v_TNH, cols_N, col_ok_N, stride_kv, col0, HEAD_DIM)
        s_MN = tl.dot(q_MH, tl.trans(k_NH), input_precision=DOT_PRECISION) * qk_scale_log2
        if HAS_BIAS:
            s_MN = _bias_log2(s_MN, bias_NR2, head, cols_N[None, :] - rows_M[:, None], radius)
        s_MN = tl.where(_visible(rows_M, cols_N, start_M, end_M, CAUSAL), s_MN, float("-inf"))
        # Stage 3: online softmax, P V accumulated.
        acc_MH, l_M, m_M = _online_softmax_step(acc_MH, l_M, m_M, s_MN, v_NH, True, DOT_PRECISION)

    # Epilogue: normalise; the natural log-sum-exp for the backward.
    out_MH, lse_M = _softmax_epilogue(acc_MH, l_M, m_M)
    dims_H = tl.arange(0, HEAD_DIM)
    tl.store(
        out_TNH + rows_M.to(tl.int64)[:, None] * (num_heads * HEAD_DIM) + col0 + dims_H[None, :],
        out_MH.to(out_TNH.dtype.element_ty),
        mask=row_ok_M[:, None],
    )
    tl.store(lse_NT + head * total_q + rows_M, lse_M, mask=row_ok_M)


@jit
def _tt_dq_kernel(
    q_TNH, k_TNH, v_TNH, out_TNH, dout_TNH, lse_NT, delta_NT, dq_TNH, bias_NR2, dbias_part_PR2,
    row_start_T, row_end_T, num_heads, total_q, scale, qk_scale_log2, radius, stride_q, stride_kv,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    first = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    col0 = head * HEAD_DIM
    row_stride = num_heads * HEAD_DIM
    rows_M, row_ok_M, start_M, end_M = _tile_tokens(first, total_q, row_start_T, row_end_T, BLOCK_M)
    q_MH = _load_rows(q_TNH, rows_M, row_ok_M, stride_q, col0, HEAD_DIM)
    do_MH = _load_rows(dout_TNH, rows_M, row_ok_M, row_stride, col0, HEAD_DIM)
    o_MH = _load_rows(out_TNH, rows_M, row_ok_M, row_stride, col0, HEAD_DIM)
    # Stage 1: δ of the tile's rows, stored for the dK/dV kernel.
    delta_M = tl.sum(do_MH.to(tl.float32) * o_MH.to(tl.float32), 1)
    tl.store(delta_NT + head * total_q + rows_M, delta_M, mask=row_ok_M)
    lse_log2_M = (
        tl.load(lse_NT + head * total_q + rows_M, mask=row_ok_M, other=float("inf")) * LOG2E
    )

    k_lo, k_hi = _query_tile_keys(first, total_q, row_start_T, row_end_T, BLOCK_M, CAUSAL)
    dq_MH = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # this program's own row of the bias gradient's partial sums
    dbias_row_R2 = dbias_part_PR2 + (head * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * (
        2 * radius + 1
    )
    for block_start in tl.range(k_lo, k_hi, BLOCK_N):
        # Stage 2: P rebuilt from the log-sum-exp, dS = P ⊙ (dP − δ), dQ += dS K.
        cols_N = block_start + tl.arange(0, BLOCK_N)
        col_ok_N = cols_N < k_hi
        k_NH = _load_rows(k_TNH, cols_N, col_ok_N, stride_kv, col0, HEAD_DIM)
        v_NH = _load_rows(v_TNH, cols_N, col_ok_N, stride_kv, col0, HEAD_DIM)
        s_MN = tl.dot(q_MH, tl.trans(k_NH), input_precision=DOT_PRECISION) * qk_scale_log2
        offsets_MN = cols_N[None, :] - rows_M[:, None]
        if HAS_BIAS:
            s_MN = _bias_log2(s_MN, bias_NR2, head, offsets_MN, radius)
        p_MN = tl.math.exp2(s_MN - lse_log2_M[:, None])
        p_MN = tl.where(_visible(rows_M, cols_N, start_M, end_M, CAUSAL), p_MN, 0.0)
        dp_MN = tl.dot(do_MH, tl.trans(v_NH), input_precision=DOT_PRECISION)
        ds_MN = p_MN * (dp_MN - delta_M[:, None])
        dq_MH = tl.dot(ds_MN.to(k_NH.dtype), k_NH, dq_MH, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            # Stage 3: dS summed per bias bucket, over the buckets this block spans.
            bucket_MN = tl.minimum(tl.maximum(offsets_MN, -radius), radius) + radius
            lo = tl.minimum(tl.maximum(block_start - (first + BLOCK_M - 1), -radius), radius)
            hi = tl.minimum(tl.maximum(block_start + BLOCK_N - 1 - first, -radius), radius)
            for bucket in tl.range(lo + radius, hi + radius + 1):
                part = tl.sum(tl.sum(tl.where(bucket_MN == bucket, ds_MN, 0.0), 1), 0)
                tl.atomic_add(dbias_row_R2 + bucket, part, sem="relaxed")

    dims_H = tl.arange(0, HEAD_DIM)
    tl.store(
        dq_TNH + rows_M.to(tl.int64)[:, None] * row_stride + col0 + dims_H[None, :],
        (dq_MH * scale).to(dq_TNH.dtype.element_ty),
        mask=row_ok_M[:, None],
    )


@jit
def _tt_dkdv_kernel(
    q_TNH, k_TNH, v_TNH, dout_TNH, lse_NT, delta_NT, dk_TNH, dv_TNH, bias_NR2, row_start_T,
    row_end_T, num_heads, total_q, scale, qk_scale_log2, radius, stride_q, stride_kv,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    first = tl.program_id(0) * BLOCK_N
    head = tl.program_id(1)
    col0 = head * HEAD_DIM
    row_stride = num_heads * HEAD_DIM
    # A key's sequence bounds are the bounds of the queries that may see it.
    cols_N, col_ok_N, start_N, end_N = _tile_tokens(first, total_q, row_start_T, row_end_T, BLOCK_N)
    k_NH = _load_rows(k_TNH, cols_N, col_ok_N, stride_kv, col0, HEAD_DIM)
    v_NH = _load_rows(v_TNH, cols_N, col_ok_N, stride_kv, col0, HEAD_DIM)
    # Stage 1: the query range that can see the tile.
    last = tl.minimum(first + BLOCK_N, total_q) - 1
    if CAUSAL:
        q_lo = first
    else:
        q_lo = tl.load(row_start_T + first)
    q_hi = tl.load(row_end_T + last)

    dk_NH = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv_NH = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for block_start in tl.range(q_lo, q_hi, BLOCK_M):
        # Stage 2: Pᵀ of the block from the saved log-sum-exp; dV += Pᵀ dO, dK += dSᵀ Q.
        rows_M = block_start + tl.arange(0, BLOCK_M)
        row_ok_M = rows_M < q_hi
        q_MH = _load_rows(q_TNH, rows_M, row_ok_M, stride_q, col0, HEAD_DIM)
        do_MH = _load_rows(dout_TNH, rows_M, row_ok_M, row_stride, col0, HEAD_DIM)
        lse_log2_M = (
            tl.load(lse_NT + head * total_q + rows_M, mask=row_ok_M, other=float("inf")) * LOG2E
        )
        delta_M = tl.load(delta_NT + head * total_q + rows_M, mask=row_ok_M, other=0.0)
        s_NM = tl.dot(k_NH, tl.trans(q_MH), input_precision=DOT_PRECISION) * qk_scale_log2
        if HAS_BIAS:
            s_NM = _bias_log2(s_NM, bias_NR2, head, cols_N[:, None] - rows_M[None, :], radius)
        p_NM = tl.math.exp2(s_NM - lse_log2_M[None, :])
        # key cols_N[a] is seen by query rows_M[b] inside the key's sequence (and b ≥ a if causal)
        visible_NM = (rows_M[None, :] >= start_N[:, None]) & (rows_M[None, :] < end_N[:, None])
        if CAUSAL:
            visible_NM = visible_NM & (rows_M[None, :] >= cols_N[:, None])
        p_NM = tl.where(visible_NM, p_NM, 0.0)
        dv_NH = tl.dot(p_NM.to(do_MH.dtype), do_MH, dv_NH, input_precision=DOT_PRECISION)
        dpt_NM = tl.dot(v_NH, tl.trans(do_MH), input_precision=DOT_PRECISION)
        dst_NM = p_NM * (dpt_NM - delta_M[None, :])
        dk_NH = tl.dot(dst_NM.to(q_MH.dtype), q_MH, dk_NH, input_precision=DOT_PRECISION)

    dims_H = tl.arange(0, HEAD_DIM)
    at_NH = cols_N.to(tl.int64)[:, None] * row_stride + col0 + dims_H[None, :]
    tl.store(dk_TNH + at_NH, (dk_NH * scale).to(dk_TNH.dtype.element_ty), mask=col_ok_N[:, None])
    tl.store(dv_TNH + at_NH, dv_NH.to(dv_TNH.dtype.element_ty), mask=col_ok_N[:, None])


def _bias_args(rel_bias, q) -> tuple[torch.Tensor, int]:
    """The kernels' ``(bias_NR2, radius)``: the bias table in float32, or ``q`` standing in as
    a pointer never read."""
    if rel_bias is None:
        return q, 0
    return rel_bias.detach().float().contiguous(), (rel_bias.shape[1] - 1) // 2


def token_tiles_forward(q, k, v, batch, *, causal, scale, rel_bias, config):
    """``(out [T, N, H], lse [N, T] float32)`` of self-attention over ``batch`` in token tiles
    of ``config.forward``'s shape, with the relative bias ``rel_bias [N, 2R+1]`` or None."""
    total, num_heads, head_dim = q.shape
    q, k, v = _rows_of_heads(q, k, v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((num_heads, total), dtype=torch.float32)
    if total == 0:
        return out, lse
    row_start, row_end = token_bounds(batch, total)
    bias, radius = _bias_args(rel_bias, q)
    tile = config.forward
    _tt_fwd_kernel[(triton.cdiv(total, tile.block_m), num_heads)](
        q, k, v, out, lse, bias, row_start, row_end, num_heads, total, scale * LOG2E, radius,
        q.stride(0), k.stride(0),
        HEAD_DIM=head_dim, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, CAUSAL=causal,
        HAS_BIAS=rel_bias is not None, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=tile.warps, num_stages=tile.stages,
    )  # fmt: skip
    return out, lse


def token_tiles_backward(dout, q, k, v, out, lse, batch, *, causal, scale, rel_bias, config):
    """``(dq, dk, dv, d_rel_bias or None)`` of ``token_tiles_forward``: the dQ kernel (which
    stores δ and sums the bias gradient's partial rows), then dK/dV, on ``config.dq``'s and
    ``config.dkdv``'s tile shapes."""
    total, num_heads, head_dim = q.shape
    q, k, v = _rows_of_heads(q, k, v)
    dout, out = dout.contiguous(), out.contiguous()
    dq, dk, dv = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
    dbias = None if rel_bias is None else torch.zeros_like(rel_bias)
    if total == 0:
        return dq, dk, dv, dbias
    row_start, row_end = token_bounds(batch, total)
    bias, radius = _bias_args(rel_bias, q)
    delta = torch.empty((num_heads, total), dtype=torch.float32, device=q.device)
    common = dict(
        HEAD_DIM=head_dim, CAUSAL=causal, HAS_BIAS=rel_bias is not None,
        DOT_PRECISION=_dot_precision(q.dtype),
    )  # fmt: skip
    strides = (q.stride(0), k.stride(0))
    tile = config.dq
    tiles = triton.cdiv(total, tile.block_m)
    dbias_part = (
        lse  # never written without a bias
        if rel_bias is None
        else torch.zeros(num_heads * tiles, 2 * radius + 1, dtype=torch.float32, device=q.device)
    )
    _tt_dq_kernel[(tiles, num_heads)](
        q, k, v, out, dout, lse, delta, dq, bias, dbias_part, row_start, row_end, num_heads,
        total, scale, scale * LOG2E, radius, *strides,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=tile.warps,
        num_stages=tile.stages, **common,
    )  # fmt: skip
    tile = config.dkdv
    _tt_dkdv_kernel[(triton.cdiv(total, tile.block_n), num_heads)](
        q, k, v, dout, lse, delta, dk, dv, bias, row_start, row_end, num_heads, total, scale,
        scale * LOG2E, radius, *strides,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=tile.warps,
        num_stages=tile.stages, **common,
    )  # fmt: skip
    if rel_bias is not None:
        dbias = dbias_part.view(num_heads, tiles, -1).sum(1).to(rel_bias.dtype)
    return dq, dk, dv, dbias

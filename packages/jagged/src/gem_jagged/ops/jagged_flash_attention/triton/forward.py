"""The jagged flash attention forward in Triton: online softmax over the key blocks of each
(query tile, head), heaviest tiles first (the algorithm: ``triton/__init__.py``), and its
launcher, which hands the pass to the Gluon forward of ``hopper/`` where the config asks for it
and the rows allow.

Legend (shape suffixes): ``Tq``/``Tk`` total query/key tokens, ``B`` sequences, ``N`` heads,
``H`` head dim, ``W`` work-list slots, ``R2`` relative-bias buckets (2R+1), ``M``/``Nk`` rows of
a query/key tile (BLOCK_M/BLOCK_N).
"""

import torch
import triton.language as tl

from gem_jagged._jit import jit
from gem_jagged._tiles import load_sequence, slot_and_head
from gem_jagged._worklist import tile_slot_bound

from .. import hopper
from ..bias_tiles import add_relative_bias, far_bias_log2
from ..config import KernelImpl, KeyLoads, Schedule
from .common import (
    LOG2E,
    _bias_tile_args,
    _dot_precision,
    _key_block_stops,
    _online_softmax_step,
    _query_work,
    _radius,
    _row_descriptor,
    _rows_of_heads,
    _softmax_epilogue,
    _stream_tile,
    _tma_ready,
)
from .token_tiles import token_tiles_forward


@jit
def _fwd_key_blocks(
    acc_MH, l_M, m_M, q_MH, k_src, v_src, k_row0, col0, bias_head, far_bias, bias_o_lo,
    bias_offsets, q_start, rows_M, k_len, diag, start, stop, qk_scale_log2, stride_kv,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, FAR_BIAS: tl.constexpr, MASKED: tl.constexpr,
    BIAS_STEP: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """Stream key blocks ``[start, stop)`` past the query tile (online softmax update); with
    ``FAR_BIAS`` the blocks lie left of the bias band and add ``far_bias`` to every score."""
    for block_start in tl.range(start, stop, BLOCK_N, num_stages=NUM_STAGES):
        cols_N = block_start + tl.arange(0, BLOCK_N)
        k_NH = _stream_tile(
            k_src, k_row0, block_start, col0, stride_kv, k_len, MASKED, TMA, BLOCK_N, HEAD_DIM
        )
        v_NH = _stream_tile(
            v_src, k_row0, block_start, col0, stride_kv, k_len, MASKED, TMA, BLOCK_N, HEAD_DIM
        )
        # Stage 1: scores in the log2 domain.
        s_MN = tl.dot(q_MH, tl.trans(k_NH), input_precision=DOT_PRECISION) * qk_scale_log2
        s_MN = add_relative_bias(
            s_MN, far_bias, bias_head, block_start - q_start, bias_o_lo, bias_offsets,
            HAS_BIAS, FAR_BIAS, BLOCK_M, BLOCK_N, BIAS_STEP,
        )  # fmt: skip
        if MASKED:
            visible_MN = (cols_N < k_len)[None, :]
            if CAUSAL:
                visible_MN = visible_MN & (cols_N[None, :] <= rows_M[:, None] + diag)
            s_MN = tl.where(visible_MN, s_MN, float("-inf"))
        # Stage 2: online softmax, P V accumulated.
        acc_MH, l_M, m_M = _online_softmax_step(acc_MH, l_M, m_M, s_MN, v_NH, MASKED, DOT_PRECISION)
    return acc_MH, l_M, m_M


@jit
def _jfa_fwd_kernel(
    q_TqNH, k_TkNH, v_TkNH, out_TqNH, lse_NTq, bias_tiles_NOMN,
    q_offsets_Bp1, kv_offsets_Bp1, work_seq_W, work_start_W, work_hi_W,
    num_heads, total_q, qk_scale_log2, radius, bias_o_lo, bias_offsets, stride_q, stride_kv,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_STEP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    slot, head = slot_and_head(num_heads, False)
    seq = tl.load(work_seq_W + slot)
    if seq < 0:
        return
    q_start = tl.load(work_start_W + slot)
    k_stop = tl.load(work_hi_W + slot)
    q_begin, q_len = load_sequence(q_offsets_Bp1, seq)
    k_begin, k_len = load_sequence(kv_offsets_Bp1, seq)
    diag = k_len - q_len  # query i sees key j iff j <= i + diag (bottom-right causal)

    rows_M = q_start + tl.arange(0, BLOCK_M)
    dims_H = tl.arange(0, HEAD_DIM)
    row_ok_M = rows_M < q_len
    q_rows_M = q_begin + rows_M.to(tl.int64)
    q_MH = tl.load(
        q_TqNH + q_rows_M[:, None] * stride_q + head * HEAD_DIM + dims_H[None, :],
        mask=row_ok_M[:, None], other=0.0,
    )  # fmt: skip
    if TMA:  # descriptors: each load adds the sequence's first row and the head's column
        k_src, v_src = k_TkNH, v_TkNH
    else:
        k_src = k_TkNH + k_begin * stride_kv + head * HEAD_DIM
        v_src = v_TkNH + k_begin * stride_kv + head * HEAD_DIM
    bias_head = bias_tiles_NOMN + head.to(tl.int64) * bias_offsets * (BLOCK_M * BLOCK_N)

    m_M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_M = tl.zeros([BLOCK_M], tl.float32)
    acc_MH = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Blocks left of the bias band add one scalar; the rest load a bias tile; only blocks
    # crossing the diagonal or the sequence's end are masked.
    far_stop, full_stop = _key_block_stops(
        q_start, k_len, diag, k_stop, radius, CAUSAL, HAS_BIAS, BLOCK_N
    )
    far_bias = 0.0
    if HAS_BIAS:
        far_bias = far_bias_log2(bias_head)
    acc_MH, l_M, m_M = _fwd_key_blocks(
        acc_MH, l_M, m_M, q_MH, k_src, v_src, k_begin, head * HEAD_DIM, bias_head, far_bias,
        bias_o_lo, bias_offsets, q_start, rows_M, k_len, diag, 0, far_stop, qk_scale_log2,
        stride_kv,
        HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, HAS_BIAS, True, False, BIAS_STEP, DOT_PRECISION,
        NUM_STAGES, TMA,
    )  # fmt: skip
    acc_MH, l_M, m_M = _fwd_key_blocks(
        acc_MH, l_M, m_M, q_MH, k_src, v_src, k_begin, head * HEAD_DIM, bias_head, far_bias,
        bias_o_lo, bias_offsets, q_start, rows_M, k_len, diag, far_stop, full_stop, qk_scale_log2,
        stride_kv,
        HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, HAS_BIAS, False, False, BIAS_STEP, DOT_PRECISION,
        NUM_STAGES, TMA,
    )  # fmt: skip
    acc_MH, l_M, m_M = _fwd_key_blocks(
        acc_MH, l_M, m_M, q_MH, k_src, v_src, k_begin, head * HEAD_DIM, bias_head, far_bias,
        bias_o_lo, bias_offsets, q_start, rows_M, k_len, diag, full_stop, k_stop, qk_scale_log2,
        stride_kv,
        HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, HAS_BIAS, False, True, BIAS_STEP, DOT_PRECISION,
        NUM_STAGES, TMA,
    )  # fmt: skip

    # Epilogue: normalise; rows that saw no key write zeros and lse = +inf.
    out_MH, lse_M = _softmax_epilogue(acc_MH, l_M, m_M)
    tl.store(
        out_TqNH + q_rows_M[:, None] * (num_heads * HEAD_DIM) + head * HEAD_DIM + dims_H[None, :],
        out_MH.to(out_TqNH.dtype.element_ty),
        mask=row_ok_M[:, None],
    )
    tl.store(lse_NTq + head * total_q + q_begin + rows_M, lse_M, mask=row_ok_M)


def jfa_forward(q, k, v, batch, *, causal, scale, rel_bias, config, descriptors=None):
    """Launch the forward kernel over ``batch`` (a ``JaggedBatch``); returns ``(out [Tq, N, H],
    lse [N, Tq] float32, work)``.

    ``work`` is the query-tile work list packed as int32 ``[5, W]``; the backward's dQ kernel
    reuses it instead of building it again. It is kept in the batch (``JaggedBatch.memo``), so
    the other layers of the batch reuse it too. ``descriptors`` (a dict, or None) remembers the
    Gluon kernels' TMA descriptors for the backward's launches (``hopper.launch.row_descriptor``).
    ``config``: the ``JaggedAttentionConfig`` (``config_for_inputs`` picks one).
    """
    total_q, num_heads, head_dim = q.shape
    cfg = config
    if cfg.schedule == Schedule.TOKEN_TILES:  # no work list: the tiles are the token range's
        out, lse = token_tiles_forward(
            q, k, v, batch, causal=causal, scale=scale, rel_bias=rel_bias, config=cfg
        )
        return out, lse, q.new_empty((5, 0), dtype=torch.int32)
    q, k, v = _rows_of_heads(q, k, v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((num_heads, total_q), dtype=torch.float32)
    work = _query_work(batch, total_q=total_q, block=cfg.forward.block_m, causal=causal)
    tiles, o_lo, num_offsets, step = _bias_tile_args(
        rel_bias, q, rows=cfg.forward.block_m, cols=cfg.forward.block_n, keys_on_rows=False
    )
    grid = (work.num_slots * num_heads,)
    if cfg.forward_impl == KernelImpl.GLUON_HOPPER and hopper.supported(
        q,
        k,
        v,
        rel_bias=rel_bias is not None,
        rows=cfg.forward.block_m,
        num_warps=cfg.forward.warps,
    ):
        from ..hopper.launch import launch_forward  # Gluon loads only where its kernels run

        launch_forward(
            grid, q, k, v, out, lse, batch.offsets, batch.kv_offsets, work, scale=scale,
            causal=causal, config=cfg, descriptors=descriptors,
        )  # fmt: skip
        return out, lse, work.packed_5W
    tma = cfg.key_loads == KeyLoads.TMA and _tma_ready(k) and _tma_ready(v)
    k_src, v_src = k, v
    if tma:
        k_src, v_src = (_row_descriptor(t, cfg.forward.block_n) for t in (k, v))
    _jfa_fwd_kernel[grid](
        q, k_src, v_src, out, lse, tiles, batch.offsets, batch.kv_offsets,
        work.seq_W, work.start_W, work.hi_W,
        num_heads, total_q, scale * LOG2E, _radius(rel_bias), o_lo, num_offsets, q.stride(0),
        k.stride(0),
        HEAD_DIM=head_dim, BLOCK_M=cfg.forward.block_m, BLOCK_N=cfg.forward.block_n, CAUSAL=causal,
        HAS_BIAS=rel_bias is not None, BIAS_STEP=step, DOT_PRECISION=_dot_precision(q.dtype),
        TMA=tma, NUM_STAGES=cfg.forward.stages, num_warps=cfg.forward.warps, num_stages=cfg.forward.stages,
    )  # fmt: skip
    return out, lse, work.packed_5W


def forward_work_slots(q: torch.Tensor, q_offsets: torch.Tensor, *, config) -> int:
    """Slots of the forward's query work list under ``config`` (host shapes only; for fake
    tensors too); none for token tiles."""
    if config.schedule == Schedule.TOKEN_TILES:
        return 0
    return tile_slot_bound(q.shape[0], q_offsets.shape[0] - 1, config.forward.block_m)

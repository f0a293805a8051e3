"""The jagged flash attention dQ kernel in Triton (a query tile held, its key blocks streamed;
it also stores δ for the dK/dV kernel and owns the relative-bias gradient), and its launcher.
The algorithm: ``triton/__init__.py``.

Legend (shape suffixes): ``Tq``/``Tk`` total query/key tokens, ``B`` sequences, ``N`` heads,
``H`` head dim, ``W`` work-list slots, ``R2`` relative-bias buckets (2R+1), ``M``/``Nk`` rows of
a query/key tile (BLOCK_M/BLOCK_N).
"""

import torch
import triton.language as tl

from gem_jagged._jit import jit
from gem_jagged._tiles import load_sequence, slot_and_head
from gem_jagged._worklist import TileWorkList

from .. import hopper
from ..bias_tiles import add_relative_bias, far_bias_log2
from ..config import KernelImpl
from .common import LOG2E, _bias_tile_args, _dot_precision, _key_block_stops, _query_work, _radius


@jit
def _dq_key_blocks(
    dq_MH, q_MH, do_MH, lse_M, delta_M, k_head, v_head, bias_head, far_bias,
    bias_o_lo, bias_offsets, dbias_row_R2, rows_M, q_start, k_len, diag, start, stop,
    qk_scale_log2, radius, stride_kv,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, FAR_BIAS: tl.constexpr,
    MASKED: tl.constexpr, BIAS_STEP: tl.constexpr, DIAG_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """Stream key blocks ``[start, stop)``: dQ (unscaled) and the bias gradient of buckets
    1 … 2R by diagonal (bucket 0 is finished on the host). With ``FAR_BIAS`` the blocks lie
    left of the bias band: all bucket 0, no bias work."""
    dims_H = tl.arange(0, HEAD_DIM)
    for block_start in tl.range(start, stop, BLOCK_N, num_stages=NUM_STAGES):
        cols_N = block_start + tl.arange(0, BLOCK_N)
        kv_offsets_NH = cols_N.to(tl.int64)[:, None] * stride_kv + dims_H[None, :]
        if MASKED:
            in_seq_N = cols_N < k_len
            k_NH = tl.load(k_head + kv_offsets_NH, mask=in_seq_N[:, None], other=0.0)
            v_NH = tl.load(v_head + kv_offsets_NH, mask=in_seq_N[:, None], other=0.0)
        else:
            k_NH = tl.load(k_head + kv_offsets_NH)
            v_NH = tl.load(v_head + kv_offsets_NH)
        s_MN = tl.dot(q_MH, tl.trans(k_NH), input_precision=DOT_PRECISION) * qk_scale_log2
        s_MN = add_relative_bias(
            s_MN, far_bias, bias_head, block_start - q_start, bias_o_lo, bias_offsets,
            HAS_BIAS, FAR_BIAS, BLOCK_M, BLOCK_N, BIAS_STEP,
        )  # fmt: skip
        p_MN = tl.math.exp2(s_MN - lse_M[:, None])
        if MASKED:
            visible_MN = in_seq_N[None, :]
            if CAUSAL:
                visible_MN = visible_MN & (cols_N[None, :] <= rows_M[:, None] + diag)
            p_MN = tl.where(visible_MN, p_MN, 0.0)
        dp_MN = tl.dot(do_MH, tl.trans(v_NH), input_precision=DOT_PRECISION)
        ds_MN = p_MN * (dp_MN - delta_M[:, None])
        dq_MH = tl.dot(ds_MN.to(k_NH.dtype), k_NH, dq_MH, input_precision=DOT_PRECISION)
        if HAS_BIAS and not FAR_BIAS:
            # Reduce dS by diagonal d = j − i into buckets 1 … 2R, in this program's own row of
            # the partial buffer. The right edge bucket (d ≥ R) takes a masked sum of the tile
            # when the tile reaches it (the largest visible d is ``diag`` when causal); the
            # interior diagonals (|d| < R) the tile crosses are read out skewed, DIAG_CHUNK at a
            # time: column c of ``ds_MK`` is diagonal d0 + c of the tile, one row per query, so
            # a column sum is that diagonal's sum. Bucket 0 is finished on the host.
            offset = block_start - q_start  # d = offset + (key col − query row) in the tile
            right_edge = tl.maximum(radius, 1)
            d_top = offset + BLOCK_N - 1
            if CAUSAL:
                d_top = tl.minimum(d_top, diag)
            if d_top >= right_edge:
                rel_MN = cols_N[None, :] - rows_M[:, None]
                right = tl.sum(tl.sum(tl.where(rel_MN >= right_edge, ds_MN, 0.0), 1), 0)
                tl.atomic_add(dbias_row_R2 + 2 * radius, right, sem="relaxed")
            d_min = tl.maximum(offset - (BLOCK_M - 1), 1 - radius)
            d_max = tl.minimum(d_top, radius - 1)
            tile_rows_M = tl.arange(0, BLOCK_M)
            for d0 in range(d_min, d_max + 1, DIAG_CHUNK):
                diag_K = d0 + tl.arange(0, DIAG_CHUNK)
                col_MK = diag_K[None, :] - offset + tile_rows_M[:, None]
                take_MK = (col_MK >= 0) & (col_MK < BLOCK_N)  # diagonals past d_max: not stored
                ds_MK = tl.gather(ds_MN, tl.where(take_MK, col_MK, 0), axis=1)
                sums_K = tl.where(diag_K <= d_max, tl.sum(tl.where(take_MK, ds_MK, 0.0), 0), 0.0)
                tl.atomic_add(
                    dbias_row_R2 + radius + diag_K, sums_K, mask=diag_K <= d_max, sem="relaxed"
                )
    return dq_MH


@jit
def _jfa_dq_kernel(
    q_TqNH, k_TkNH, v_TkNH, out_TqNH, do_TqNH, lse_NTq, delta_NTq, bias_tiles_NOMN, dq_TqNH,
    dbias_part_PR2,
    q_offsets_Bp1, kv_offsets_Bp1, work_seq_W, work_start_W, work_hi_W,
    num_heads, total_q, scale, qk_scale_log2, radius, bias_o_lo, bias_offsets, stride_q, stride_kv,
    keys_done_elsewhere,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_STEP: tl.constexpr,
    DIAG_CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    slot, head = slot_and_head(num_heads, True)
    seq = tl.load(work_seq_W + slot)
    if seq < 0:
        return
    q_start = tl.load(work_start_W + slot)
    k_stop = tl.load(work_hi_W + slot)
    q_begin, q_len = load_sequence(q_offsets_Bp1, seq)
    k_begin, k_len = load_sequence(kv_offsets_Bp1, seq)
    if (k_len > 0) & (k_len <= keys_done_elsewhere):
        return  # 1 to ``keys_done_elsewhere`` keys: the dK/dV kernel writes this dQ (DQ_IN_DKDV)
    diag = k_len - q_len
    stride_o = num_heads * HEAD_DIM  # O, dO and dQ are contiguous

    rows_M = q_start + tl.arange(0, BLOCK_M)
    dims_H = tl.arange(0, HEAD_DIM)
    row_ok_M = rows_M < q_len
    q_rows_M1 = (q_begin + rows_M.to(tl.int64))[:, None]
    q_MH = tl.load(
        q_TqNH + q_rows_M1 * stride_q + head * HEAD_DIM + dims_H[None, :],
        mask=row_ok_M[:, None], other=0.0,
    )  # fmt: skip
    q_offsets_MH = q_rows_M1 * stride_o + head * HEAD_DIM + dims_H[None, :]
    do_MH = tl.load(do_TqNH + q_offsets_MH, mask=row_ok_M[:, None], other=0.0)
    lse_M = tl.load(lse_NTq + head * total_q + q_begin + rows_M, mask=row_ok_M, other=float("inf"))
    lse_M = lse_M * 1.4426950408889634  # the kernels work in log2
    # δ = rowsum(dO ⊙ O) of the tile's rows, stored for the dK/dV kernel that runs next (every
    # query row belongs to exactly one query tile).
    out_MH = tl.load(out_TqNH + q_offsets_MH, mask=row_ok_M[:, None], other=0.0)
    delta_M = tl.sum(out_MH.to(tl.float32) * do_MH.to(tl.float32), 1)
    tl.store(delta_NTq + head * total_q + q_begin + rows_M, delta_M, mask=row_ok_M)
    k_head = k_TkNH + k_begin * stride_kv + head * HEAD_DIM
    v_head = v_TkNH + k_begin * stride_kv + head * HEAD_DIM
    bias_head = bias_tiles_NOMN + head.to(tl.int64) * bias_offsets * (BLOCK_M * BLOCK_N)
    dbias_row_R2 = dbias_part_PR2 + tl.program_id(0).to(tl.int64) * (2 * radius + 1)

    dq_MH = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    far_stop, full_stop = _key_block_stops(
        q_start, k_len, diag, k_stop, radius, CAUSAL, HAS_BIAS, BLOCK_N
    )
    far_bias = 0.0
    if HAS_BIAS:
        far_bias = far_bias_log2(bias_head)
    dq_MH = _dq_key_blocks(
        dq_MH, q_MH, do_MH, lse_M, delta_M, k_head, v_head, bias_head,
        far_bias, bias_o_lo, bias_offsets, dbias_row_R2, rows_M, q_start, k_len, diag,
        0, far_stop, qk_scale_log2, radius, stride_kv, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL,
        HAS_BIAS, True, False, BIAS_STEP, DIAG_CHUNK, DOT_PRECISION, NUM_STAGES,
    )  # fmt: skip
    dq_MH = _dq_key_blocks(
        dq_MH, q_MH, do_MH, lse_M, delta_M, k_head, v_head, bias_head,
        far_bias, bias_o_lo, bias_offsets, dbias_row_R2, rows_M, q_start, k_len, diag,
        far_stop, full_stop, qk_scale_log2, radius, stride_kv, HEAD_DIM, BLOCK_M, BLOCK_N,
        CAUSAL, HAS_BIAS, False, False, BIAS_STEP, DIAG_CHUNK, DOT_PRECISION, NUM_STAGES,
    )  # fmt: skip
    dq_MH = _dq_key_blocks(
        dq_MH, q_MH, do_MH, lse_M, delta_M, k_head, v_head, bias_head,
        far_bias, bias_o_lo, bias_offsets, dbias_row_R2, rows_M, q_start, k_len, diag,
        full_stop, k_stop, qk_scale_log2, radius, stride_kv, HEAD_DIM, BLOCK_M, BLOCK_N,
        CAUSAL, HAS_BIAS, False, True, BIAS_STEP, DIAG_CHUNK, DOT_PRECISION, NUM_STAGES,
    )  # fmt: skip
    tl.store(
        dq_TqNH + q_offsets_MH, (dq_MH * scale).to(dq_TqNH.dtype.element_ty), mask=row_ok_M[:, None]
    )


def backward_dq(
    dout, q, k, v, out, lse, batch, *, causal, scale, rel_bias, config, forward_work=None,
    descriptors=None, dq=None, keys_done_elsewhere=0,
):  # fmt: skip
    """dQ, the relative-bias gradient (or None) and ``δ [N, Tq] = rowsum(dO ⊙ O)`` in float32
    (q, k, v as ``_rows_of_heads`` leaves them; dout and out contiguous), from the query-tile
    work list; into ``dq`` when given. Sequences of 1 to ``keys_done_elsewhere`` keys are
    skipped (the dK/dV kernel writes their dQ).

    ``forward_work`` (the forward's packed list) is reused when its tile height matches;
    ``config``: its ``dq`` tiles and implementation.
    """
    cfg = config
    total_q, num_heads, head_dim = q.shape
    q_offsets, kv_offsets = batch.offsets, batch.kv_offsets
    if dq is None:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    delta = torch.empty(num_heads, total_q, dtype=torch.float32, device=q.device)
    radius = _radius(rel_bias)
    if forward_work is not None and cfg.forward.block_m == cfg.dq.block_m:
        qwork = TileWorkList(forward_work, cfg.dq.block_m)
    else:
        qwork = _query_work(batch, total_q=total_q, block=cfg.dq.block_m, causal=causal)
    num_programs = qwork.num_slots * num_heads
    if rel_bias is not None:
        dbias_part = torch.zeros(num_programs, 2 * radius + 1, dtype=torch.float32, device=q.device)
    else:
        dbias_part = lse
    tiles, o_lo, num_offsets, step = _bias_tile_args(
        rel_bias, q, rows=cfg.dq.block_m, cols=cfg.dq.block_n, keys_on_rows=False
    )
    if cfg.dq_impl == KernelImpl.GLUON_HOPPER and not keys_done_elsewhere and hopper.supported(
        q, k, v, out, dout,
        rel_bias=rel_bias is not None, rows=cfg.dq.block_m, num_warps=cfg.dq.warps,
    ):  # fmt: skip
        from ..hopper.launch import launch_dq  # Gluon loads only where its kernels run

        launch_dq(
            (num_programs,), q, k, v, out, dout, lse, delta, dq, q_offsets, kv_offsets, qwork,
            scale=scale, causal=causal, config=cfg, descriptors=descriptors,
        )  # fmt: skip
    else:
        _jfa_dq_kernel[(num_programs,)](
            q, k, v, out, dout, lse, delta, tiles, dq, dbias_part,
            q_offsets, kv_offsets, qwork.seq_W, qwork.start_W, qwork.hi_W,
            num_heads, total_q, scale, scale * LOG2E, radius, o_lo, num_offsets, q.stride(0),
            k.stride(0), keys_done_elsewhere,
            HEAD_DIM=head_dim, BLOCK_M=cfg.dq.block_m, BLOCK_N=cfg.dq.block_n, CAUSAL=causal,
            HAS_BIAS=rel_bias is not None, BIAS_STEP=step,
            DIAG_CHUNK=min(cfg.dq_diag_chunk, cfg.dq.block_n),
            DOT_PRECISION=_dot_precision(q.dtype), NUM_STAGES=cfg.dq.stages,
            num_warps=cfg.dq.warps, num_stages=cfg.dq.stages,
        )  # fmt: skip
    dbias = None
    if rel_bias is not None:
        dbias = dbias_part.view(num_heads, qwork.num_slots, -1).sum(1)  # heads outermost
        # Every row of dS sums to zero, so all of dS does: bucket 0 (j − i ≤ −R), which the
        # kernel never sums, is minus the other buckets.
        dbias[:, :1] = -dbias[:, 1:].sum(1, keepdim=True)
        dbias = dbias.to(rel_bias.dtype)
    return dq, dbias, delta

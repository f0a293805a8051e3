"""The jagged flash attention dK/dV kernel in Triton (a key tile held, the query blocks that
see it streamed; long query ranges split into chunks that meet in a float32 scratch), the
kernel that finishes split tiles after the Gluon dK/dV kernel, the split rule, and the launcher.
The algorithm: ``triton/__init__.py``.

Legend (shape suffixes): ``Tq``/``Tk`` total query/key tokens, ``B`` sequences, ``N`` heads,
``H`` head dim, ``W`` work-list slots, ``R2`` relative-bias buckets (2R+1), ``M``/``Nk`` rows of
a query/key tile (BLOCK_M/BLOCK_N).
"""

import torch
import triton.language as tl

from gem_jagged._jit import jit
from gem_jagged._tiles import load_sequence, slot_and_head
from gem_jagged._worklist import key_tiles

from ..bias_tiles import add_relative_bias, far_bias_log2
from ..config import JaggedAttentionConfig
from .common import LOG2E, _bias_tile_args, _dot_precision, _radius, _sm_count, _unused_float32


def longest_query_rows(batch, *, total_q: int) -> int:
    """The longest query sequence of ``batch`` as the backward sizes its split by: the batch's
    ``max_len`` (the checked longest length, else the caller's hint), else all ``total_q``."""
    return total_q if batch.max_len is None else min(batch.max_len, total_q)


def dkdv_splits(
    cfg: JaggedAttentionConfig, *, total_q: int, total_kv: int, num_seqs: int, num_heads: int,
    longest_q: int, causal: bool, sm_count: int | None,
) -> int:  # fmt: skip
    """Chunks per key tile: more than one only where the longest tile would be the launch's tail.

    The heaviest dK/dV program streams the whole query range of the longest sequence, about
    ``longest_q`` rows. The launch shares about ``pairs · N / BLOCK_N`` streamed rows over the
    SMs, with ``pairs`` estimated from host-known sizes as ``Tq · Tk / B`` (halved when causal),
    the count for equal lengths. Heaviest-first scheduling hides a program no longer than one
    SM's share; a longer one is cut into chunks of about that share (at least ``split_rows``
    rows, at most ``max_splits`` chunks). Splitting costs a float32 scratch for dK/dV (zeroed:
    proportional to ``Tk``), atomics and, after the Gluon kernel, a finishing kernel, so it is
    kept for real tails: J3 (64 keys per sequence, one key tile each) splits, J1 and J2 do not.
    ``sm_count`` None (the interpreter) splits whenever ``cfg`` allows, so that tests cover it.
    """
    if longest_q <= cfg.split_rows or cfg.max_splits <= 1 or num_seqs == 0:
        return 1
    if sm_count is None:  # the interpreter: split whenever allowed, so tests cover it
        return max(1, min(cfg.max_splits, -(-longest_q // cfg.split_rows)))
    pairs = total_q * total_kv / num_seqs / (2 if causal else 1)
    share = pairs * num_heads / cfg.dkdv.block_n / sm_count
    if longest_q <= share:
        return 1
    return max(1, min(cfg.max_splits, -(-longest_q // max(cfg.split_rows, int(share)))))


@jit
def _dkdv_query_blocks(
    dk_NH, dv_NH, k_NH, v_NH, q_head, do_head, out_head, dq_head, lse_head, delta_head,
    bias_head, far_bias, bias_o_lo, bias_offsets, k_start, cols_N, q_len, diag, start, stop,
    scale, qk_scale_log2, stride_q, stride_o, dq_here,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, FAR_BIAS: tl.constexpr, MASKED: tl.constexpr,
    BIAS_STEP: tl.constexpr, DQ_IN_DKDV: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """Stream query blocks ``[start, stop)`` past the key tile, accumulating dK (unscaled), dV;
    with ``FAR_BIAS`` the blocks lie below the bias band (bucket 0 for every pair). With
    ``DQ_IN_DKDV`` δ comes from the output block instead of the dQ kernel, and where the tile
    holds all of the sequence's keys (``dq_here``) each block's dQ = dS K is stored too."""
    dims_H = tl.arange(0, HEAD_DIM)
    for block_start in tl.range(start, stop, BLOCK_M, num_stages=NUM_STAGES):
        rows_M = block_start + tl.arange(0, BLOCK_M)
        row_ok_M = rows_M < q_len
        rows_M1 = rows_M.to(tl.int64)[:, None]
        q_MH = tl.load(
            q_head + rows_M1 * stride_q + dims_H[None, :], mask=row_ok_M[:, None], other=0.0
        )
        do_MH = tl.load(
            do_head + rows_M1 * stride_o + dims_H[None, :], mask=row_ok_M[:, None], other=0.0
        )
        lse_M = tl.load(lse_head + rows_M, mask=row_ok_M, other=float("inf")) * 1.4426950408889634
        if DQ_IN_DKDV:
            out_MH = tl.load(
                out_head + rows_M1 * stride_o + dims_H[None, :], mask=row_ok_M[:, None], other=0.0
            )
            delta_M = tl.sum(out_MH.to(tl.float32) * do_MH.to(tl.float32), 1)
        else:
            delta_M = tl.load(delta_head + rows_M, mask=row_ok_M, other=0.0)
        # Rebuild Pᵀ from the saved log-sum-exp.
        s_NM = tl.dot(k_NH, tl.trans(q_MH), input_precision=DOT_PRECISION) * qk_scale_log2
        s_NM = add_relative_bias(
            s_NM, far_bias, bias_head, k_start - block_start, bias_o_lo, bias_offsets,
            HAS_BIAS, FAR_BIAS, BLOCK_N, BLOCK_M, BIAS_STEP,
        )  # fmt: skip
        p_NM = tl.math.exp2(s_NM - lse_M[None, :])
        if MASKED:
            if CAUSAL:
                p_NM = tl.where(cols_N[:, None] <= rows_M[None, :] + diag, p_NM, 0.0)
        dv_NH = tl.dot(p_NM.to(do_MH.dtype), do_MH, dv_NH, input_precision=DOT_PRECISION)
        dp_NM = tl.dot(v_NH, tl.trans(do_MH), input_precision=DOT_PRECISION)
        ds_NM = (p_NM * (dp_NM - delta_M[None, :])).to(q_MH.dtype)
        dk_NH = tl.dot(ds_NM, q_MH, dk_NH, input_precision=DOT_PRECISION)
        if DQ_IN_DKDV:
            if dq_here:
                dq_MH = tl.dot(tl.trans(ds_NM), k_NH, input_precision=DOT_PRECISION) * scale
                tl.store(
                    dq_head + rows_M1 * stride_o + dims_H[None, :],
                    dq_MH.to(dq_head.dtype.element_ty), mask=row_ok_M[:, None],
                )  # fmt: skip
    return dk_NH, dv_NH


@jit
def _jfa_dkdv_kernel(
    q_TqNH, k_TkNH, v_TkNH, out_TqNH, do_TqNH, lse_NTq, delta_NTq, bias_tiles_NONM,
    dq_TqNH, dk_TkNH, dv_TkNH, scratch_F,
    q_offsets_Bp1, kv_offsets_Bp1, work_seq_W, work_start_W, work_lo_W, work_hi_W, work_splits_W,
    num_heads, total_q, total_k, scale, qk_scale_log2, radius, bias_o_lo, bias_offsets,
    stride_q, stride_kv,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_STEP: tl.constexpr,
    DQ_IN_DKDV: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    slot, head = slot_and_head(num_heads, True)
    seq = tl.load(work_seq_W + slot)
    if seq < 0:
        return
    k_start = tl.load(work_start_W + slot)
    q_lo = tl.load(work_lo_W + slot)
    q_hi = tl.load(work_hi_W + slot)
    splits = tl.load(work_splits_W + slot)
    q_begin, q_len = load_sequence(q_offsets_Bp1, seq)
    k_begin, k_len = load_sequence(kv_offsets_Bp1, seq)
    diag = k_len - q_len
    stride_o = num_heads * HEAD_DIM  # O, dO, dQ, dK, dV and the scratch are contiguous

    cols_N = k_start + tl.arange(0, BLOCK_N)
    dims_H = tl.arange(0, HEAD_DIM)
    col_ok_N = cols_N < k_len
    k_rows_N1 = (k_begin + cols_N.to(tl.int64))[:, None]
    kv_in_NH = k_rows_N1 * stride_kv + head * HEAD_DIM + dims_H[None, :]
    k_NH = tl.load(k_TkNH + kv_in_NH, mask=col_ok_N[:, None], other=0.0)
    v_NH = tl.load(v_TkNH + kv_in_NH, mask=col_ok_N[:, None], other=0.0)
    kv_offsets_NH = k_rows_N1 * stride_o + head * HEAD_DIM + dims_H[None, :]
    q_head = q_TqNH + q_begin * stride_q + head * HEAD_DIM
    do_head = do_TqNH + q_begin * stride_o + head * HEAD_DIM
    out_head = out_TqNH + q_begin * stride_o + head * HEAD_DIM
    dq_head = dq_TqNH + q_begin * stride_o + head * HEAD_DIM
    lse_head = lse_NTq + head * total_q + q_begin
    delta_head = delta_NTq + head * total_q + q_begin
    bias_head = bias_tiles_NONM + head.to(tl.int64) * bias_offsets * (BLOCK_N * BLOCK_M)
    # The tile holds every key of its sequence: dQ of the rows it visits is complete here.
    dq_here = k_len <= BLOCK_N
    if DQ_IN_DKDV:
        if CAUSAL:
            # Rows above the diagonal see no key and are in no chunk: the first chunk zeroes
            # their dQ.
            first_lo = tl.minimum(tl.maximum(k_start - diag, 0) // BLOCK_M * BLOCK_M, q_len)
            if dq_here & (q_lo == first_lo):
                zeros_MH = tl.zeros([BLOCK_M, HEAD_DIM], dq_TqNH.dtype.element_ty)
                for block_start in range(0, first_lo, BLOCK_M):
                    rows_M = block_start + tl.arange(0, BLOCK_M)
                    tl.store(
                        dq_head + rows_M.to(tl.int64)[:, None] * stride_o + dims_H[None, :],
                        zeros_MH, mask=(rows_M < first_lo)[:, None],
                    )  # fmt: skip

    dk_NH = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv_NH = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # Query blocks starting before the last key's diagonal need the causal mask; later ones
    # see the whole key tile.
    mask_stop = q_lo
    if CAUSAL:
        first_full = k_start + BLOCK_N - 1 - diag
        mask_stop = q_lo + tl.maximum(first_full - q_lo + BLOCK_M - 1, 0) // BLOCK_M * BLOCK_M
        mask_stop = tl.minimum(mask_stop, q_hi)
    # Query blocks from ``far_start`` on see the key tile only left of the bias band
    # (i − j > R for every pair): one scalar bias instead of a gather.
    far_start = q_hi
    far_bias = 0.0
    if HAS_BIAS:
        first_far = k_start + BLOCK_N + radius  # rows i ≥ this have j − i < −R for every key
        far_start = q_lo + tl.maximum(first_far - q_lo + BLOCK_M - 1, 0) // BLOCK_M * BLOCK_M
        far_start = tl.minimum(tl.maximum(far_start, mask_stop), q_hi)
        far_bias = far_bias_log2(bias_head)
    dk_NH, dv_NH = _dkdv_query_blocks(
        dk_NH, dv_NH, k_NH, v_NH, q_head, do_head, out_head, dq_head, lse_head, delta_head,
        bias_head, far_bias, bias_o_lo, bias_offsets, k_start, cols_N, q_len, diag, q_lo,
        mask_stop, scale, qk_scale_log2, stride_q, stride_o, dq_here, HEAD_DIM, BLOCK_M,
        BLOCK_N, CAUSAL, HAS_BIAS, False, True, BIAS_STEP, DQ_IN_DKDV, DOT_PRECISION, NUM_STAGES,
    )  # fmt: skip
    dk_NH, dv_NH = _dkdv_query_blocks(
        dk_NH, dv_NH, k_NH, v_NH, q_head, do_head, out_head, dq_head, lse_head, delta_head,
        bias_head, far_bias, bias_o_lo, bias_offsets, k_start, cols_N, q_len, diag, mask_stop,
        far_start, scale, qk_scale_log2, stride_q, stride_o, dq_here, HEAD_DIM, BLOCK_M,
        BLOCK_N, CAUSAL, HAS_BIAS, False, False, BIAS_STEP, DQ_IN_DKDV, DOT_PRECISION, NUM_STAGES,
    )  # fmt: skip
    dk_NH, dv_NH = _dkdv_query_blocks(
        dk_NH, dv_NH, k_NH, v_NH, q_head, do_head, out_head, dq_head, lse_head, delta_head,
        bias_head, far_bias, bias_o_lo, bias_offsets, k_start, cols_N, q_len, diag, far_start,
        q_hi, scale, qk_scale_log2, stride_q, stride_o, dq_here, HEAD_DIM, BLOCK_M,
        BLOCK_N, CAUSAL, HAS_BIAS, True, False, BIAS_STEP, DQ_IN_DKDV, DOT_PRECISION, NUM_STAGES,
    )  # fmt: skip
    dk_NH = dk_NH * scale
    out_ty = dk_TkNH.dtype.element_ty
    if splits > 1:
        # The chunks of a split tile add their parts into the float32 scratch ([dK; dV; one
        # arrival counter per (key row, head)]); the last to arrive casts the sums into dK/dV.
        # All of this program's adds are issued (barrier) before its arrival is counted
        # (release), and the sums are read after (acquire), from L2.
        dk_scratch = scratch_F + kv_offsets_NH
        dv_scratch = dk_scratch + total_k.to(tl.int64) * stride_o
        tl.atomic_add(dk_scratch, dk_NH, mask=col_ok_N[:, None], sem="relaxed")
        tl.atomic_add(dv_scratch, dv_NH, mask=col_ok_N[:, None], sem="relaxed")
        tl.debug_barrier()
        arrivals = scratch_F + 2 * total_k.to(tl.int64) * stride_o
        arrivals = arrivals.to(tl.pointer_type(tl.int32), bitcast=True)
        arrived = tl.atomic_add(arrivals + (k_begin + k_start) * num_heads + head, 1, sem="acq_rel")
        if arrived == splits - 1:
            dk_NH = tl.load(dk_scratch, mask=col_ok_N[:, None], other=0.0, cache_modifier=".cg")
            dv_NH = tl.load(dv_scratch, mask=col_ok_N[:, None], other=0.0, cache_modifier=".cg")
            tl.store(dk_TkNH + kv_offsets_NH, dk_NH.to(out_ty), mask=col_ok_N[:, None])
            tl.store(dv_TkNH + kv_offsets_NH, dv_NH.to(out_ty), mask=col_ok_N[:, None])
    else:
        tl.store(dk_TkNH + kv_offsets_NH, dk_NH.to(out_ty), mask=col_ok_N[:, None])
        tl.store(dv_TkNH + kv_offsets_NH, dv_NH.to(out_ty), mask=col_ok_N[:, None])


@jit
def _jfa_dkdv_finish_kernel(
    dk_TkNH, dv_TkNH, dk_scratch_TkNH, dv_scratch_TkNH,
    kv_offsets_Bp1, work_seq_W, work_start_W, work_splits_W, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Cast the float32 sums of split key tiles into dK/dV after the Gluon dK/dV kernel (every
    chunk writes the same rows)."""
    slot, head = slot_and_head(num_heads, True)
    seq = tl.load(work_seq_W + slot)
    splits = tl.load(work_splits_W + slot)
    if (seq < 0) | (splits <= 1):
        return
    k_start = tl.load(work_start_W + slot)
    k_begin, k_len = load_sequence(kv_offsets_Bp1, seq)
    stride_t = num_heads * HEAD_DIM
    cols_N = k_start + tl.arange(0, BLOCK_N)
    col_ok_N = cols_N < k_len
    offsets_NH = (k_begin + cols_N.to(tl.int64))[:, None] * stride_t + head * HEAD_DIM
    offsets_NH += tl.arange(0, HEAD_DIM)[None, :]
    out_ty = dk_TkNH.dtype.element_ty
    dk_NH = tl.load(dk_scratch_TkNH + offsets_NH, mask=col_ok_N[:, None], other=0.0)
    dv_NH = tl.load(dv_scratch_TkNH + offsets_NH, mask=col_ok_N[:, None], other=0.0)
    tl.store(dk_TkNH + offsets_NH, dk_NH.to(out_ty), mask=col_ok_N[:, None])
    tl.store(dv_TkNH + offsets_NH, dv_NH.to(out_ty), mask=col_ok_N[:, None])


def backward_dkdv(
    dout, q, k, v, out, lse, delta, dq, batch, *, causal, scale, rel_bias, config, on_hopper,
    dq_in_dkdv, descriptors=None,
):  # fmt: skip
    """dK and dV (q, k, v as ``_rows_of_heads`` leaves them; dout and out contiguous) from the
    key-tile work list, long query ranges split; with ``dq_in_dkdv`` also dQ of the sequences
    whose keys fit one tile, into ``dq``. ``config``: its ``dkdv`` tiles and split limits;
    ``on_hopper``: the Gluon kernel runs (the caller checked ``hopper.supported``)."""
    cfg = config
    total_q, num_heads, head_dim = q.shape
    num_seqs = batch.num_seqs
    q_offsets, kv_offsets = batch.offsets, batch.kv_offsets
    dk, dv = (torch.empty(k.shape, dtype=k.dtype, device=k.device) for _ in range(2))
    max_splits = dkdv_splits(
        cfg, total_q=total_q, total_kv=k.shape[0], num_seqs=num_seqs, num_heads=num_heads,
        longest_q=longest_query_rows(batch, total_q=total_q), causal=causal,
        sm_count=_sm_count(q.device) if q.device.type == "cuda" else None,
    )  # fmt: skip
    kwork = batch.memo(
        ("jfa.key_tiles", k.shape[0], cfg.dkdv.block_n, causal, cfg.dkdv.block_m,
         cfg.split_rows, max_splits),
        lambda: key_tiles(
            q_offsets, kv_offsets, total_kv=k.shape[0], block=cfg.dkdv.block_n, causal=causal,
            align=cfg.dkdv.block_m, split_rows=cfg.split_rows, max_splits=max_splits,
        ),
    )  # fmt: skip
    # Split tiles add into a zeroed float32 scratch: dK, dV, then (for the Triton kernel) an
    # arrival counter per (key row, head).
    kv_numel = k.numel()
    if max_splits > 1:
        scratch_numel = 2 * kv_numel + k.shape[0] * num_heads
        scratch = torch.zeros(scratch_numel, dtype=torch.float32, device=k.device)
    else:  # never written, but float32 like the real scratch: one compiled variant for both
        scratch = _unused_float32(k.device)
    grid = (kwork.num_slots * num_heads,)
    if on_hopper:
        dk_scratch = dv_scratch = scratch
        if max_splits > 1:
            dk_scratch = scratch[:kv_numel].view(k.shape)
            dv_scratch = scratch[kv_numel : 2 * kv_numel].view(k.shape)
        from ..hopper.launch import launch_dkdv  # Gluon loads only where its kernels run

        launch_dkdv(
            grid, q, k, v, dout, lse, delta, dk, dv, dk_scratch, dv_scratch, q_offsets,
            kv_offsets, kwork, scale=scale, causal=causal, config=cfg, descriptors=descriptors,
        )  # fmt: skip
        if max_splits > 1:
            _jfa_dkdv_finish_kernel[grid](
                dk, dv, dk_scratch, dv_scratch, kv_offsets,
                kwork.seq_W, kwork.start_W, kwork.splits_W, num_heads,
                HEAD_DIM=head_dim, BLOCK_N=cfg.dkdv.block_n, num_warps=cfg.dkdv.warps,
            )  # fmt: skip
        return dk, dv
    tiles, o_lo, num_offsets, step = _bias_tile_args(
        rel_bias, q, rows=cfg.dkdv.block_n, cols=cfg.dkdv.block_m, keys_on_rows=True
    )
    _jfa_dkdv_kernel[grid](
        q, k, v, out, dout, lse, delta, tiles, dq, dk, dv, scratch,
        q_offsets, kv_offsets, kwork.seq_W, kwork.start_W, kwork.lo_W, kwork.hi_W, kwork.splits_W,
        num_heads, total_q, k.shape[0], scale, scale * LOG2E, _radius(rel_bias), o_lo,
        num_offsets, q.stride(0), k.stride(0),
        HEAD_DIM=head_dim, BLOCK_M=cfg.dkdv.block_m, BLOCK_N=cfg.dkdv.block_n, CAUSAL=causal,
        HAS_BIAS=rel_bias is not None, BIAS_STEP=step, DQ_IN_DKDV=dq_in_dkdv,
        DOT_PRECISION=_dot_precision(q.dtype), NUM_STAGES=cfg.dkdv.stages,
        num_warps=cfg.dkdv.warps, num_stages=cfg.dkdv.stages,
    )  # fmt: skip
    return dk, dv

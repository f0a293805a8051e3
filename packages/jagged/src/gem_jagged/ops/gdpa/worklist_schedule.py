"""GDPA kernels of the work-list schedule, and its self-attention launchers.

Legend (shape suffixes): ``T`` tokens (``Tq`` queries, ``Tk`` keys), ``B`` sequences, ``N`` heads,
``H`` head dim, ``S`` PMA seeds, ``W`` work items (tiles of a jagged dimension), ``NB`` relative
bias buckets (``2R+1``). ``q_TNH`` is a query tensor of ``Tq`` rows, ``offsets_Bp1`` an offsets
tensor of ``B+1`` entries.

Why it is simpler than softmax attention: with a pointwise activation every (query, key) pair
contributes independently. The forward keeps no running max and no denominator, nothing but the
accumulator is saved, and a sum over key chunks may be split across programs and added up. The
backward recomputes the scores and needs no row statistic (softmax needs ``rowsum(dO ⊙ O)``).

Work lists are built on the device from the offsets (``gem_jagged._worklist``), heavy tiles
first, with no host synchronisation; programs past the real tile count exit at once. The lists
are memoised in the caller's ``JaggedBatch``.

- forward: one program per (query tile, head), looping over the visible key tiles;
- backward dK/dV: one program per (key tile, head), keys resident while query tiles stream past;
- backward dQ: one program per (query tile, head), looping over key tiles;
- relative bias gradient: each program reduces its buckets into a private row of a partial
  buffer ``[W, N, NB]``; one ``sum`` over ``W`` finishes it (deterministic, no atomics).

Production runs self-attention here. The kernels also carry the cross-attention and PMA forms of
the schedule (``BROADCAST_Q``: PMA key chunks whose partial outputs add up in fp32; ``ATOMIC_KV``:
cross key tiles whose query range is split, dK/dV added in fp32): the per-sequence schedule
(``per_sequence_schedule.py``) serves those in production, and their work-list entry points live
in ``gem_jagged.prototype.gdpa``, kept for sweeps. The launch helpers below are shared with it.
"""

import torch
import triton.language as tl

from gem_jagged._jit import jit
from gem_jagged._worklist import TileWorkList, key_tiles, query_tiles

from .config import GdpaTiles
from .tiles import (
    _dkdv_tile,
    _dq_tile,
    _finish_bias_grad,
    _fwd_tile,
    _load_rows,
    _sequence,
)


@jit
def _gdpa_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, rel_bias_ptr,
    q_offsets_ptr, kv_offsets_ptr, seq_W_ptr, start_W_ptr, hi_W_ptr,
    stride_qt, stride_kt, stride_vt, stride_ot,
    num_seeds, scale, out_scale, RADIUS,
    H: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BROADCAST_Q: tl.constexpr, KV_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Stage 1: which sequence, which query rows and which key range this program owns.
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_W_ptr + pid)
    if seq < 0:
        return
    q_begin, q_len, out_begin, kv_begin, kv_len = _sequence(
        q_offsets_ptr, kv_offsets_ptr, seq, num_seeds, BROADCAST_Q
    )
    diag = kv_len - q_len
    if BROADCAST_Q:  # the list tiles the keys in chunks; axis 2 tiles the seeds
        q_start = tl.program_id(2) * BLOCK_M
        kv_lo = tl.load(start_W_ptr + pid)
        kv_hi = tl.minimum(kv_lo + KV_CHUNK, kv_len)
        if CAUSAL:
            kv_hi = tl.minimum(kv_hi, q_start + BLOCK_M + diag)
    else:  # the list tiles the queries and gives the visible key range [0, hi)
        q_start = tl.load(start_W_ptr + pid)
        kv_lo = tl.zeros((), tl.int32)
        kv_hi = tl.load(hi_W_ptr + pid)
    # Key tiles wholly left of the first row's diagonal need no mask: [kv_lo, kv_mid).
    kv_mid = kv_hi
    if CAUSAL:
        kv_mid = tl.minimum(tl.maximum(q_start + diag + 1, kv_lo), kv_hi)
        kv_mid = kv_lo + (kv_mid - kv_lo) // BLOCK_N * BLOCK_N
    offs_m = q_start + tl.arange(0, BLOCK_M)
    head_col = head * H + tl.arange(0, H)
    q_MH = _load_rows(q_ptr, q_begin, offs_m, q_len, stride_qt, head_col)
    acc_MH = tl.zeros((BLOCK_M, H), tl.float32)
    # Stage 2: stream key/value tiles: S = scale·QKᵀ (+ bias), P = act(S) ⊙ mask, acc += P V.
    for start_n in range(kv_lo, kv_mid, BLOCK_N):
        acc_MH = _fwd_tile(
            acc_MH, q_MH, offs_m, start_n, k_ptr, v_ptr, kv_begin, kv_len, stride_kt, stride_vt,
            head_col, rel_bias_ptr, head, RADIUS, scale, diag, ACT, HAS_BIAS, False, BLOCK_N, IEEE,
        )  # fmt: skip
    for start_n in range(kv_mid, kv_hi, BLOCK_N):
        acc_MH = _fwd_tile(
            acc_MH, q_MH, offs_m, start_n, k_ptr, v_ptr, kv_begin, kv_len, stride_kt, stride_vt,
            head_col, rel_bias_ptr, head, RADIUS, scale, diag, ACT, HAS_BIAS, CAUSAL, BLOCK_N, IEEE,
        )  # fmt: skip
    # Stage 3: write (or, for PMA key chunks, add) the scaled accumulator.
    acc_MH = acc_MH * out_scale
    out_ptrs = out_ptr + (out_begin + offs_m)[:, None] * stride_ot + head_col[None, :]
    if BROADCAST_Q:
        tl.atomic_add(out_ptrs, acc_MH, mask=(offs_m < q_len)[:, None], sem="relaxed")
    else:
        tl.store(out_ptrs, acc_MH.to(out_ptr.dtype.element_ty), mask=(offs_m < q_len)[:, None])


@jit
def _gdpa_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, dq_ptr, rel_bias_ptr, dbias_WNB_ptr,
    q_offsets_ptr, kv_offsets_ptr, seq_W_ptr, start_W_ptr, lo_W_ptr, hi_W_ptr,
    stride_qt, stride_kt, stride_vt, stride_dot, stride_dkt, stride_dvt, stride_dqt,
    num_heads, num_seeds, scale, out_scale, RADIUS,
    H: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BROADCAST_Q: tl.constexpr, ATOMIC_KV: tl.constexpr, NB_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Stage 1: one key tile of one sequence and head stays on chip; its query range [lo, hi).
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_W_ptr + pid)
    if seq < 0:
        return
    q_begin, q_len, out_begin, kv_begin, kv_len = _sequence(
        q_offsets_ptr, kv_offsets_ptr, seq, num_seeds, BROADCAST_Q
    )
    diag = kv_len - q_len
    k_start = tl.load(start_W_ptr + pid)
    q_lo = tl.load(lo_W_ptr + pid)
    q_hi = tl.load(hi_W_ptr + pid)
    # Query tiles from q_mid on see the whole key tile: only [q_lo, q_mid) needs the mask.
    q_mid = q_lo
    if CAUSAL:
        first_full = tl.maximum(k_start + BLOCK_N - 1 - diag - q_lo, 0)
        q_mid = tl.minimum(q_lo + (first_full + BLOCK_M - 1) // BLOCK_M * BLOCK_M, q_hi)
    offs_n = k_start + tl.arange(0, BLOCK_N)
    head_col = head * H + tl.arange(0, H)
    k_NH = _load_rows(k_ptr, kv_begin, offs_n, kv_len, stride_kt, head_col)
    v_NH = _load_rows(v_ptr, kv_begin, offs_n, kv_len, stride_vt, head_col)
    dk_NH = tl.zeros((BLOCK_N, H), tl.float32)
    dv_NH = tl.zeros((BLOCK_N, H), tl.float32)
    dbias_NB = tl.zeros((NB_POW2,), tl.float32)
    left_N = tl.zeros((BLOCK_N,), tl.float32)
    right_N = tl.zeros((BLOCK_N,), tl.float32)
    # Stage 2: stream query tiles: dV += Pᵀ dO, dSᵀ = (V dOᵀ) ⊙ act'(Sᵀ), dK += dSᵀ Q.
    for q_start in range(q_lo, q_mid, BLOCK_M):
        dk_NH, dv_NH, dbias_NB, left_N, right_N = _dkdv_tile(
            dk_NH, dv_NH, dbias_NB, left_N, right_N, k_NH, v_NH, offs_n, q_start, q_ptr, do_ptr,
            dq_ptr, q_begin, out_begin, q_len, stride_qt, stride_dot, stride_dqt, head_col,
            rel_bias_ptr, head, RADIUS, scale, out_scale, diag, False, ACT, HAS_BIAS, BROADCAST_Q,
            CAUSAL, NB_POW2, BLOCK_M, IEEE, False,
        )  # fmt: skip
    for q_start in range(q_mid, q_hi, BLOCK_M):
        dk_NH, dv_NH, dbias_NB, left_N, right_N = _dkdv_tile(
            dk_NH, dv_NH, dbias_NB, left_N, right_N, k_NH, v_NH, offs_n, q_start, q_ptr, do_ptr,
            dq_ptr, q_begin, out_begin, q_len, stride_qt, stride_dot, stride_dqt, head_col,
            rel_bias_ptr, head, RADIUS, scale, out_scale, diag, False, ACT, HAS_BIAS, BROADCAST_Q,
            False, NB_POW2, BLOCK_M, IEEE, False,
        )  # fmt: skip
    # Stage 3: dK = scale·dSᵀQ, dV = out_scale·PᵀdO; split tiles add into fp32 buffers.
    dk_NH = dk_NH * scale
    dv_NH = dv_NH * out_scale
    rows = (offs_n < kv_len)[:, None]
    dk_ptrs = dk_ptr + (kv_begin + offs_n)[:, None] * stride_dkt + head_col[None, :]
    dv_ptrs = dv_ptr + (kv_begin + offs_n)[:, None] * stride_dvt + head_col[None, :]
    if ATOMIC_KV:
        tl.atomic_add(dk_ptrs, dk_NH, mask=rows, sem="relaxed")
        tl.atomic_add(dv_ptrs, dv_NH, mask=rows, sem="relaxed")
    else:
        tl.store(dk_ptrs, dk_NH.to(dk_ptr.dtype.element_ty), mask=rows)
        tl.store(dv_ptrs, dv_NH.to(dv_ptr.dtype.element_ty), mask=rows)
    if BROADCAST_Q & HAS_BIAS:
        dbias_NB = _finish_bias_grad(dbias_NB, left_N, right_N, RADIUS)
        idx = tl.arange(0, NB_POW2)
        tl.store(dbias_WNB_ptr + (pid * num_heads + head) * NB_POW2 + idx, dbias_NB)


@jit
def _gdpa_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, rel_bias_ptr, dbias_WNB_ptr,
    q_offsets_ptr, kv_offsets_ptr, seq_W_ptr, start_W_ptr, hi_W_ptr,
    stride_qt, stride_kt, stride_vt, stride_dot, stride_dqt,
    num_heads, scale, out_scale, RADIUS,
    H: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    NB_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Stage 1: one query tile and its gradient dO stay on chip.
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_W_ptr + pid)
    if seq < 0:
        return
    q_begin, q_len, out_begin, kv_begin, kv_len = _sequence(
        q_offsets_ptr, kv_offsets_ptr, seq, 0, False
    )
    diag = kv_len - q_len
    q_start = tl.load(start_W_ptr + pid)
    kv_hi = tl.load(hi_W_ptr + pid)
    kv_mid = kv_hi
    if CAUSAL:  # key tiles wholly left of the first row's diagonal need no mask
        kv_mid = tl.minimum(tl.maximum(q_start + diag + 1, 0), kv_hi) // BLOCK_N * BLOCK_N
    offs_m = q_start + tl.arange(0, BLOCK_M)
    head_col = head * H + tl.arange(0, H)
    q_MH = _load_rows(q_ptr, q_begin, offs_m, q_len, stride_qt, head_col)
    do_MH = _load_rows(do_ptr, q_begin, offs_m, q_len, stride_dot, head_col)
    dq_MH = tl.zeros((BLOCK_M, H), tl.float32)
    dbias_NB = tl.zeros((NB_POW2,), tl.float32)
    left_M = tl.zeros((BLOCK_M,), tl.float32)
    right_M = tl.zeros((BLOCK_M,), tl.float32)
    # Stage 2: stream key tiles.
    for start_n in range(0, kv_mid, BLOCK_N):
        dq_MH, dbias_NB, left_M, right_M = _dq_tile(
            dq_MH, dbias_NB, left_M, right_M, q_MH, do_MH, offs_m, start_n, k_ptr, v_ptr, kv_begin,
            kv_len, stride_kt, stride_vt, head_col, rel_bias_ptr, head, RADIUS, scale, out_scale,
            diag, ACT, HAS_BIAS, False, NB_POW2, BLOCK_N, IEEE,
        )  # fmt: skip
    for start_n in range(kv_mid, kv_hi, BLOCK_N):
        dq_MH, dbias_NB, left_M, right_M = _dq_tile(
            dq_MH, dbias_NB, left_M, right_M, q_MH, do_MH, offs_m, start_n, k_ptr, v_ptr, kv_begin,
            kv_len, stride_kt, stride_vt, head_col, rel_bias_ptr, head, RADIUS, scale, out_scale,
            diag, ACT, HAS_BIAS, CAUSAL, NB_POW2, BLOCK_N, IEEE,
        )  # fmt: skip
    # Stage 3: write dQ = scale·dS K and this program's bias-gradient partial.
    dq_ptrs = dq_ptr + (q_begin + offs_m)[:, None] * stride_dqt + head_col[None, :]
    tl.store(dq_ptrs, (dq_MH * scale).to(dq_ptr.dtype.element_ty), mask=(offs_m < q_len)[:, None])
    if HAS_BIAS:
        dbias_NB = _finish_bias_grad(dbias_NB, left_M, right_M, RADIUS)
        idx = tl.arange(0, NB_POW2)
        tl.store(dbias_WNB_ptr + (pid * num_heads + head) * NB_POW2 + idx, dbias_NB)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def query_work(batch, q_offsets, kv_offsets, *, total_q, block, causal) -> TileWorkList:
    """The query-tile list of ``batch`` (built at its first use, kept in the batch)."""
    return batch.memo(
        ("gdpa.query_tiles", total_q, block, causal),
        lambda: query_tiles(q_offsets, kv_offsets, total_q=total_q, block=block, causal=causal),
    )


def key_work(batch, q_offsets, kv_offsets, *, total_kv, block, causal, align, split):
    """The key-tile list of ``batch``; ``split`` is ``(split_rows, max_splits)`` or None."""
    options = dict(split_rows=split[0], max_splits=split[1]) if split else {}
    return batch.memo(
        ("gdpa.key_tiles", total_kv, block, causal, align, split),
        lambda: key_tiles(
            q_offsets, kv_offsets, total_kv=total_kv, block=block, causal=causal, align=align,
            **options,
        ),
    )  # fmt: skip


def launch_forward(
    q_TNH, k_TNH, v_TNH, out, bias, q_offsets_Bp1, kv_offsets_Bp1, work: TileWorkList, *,
    grid_z, num_seeds, scale, out_scale, radius, broadcast_q, block_m, kv_chunk,
    tiles: GdpaTiles, common,
):  # fmt: skip
    """``_gdpa_fwd_kernel`` over ``work`` (``grid_z`` seed tiles for PMA, else 1)."""
    _gdpa_fwd_kernel[(work.num_slots, k_TNH.shape[1], grid_z)](
        q_TNH, k_TNH, v_TNH, out, bias,
        q_offsets_Bp1, kv_offsets_Bp1, work.seq_W, work.start_W, work.hi_W,
        q_TNH.stride(0), k_TNH.stride(0), v_TNH.stride(0), out.stride(0),
        num_seeds, scale, out_scale, radius,
        BROADCAST_Q=broadcast_q, KV_CHUNK=kv_chunk, BLOCK_M=block_m, BLOCK_N=tiles.fwd_n,
        num_warps=tiles.fwd_warps, num_stages=tiles.fwd_stages, **common,
    )  # fmt: skip


def launch_dkdv(
    q_TNH, k_TNH, v_TNH, do_TNH, dk, dv, dq, bias, dbias, q_offsets_Bp1, kv_offsets_Bp1,
    work: TileWorkList, *, num_seeds, scale, out_scale, radius, broadcast_q, atomic_kv, block_m,
    tiles: GdpaTiles, common,
):  # fmt: skip
    """``_gdpa_bwd_dkdv_kernel`` over the key-tile list ``work``."""
    num_heads = k_TNH.shape[1]
    _gdpa_bwd_dkdv_kernel[(work.num_slots, num_heads)](
        q_TNH, k_TNH, v_TNH, do_TNH, dk, dv, dq, bias, dbias,
        q_offsets_Bp1, kv_offsets_Bp1, work.seq_W, work.start_W, work.lo_W, work.hi_W,
        q_TNH.stride(0), k_TNH.stride(0), v_TNH.stride(0), do_TNH.stride(0),
        dk.stride(0), dv.stride(0), dq.stride(0),
        num_heads, num_seeds, scale, out_scale, radius,
        BROADCAST_Q=broadcast_q, ATOMIC_KV=atomic_kv, BLOCK_M=block_m, BLOCK_N=tiles.dkdv_n,
        num_warps=tiles.dkdv_warps, num_stages=tiles.dkdv_stages, **common,
    )  # fmt: skip


def launch_dq(
    q_TNH, k_TNH, v_TNH, do_TNH, dq, bias, q_offsets_Bp1, kv_offsets_Bp1, work: TileWorkList, *,
    has_bias, nb_pow2, scale, out_scale, radius, tiles: GdpaTiles, common,
):  # fmt: skip
    """``_gdpa_bwd_dq_kernel`` over the query-tile list ``work``; returns the bias-gradient
    partials ``[W, N, NB_POW2]`` (fp32), or ``dq`` itself as a placeholder without a bias."""
    num_heads = k_TNH.shape[1]
    dbias = dq  # placeholder pointer without a bias
    if has_bias:
        dbias = torch.zeros(
            (work.num_slots, num_heads, nb_pow2), device=q_TNH.device, dtype=torch.float32
        )
    _gdpa_bwd_dq_kernel[(work.num_slots, num_heads)](
        q_TNH, k_TNH, v_TNH, do_TNH, dq, bias, dbias,
        q_offsets_Bp1, kv_offsets_Bp1, work.seq_W, work.start_W, work.hi_W,
        q_TNH.stride(0), k_TNH.stride(0), v_TNH.stride(0), do_TNH.stride(0), dq.stride(0),
        num_heads, scale, out_scale, radius,
        BLOCK_M=tiles.dq_m, BLOCK_N=tiles.dq_n,
        num_warps=tiles.dq_warps, num_stages=tiles.dq_stages, **common,
    )  # fmt: skip
    return dbias


def forward_self(
    q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, *, bias, radius, scale, out_scale, causal, batch,
    tiles: GdpaTiles, common,
):  # fmt: skip
    """Self-attention forward; returns ``(out [T, N, H] in q's dtype, the query-tile list)``."""
    num_heads, head_dim = k_TNH.shape[1], k_TNH.shape[2]
    out = torch.empty(q_TNH.shape[0], num_heads, head_dim, device=q_TNH.device, dtype=q_TNH.dtype)
    work = query_work(
        batch,
        q_offsets_Bp1,
        kv_offsets_Bp1,
        total_q=q_TNH.shape[0],
        block=tiles.fwd_m,
        causal=causal,
    )
    launch_forward(
        q_TNH, k_TNH, v_TNH, out, bias, q_offsets_Bp1, kv_offsets_Bp1, work, grid_z=1, num_seeds=0,
        scale=scale, out_scale=out_scale, radius=radius, broadcast_q=False, block_m=tiles.fwd_m,
        kv_chunk=tiles.fwd_n, tiles=tiles, common=common,
    )  # fmt: skip
    return out, work


def backward_self(
    do_TNH, q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, *, bias, radius, has_bias, nb_pow2, scale,
    out_scale, causal, batch, tiles: GdpaTiles, common, query_work_list: TileWorkList | None,
):  # fmt: skip
    """Self-attention backward; returns ``(dq, dk, dv, bias-gradient partials or None)``.
    ``query_work_list`` (the forward's) is reused when its tiles have the dQ kernel's height."""
    dq = torch.empty_like(q_TNH)
    dk, dv = torch.empty_like(k_TNH), torch.empty_like(v_TNH)
    work = key_work(
        batch, q_offsets_Bp1, kv_offsets_Bp1, total_kv=k_TNH.shape[0], block=tiles.dkdv_n,
        causal=causal, align=tiles.dkdv_m, split=None,
    )  # fmt: skip
    launch_dkdv(
        q_TNH, k_TNH, v_TNH, do_TNH, dk, dv, dq, bias, dq, q_offsets_Bp1, kv_offsets_Bp1, work,
        num_seeds=0, scale=scale, out_scale=out_scale, radius=radius, broadcast_q=False,
        atomic_kv=False, block_m=tiles.dkdv_m, tiles=tiles, common=common,
    )  # fmt: skip
    if query_work_list is None or query_work_list.block != tiles.dq_m:
        query_work_list = query_work(
            batch, q_offsets_Bp1, kv_offsets_Bp1, total_q=q_TNH.shape[0], block=tiles.dq_m,
            causal=causal,
        )  # fmt: skip
    dbias = launch_dq(
        q_TNH, k_TNH, v_TNH, do_TNH, dq, bias, q_offsets_Bp1, kv_offsets_Bp1, query_work_list,
        has_bias=has_bias, nb_pow2=nb_pow2, scale=scale, out_scale=out_scale, radius=radius,
        tiles=tiles, common=common,
    )  # fmt: skip
    return dq, dk, dv, (dbias if has_bias else None)

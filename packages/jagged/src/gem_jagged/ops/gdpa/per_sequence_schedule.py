"""GDPA kernels of the per-sequence schedule (cross-attention and PMA) and their launchers.

Legend (shape suffixes): ``T`` tokens (``Tq`` queries, ``Tk`` keys), ``B`` sequences, ``N`` heads,
``H`` head dim, ``S`` PMA seeds, ``W`` work items (here: programs that own a bias-gradient row),
``NB`` relative bias buckets (``2R+1``). ``q_TNH`` is a query tensor of ``Tq`` rows,
``offsets_Bp1`` an offsets tensor of ``B+1`` entries.

Grid ``(B, N, SPLIT)``: program ``(b, n, part)`` takes every ``SPLIT``-th tile of sequence ``b``
and derives everything else from its ids. Building a device work list costs dozens of tiny
launches; for the short problems of cross-attention over candidates (64–256 keys, resident on
chip while the queries stream past) and of PMA that costs more than the attention itself. The
tile bodies (``_fwd_tile``, ``_dkdv_tile``, ``_dq_tile``) live in ``tiles.py``, shared with the
work-list kernels of ``worklist_schedule.py``; ``triton.py`` sends every cross-attention and PMA
call here.

- forward: cross-attention writes each query tile once (keys that fit one tile stay on chip for
  the program); PMA sums a sequence's key parts into an fp32 output with atomics (each output
  row gets one add per part).
- backward dK/dV: keys resident, query tiles stream past. PMA splits the key tiles among the
  parts and adds each part's dQ share to a shared fp32 buffer. Cross-attention splits the
  query tiles into up to SPLIT contiguous chunks of at least ``cross_min_part_tiles`` tiles
  (one long sequence of queries over 64 candidates would otherwise be one program's serial
  loop, the tail of the launch) and adds the chunks' dK/dV in fp32; a sequence whose keys fit
  one tile gets its dQ here as well (one more matmul on scores already recomputed), so its
  queries are read once.
- backward dQ (cross-attention with keys longer than one tile): one pass over the sequence's
  key tiles per query tile.
- relative bias gradient: one private row of ``[B·SPLIT, N, NB]`` per program, summed once.
"""

import torch
import triton.language as tl

from gem_jagged._jit import jit

from .config import GdpaTiles, seed_block
from .tiles import (
    _dkdv_tile,
    _dq_tile,
    _finish_bias_grad,
    _fwd_keys_on_chip,
    _fwd_tile,
    _load_rows,
    _sequence,
)


@jit
def _key_stops(q_start, kv_len, diag, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """``(kv_mid, kv_hi)`` for the query tile at ``q_start``: key blocks ``[0, kv_mid)`` are seen
    whole by every row of the tile (no mask), ``[kv_mid, kv_hi)`` cross the causal diagonal, the
    rest are above it."""
    kv_hi = kv_len
    kv_mid = kv_len
    if CAUSAL:
        kv_hi = tl.minimum(tl.maximum(q_start + BLOCK_M + diag, 0), kv_len)
        kv_mid = tl.minimum(tl.maximum(q_start + diag + 1, 0), kv_hi) // BLOCK_N * BLOCK_N
    return kv_mid, kv_hi


@jit
def _gdpa_fwd_seq_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, rel_bias_ptr, q_offsets_ptr, kv_offsets_ptr,
    stride_qt, stride_kt, stride_vt, stride_ot,
    num_seeds, scale, out_scale, RADIUS, SPLIT,
    H: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BROADCAST_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    part = tl.program_id(2)
    q_begin, q_len, out_begin, kv_begin, kv_len = _sequence(
        q_offsets_ptr, kv_offsets_ptr, seq, num_seeds, BROADCAST_Q
    )
    diag = kv_len - q_len
    head_col = head * H + tl.arange(0, H)
    if BROADCAST_Q:
        # PMA: the seeds stay on chip; key tiles part, part + SPLIT, ... stream past and the
        # partial sums of the SPLIT programs of a sequence are added in fp32.
        for q_start in range(0, q_len, BLOCK_M):
            offs_m = q_start + tl.arange(0, BLOCK_M)
            q_MH = _load_rows(q_ptr, q_begin, offs_m, q_len, stride_qt, head_col)
            acc_MH = tl.zeros((BLOCK_M, H), tl.float32)
            for start_n in range(part * BLOCK_N, kv_len, SPLIT * BLOCK_N):
                acc_MH = _fwd_tile(
                    acc_MH, q_MH, offs_m, start_n, k_ptr, v_ptr, kv_begin, kv_len, stride_kt,
                    stride_vt, head_col, rel_bias_ptr, head, RADIUS, scale, diag, ACT, HAS_BIAS,
                    CAUSAL, BLOCK_N, IEEE,
                )  # fmt: skip
            out_ptrs = out_ptr + (out_begin + offs_m)[:, None] * stride_ot + head_col[None, :]
            rows = (offs_m < q_len)[:, None]
            tl.atomic_add(out_ptrs, acc_MH * out_scale, mask=rows, sem="relaxed")
    elif kv_len <= BLOCK_N:
        # Cross-attention over keys that fit one tile (candidates): the keys stay on chip for
        # the whole program and its query tiles part, part + SPLIT, ... stream past, their
        # loads pipelined, rather than each query tile reloading the keys through ``_fwd_tile``
        # and waiting for its own query load. A program past the sequence's last tile exits
        # before loading the keys.
        if part * BLOCK_M >= q_len:
            return
        offs_n = tl.arange(0, BLOCK_N)
        k_NH = _load_rows(k_ptr, kv_begin, offs_n, kv_len, stride_kt, head_col)
        v_NH = _load_rows(v_ptr, kv_begin, offs_n, kv_len, stride_vt, head_col)
        for q_start in tl.range(part * BLOCK_M, q_len, SPLIT * BLOCK_M, num_stages=2):
            offs_m = q_start + tl.arange(0, BLOCK_M)
            q_MH = _load_rows(q_ptr, q_begin, offs_m, q_len, stride_qt, head_col)
            acc_MH = _fwd_keys_on_chip(
                tl.zeros((BLOCK_M, H), tl.float32), q_MH, offs_m, offs_n, k_NH, v_NH,
                rel_bias_ptr, head, RADIUS, scale, diag, ACT, HAS_BIAS, CAUSAL, IEEE,
            )  # fmt: skip
            out_ptrs = out_ptr + (out_begin + offs_m)[:, None] * stride_ot + head_col[None, :]
            rows = (offs_m < q_len)[:, None]
            tl.store(out_ptrs, (acc_MH * out_scale).to(out_ptr.dtype.element_ty), mask=rows)
    else:
        # Cross-attention over longer keys: query tiles part, part + SPLIT, ... each stream the
        # key tiles.
        for q_start in range(part * BLOCK_M, q_len, SPLIT * BLOCK_M):
            kv_mid, kv_hi = _key_stops(q_start, kv_len, diag, CAUSAL, BLOCK_M, BLOCK_N)
            offs_m = q_start + tl.arange(0, BLOCK_M)
            q_MH = _load_rows(q_ptr, q_begin, offs_m, q_len, stride_qt, head_col)
            acc_MH = tl.zeros((BLOCK_M, H), tl.float32)
            for start_n in range(0, kv_mid, BLOCK_N):
                acc_MH = _fwd_tile(
                    acc_MH, q_MH, offs_m, start_n, k_ptr, v_ptr, kv_begin, kv_len, stride_kt,
                    stride_vt, head_col, rel_bias_ptr, head, RADIUS, scale, diag, ACT, HAS_BIAS,
                    False, BLOCK_N, IEEE,
                )  # fmt: skip
            for start_n in range(kv_mid, kv_hi, BLOCK_N):
                acc_MH = _fwd_tile(
                    acc_MH, q_MH, offs_m, start_n, k_ptr, v_ptr, kv_begin, kv_len, stride_kt,
                    stride_vt, head_col, rel_bias_ptr, head, RADIUS, scale, diag, ACT, HAS_BIAS,
                    CAUSAL, BLOCK_N, IEEE,
                )  # fmt: skip
            out_ptrs = out_ptr + (out_begin + offs_m)[:, None] * stride_ot + head_col[None, :]
            rows = (offs_m < q_len)[:, None]
            tl.store(out_ptrs, (acc_MH * out_scale).to(out_ptr.dtype.element_ty), mask=rows)


@jit
def _gdpa_bwd_dkdv_seq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, dq_ptr, rel_bias_ptr, dbias_WNB_ptr,
    q_offsets_ptr, kv_offsets_ptr,
    stride_qt, stride_kt, stride_vt, stride_dot, stride_dkt, stride_dvt, stride_dqt,
    num_heads, num_seeds, scale, out_scale, RADIUS, SPLIT, MIN_PART_TILES,
    H: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BROADCAST_Q: tl.constexpr, ATOMIC_KV: tl.constexpr, NB_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Each key tile stays on chip while query tiles stream past. PMA (a few seeds, long keys):
    # program ``part`` owns key tiles part, part + SPLIT, ... and every seed, so it stores its
    # dK/dV rows alone. Cross-attention (long queries, short keys): every program visits every
    # key tile with its own contiguous chunk of the query tiles, and the SPLIT chunks' dK/dV add
    # up in fp32 (``ATOMIC_KV``). A sequence whose keys fit one tile gets its whole dQ here
    # (``dq_here``: dS K over all its keys); the dQ kernel skips it.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    part = tl.program_id(2)
    q_begin, q_len, out_begin, kv_begin, kv_len = _sequence(
        q_offsets_ptr, kv_offsets_ptr, seq, num_seeds, BROADCAST_Q
    )
    diag = kv_len - q_len
    head_col = head * H + tl.arange(0, H)
    dbias_NB = tl.zeros((NB_POW2,), tl.float32)
    left_N = tl.zeros((BLOCK_N,), tl.float32)
    right_N = tl.zeros((BLOCK_N,), tl.float32)
    dq_here = (kv_len > 0) & (kv_len <= BLOCK_N)
    if BROADCAST_Q:
        k_first, k_step = part * BLOCK_N, SPLIT * BLOCK_N
    else:
        k_first, k_step = 0, BLOCK_N
    for k_start in range(k_first, kv_len, k_step):
        # Query rows [q_lo, q_mid) cross the causal diagonal; from q_mid on the tile is seen whole.
        q_lo = 0
        q_mid = 0
        if CAUSAL:  # rows above the diagonal see nothing: skipped unless this writes their dQ
            q_lo = tl.minimum(tl.maximum(k_start - diag, 0) // BLOCK_M * BLOCK_M, q_len)
            if not BROADCAST_Q:
                q_lo = tl.where(dq_here, 0, q_lo)
            first_full = tl.maximum(k_start + BLOCK_N - 1 - diag - q_lo, 0)
            q_mid = tl.minimum(q_lo + (first_full + BLOCK_M - 1) // BLOCK_M * BLOCK_M, q_len)
        q_hi = q_len
        if not BROADCAST_Q:  # this program's chunk of the query tiles [q_lo, q_len)
            # At least MIN_PART_TILES tiles a chunk: every chunk adds its dK/dV once, so a
            # sequence of a few tiles takes few chunks (and few fp32 adds), a long one up to SPLIT.
            tiles = tl.cdiv(q_len - q_lo, BLOCK_M)
            per_part = tl.maximum(tl.cdiv(tiles, SPLIT), MIN_PART_TILES) * BLOCK_M
            q_lo = q_lo + part * per_part
            q_hi = tl.minimum(q_lo + per_part, q_len)
        offs_n = k_start + tl.arange(0, BLOCK_N)
        k_NH = _load_rows(k_ptr, kv_begin, offs_n, kv_len, stride_kt, head_col)
        v_NH = _load_rows(v_ptr, kv_begin, offs_n, kv_len, stride_vt, head_col)
        dk_NH = tl.zeros((BLOCK_N, H), tl.float32)
        dv_NH = tl.zeros((BLOCK_N, H), tl.float32)
        for q_start in range(q_lo, tl.minimum(q_mid, q_hi), BLOCK_M):
            dk_NH, dv_NH, dbias_NB, left_N, right_N = _dkdv_tile(
                dk_NH, dv_NH, dbias_NB, left_N, right_N, k_NH, v_NH, offs_n, q_start, q_ptr,
                do_ptr, dq_ptr, q_begin, out_begin, q_len, stride_qt, stride_dot, stride_dqt,
                head_col, rel_bias_ptr, head, RADIUS, scale, out_scale, diag, dq_here, ACT,
                HAS_BIAS, BROADCAST_Q, CAUSAL, NB_POW2, BLOCK_M, IEEE, not BROADCAST_Q,
            )  # fmt: skip
        for q_start in range(tl.maximum(q_lo, q_mid), q_hi, BLOCK_M):
            dk_NH, dv_NH, dbias_NB, left_N, right_N = _dkdv_tile(
                dk_NH, dv_NH, dbias_NB, left_N, right_N, k_NH, v_NH, offs_n, q_start, q_ptr,
                do_ptr, dq_ptr, q_begin, out_begin, q_len, stride_qt, stride_dot, stride_dqt,
                head_col, rel_bias_ptr, head, RADIUS, scale, out_scale, diag, dq_here, ACT,
                HAS_BIAS, BROADCAST_Q, False, NB_POW2, BLOCK_M, IEEE, not BROADCAST_Q,
            )  # fmt: skip
        rows = (offs_n < kv_len)[:, None]
        dk_ptrs = dk_ptr + (kv_begin + offs_n)[:, None] * stride_dkt + head_col[None, :]
        dv_ptrs = dv_ptr + (kv_begin + offs_n)[:, None] * stride_dvt + head_col[None, :]
        if ATOMIC_KV:
            if q_lo < q_hi:
                tl.atomic_add(dk_ptrs, dk_NH * scale, mask=rows, sem="relaxed")
                tl.atomic_add(dv_ptrs, dv_NH * out_scale, mask=rows, sem="relaxed")
        else:
            tl.store(dk_ptrs, (dk_NH * scale).to(dk_ptr.dtype.element_ty), mask=rows)
            tl.store(dv_ptrs, (dv_NH * out_scale).to(dv_ptr.dtype.element_ty), mask=rows)
    if HAS_BIAS:
        dbias_NB = _finish_bias_grad(dbias_NB, left_N, right_N, RADIUS)
        slot = seq * SPLIT + part
        idx = tl.arange(0, NB_POW2)
        dbias_ptrs = dbias_WNB_ptr + (slot * num_heads + head) * NB_POW2 + idx
        if BROADCAST_Q:
            tl.store(dbias_ptrs, dbias_NB)
        else:
            if dq_here:
                tl.store(dbias_ptrs, dbias_NB)


@jit
def _gdpa_bwd_dq_seq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, rel_bias_ptr, dbias_WNB_ptr,
    q_offsets_ptr, kv_offsets_ptr, stride_qt, stride_kt, stride_vt, stride_dot, stride_dqt,
    num_heads, scale, out_scale, RADIUS, SPLIT, FUSED_KV,
    H: tl.constexpr, ACT: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    NB_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Query tiles part, part + SPLIT, ... of one sequence: dQ = scale · Σ dS K over the keys.
    # Sequences with 1..FUSED_KV keys got their dQ from the dK/dV kernel.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    part = tl.program_id(2)
    q_begin, q_len, out_begin, kv_begin, kv_len = _sequence(
        q_offsets_ptr, kv_offsets_ptr, seq, 0, False
    )
    if (kv_len > 0) & (kv_len <= FUSED_KV):
        return
    diag = kv_len - q_len
    head_col = head * H + tl.arange(0, H)
    dbias_NB = tl.zeros((NB_POW2,), tl.float32)
    left_M = tl.zeros((BLOCK_M,), tl.float32)
    right_M = tl.zeros((BLOCK_M,), tl.float32)
    for q_start in range(part * BLOCK_M, q_len, SPLIT * BLOCK_M):
        kv_mid, kv_hi = _key_stops(q_start, kv_len, diag, CAUSAL, BLOCK_M, BLOCK_N)
        offs_m = q_start + tl.arange(0, BLOCK_M)
        q_MH = _load_rows(q_ptr, q_begin, offs_m, q_len, stride_qt, head_col)
        do_MH = _load_rows(do_ptr, q_begin, offs_m, q_len, stride_dot, head_col)
        dq_MH = tl.zeros((BLOCK_M, H), tl.float32)
        for start_n in range(0, kv_mid, BLOCK_N):
            dq_MH, dbias_NB, left_M, right_M = _dq_tile(
                dq_MH, dbias_NB, left_M, right_M, q_MH, do_MH, offs_m, start_n, k_ptr, v_ptr,
                kv_begin, kv_len, stride_kt, stride_vt, head_col, rel_bias_ptr, head, RADIUS,
                scale, out_scale, diag, ACT, HAS_BIAS, False, NB_POW2, BLOCK_N, IEEE,
            )  # fmt: skip
        for start_n in range(kv_mid, kv_hi, BLOCK_N):
            dq_MH, dbias_NB, left_M, right_M = _dq_tile(
                dq_MH, dbias_NB, left_M, right_M, q_MH, do_MH, offs_m, start_n, k_ptr, v_ptr,
                kv_begin, kv_len, stride_kt, stride_vt, head_col, rel_bias_ptr, head, RADIUS,
                scale, out_scale, diag, ACT, HAS_BIAS, CAUSAL, NB_POW2, BLOCK_N, IEEE,
            )  # fmt: skip
        dq_ptrs = dq_ptr + (q_begin + offs_m)[:, None] * stride_dqt + head_col[None, :]
        rows = (offs_m < q_len)[:, None]
        tl.store(dq_ptrs, (dq_MH * scale).to(dq_ptr.dtype.element_ty), mask=rows)
    if HAS_BIAS:
        dbias_NB = _finish_bias_grad(dbias_NB, left_M, right_M, RADIUS)
        slot = seq * SPLIT + part
        idx = tl.arange(0, NB_POW2)
        tl.store(dbias_WNB_ptr + (slot * num_heads + head) * NB_POW2 + idx, dbias_NB)


def _split(batch: int, num_heads: int, tiles: GdpaTiles, target: int | None = None) -> int:
    """Programs per (sequence, head) of the per-sequence schedule, aiming at ``target``
    programs in all (default ``tiles.split_target``)."""
    target = target or tiles.split_target
    return max(1, min(tiles.max_split, -(-target // max(1, batch * num_heads))))


def forward_per_sequence(
    q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, bias, radius, scale, out_scale,
    broadcast_q, tiles, common,
):  # fmt: skip
    num_heads, head_dim = k_TNH.shape[1], k_TNH.shape[2]
    batch = kv_offsets_Bp1.numel() - 1
    num_seeds = q_TNH.shape[0] if broadcast_q else 0
    warps, stages = tiles.fwd_warps, tiles.fwd_stages
    split = _split(batch, num_heads, tiles)
    if broadcast_q:  # split key ranges add up in fp32
        out = torch.zeros(batch * num_seeds, num_heads, head_dim, device=q_TNH.device)
        block_m = seed_block(num_seeds)
    else:
        out = torch.empty(
            q_TNH.shape[0], num_heads, head_dim, device=q_TNH.device, dtype=q_TNH.dtype
        )
        block_m = tiles.cross_fwd_m or tiles.fwd_m
        warps = tiles.cross_fwd_warps or warps
        stages = tiles.cross_fwd_stages or stages
        split = _split(batch, num_heads, tiles, tiles.cross_fwd_split_target)
    if batch > 0:
        _gdpa_fwd_seq_kernel[(batch, num_heads, split)](
            q_TNH, k_TNH, v_TNH, out, bias, q_offsets_Bp1, kv_offsets_Bp1,
            q_TNH.stride(0), k_TNH.stride(0), v_TNH.stride(0), out.stride(0),
            num_seeds, scale, out_scale, radius, split,
            BROADCAST_Q=broadcast_q, BLOCK_M=block_m, BLOCK_N=tiles.fwd_n,
            num_warps=warps, num_stages=stages, **common,
        )  # fmt: skip
    return out.to(q_TNH.dtype)


def backward_per_sequence(
    do_TNH, q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, bias, radius, scale, out_scale,
    broadcast_q, has_bias, nb_pow2, tiles, common, *, keys_fit_one_tile,
):  # fmt: skip
    """``(dq, dk, dv, dbias [B·SPLIT, N, NB] or None)``; PMA's dq is fp32.
    ``keys_fit_one_tile``: every sequence is known to hold 1 to ``tiles.dkdv_n`` keys (the
    dK/dV kernel then writes every dQ row and the dQ kernel is not launched)."""
    device = q_TNH.device
    num_heads = k_TNH.shape[1]
    batch = kv_offsets_Bp1.numel() - 1
    split = _split(batch, num_heads, tiles)
    num_seeds = q_TNH.shape[0] if broadcast_q else 0
    atomic_kv = not broadcast_q and split > 1  # cross: query chunks add into fp32 dK/dV
    if broadcast_q:
        dq = torch.zeros(q_TNH.shape, device=device, dtype=torch.float32)
        block_m = seed_block(num_seeds)
    else:
        dq = torch.empty_like(q_TNH)
        block_m = tiles.dkdv_m
    if atomic_kv:
        dkv = torch.zeros((2, *k_TNH.shape), device=device, dtype=torch.float32)
        dk, dv = dkv[0], dkv[1]
    else:
        dk, dv = torch.empty_like(k_TNH), torch.empty_like(v_TNH)
    dbias = None
    if has_bias:  # one private row per program; the cross dQ kernel writes the rows it owns
        dbias = torch.zeros((batch * split, num_heads, nb_pow2), device=device, dtype=torch.float32)
    if batch > 0:
        dbias_arg = dq if dbias is None else dbias
        _gdpa_bwd_dkdv_seq_kernel[(batch, num_heads, split)](
            q_TNH, k_TNH, v_TNH, do_TNH, dk, dv, dq, bias, dbias_arg, q_offsets_Bp1,
            kv_offsets_Bp1, q_TNH.stride(0), k_TNH.stride(0), v_TNH.stride(0), do_TNH.stride(0),
            dk.stride(0), dv.stride(0), dq.stride(0),
            num_heads, num_seeds, scale, out_scale, radius, split, tiles.cross_min_part_tiles,
            BROADCAST_Q=broadcast_q, ATOMIC_KV=atomic_kv, BLOCK_M=block_m, BLOCK_N=tiles.dkdv_n,
            num_warps=tiles.dkdv_warps, num_stages=tiles.dkdv_stages, **common,
        )  # fmt: skip
        if not broadcast_q and not keys_fit_one_tile:
            _gdpa_bwd_dq_seq_kernel[(batch, num_heads, split)](
                q_TNH, k_TNH, v_TNH, do_TNH, dq, bias, dbias_arg, q_offsets_Bp1, kv_offsets_Bp1,
                q_TNH.stride(0), k_TNH.stride(0), v_TNH.stride(0), do_TNH.stride(0), dq.stride(0),
                num_heads, scale, out_scale, radius, split, tiles.dkdv_n,
                BLOCK_M=tiles.dq_m, BLOCK_N=tiles.dq_n,
                num_warps=tiles.dq_warps, num_stages=tiles.dq_stages, **common,
            )  # fmt: skip
    if atomic_kv:
        # Two tensors, not two views of one: a custom op's outputs may not alias each other.
        dk, dv = dkv[0].to(k_TNH.dtype, copy=True), dkv[1].to(v_TNH.dtype, copy=True)
    return dq, dk, dv, dbias

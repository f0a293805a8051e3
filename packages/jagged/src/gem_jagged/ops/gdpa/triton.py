"""GDPA Triton kernels: forward, and a backward that is recompute plus matmuls (no LSE).

Legend (shape suffixes): ``T`` tokens (``Tq`` queries, ``Tk`` keys), ``B`` sequences, ``N`` heads,
``H`` head dim, ``S`` PMA seeds, ``W`` work items (tiles of a jagged dimension), ``NB`` relative
bias buckets (``2R+1``). ``q_TNH`` is a query tensor of ``Tq`` rows, ``offsets_Bp1`` an offsets
tensor of ``B+1`` entries.

Why it is simpler than softmax attention: with a pointwise activation every (query, key) pair
contributes independently. The forward keeps no running max and no denominator, nothing but the
accumulator is saved, and a sum over key chunks may be split across programs and added up
(PMA does this: its few seeds meet long key sequences). The backward recomputes the scores and
needs no row statistic (softmax needs ``rowsum(dO ⊙ O)``):

    P = act(S)        dV = Pᵀ dO        dS = (dO Vᵀ) ⊙ act'(S)        dQ = dS K        dK = dSᵀ Q

Schedules (work lists are built on the device from the offsets, heavy sequences first, no host
synchronisation; programs past the real tile count exit at once):

- forward, self/cross: one program per (query tile, head), looping over the visible key tiles.
- forward, PMA: one program per (key chunk, head, seed tile); partial outputs of a sequence's
  chunks are summed by fp32 atomics (exact in count: each output row gets one add per chunk).
- backward dK/dV: one program per (key tile, head), keys resident while query tiles stream past;
  for PMA it also reduces its dQ contribution and adds it once to a shared fp32 buffer.
- backward dQ (not PMA): one program per (query tile, head), looping over key tiles.
- cross-attention and PMA by default: one program per (sequence, head, part), no work list
  (``triton_per_sequence.py``, built from the tile functions of this file).
- relative bias gradient: each program reduces its buckets into a private row of a partial
  buffer ``[W, N, NB]``; one ``sum`` over ``W`` finishes it (deterministic, no atomics). A tile
  reduces its interior diagonals from skewed reads of dS (``_accumulate_bias_grad``).
"""

from dataclasses import dataclass, replace

import torch
import triton.language as tl

from gem_jagged._intmath import cdiv, next_power_of_2
from gem_jagged._jit import jit

from ..._worklist import TileWorkList, key_tiles, query_tiles

# Activation cost: the special-function unit (MUFU: 16 results per clock per SM on Hopper) is as
# scarce as the tensor cores here. A forward (query, key) pair costs 4·H = 512 matmul FLOPs, an
# eighth of a clock of an SM's tensor cores at H = 128, and each MUFU op per score another
# sixteenth of a clock, not overlapped. Triton lowers ``tl.sigmoid`` to ``ex2.approx`` plus the
# approximate division ``div.full.f32`` (a MUFU reciprocal): two MUFU ops, which made the SiLU
# forward slower than softmax attention (one ``ex2`` per score). With bf16 operands on a GPU the
# sigmoid-based activations use ``σ(x) = ½ + ½·tanh(x/2)`` with the one-op ``tanh.approx.f32``
# instead (absolute error ~5e-4 in σ, far below bf16's rounding of P); fp16, fp32 and the
# interpreter keep the exact forms.
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "sigmoid": 4, "identity": 5}
FAST_ACTIVATION_CODES = {"silu": 6, "gelu_tanh": 7, "sigmoid": 8}


def activation_code(activation: str, dtype: torch.dtype, device: torch.device) -> int:
    """The kernels' ``ACT``: the one-MUFU-op form for bf16 on a GPU where there is one."""
    if dtype == torch.bfloat16 and device.type == "cuda" and activation in FAST_ACTIVATION_CODES:
        return FAST_ACTIVATION_CODES[activation]
    return ACTIVATION_CODES[activation]


@jit
def _tanh_approx(x):
    return tl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@jit
def _activation_and_slope(s, ACT: tl.constexpr):
    """``act(s)`` and ``act'(s)`` in fp32."""
    if ACT == 6:  # silu, one MUFU op
        sig = 0.5 + 0.5 * _tanh_approx(0.5 * s)
        return s * sig, sig * (1.0 + s * (1.0 - sig))
    elif ACT == 7:  # gelu_tanh, one MUFU op
        u = 0.7978845608028654 * (s + 0.044715 * s * s * s)
        t = _tanh_approx(u)
        du = 0.7978845608028654 * (1.0 + 0.134145 * s * s)
        return 0.5 * s * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * du
    elif ACT == 8:  # sigmoid, one MUFU op
        sig = 0.5 + 0.5 * _tanh_approx(0.5 * s)
        return sig, sig * (1.0 - sig)
    elif ACT == 0:  # silu
        sig = tl.sigmoid(s)
        return s * sig, sig * (1.0 + s * (1.0 - sig))
    elif ACT == 1:  # gelu (erf)
        cdf = 0.5 * (1.0 + tl.math.erf(s * 0.7071067811865476))
        pdf = tl.exp(-0.5 * s * s) * 0.3989422804014327
        return s * cdf, cdf + s * pdf
    elif ACT == 2:  # gelu (tanh approximation); tanh(u) = 2σ(2u) − 1
        u = 0.7978845608028654 * (s + 0.044715 * s * s * s)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        du = 0.7978845608028654 * (1.0 + 0.134145 * s * s)
        return 0.5 * s * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * du
    elif ACT == 3:  # relu
        return tl.maximum(s, 0.0), (s > 0.0).to(tl.float32)
    elif ACT == 4:  # sigmoid
        sig = tl.sigmoid(s)
        return sig, sig * (1.0 - sig)
    else:  # identity
        return s, tl.full(s.shape, 1.0, tl.float32)


@jit
def _activation(s, ACT: tl.constexpr):
    if ACT == 6:
        return s * (0.5 + 0.5 * _tanh_approx(0.5 * s))
    elif ACT == 7:
        u = 0.7978845608028654 * (s + 0.044715 * s * s * s)
        return 0.5 * s * (1.0 + _tanh_approx(u))
    elif ACT == 8:
        return 0.5 + 0.5 * _tanh_approx(0.5 * s)
    elif ACT == 0:
        return s * tl.sigmoid(s)
    elif ACT == 1:
        return 0.5 * s * (1.0 + tl.math.erf(s * 0.7071067811865476))
    elif ACT == 2:
        u = 0.7978845608028654 * (s + 0.044715 * s * s * s)
        return s * tl.sigmoid(2.0 * u)
    elif ACT == 3:
        return tl.maximum(s, 0.0)
    elif ACT == 4:
        return tl.sigmoid(s)
    else:
        return s


@jit
def _relative_range(e0, ROWS: tl.constexpr, COLS: tl.constexpr, SIGN: tl.constexpr):
    """Smallest and largest ``j − i`` of a tile whose pair at (r, c) has ``e0 + SIGN·(c − r)``."""
    if SIGN > 0:
        return e0 - (ROWS - 1), e0 + (COLS - 1)
    return e0 - (COLS - 1), e0 + (ROWS - 1)


@jit
def _add_relative_bias(s_RC, bias_head_ptr, e0, RADIUS, SIGN: tl.constexpr):
    """``s + bias[clamp(j − i, −R, R) + R]`` for a tile whose pair at row r, column c has
    ``j − i = e0 + SIGN·(c − r)`` (``SIGN`` +1: queries on rows; −1: keys on rows). A tile wholly
    on one side of the band (every pair in one clamped bucket, most tiles of a long sequence)
    adds one scalar; a tile crossing the band gathers a bucket per score."""
    ROWS: tl.constexpr = s_RC.shape[0]
    COLS: tl.constexpr = s_RC.shape[1]
    lo, hi = _relative_range(e0, ROWS, COLS, SIGN)
    if hi <= -RADIUS:
        s_RC += tl.load(bias_head_ptr).to(tl.float32)
    elif lo >= RADIUS:
        s_RC += tl.load(bias_head_ptr + 2 * RADIUS).to(tl.float32)
    else:
        rel_RC = e0 + SIGN * (tl.arange(0, COLS)[None, :] - tl.arange(0, ROWS)[:, None])
        bucket_RC = tl.minimum(tl.maximum(rel_RC, -RADIUS), RADIUS) + RADIUS
        s_RC += tl.load(bias_head_ptr + bucket_RC).to(tl.float32)
    return s_RC


@jit
def _accumulate_bias_grad(
    acc_NB, left_R, right_R, ds_RC, e0, RADIUS, NB_POW2: tl.constexpr, SIGN: tl.constexpr
):
    """Add ``ds`` summed by relative-bias bucket: interior buckets into ``acc_NB``, the two
    clamped edges into per-row partial sums ``left_R`` / ``right_R`` (``_finish_bias_grad``
    adds those into the edge buckets once, at the end of the program). The pair at tile row r,
    column c has ``j − i = e0 + SIGN·(c − r)`` (``SIGN`` +1: queries on rows; −1: keys on rows)
    and bucket ``clamp(j − i, −R, R) + R``.

    Most tiles of a long sequence lie wholly on one side of the band: they add their row sums
    (a reduction along each row, within a thread and its quad) to one edge. A full-tile sum per
    tile would reduce across warps through shared memory on every tile: in J1's causal dQ with
    R = 32 that doubled the kernel's time. The interior diagonals ``|j − i| < R`` a band
    tile crosses are read out skewed, one ``tl.gather`` per tile width of diagonals: column k of
    the gathered tile is diagonal d0 + k, one row per tile row, so a column sum is that
    diagonal's sum (one masked pass per bucket instead cost up to 2R + 1 full-tile reductions).
    """
    ROWS: tl.constexpr = ds_RC.shape[0]
    COLS: tl.constexpr = ds_RC.shape[1]
    lo, hi = _relative_range(e0, ROWS, COLS, SIGN)
    right_edge = tl.maximum(RADIUS, 1)  # R = 0: one bucket, both edges land in it
    if hi <= -RADIUS:
        left_R += tl.sum(ds_RC, 1)
    elif lo >= right_edge:
        right_R += tl.sum(ds_RC, 1)
    else:
        rows_R = tl.arange(0, ROWS)
        cols_C = tl.arange(0, COLS)
        idx_B = tl.arange(0, NB_POW2)
        rel_RC = e0 + SIGN * (cols_C[None, :] - rows_R[:, None])
        if lo <= -RADIUS:
            left_R += tl.sum(tl.where(rel_RC <= -RADIUS, ds_RC, 0.0), 1)
        if hi >= right_edge:
            right_R += tl.sum(tl.where(rel_RC >= right_edge, ds_RC, 0.0), 1)
        d_min = tl.maximum(lo, 1 - RADIUS)
        d_max = tl.minimum(hi, RADIUS - 1)
        for d0 in range(d_min, d_max + 1, COLS):
            diag_K = d0 + tl.arange(0, COLS)
            col_RK = rows_R[:, None] + SIGN * (diag_K[None, :] - e0)  # diagonal d meets row r
            take_RK = (col_RK >= 0) & (col_RK < COLS)
            ds_RK = tl.gather(ds_RC, tl.where(take_RK, col_RK, 0), axis=1)
            sums_K = tl.sum(tl.where(take_RK, ds_RK, 0.0), 0)
            hit_BK = (idx_B[:, None] == (diag_K + RADIUS)[None, :]) & (diag_K <= d_max)[None, :]
            acc_NB += tl.sum(tl.where(hit_BK, sums_K[None, :], 0.0), 1)
    return acc_NB, left_R, right_R


@jit
def _finish_bias_grad(acc_NB, left_R, right_R, RADIUS):
    """The bucket sums of a program: ``acc_NB`` with the edge rows' totals added (bucket 0 and
    bucket 2R; with R = 0 both are the one bucket)."""
    idx_B = tl.arange(0, acc_NB.shape[0])
    acc_NB = tl.where(idx_B == 0, acc_NB + tl.sum(left_R, 0), acc_NB)
    return tl.where(idx_B == 2 * RADIUS, acc_NB + tl.sum(right_R, 0), acc_NB)


@jit
def _mm(a, b, IEEE: tl.constexpr):
    """``a @ b`` in fp32; exact fp32 products for fp32 inputs (no tf32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@jit
def _sequence(
    q_offsets_ptr, kv_offsets_ptr, seq, num_seeds, BROADCAST_Q: tl.constexpr
):  # fmt: skip
    """(first query row, queries, first output row, first key row, keys) of sequence ``seq``."""
    kv_begin = tl.load(kv_offsets_ptr + seq).to(tl.int64)
    kv_len = (tl.load(kv_offsets_ptr + seq + 1) - kv_begin).to(tl.int32)
    if BROADCAST_Q:  # PMA: the seeds are shared; output rows are stacked S per sequence
        q_begin = tl.zeros((), tl.int64)
        q_len = num_seeds
        out_begin = seq.to(tl.int64) * num_seeds
    else:
        q_begin = tl.load(q_offsets_ptr + seq).to(tl.int64)
        q_len = (tl.load(q_offsets_ptr + seq + 1) - q_begin).to(tl.int32)
        out_begin = q_begin
    return q_begin, q_len, out_begin, kv_begin, kv_len


@jit
def _load_rows(ptr, begin, offs, length, stride, head_col):
    return tl.load(
        ptr + (begin + offs)[:, None] * stride + head_col[None, :],
        mask=(offs < length)[:, None],
        other=0.0,
    )


@jit
def _causal(offs_m, offs_n, diag):
    """Bottom-right causal visibility: key ``j`` is seen by query ``i`` when ``j ≤ i + Lk − Lq``.

    Pairs outside the sequences need no mask anywhere: their rows of q, k, v and dO load as zeros,
    so they add nothing to any output or gradient.
    """
    return offs_n[None, :] <= offs_m[:, None] + diag


@jit
def _fwd_tile(
    acc_MH, q_MH, offs_m, start_n, k_ptr, v_ptr, kv_begin, kv_len, stride_kt, stride_vt,
    head_col, rel_bias_ptr, head, RADIUS, scale, diag,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, MASK: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """acc += act(scale·Q Kᵀ + bias) V for one key tile (masked only on the causal diagonal)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_NH = _load_rows(k_ptr, kv_begin, offs_n, kv_len, stride_kt, head_col)
    v_NH = _load_rows(v_ptr, kv_begin, offs_n, kv_len, stride_vt, head_col)
    return _fwd_keys_on_chip(
        acc_MH, q_MH, offs_m, offs_n, k_NH, v_NH, rel_bias_ptr, head, RADIUS, scale, diag, ACT,
        HAS_BIAS, MASK, IEEE,
    )  # fmt: skip


@jit
def _fwd_keys_on_chip(
    acc_MH, q_MH, offs_m, offs_n, k_NH, v_NH, rel_bias_ptr, head, RADIUS, scale, diag,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """``_fwd_tile`` on a key tile already loaded (``offs_n`` its key positions)."""
    s_MN = _mm(q_MH, tl.trans(k_NH), IEEE) * scale
    if HAS_BIAS:
        bias_head = rel_bias_ptr + head * (2 * RADIUS + 1)
        s_MN = _add_relative_bias(s_MN, bias_head, tl.min(offs_n, 0) - tl.min(offs_m, 0), RADIUS, 1)
    p_MN = _activation(s_MN, ACT)
    if MASK:
        p_MN = tl.where(_causal(offs_m, offs_n, diag), p_MN, 0.0)
    return acc_MH + _mm(p_MN.to(v_NH.dtype), v_NH, IEEE)


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
def _dkdv_tile(
    dk_NH, dv_NH, dbias_NB, left_N, right_N, k_NH, v_NH, offs_n, q_start, q_ptr, do_ptr, dq_ptr,
    q_begin, out_begin, q_len, stride_qt, stride_dot, stride_dqt, head_col, rel_bias_ptr, head,
    RADIUS, scale, out_scale, diag, dq_here,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BROADCAST_Q: tl.constexpr, MASK: tl.constexpr,
    NB_POW2: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr, FUSED_DQ: tl.constexpr,
):  # fmt: skip
    """One query tile's share of dK, dV (and, for PMA, of dQ), on transposed scores Sᵀ.

    With ``FUSED_DQ`` and ``dq_here`` (the key tile is the sequence's only one) the tile's dQ is
    complete here too: ``dQ = scale · dS K``, stored, and its bias-gradient share accumulated.
    """
    offs_m = q_start + tl.arange(0, BLOCK_M)
    q_MH = _load_rows(q_ptr, q_begin, offs_m, q_len, stride_qt, head_col)
    do_MH = _load_rows(do_ptr, out_begin, offs_m, q_len, stride_dot, head_col)
    sT_NM = _mm(k_NH, tl.trans(q_MH), IEEE) * scale
    if HAS_BIAS:
        e0 = tl.min(offs_n, 0) - q_start  # j − i of the tile's first key and first query
        bias_head = rel_bias_ptr + head * (2 * RADIUS + 1)
        sT_NM = _add_relative_bias(sT_NM, bias_head, e0, RADIUS, -1)
    pT_NM, slopeT_NM = _activation_and_slope(sT_NM, ACT)
    dpT_NM = _mm(v_NH, tl.trans(do_MH), IEEE)
    dsT_NM = dpT_NM * slopeT_NM * out_scale
    if MASK:
        visibleT_NM = tl.trans(_causal(offs_m, offs_n, diag))
        pT_NM = tl.where(visibleT_NM, pT_NM, 0.0)
        dsT_NM = tl.where(visibleT_NM, dsT_NM, 0.0)
    dv_NH += _mm(pT_NM.to(do_MH.dtype), do_MH, IEEE)
    dk_NH += _mm(dsT_NM.to(q_MH.dtype), q_MH, IEEE)
    if BROADCAST_Q:  # seeds are shared by all sequences: add this tile's dQ share once
        dq_MH = _mm(tl.trans(dsT_NM).to(k_NH.dtype), k_NH, IEEE) * scale
        dq_ptrs = dq_ptr + offs_m[:, None] * stride_dqt + head_col[None, :]
        tl.atomic_add(dq_ptrs, dq_MH, mask=(offs_m < q_len)[:, None], sem="relaxed")
        if HAS_BIAS:
            dbias_NB, left_N, right_N = _accumulate_bias_grad(
                dbias_NB, left_N, right_N, dsT_NM, e0, RADIUS, NB_POW2, -1
            )
    elif FUSED_DQ:
        if dq_here:
            dq_MH = _mm(tl.trans(dsT_NM).to(k_NH.dtype), k_NH, IEEE) * scale
            dq_ptrs = dq_ptr + (q_begin + offs_m)[:, None] * stride_dqt + head_col[None, :]
            tl.store(dq_ptrs, dq_MH.to(dq_ptr.dtype.element_ty), mask=(offs_m < q_len)[:, None])
            if HAS_BIAS:
                dbias_NB, left_N, right_N = _accumulate_bias_grad(
                    dbias_NB, left_N, right_N, dsT_NM, e0, RADIUS, NB_POW2, -1
                )
    return dk_NH, dv_NH, dbias_NB, left_N, right_N


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
def _dq_tile(
    dq_MH, dbias_NB, left_M, right_M, q_MH, do_MH, offs_m, start_n, k_ptr, v_ptr, kv_begin, kv_len,
    stride_kt, stride_vt, head_col, rel_bias_ptr, head, RADIUS, scale, out_scale, diag,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, MASK: tl.constexpr, NB_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One key tile's share of dQ: dS = (dO Vᵀ) ⊙ act'(S), dQ += dS K."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_NH = _load_rows(k_ptr, kv_begin, offs_n, kv_len, stride_kt, head_col)
    v_NH = _load_rows(v_ptr, kv_begin, offs_n, kv_len, stride_vt, head_col)
    s_MN = _mm(q_MH, tl.trans(k_NH), IEEE) * scale
    if HAS_BIAS:
        e0 = start_n - tl.min(offs_m, 0)  # j − i of the tile's first query and first key
        bias_head = rel_bias_ptr + head * (2 * RADIUS + 1)
        s_MN = _add_relative_bias(s_MN, bias_head, e0, RADIUS, 1)
    slope_MN = _activation_and_slope(s_MN, ACT)[1]
    dp_MN = _mm(do_MH, tl.trans(v_NH), IEEE)
    ds_MN = dp_MN * slope_MN * out_scale
    if MASK:
        ds_MN = tl.where(_causal(offs_m, offs_n, diag), ds_MN, 0.0)
    dq_MH += _mm(ds_MN.to(k_NH.dtype), k_NH, IEEE)
    if HAS_BIAS:
        dbias_NB, left_M, right_M = _accumulate_bias_grad(
            dbias_NB, left_M, right_M, ds_MN, e0, RADIUS, NB_POW2, 1
        )
    return dq_MH, dbias_NB, left_M, right_M


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


@dataclass(frozen=True)
class GdpaTiles:
    """Tile shapes and launch options of the three kernels (rows of queries ``m``, keys ``n``)."""

    fwd_m: int = 128
    fwd_n: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    dkdv_m: int = 64
    dkdv_n: int = 128
    dkdv_warps: int = 8
    dkdv_stages: int = 2
    dq_m: int = 128
    dq_n: int = 64
    dq_warps: int = 8
    dq_stages: int = 2
    pma_chunk: int = 256  # keys per PMA forward program
    cross_split_rows: int = 512  # work-list schedule: cross key tiles split their query range
    cross_max_splits: int = 16
    # Cross-attention and PMA: "per_sequence" (grid B × N × SPLIT, no work list) or "work_list".
    cross_schedule: str = "per_sequence"
    # Per-sequence schedule: aim for this many programs in all (about 8 per SM of an H200), at
    # most max_split per (sequence, head), so that one long sequence is not the tail of the
    # launch. Programs past a sequence's tiles exit at once, but not for free: on J3 (B = 64,
    # 4 heads) 16 programs per (sequence, head) took 0.338 ms of fwd+bwd and 4 took 0.274 (H200,
    # graph-replayed, docs/performance.md 2026-11-29).
    split_target: int = 1024
    max_split: int = 16
    # Cross-attention dK/dV: a chunk of query tiles is at least this long. Each chunk adds its
    # dK/dV (BLOCK_N × H per key tile) to fp32 buffers with atomics; one-tile chunks of
    # J3's median sequence made those adds most of the backward's traffic.
    cross_min_part_tiles: int = 4
    # The per-sequence cross-attention forward: rows, warps and stages of its own where set,
    # else fwd_m / fwd_warps / fwd_stages. On J3 (64 candidates, bf16, head dim 128) 64 rows on
    # 4 warps with one stage took its kernel from 66 to 55 µs on an H200: 162 registers and
    # 72 KiB of shared memory let three programs share an SM, where 128 rows on 8 warps (238
    # registers, 128 KiB) left one (docs/performance.md).
    cross_fwd_m: int | None = None
    cross_fwd_warps: int | None = None
    cross_fwd_stages: int | None = None
    # The per-sequence cross-attention forward's own program target (else split_target). Its
    # programs add nothing up, so a program past its sequence's tiles costs only its exit, and a
    # finer split keeps the longest sequence (J3: 57 query tiles of 64) from being the launch's
    # tail: on J3 4096 programs (16 per sequence and head) took the kernel from 55 to 43.5 µs
    # on an H200, where 2048 gave 46 and 8192 47 (docs/performance.md).
    cross_fwd_split_target: int | None = None


INTERPRETER_TILES = GdpaTiles(
    16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1, 32, 32, 4, split_target=64, max_split=3,
    cross_min_part_tiles=2,
)  # fmt: skip
# fp32 operands take twice the shared memory of bf16 per tile: the bf16 tiles (128×64 queries ×
# keys, three stages, head dim 128) would not fit in an H200's 227 KiB; these do.
FP32_TILES = GdpaTiles(
    fwd_m=64, fwd_n=32, fwd_warps=4, fwd_stages=2, dkdv_m=32, dkdv_n=64, dkdv_warps=4,
    dkdv_stages=1, dq_m=64, dq_n=32, dq_warps=4, dq_stages=1,
)  # fmt: skip


def default_tiles(
    device: torch.device, head_dim: int, dtype: torch.dtype, *, has_bias: bool = False
) -> GdpaTiles:
    if device.type != "cuda":
        return INTERPRETER_TILES
    if dtype == torch.float32:
        return FP32_TILES
    if head_dim <= 64:
        return GdpaTiles(fwd_warps=4, dkdv_warps=4, dq_warps=4, dkdv_m=64, dkdv_n=64)
    tiles = GdpaTiles(
        cross_fwd_m=64, cross_fwd_warps=4, cross_fwd_stages=1, cross_fwd_split_target=4096
    )
    if has_bias:
        # The dQ tiles below were measured without a bias; with one (R = 32) the dQ kernel's bias
        # gradient spills 1,564 / 1,756 bytes at them, against 64 / 64 at 128 rows on 8 warps
        # (ptxas, sm_90), so the bias path keeps the tiles it was measured with.
        return tiles
    # dQ on 64-row tiles, 4 warps: J1's forward + backward 1.15 -> 1.07 ms on an H200 (eager;
    # 1.21 -> 1.14 graph-replayed; docs/performance.md, 2026-11-30)
    return replace(tiles, dq_m=64, dq_warps=4)


def _seed_block(num_seeds: int) -> int:
    return max(16, min(64, next_power_of_2(max(num_seeds, 1))))


def _seed_offsets(kv_offsets: torch.Tensor, num_seeds: int) -> torch.Tensor:
    """PMA: every sequence has the same ``S`` queries (the seeds)."""
    batch = kv_offsets.numel() - 1
    return torch.arange(batch + 1, device=kv_offsets.device, dtype=torch.int64) * num_seeds


def _query_work(batch, q_offsets, kv_offsets, *, total_q, block, causal) -> TileWorkList:
    return batch.memo(
        ("gdpa.query_tiles", total_q, block, causal),
        lambda: query_tiles(q_offsets, kv_offsets, total_q=total_q, block=block, causal=causal),
    )


def _key_work(batch, q_offsets, kv_offsets, *, total_kv, block, causal, align, split):
    options = dict(split_rows=split[0], max_splits=split[1]) if split else {}
    return batch.memo(
        ("gdpa.key_tiles", total_kv, block, causal, align, split),
        lambda: key_tiles(
            q_offsets, kv_offsets, total_kv=total_kv, block=block, causal=causal, align=align,
            **options,
        ),
    )  # fmt: skip


def _pma_key_work(batch, kv_offsets, num_seeds, *, total_kv, block, causal, align):
    return batch.memo(
        ("gdpa.pma_key_tiles", num_seeds, total_kv, block, causal, align),
        lambda: key_tiles(
            _seed_offsets(kv_offsets, num_seeds), kv_offsets, total_kv=total_kv, block=block,
            causal=causal, align=align,
        ),
    )  # fmt: skip


def gdpa_forward(
    q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, *, activation, causal, scale,
    out_scale, broadcast_q, rel_bias_NB, is_cross, batch, tiles: GdpaTiles | None = None,
    return_work: bool = False,
):  # fmt: skip
    """Launch the forward kernel; ``kv_offsets_Bp1`` is never None here (self: the q offsets).
    ``batch`` (the ``JaggedBatch`` the offsets come from) keeps the work lists.

    With ``return_work`` returns ``(out, work)``: the query-tile work list of the self-attention
    schedule (``None`` for the others), which the backward's dQ kernel can reuse.
    """
    q_TNH, k_TNH, v_TNH = q_TNH.contiguous(), k_TNH.contiguous(), v_TNH.contiguous()
    num_heads, head_dim = k_TNH.shape[1], k_TNH.shape[2]
    has_bias = rel_bias_NB is not None
    tiles = tiles or default_tiles(q_TNH.device, head_dim, q_TNH.dtype, has_bias=has_bias)
    bias = rel_bias_NB.contiguous() if has_bias else q_TNH
    radius = (rel_bias_NB.shape[1] - 1) // 2 if has_bias else 0
    common = dict(
        H=head_dim, ACT=activation_code(activation, q_TNH.dtype, q_TNH.device), CAUSAL=causal, HAS_BIAS=has_bias,
        IEEE=q_TNH.dtype == torch.float32,
    )  # fmt: skip
    work = None
    if (broadcast_q or is_cross) and tiles.cross_schedule == "per_sequence":
        from . import triton_per_sequence as per_sequence  # it imports this module's tile code

        out = per_sequence.forward_per_sequence(
            q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, bias, radius, scale, out_scale,
            broadcast_q, tiles, common,
        )  # fmt: skip
        return (out, work) if return_work else out
    if broadcast_q:
        num_seeds = q_TNH.shape[0]
        batch = kv_offsets_Bp1.numel() - 1
        out = torch.zeros(batch * num_seeds, num_heads, head_dim, device=q_TNH.device)
        seed_block = _seed_block(num_seeds)
        pma_work = _pma_key_work(
            batch, kv_offsets_Bp1, num_seeds, total_kv=k_TNH.shape[0], block=tiles.pma_chunk,
            causal=causal, align=1,
        )  # fmt: skip
        grid = (pma_work.num_slots, num_heads, cdiv(num_seeds, seed_block))
        block_m, kv_chunk = seed_block, tiles.pma_chunk
        q_offsets_Bp1 = kv_offsets_Bp1
        launch_work = pma_work
    else:
        num_seeds = 0
        out = torch.empty(
            q_TNH.shape[0], num_heads, head_dim, device=q_TNH.device, dtype=q_TNH.dtype
        )
        work = _query_work(
            batch, q_offsets_Bp1, kv_offsets_Bp1, total_q=q_TNH.shape[0], block=tiles.fwd_m,
            causal=causal,
        )  # fmt: skip
        grid = (work.num_slots, num_heads, 1)
        block_m, kv_chunk = tiles.fwd_m, tiles.fwd_n
        launch_work = work
    _gdpa_fwd_kernel[grid](
        q_TNH, k_TNH, v_TNH, out, bias,
        q_offsets_Bp1, kv_offsets_Bp1, launch_work.seq_W, launch_work.start_W, launch_work.hi_W,
        q_TNH.stride(0), k_TNH.stride(0), v_TNH.stride(0), out.stride(0),
        num_seeds, scale, out_scale, radius,
        BROADCAST_Q=broadcast_q, KV_CHUNK=kv_chunk, BLOCK_M=block_m, BLOCK_N=tiles.fwd_n,
        num_warps=tiles.fwd_warps, num_stages=tiles.fwd_stages, **common,
    )  # fmt: skip
    out = out.to(q_TNH.dtype)
    return (out, work) if return_work else out


def gdpa_backward(
    do_TNH, q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, *, activation, causal, scale,
    out_scale, broadcast_q, rel_bias_NB, is_cross, batch, tiles: GdpaTiles | None = None,
    query_work: TileWorkList | None = None,
):  # fmt: skip
    """Launch the backward kernels; returns ``(dq, dk, dv, d_rel_bias or None)``.

    ``query_work`` is the forward's query-tile list (``gdpa_forward(..., return_work=True)``);
    the dQ kernel reuses it when its tiles have the forward's height.
    """
    do_TNH = do_TNH.contiguous()
    q_TNH, k_TNH, v_TNH = q_TNH.contiguous(), k_TNH.contiguous(), v_TNH.contiguous()
    num_heads, head_dim = k_TNH.shape[1], k_TNH.shape[2]
    has_bias = rel_bias_NB is not None
    tiles = tiles or default_tiles(q_TNH.device, head_dim, q_TNH.dtype, has_bias=has_bias)
    bias = rel_bias_NB.contiguous() if has_bias else q_TNH
    num_buckets = rel_bias_NB.shape[1] if has_bias else 1
    nb_pow2 = next_power_of_2(num_buckets)
    radius = (num_buckets - 1) // 2
    common = dict(
        H=head_dim, ACT=activation_code(activation, q_TNH.dtype, q_TNH.device), CAUSAL=causal, HAS_BIAS=has_bias,
        IEEE=q_TNH.dtype == torch.float32, NB_POW2=nb_pow2,
    )  # fmt: skip
    device = q_TNH.device
    if (broadcast_q or is_cross) and tiles.cross_schedule == "per_sequence":
        from . import triton_per_sequence as per_sequence  # it imports this module's tile code

        dq, dk, dv, dbias = per_sequence.backward_per_sequence(
            do_TNH, q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, bias, radius, scale,
            out_scale, broadcast_q, has_bias, nb_pow2, tiles, common,
            keys_fit_one_tile=batch.kv_lengths_known_within(1, tiles.dkdv_n),
        )  # fmt: skip
        d_rel_bias = dbias.sum(0)[:, :num_buckets].to(rel_bias_NB.dtype) if has_bias else None
        return dq.to(q_TNH.dtype), dk, dv, d_rel_bias
    if broadcast_q:
        num_seeds = q_TNH.shape[0]
        block_m = _seed_block(num_seeds)
        dq = torch.zeros(q_TNH.shape, device=device, dtype=torch.float32)
        work = _pma_key_work(
            batch, kv_offsets_Bp1, num_seeds, total_kv=k_TNH.shape[0], block=tiles.dkdv_n,
            causal=causal, align=block_m,
        )  # fmt: skip
        q_offsets_Bp1 = _seed_offsets(kv_offsets_Bp1, num_seeds)
        atomic_kv = False
    else:
        num_seeds = 0
        block_m = tiles.dkdv_m
        dq = torch.empty_like(q_TNH)
        split = (tiles.cross_split_rows, tiles.cross_max_splits) if is_cross else None
        work = _key_work(
            batch, q_offsets_Bp1, kv_offsets_Bp1, total_kv=k_TNH.shape[0], block=tiles.dkdv_n,
            causal=causal, align=block_m, split=split,
        )  # fmt: skip
        atomic_kv = is_cross
    kv_dtype = torch.float32 if atomic_kv else k_TNH.dtype
    make = torch.zeros if atomic_kv else torch.empty
    dk = make(k_TNH.shape, device=device, dtype=kv_dtype)
    dv = make(v_TNH.shape, device=device, dtype=kv_dtype)
    dbias_dkdv = dq  # a placeholder pointer unless PMA has a bias
    if broadcast_q and has_bias:
        dbias_dkdv = torch.zeros(
            (work.num_slots, num_heads, nb_pow2), device=device, dtype=torch.float32
        )
    _gdpa_bwd_dkdv_kernel[(work.num_slots, num_heads)](
        q_TNH, k_TNH, v_TNH, do_TNH, dk, dv, dq, bias, dbias_dkdv,
        q_offsets_Bp1, kv_offsets_Bp1, work.seq_W, work.start_W, work.lo_W, work.hi_W,
        q_TNH.stride(0), k_TNH.stride(0), v_TNH.stride(0), do_TNH.stride(0),
        dk.stride(0), dv.stride(0), dq.stride(0),
        num_heads, num_seeds, scale, out_scale, radius,
        BROADCAST_Q=broadcast_q, ATOMIC_KV=atomic_kv, BLOCK_M=block_m, BLOCK_N=tiles.dkdv_n,
        num_warps=tiles.dkdv_warps, num_stages=tiles.dkdv_stages, **common,
    )  # fmt: skip
    dbias = dbias_dkdv
    if not broadcast_q:
        if query_work is None or query_work.block != tiles.dq_m:
            query_work = _query_work(
                batch, q_offsets_Bp1, kv_offsets_Bp1, total_q=q_TNH.shape[0], block=tiles.dq_m,
                causal=causal,
            )  # fmt: skip
        dbias = dq  # placeholder pointer without a bias
        if has_bias:
            dbias = torch.zeros(
                (query_work.num_slots, num_heads, nb_pow2), device=device, dtype=torch.float32
            )
        _gdpa_bwd_dq_kernel[(query_work.num_slots, num_heads)](
            q_TNH, k_TNH, v_TNH, do_TNH, dq, bias, dbias,
            q_offsets_Bp1, kv_offsets_Bp1, query_work.seq_W, query_work.start_W, query_work.hi_W,
            q_TNH.stride(0), k_TNH.stride(0), v_TNH.stride(0), do_TNH.stride(0), dq.stride(0),
            num_heads, scale, out_scale, radius,
            BLOCK_M=tiles.dq_m, BLOCK_N=tiles.dq_n,
            num_warps=tiles.dq_warps, num_stages=tiles.dq_stages, **common,
        )  # fmt: skip
    d_rel_bias = dbias.sum(0)[:, :num_buckets].to(rel_bias_NB.dtype) if has_bias else None
    return dq.to(q_TNH.dtype), dk.to(k_TNH.dtype), dv.to(v_TNH.dtype), d_rel_bias

"""GDPA's shared Triton tile code: activations, relative bias, loads and the per-tile bodies.

Legend (shape suffixes): ``T`` tokens (``Tq`` queries, ``Tk`` keys), ``B`` sequences, ``N`` heads,
``H`` head dim, ``M`` query rows of a tile, ``N`` (in ``_MN``, ``_NH``) key rows of a tile,
``R``/``C`` rows and columns of a tile whichever side is which, ``NB`` relative bias buckets
(``2R+1``, padded to ``NB_POW2``). ``q_MH`` is a query tile, ``s_MN`` its scores against a key tile.

Both schedules (``worklist_schedule.py``: programs from a device work list;
``per_sequence_schedule.py``: a ``(B, N, SPLIT)`` grid) decide which tiles a program visits and
call the bodies here for each one, so the arithmetic of a tile is written once:

    P = act(S)        dV = Pᵀ dO        dS = (dO Vᵀ) ⊙ act'(S)        dQ = dS K        dK = dSᵀ Q

- ``_fwd_tile`` / ``_fwd_keys_on_chip``: ``acc += act(scale·Q Kᵀ + bias) V`` for one key tile;
- ``_dkdv_tile``: one query tile's share of dK, dV (and of dQ for PMA, or where the keys fit one
  tile), on transposed scores ``Sᵀ`` so the key tile stays the resident operand;
- ``_dq_tile``: one key tile's share of dQ.

Activations are selected by the constexpr ``ACT`` (``config.activation_code``). The
sigmoid-based ones have a second form built on the one-instruction ``tanh.approx.f32``
(``σ(x) = ½ + ½·tanh(x/2)``): the special-function unit is as scarce as the tensor cores at these
shapes, and ``tl.sigmoid`` costs it two instructions (an exponential and a reciprocal) per score.
Its absolute error (~5e-4 in σ) is far below bf16's rounding of P, so it is picked for bf16 on a
GPU only (``GdpaTiles.sigmoid``); the interpreter has no inline assembly.

The relative bias adds ``bias[clamp(j − i, −R, R) + R]``: a tile wholly on one side of the band
adds one scalar, a band tile gathers per score. Its gradient sums dS by bucket: edge tiles reduce
rows, band tiles read their interior diagonals skewed (``_accumulate_bias_grad``).
"""

import triton.language as tl

from gem_jagged._jit import jit


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
    (a reduction along each row, within a thread and its quad) to one edge, because a full-tile
    sum per tile would reduce across warps through shared memory on every tile
    (``docs/design/gdpa.md`` has the measurement). The interior diagonals ``|j − i| < R`` a band
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

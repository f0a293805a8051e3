"""Jagged flash attention in Triton: forward, and backward split into a dQ and a dK/dV kernel.

Legend (shape suffixes): ``Tq``/``Tk`` total query/key tokens, ``B`` sequences, ``N`` heads,
``H`` head dim, ``W`` work-list slots, ``R2`` relative-bias buckets (2R+1), ``M``/``Nk`` rows of
a query/key tile (BLOCK_M/BLOCK_N).

Forward (one program per (query tile, head), heaviest tiles first, see ``gem_jagged._worklist``)
    The classic online softmax: the query tile stays in registers while key/value blocks stream
    past; running max ``m``, running sum ``l`` and the output accumulator are rescaled as the max
    grows. Scores live in the log2 domain (``scale · log2 e`` is folded into one multiply, so the
    exponentials are ``exp2``). Key blocks wholly below the causal diagonal run without any mask;
    only the blocks crossing the diagonal or the end of the sequence pay for masking, and blocks
    wholly above it are never visited. The (natural) log-sum-exp of each row is saved for
    the backward pass; a row that sees no key saves ``+inf`` and outputs zeros. Where the tile
    table says so (``fwd_tma``) and the layout allows, K and V blocks arrive through TMA
    descriptors over the packed ``[Tk, N·H]`` rows (the copy engine fills shared memory; no
    per-element addresses in registers); a sequence's last block then reads into the next
    sequence's rows, which the masked step zeroes like the pointer loads' mask does.

Backward, dK/dV kernel (one program per (key tile, query-range chunk, head))
    Keeps a key/value tile in registers and streams the query blocks that can see it, rebuilding
    ``Pᵀ = exp2(K Qᵀ · c − lse)`` from the saved log-sum-exp and accumulating ``dV += Pᵀ dO`` and
    ``dK += dSᵀ Q`` with ``dS = P ⊙ (dP − δ)``, ``δ = rowsum(dO ⊙ O)``. The key tiles of a long
    sequence see thousands of query rows; the work list splits that query range into chunks so
    one 20k-token sequence spreads over many programs. Chunks of a split tile add their partial
    dK/dV into a float32 scratch with atomics and count their arrival; the last to arrive casts
    the sums into dK/dV (no finishing launch). Unsplit tiles store directly.

    Short keys (candidates, J3: the short-keys table's ``dq_in_dkdv``, no bias). A sequence of
    at most ``BLOCK_N`` keys is one key tile, so its program sees every key of the query rows
    it streams: it computes their ``δ`` from the output block and stores ``dQ = dS K`` too, from
    the ``dS`` it has anyway. The backward of such a batch is one launch instead of three (dQ,
    dK/dV, finish), and ``QKᵀ`` and ``dO Vᵀ`` are computed once instead of twice. The dQ kernel
    still serves the sequences with no keys or more than a tile's, and is not launched when
    the offsets' host check has shown there are none.

Backward, dQ kernel (one program per (query tile, head), a query work list like the forward's)
    Runs first. It computes ``δ`` of its rows from the output tile and ``dO``, which it holds
    anyway, and stores it for the dK/dV kernel (no separate launch, no second pass over ``O``
    and ``dO``). Then it mirrors the forward loop: ``dQ += dS K``. It also owns the
    relative-bias gradient: each program reduces ``dS`` of its tiles by diagonal into its own
    row of a partial buffer, and one sum over the rows finishes it. No per-element atomics, and
    no two programs ever add into the same address. The interior diagonals (|j − i| < R) a tile
    crosses are read out of the ``dS`` tile skewed (``tl.gather``: row r, column c holds
    diagonal d0 + c), so that one column sum per diagonal gives them all, ``dq_diag_chunk``
    diagonals per read (masking the tile once per diagonal instead made the dQ kernel at R = 32
    do 63 full-tile reductions on every tile crossing the band). The right edge bucket (j − i ≥
    R) takes one masked sum of a tile that reaches it, which a causal self-attention tile never
    does. The left edge bucket (j − i ≤ −R, the bulk of a long causal sequence) costs nothing:
    every row of dS sums to zero (``Σ_j P_ij (dP_ij − δ_i) = δ_i − δ_i Σ_j P_ij``), so the
    whole gradient does, and bucket 0 is minus the sum of the others (one op after the sum of
    the partial rows).

Relative bias. The bias of a pair depends on ``clamp(j − i, −R, R)``: every pair of a tile lying
wholly left of the band (``j − i < −R`` for all of it, the bulk of a long causal sequence) takes
the same bucket 0. Such tiles add one scalar to the scores, and the dQ kernel does no bias work
on them at all (bucket 0's gradient comes from the zero row sums of dS, above). A tile crossing
the band loads its bias as a plain tile from ``relative_bias_tiles`` (``bias_tiles.py``: the
bias of every tile offset that is not constant, laid out per kernel geometry), one coalesced
load like a key tile's, instead of computing and gathering a bucket per score.

On Hopper the tile table can hand each of the three kernels to a Gluon twin (``hopper/``:
the same work lists and math, scheduled by hand with asynchronous ``wgmma`` and the tiles a
program keeps in shared memory instead of registers); it does so at head dim 128 without a bias.
The launchers below choose. The Triton kernels remain what the interpreter runs, the fallback
off Hopper and for rows the Gluon copies cannot tile, and the relative-bias and short-keys
paths.

Tile shapes are fixed per head dim and element size (``_GPU_CONFIGS`` for bf16/fp16,
``_GPU_CONFIGS_FP32`` with smaller tiles, so that float32 inputs fit the shared memory; the
benchmark's ``--sweep`` times alternatives) rather than autotuned: the work list depends on the
query tile height, so a tuner would have to rebuild it per candidate. Under the interpreter
every tile is 16 rows, so small tests cross many tile edges.

Host cost. A forward + backward step of a small batch is over in a few hundred microseconds of
device time, so what the host does per call matters: the work lists are kept in the batch's
``JaggedBatch`` (built once per batch, shared by its layers), the forward's query list is handed to the
backward, and the dK/dV split (with its zeroed float32 scratch) is only used when the longest
sequence would otherwise be the tail of the launch (``dkdv_splits``). Q, K and V
are read where they lie as long as each token's heads are dense (the views of a fused QKV
projection are): the kernels take their row strides instead of a contiguous copy of each.
"""

import math

import torch
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gem_jagged._jit import jit
from gem_jagged._worklist import TileWorkList, key_tiles, query_tiles, tile_slot_bound

from . import hopper
from .bias_tiles import add_relative_bias, far_bias_log2, relative_bias_tiles
from .config import DqPlacement, JaggedAttentionConfig, KernelImpl, KeyLoads

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


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------


@jit
def _slot_and_head(num_heads, HEADS_OUTER: tl.constexpr):
    """This program's work-list slot and head. ``HEADS_OUTER``: program ``pid`` takes slot
    ``pid mod W`` of head ``pid div W`` (one head's tiles, heaviest first, then the next
    head's), so the running programs stream one head's rows, which can stay in L2; otherwise
    the heads of one slot run side by side.

    With a relative bias R = 32 (gem-small's attention) on an H200 (docs/performance.md,
    2026-12-01), heads outermost took J1's dQ from 441 to 409 us and its dK/dV from 592 to 576
    (J2's dK/dV 832 to 818), but the forward from 317 to 322 us (J2: 435 to 451): the backward
    kernels run heads outermost, the forward heads innermost. The other tables (short keys,
    other head dims, no Hopper) take the same order, not measured there.
    """
    pid = tl.program_id(0)
    if HEADS_OUTER:
        num_slots = tl.num_programs(0) // num_heads
        slot = pid % num_slots
        head = pid // num_slots
    else:
        slot = pid // num_heads
        head = pid % num_heads
    return slot, head


@jit
def _load_sequence(offsets_Bp1, seq):
    begin = tl.load(offsets_Bp1 + seq).to(tl.int64)
    end = tl.load(offsets_Bp1 + seq + 1).to(tl.int64)
    return begin, (end - begin).to(tl.int32)


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


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


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
        # Stage 2: online softmax; a row that has seen nothing yet keeps max -inf safely.
        m_new_M = tl.maximum(m_M, tl.max(s_MN, 1))
        if MASKED:
            m_use_M = tl.where(m_new_M == float("-inf"), 0.0, m_new_M)
        else:
            m_use_M = m_new_M
        p_MN = tl.math.exp2(s_MN - m_use_M[:, None])
        alpha_M = tl.math.exp2(m_M - m_use_M)
        l_M = l_M * alpha_M + tl.sum(p_MN, 1)
        # Stage 3: rescale and accumulate P V.
        acc_MH = acc_MH * alpha_M[:, None]
        acc_MH = tl.dot(p_MN.to(v_NH.dtype), v_NH, acc_MH, input_precision=DOT_PRECISION)
        m_M = m_new_M
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
    slot, head = _slot_and_head(num_heads, False)
    seq = tl.load(work_seq_W + slot)
    if seq < 0:
        return
    q_start = tl.load(work_start_W + slot)
    k_stop = tl.load(work_hi_W + slot)
    q_begin, q_len = _load_sequence(q_offsets_Bp1, seq)
    k_begin, k_len = _load_sequence(kv_offsets_Bp1, seq)
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
    seen_M = l_M > 0.0
    out_MH = acc_MH / tl.where(seen_M, l_M, 1.0)[:, None]
    log2_sum_M = m_M + tl.math.log2(tl.where(seen_M, l_M, 1.0))
    lse_M = tl.where(seen_M, log2_sum_M * 0.6931471805599453, float("inf"))  # natural log
    tl.store(
        out_TqNH + q_rows_M[:, None] * (num_heads * HEAD_DIM) + head * HEAD_DIM + dims_H[None, :],
        out_MH.to(out_TqNH.dtype.element_ty),
        mask=row_ok_M[:, None],
    )
    tl.store(lse_NTq + head * total_q + q_begin + rows_M, lse_M, mask=row_ok_M)


# ----------------------------------------------------------------------------------------------
# Backward: dK and dV
# ----------------------------------------------------------------------------------------------


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
    slot, head = _slot_and_head(num_heads, True)
    seq = tl.load(work_seq_W + slot)
    if seq < 0:
        return
    k_start = tl.load(work_start_W + slot)
    q_lo = tl.load(work_lo_W + slot)
    q_hi = tl.load(work_hi_W + slot)
    splits = tl.load(work_splits_W + slot)
    q_begin, q_len = _load_sequence(q_offsets_Bp1, seq)
    k_begin, k_len = _load_sequence(kv_offsets_Bp1, seq)
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
    slot, head = _slot_and_head(num_heads, True)
    seq = tl.load(work_seq_W + slot)
    splits = tl.load(work_splits_W + slot)
    if (seq < 0) | (splits <= 1):
        return
    k_start = tl.load(work_start_W + slot)
    k_begin, k_len = _load_sequence(kv_offsets_Bp1, seq)
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


# ----------------------------------------------------------------------------------------------
# Backward: dQ and the relative-bias gradient
# ----------------------------------------------------------------------------------------------


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
    slot, head = _slot_and_head(num_heads, True)
    seq = tl.load(work_seq_W + slot)
    if seq < 0:
        return
    q_start = tl.load(work_start_W + slot)
    k_stop = tl.load(work_hi_W + slot)
    q_begin, q_len = _load_sequence(q_offsets_Bp1, seq)
    k_begin, k_len = _load_sequence(kv_offsets_Bp1, seq)
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


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


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


def jfa_forward(q, k, v, batch, *, causal, scale, rel_bias, config, descriptors=None):
    """Launch the forward kernel over ``batch`` (a ``JaggedBatch``); returns ``(out [Tq, N, H],
    lse [N, Tq] float32, work)``.

    ``work`` is the query-tile work list packed as int32 ``[5, W]``; the backward's dQ kernel
    reuses it instead of building it again. It is kept in the batch (``JaggedBatch.memo``), so
    the other layers of the batch reuse it too. ``descriptors`` (a dict, or None) remembers the
    Gluon kernels' TMA descriptors for the backward's launches (``hopper.row_descriptor``).
    ``config``: the ``JaggedAttentionConfig`` (``config_for_inputs`` picks one).
    """
    total_q, num_heads, head_dim = q.shape
    cfg = config
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
        hopper.launch_forward(
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


def _query_work(batch, *, total_q, block, causal) -> TileWorkList:
    """The batch's query-tile list for this tile height (built at its first use)."""
    return batch.memo(
        ("jfa.query_tiles", total_q, block, causal),
        lambda: query_tiles(
            batch.offsets, batch.kv_offsets, total_q=total_q, block=block, causal=causal
        ),
    )


def forward_work_slots(q: torch.Tensor, q_offsets: torch.Tensor, *, config) -> int:
    """Slots of the forward's query work list under ``config`` (host shapes only; for fake
    tensors too)."""
    return tile_slot_bound(q.shape[0], q_offsets.shape[0] - 1, config.forward.block_m)


def jfa_backward(
    dout, q, k, v, out, lse, batch, *, causal, scale, rel_bias, config, forward_work=None,
    descriptors=None,
):  # fmt: skip
    """Launch the backward kernels over ``batch``; returns ``(dq, dk, dv, d_rel_bias or None)``.
    ``forward_work``: the forward's packed query list; ``descriptors``: the forward's memo of
    TMA descriptors (``jfa_forward``), or None; ``config``: the forward's config.

    Usually dQ runs first: its kernel also computes δ = rowsum(dO ⊙ O), which dK/dV then
    reads. Where the config says so (``DqPlacement.IN_DKDV``: no bias, the Triton dK/dV
    kernel) the dK/dV kernel computes δ itself and writes dQ of every sequence whose keys fit
    its one key tile; the dQ kernel then runs only for the other sequences, and not at all when
    the batch's host check showed every sequence to have 1 to ``config.dkdv.block_n`` keys.
    """
    q, k, v = _rows_of_heads(q, k, v)
    dout, out = dout.contiguous(), out.contiguous()
    cfg = config
    dkdv_on_hopper = cfg.dkdv_impl == KernelImpl.GLUON_HOPPER and hopper.supported(
        q, k, v, dout,
        rel_bias=rel_bias is not None, rows=cfg.dkdv.block_n, num_warps=cfg.dkdv.warps,
    )  # fmt: skip
    in_dkdv = cfg.dq_placement == DqPlacement.IN_DKDV
    dq_in_dkdv = in_dkdv and rel_bias is None and not dkdv_on_hopper
    options = dict(causal=causal, scale=scale, rel_bias=rel_bias, config=cfg)
    if dq_in_dkdv:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        delta = lse  # never read: the dK/dV kernel sums δ itself
        # Sequences of 1 to one key tile of keys get their dQ from the dK/dV kernel: where that
        # is known of every sequence, the dQ kernel would launch only to exit.
        if not batch.kv_lengths_known_within(1, cfg.dkdv.block_n):
            backward_dq(
                dout, q, k, v, out, lse, batch, forward_work=forward_work,
                descriptors=descriptors, dq=dq, keys_done_elsewhere=cfg.dkdv.block_n, **options,
            )  # fmt: skip
        dbias = None
    else:
        dq, dbias, delta = backward_dq(
            dout, q, k, v, out, lse, batch, forward_work=forward_work,
            descriptors=descriptors, **options,
        )  # fmt: skip
    dk, dv = backward_dkdv(
        dout, q, k, v, out, lse, delta, dq, batch, descriptors=descriptors,
        on_hopper=dkdv_on_hopper, dq_in_dkdv=dq_in_dkdv, **options,
    )  # fmt: skip
    return dq, dk, dv, dbias


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
        hopper.launch_dkdv(
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
        hopper.launch_dq(
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

"""The backward of jagged flash attention on Hopper, written in Gluon (explicit layouts, async
MMAs): the same work as ``triton.py``'s dK/dV and dQ kernels, from the same work lists,
scheduled by hand.

dK/dV (one program per key tile, query-range chunk and head):

    K, V tile [Nk, H]                    → shared memory, once (cp.async)
    for each query block [M, H] of the chunk, NUM_STAGES − 1 blocks ahead (cp.async ring):
        Sᵀ  = K Qᵀ          wgmma, async ┐ both issued before either is waited for
        dPᵀ = V dOᵀ         wgmma, async ┘
        Pᵀ  = exp2(Sᵀ · c − lse)          while dPᵀ is still on the tensor cores
        dV += Pᵀ dO         wgmma, async, Pᵀ straight from registers
        dSᵀ = Pᵀ ⊙ (dPᵀ − δ)              while dV's MMA runs
        dK += dSᵀ Q         wgmma, async, dSᵀ from registers

dQ (one program per query tile and head; it also stores δ = rowsum(dO ⊙ O) for dK/dV):

    Q, dO tile [M, H]                    → shared memory, once (cp.async)
    for each key block [Nk, H] up to the tile's last visible key (cp.async ring):
        S  = Q Kᵀ, dP = dO Vᵀ   wgmma, async, both in flight
        P  = exp2(S · c − lse)            while dP is still on the tensor cores
        dS = P ⊙ (dP − δ)
        dQ += dS K          wgmma, async, dS from registers; it runs on while the next
                            block's S and dP are issued, and is waited for before its key
                            block's ring slot is refilled

Why second kernels: Triton keeps the tiles a program holds for its whole loop (K and V in
dK/dV, Q and dO in dQ) in registers next to the float32 accumulators and score tiles; its dK/dV
kernel sits at the 255-register limit with spills (``ptxas``, sm_90), and the compiler does not
overlap the exponentials with the MMAs. Here those tiles stay in shared memory, where ``wgmma``
reads its left operand, and the MMAs are issued asynchronously in the order above.

Rows past a sequence's end are copied as zeros (the copy's mask), so a neighbour's Inf or NaN
never meets a zero probability in a matmul, and rows past the end are never written. Gluon
compiles for the GPU only (no interpreter): the launchers use these kernels on sm_90 for 2-byte
inputs without a relative bias, where the tile table asks for them
(``JaggedAttentionConfig.dkdv_hopper``, ``dq_hopper``), and the Triton kernels everywhere else.
The GPU tests hold them to the tolerance rule against fp64 and compare them with Triton's.
"""

import functools

import torch
from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gem_jagged._jit import BATCH_DEPENDENT

LOG2E = gl.constexpr(1.4426950408889634)
# A CTA-wide barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` from 3.7 on.
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
HEAD_DIMS = (64, 128)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


_HOPPER: dict[int, bool] = {}


def _is_hopper(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HOPPER:
        _HOPPER[index] = torch.cuda.get_device_capability(index)[0] == 9
    return _HOPPER[index]


def supported(*rows_TNH: torch.Tensor, rel_bias: bool, rows: int, num_warps: int) -> bool:
    """Whether these kernels can take a pass over the token-major tensors ``rows_TNH`` (q, k,
    v, and the output and its gradient where read) on their device, with tiles of ``rows``
    rows (keys for dK/dV, queries for the forward and dQ) on ``num_warps`` warps (16 rows per
    warp: one wgmma slice each). The copies move 16-byte vectors, so every row must start
    16-byte aligned with a row stride the compiler can see is a multiple of 16 elements."""
    q = rows_TNH[0]
    return (
        q.is_cuda
        and _is_hopper(q.device)
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] in HEAD_DIMS
        and not rel_bias
        and rows == 16 * num_warps
        and all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in rows_TNH)
    )


@constexpr_function
def _row_copy_layout(head_dim, num_warps):
    """16-byte vectors along the head dim, whole rows per group of threads."""
    threads_per_row = head_dim // 8
    return gl.BlockedLayout(
        [1, 8], [32 // threads_per_row, threads_per_row], [num_warps, 1], [1, 0]
    )


@gluon.jit
def _copy_rows_async(
    smem_RH, head_ptr, first, length, stride,
    LAYOUT: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """Start copying rows ``[first, first + ROWS)`` of one head into ``smem_RH``; rows at or
    past ``length`` are written as zeros and read nothing."""
    rows_R = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT))
    dims_H = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LAYOUT))
    ptrs_RH = head_ptr + rows_R.to(gl.int64)[:, None] * stride + dims_H[None, :]
    mask_RH = (rows_R < length)[:, None] & (dims_H < HEAD_DIM)[None, :]
    async_copy.async_copy_global_to_shared(smem_RH, ptrs_RH, mask=mask_RH)


@gluon.jit
def _head_rows(
    seq_begin, first, length, stride, head,
    LAYOUT: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """Element offsets and in-sequence mask of rows ``[first, first + ROWS)`` of one head."""
    rows_R = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT))
    dims_H = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LAYOUT))
    offsets_RH = (seq_begin + rows_R.to(gl.int64))[:, None] * stride + head * HEAD_DIM
    offsets_RH += dims_H[None, :]
    mask_RH = (rows_R < length)[:, None] & (dims_H < HEAD_DIM)[None, :]
    return offsets_RH, mask_RH


@gluon.jit
def _row_dots(
    a_TNH, b_TNH, seq_begin, first, length, stride, head,
    LAYOUT: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """``rowsum(a ⊙ b)`` in float32 over rows ``[first, first + ROWS)`` of one head."""
    offsets_RH, mask_RH = _head_rows(seq_begin, first, length, stride, head, LAYOUT, ROWS, HEAD_DIM)
    a_RH = gl.load(a_TNH + offsets_RH, mask=mask_RH, other=0.0).to(gl.float32)
    b_RH = gl.load(b_TNH + offsets_RH, mask=mask_RH, other=0.0).to(gl.float32)
    return gl.sum(a_RH * b_RH, axis=1)


@gluon.jit
def _store_rows(
    dst_TNH, tile_RH, seq_begin, first, length, stride, head,
    LAYOUT: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """Store ``tile_RH`` (in ``LAYOUT``) as rows ``[first, first + ROWS)`` of one head, those
    in the sequence only."""
    offsets_RH, mask_RH = _head_rows(seq_begin, first, length, stride, head, LAYOUT, ROWS, HEAD_DIM)
    gl.store(dst_TNH + offsets_RH, tile_RH, mask=mask_RH)


@gluon.jit
def _online_softmax_step(
    s_MN, m_M, l_M, rows_M, block_start, full_stop, k_len, diag, qk_scale_log2,
    CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, DTYPE: gl.constexpr, LHS_LAYOUT: gl.constexpr,
):  # fmt: skip
    """One key block of the online softmax: ``(P as an MMA left operand, α, m, l)``. Blocks
    from ``full_stop`` on cross the causal diagonal or the sequence's end and are masked; a
    row that has seen no key keeps ``m = −inf`` safely."""
    s_MN = s_MN * qk_scale_log2
    if block_start >= full_stop:
        cols_N = block_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_MN.type.layout))
        visible_MN = (cols_N < k_len)[None, :] & (rows_M >= 0)[:, None]
        if CAUSAL:
            visible_MN = visible_MN & (cols_N[None, :] <= rows_M[:, None] + diag)
        s_MN = gl.where(visible_MN, s_MN, float("-inf"))
    m_new_M = gl.maximum(m_M, gl.max(s_MN, axis=1))
    m_use_M = gl.where(m_new_M == float("-inf"), 0.0, m_new_M)
    p_MN = gl.exp2(s_MN - m_use_M[:, None])
    alpha_M = gl.exp2(m_M - m_use_M)
    l_M = l_M * alpha_M + gl.sum(p_MN, axis=1)
    return gl.convert_layout(p_MN.to(DTYPE), LHS_LAYOUT), alpha_M, m_new_M, l_M


@gluon.jit
def _load_key_block(k_desc, v_desc, k_dst, v_dst, ready, row, col, pred):
    """Start the TMA copy of one K and one V block into a ring slot; ``ready`` flips when
    both have landed. Skipped where ``pred`` is false (past the last block)."""
    mbarrier.expect(ready, 2 * k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row, col], ready, k_dst, pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, col], ready, v_dst, pred=pred)


@gluon.jit
def _wait_key_block(
    v_dst, ready, phase, block_start, k_len,
    LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Wait for a ring slot. A block running past the sequence's end holds the next sequence's
    rows there: their scores are masked, but a V row of Inf or NaN would still reach the output
    through a zero probability, so those V rows are zeroed in shared memory first."""
    mbarrier.wait(ready, phase)
    if block_start + BLOCK_N > k_len:
        rows_N = block_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
        v_NH = v_dst.load(LAYOUT)
        v_dst.store(gl.where((rows_N < k_len)[:, None], v_NH, 0.0))
        fence_async_shared()  # generic-proxy stores, then wgmma's async-proxy reads
        _cta_barrier()


@gluon.jit(do_not_specialize=BATCH_DEPENDENT)
def _jfa_fwd_hopper_kernel(
    q_TqNH, k_desc, v_desc, out_TqNH, lse_NTq,
    q_offsets_Bp1, kv_offsets_Bp1, work_seq_W, work_start_W, work_hi_W,
    num_heads, total_q, qk_scale_log2, stride_q,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    gl.static_assert(BLOCK_M == 16 * num_warps, "one 16-row wgmma slice of the query tile per warp")
    gl.static_assert(NUM_STAGES >= 2, "the ring must hold the block in use and the next")
    pid = gl.program_id(0)
    slot = pid // num_heads
    head = pid % num_heads
    seq = gl.load(work_seq_W + slot)
    if seq < 0:
        return
    q_start = gl.load(work_start_W + slot)
    k_stop = gl.load(work_hi_W + slot)
    q_begin = gl.load(q_offsets_Bp1 + seq).to(gl.int64)
    q_len = (gl.load(q_offsets_Bp1 + seq + 1) - q_begin).to(gl.int32)
    k_begin = gl.load(kv_offsets_Bp1 + seq)
    k_len = (gl.load(kv_offsets_Bp1 + seq + 1) - k_begin).to(gl.int32)
    k_row0 = k_begin.to(gl.int32)  # TMA coordinates are 32-bit (the launcher checks Tk)
    col0 = head * HEAD_DIM
    diag = k_len - q_len  # query i sees key j iff j <= i + diag (bottom-right causal)
    dtype: gl.constexpr = q_TqNH.dtype.element_ty

    copy_layout: gl.constexpr = _row_copy_layout(HEAD_DIM, num_warps)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    lhs_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_M, HEAD_DIM], dtype
    )
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], rows_smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)

    # Stage 0: the query tile (cp.async, rows past the end as zeros) and a full ring of key
    # blocks (TMA) in flight.
    n_blocks = gl.cdiv(k_stop, BLOCK_N)
    q_head = q_TqNH + q_begin * stride_q + head * HEAD_DIM
    _copy_rows_async(q_smem, q_head, q_start, q_len, stride_q, copy_layout, BLOCK_M, HEAD_DIM)
    async_copy.commit_group()
    for i in gl.static_range(NUM_STAGES):
        _load_key_block(
            k_desc, v_desc, k_smem.index(i), v_smem.index(i), ready.index(i),
            k_row0 + i * BLOCK_N, col0, i < n_blocks,
        )  # fmt: skip
    rows_M = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    full_stop = k_len  # key blocks from here on cross the causal diagonal or the end
    if CAUSAL:
        full_stop = gl.minimum(full_stop, q_start + 1 + diag)
    full_stop = gl.minimum(gl.maximum(full_stop, 0) // BLOCK_N * BLOCK_N, k_stop)
    no_scores_MN = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    m_M = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_M = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc_MH = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    async_copy.wait_group(0)
    _cta_barrier()
    fence_async_shared()  # cp.async wrote the query tile through the generic proxy

    if n_blocks > 0:
        # Stage 1 (block 0): S and its softmax; P₀ V₀ is issued with block 1's scores.
        _wait_key_block(v_smem.index(0), ready.index(0), 0, 0, k_len, copy_layout, BLOCK_N)
        s_MN = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), no_scores_MN, use_acc=False)
        p_lhs, alpha_M, m_M, l_M = _online_softmax_step(
            s_MN, m_M, l_M, rows_M, 0, full_stop, k_len, diag, qk_scale_log2,
            CAUSAL, BLOCK_N, dtype, lhs_layout,
        )  # fmt: skip
        # Stage 2 (blocks 1 …): Sⱼ and Pⱼ₋₁ Vⱼ₋₁ on the tensor cores together; Sⱼ's softmax runs
        # while Pⱼ₋₁ Vⱼ₋₁ finishes; then O is rescaled and block j − 1's ring slot refilled.
        for j in range(1, n_blocks):
            _wait_key_block(
                v_smem.index(j % NUM_STAGES), ready.index(j % NUM_STAGES),
                (j // NUM_STAGES) & 1, j * BLOCK_N, k_len, copy_layout, BLOCK_N,
            )  # fmt: skip
            s_MN = warpgroup_mma(
                q_smem, k_smem.index(j % NUM_STAGES).permute((1, 0)), no_scores_MN,
                use_acc=False, is_async=True,
            )  # fmt: skip
            acc_MH = warpgroup_mma(p_lhs, v_smem.index((j - 1) % NUM_STAGES), acc_MH, is_async=True)
            s_MN = warpgroup_mma_wait(num_outstanding=1, deps=(s_MN,))
            p_next, alpha_M, m_M, l_M = _online_softmax_step(
                s_MN, m_M, l_M, rows_M, j * BLOCK_N, full_stop, k_len, diag, qk_scale_log2,
                CAUSAL, BLOCK_N, dtype, lhs_layout,
            )  # fmt: skip
            acc_MH, p_lhs = warpgroup_mma_wait(num_outstanding=0, deps=(acc_MH, p_lhs))
            acc_MH = acc_MH * gl.convert_layout(alpha_M, gl.SliceLayout(1, acc_layout))[:, None]
            p_lhs = p_next
            _cta_barrier()  # every warp is done with block j − 1's slot
            refill = j - 1 + NUM_STAGES
            _load_key_block(
                k_desc, v_desc, k_smem.index((j - 1) % NUM_STAGES),
                v_smem.index((j - 1) % NUM_STAGES), ready.index((j - 1) % NUM_STAGES),
                k_row0 + refill * BLOCK_N, col0, refill < n_blocks,
            )  # fmt: skip
        acc_MH = warpgroup_mma(p_lhs, v_smem.index((n_blocks - 1) % NUM_STAGES), acc_MH)

    # Epilogue: normalise; rows that saw no key write zeros and lse = +inf.
    seen_M = l_M > 0.0
    l_safe_M = gl.where(seen_M, l_M, 1.0)
    out_MH = acc_MH / gl.convert_layout(l_safe_M, gl.SliceLayout(1, acc_layout))[:, None]
    lse_M = gl.where(seen_M, (m_M + gl.log2(l_safe_M)) * 0.6931471805599453, float("inf"))
    stride_o = num_heads * HEAD_DIM  # the output is contiguous
    out_CH = gl.convert_layout(out_MH.to(out_TqNH.dtype.element_ty), copy_layout)
    _store_rows(
        out_TqNH, out_CH, q_begin, q_start, q_len, stride_o, head, copy_layout, BLOCK_M, HEAD_DIM
    )
    gl.store(lse_NTq + head * total_q + q_begin + rows_M, lse_M, mask=rows_M < q_len)


@gluon.jit(do_not_specialize=BATCH_DEPENDENT)
def _jfa_dkdv_hopper_kernel(
    q_TqNH, k_TkNH, v_TkNH, do_TqNH, lse_NTq, delta_NTq,
    dk_TkNH, dv_TkNH, dk_scratch_TkNH, dv_scratch_TkNH,
    q_offsets_Bp1, kv_offsets_Bp1, work_seq_W, work_start_W, work_lo_W, work_hi_W, work_splits_W,
    num_heads, total_q, scale, qk_scale_log2, stride_q, stride_kv,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    gl.static_assert(BLOCK_N == 16 * num_warps, "one 16-row wgmma slice of the key tile per warp")
    pid = gl.program_id(0)
    slot = pid // num_heads
    head = pid % num_heads
    seq = gl.load(work_seq_W + slot)
    if seq < 0:
        return
    k_start = gl.load(work_start_W + slot)
    q_lo = gl.load(work_lo_W + slot)
    q_hi = gl.load(work_hi_W + slot)
    splits = gl.load(work_splits_W + slot)
    q_begin = gl.load(q_offsets_Bp1 + seq).to(gl.int64)
    q_len = (gl.load(q_offsets_Bp1 + seq + 1) - q_begin).to(gl.int32)
    k_begin = gl.load(kv_offsets_Bp1 + seq).to(gl.int64)
    k_len = (gl.load(kv_offsets_Bp1 + seq + 1) - k_begin).to(gl.int32)
    diag = k_len - q_len
    stride_o = num_heads * HEAD_DIM  # dO, dK, dV and the scratch are contiguous
    dtype: gl.constexpr = q_TqNH.dtype.element_ty

    # Layouts: rows of the key tile over the warps (16 each), as one wgmma slice per warp.
    copy_layout: gl.constexpr = _row_copy_layout(HEAD_DIM, num_warps)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    lhs_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    keys_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_N, HEAD_DIM], dtype
    )
    rows_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_M, HEAD_DIM], dtype
    )

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], keys_smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], keys_smem_layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], rows_smem_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], rows_smem_layout)

    k_head = k_TkNH + k_begin * stride_kv + head * HEAD_DIM
    v_head = v_TkNH + k_begin * stride_kv + head * HEAD_DIM
    q_head = q_TqNH + q_begin * stride_q + head * HEAD_DIM
    do_head = do_TqNH + q_begin * stride_o + head * HEAD_DIM
    lse_head = lse_NTq + head * total_q + q_begin
    delta_head = delta_NTq + head * total_q + q_begin

    # Stage 0: the key tile, and the first query blocks of the ring, in flight together.
    n_blocks = gl.cdiv(q_hi - q_lo, BLOCK_M)
    _copy_rows_async(k_smem, k_head, k_start, k_len, stride_kv, copy_layout, BLOCK_N, HEAD_DIM)
    _copy_rows_async(v_smem, v_head, k_start, k_len, stride_kv, copy_layout, BLOCK_N, HEAD_DIM)
    for i in gl.static_range(NUM_STAGES - 1):
        length = gl.where(i < n_blocks, q_len, 0)
        first = q_lo + i * BLOCK_M
        _copy_rows_async(
            q_smem.index(i), q_head, first, length, stride_q, copy_layout, BLOCK_M, HEAD_DIM
        )
        _copy_rows_async(
            do_smem.index(i), do_head, first, length, stride_o, copy_layout, BLOCK_M, HEAD_DIM
        )
        async_copy.commit_group()

    # Query blocks starting before the last key's diagonal need the causal mask.
    mask_stop = q_lo
    if CAUSAL:
        first_full = k_start + BLOCK_N - 1 - diag
        mask_stop = q_lo + gl.maximum(first_full - q_lo + BLOCK_M - 1, 0) // BLOCK_M * BLOCK_M
    cols_N = k_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    no_scores_NM = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk_NH = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv_NH = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    for j in range(n_blocks):
        # Stage 1: refill the ring slot freed by the previous block, then wait for this one.
        ahead = j + NUM_STAGES - 1
        length = gl.where(ahead < n_blocks, q_len, 0)
        first = q_lo + ahead * BLOCK_M
        slot_ahead = ahead % NUM_STAGES
        _copy_rows_async(
            q_smem.index(slot_ahead),
            q_head,
            first,
            length,
            stride_q,
            copy_layout,
            BLOCK_M,
            HEAD_DIM,
        )
        _copy_rows_async(
            do_smem.index(slot_ahead),
            do_head,
            first,
            length,
            stride_o,
            copy_layout,
            BLOCK_M,
            HEAD_DIM,
        )
        async_copy.commit_group()
        block_start = q_lo + j * BLOCK_M
        rows_M = block_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        row_ok_M = rows_M < q_len
        lse_M = gl.load(lse_head + rows_M, mask=row_ok_M, other=float("inf")) * LOG2E
        delta_M = gl.load(delta_head + rows_M, mask=row_ok_M, other=0.0)
        async_copy.wait_group(NUM_STAGES - 1)
        _cta_barrier()
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads async
        q_MH = q_smem.index(j % NUM_STAGES)
        do_MH = do_smem.index(j % NUM_STAGES)

        # Stage 2: both score-shaped products on the tensor cores at once.
        s_NM = warpgroup_mma(
            k_smem, q_MH.permute((1, 0)), no_scores_NM, use_acc=False, is_async=True
        )
        dp_NM = warpgroup_mma(
            v_smem, do_MH.permute((1, 0)), no_scores_NM, use_acc=False, is_async=True
        )
        s_NM = warpgroup_mma_wait(num_outstanding=1, deps=(s_NM,))

        # Stage 3: Pᵀ from the saved log-sum-exp, then dV += Pᵀ dO while dPᵀ finishes.
        p_NM = gl.exp2(s_NM * qk_scale_log2 - lse_M[None, :])
        if CAUSAL:
            if block_start < mask_stop:
                p_NM = gl.where(cols_N[:, None] <= rows_M[None, :] + diag, p_NM, 0.0)
        p_lhs = gl.convert_layout(p_NM.to(dtype), lhs_layout)
        dv_NH = warpgroup_mma(p_lhs, do_MH, dv_NH, is_async=True)
        dp_NM = warpgroup_mma_wait(num_outstanding=1, deps=(dp_NM,))

        # Stage 4: dSᵀ and dK += dSᵀ Q; both accumulators settle before the ring slot is reused.
        ds_NM = p_NM * (dp_NM - delta_M[None, :])
        ds_lhs = gl.convert_layout(ds_NM.to(dtype), lhs_layout)
        dk_NH = warpgroup_mma(ds_lhs, q_MH, dk_NH, is_async=True)
        dv_NH, dk_NH, p_lhs, ds_lhs = warpgroup_mma_wait(
            num_outstanding=0, deps=(dv_NH, dk_NH, p_lhs, ds_lhs)
        )
    async_copy.wait_group(0)

    # Stage 5: write the key tile's rows (a split tile adds its part into the float32 scratch),
    # one accumulator at a time through the copy layout (coalesced rows).
    dk_NH = dk_NH * scale
    offsets_CH, mask_CH = _head_rows(
        k_begin, k_start, k_len, stride_o, head, copy_layout, BLOCK_N, HEAD_DIM
    )
    if splits > 1:
        dk_sum_CH = gl.convert_layout(dk_NH, copy_layout)
        gl.atomic_add(dk_scratch_TkNH + offsets_CH, dk_sum_CH, mask=mask_CH, sem="relaxed")
        dv_sum_CH = gl.convert_layout(dv_NH, copy_layout)
        gl.atomic_add(dv_scratch_TkNH + offsets_CH, dv_sum_CH, mask=mask_CH, sem="relaxed")
    else:
        out_ty: gl.constexpr = dk_TkNH.dtype.element_ty
        gl.store(
            dk_TkNH + offsets_CH, gl.convert_layout(dk_NH.to(out_ty), copy_layout), mask=mask_CH
        )
        gl.store(
            dv_TkNH + offsets_CH, gl.convert_layout(dv_NH.to(out_ty), copy_layout), mask=mask_CH
        )


@gluon.jit(do_not_specialize=BATCH_DEPENDENT)
def _jfa_dq_hopper_kernel(
    q_TqNH, k_TkNH, v_TkNH, out_TqNH, do_TqNH, lse_NTq, delta_NTq, dq_TqNH,
    q_offsets_Bp1, kv_offsets_Bp1, work_seq_W, work_start_W, work_hi_W,
    num_heads, total_q, scale, qk_scale_log2, stride_q, stride_kv,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    gl.static_assert(BLOCK_M == 16 * num_warps, "one 16-row wgmma slice of the query tile per warp")
    gl.static_assert(NUM_STAGES >= 2, "the ring must hold the block in use and the next")
    pid = gl.program_id(0)
    slot = pid // num_heads
    head = pid % num_heads
    seq = gl.load(work_seq_W + slot)
    if seq < 0:
        return
    q_start = gl.load(work_start_W + slot)
    k_stop = gl.load(work_hi_W + slot)
    q_begin = gl.load(q_offsets_Bp1 + seq).to(gl.int64)
    q_len = (gl.load(q_offsets_Bp1 + seq + 1) - q_begin).to(gl.int32)
    k_begin = gl.load(kv_offsets_Bp1 + seq).to(gl.int64)
    k_len = (gl.load(kv_offsets_Bp1 + seq + 1) - k_begin).to(gl.int32)
    diag = k_len - q_len  # query i sees key j iff j <= i + diag (bottom-right causal)
    stride_o = num_heads * HEAD_DIM  # O, dO and dQ are contiguous
    dtype: gl.constexpr = q_TqNH.dtype.element_ty

    copy_layout: gl.constexpr = _row_copy_layout(HEAD_DIM, num_warps)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    lhs_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_M, HEAD_DIM], dtype
    )
    keys_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_N, HEAD_DIM], dtype
    )

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], rows_smem_layout)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], rows_smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], keys_smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], keys_smem_layout)

    q_head = q_TqNH + q_begin * stride_q + head * HEAD_DIM
    do_head = do_TqNH + q_begin * stride_o + head * HEAD_DIM
    k_head = k_TkNH + k_begin * stride_kv + head * HEAD_DIM
    v_head = v_TkNH + k_begin * stride_kv + head * HEAD_DIM

    # Stage 0: the query tile and the first key blocks of the ring in flight; meanwhile
    # δ = rowsum(dO ⊙ O), stored for the dK/dV kernel (each query row is in one tile).
    n_blocks = gl.cdiv(k_stop, BLOCK_N)
    _copy_rows_async(q_smem, q_head, q_start, q_len, stride_q, copy_layout, BLOCK_M, HEAD_DIM)
    _copy_rows_async(do_smem, do_head, q_start, q_len, stride_o, copy_layout, BLOCK_M, HEAD_DIM)
    for i in gl.static_range(NUM_STAGES - 1):
        length = gl.where(i < n_blocks, k_len, 0)
        first = i * BLOCK_N
        _copy_rows_async(
            k_smem.index(i), k_head, first, length, stride_kv, copy_layout, BLOCK_N, HEAD_DIM
        )
        _copy_rows_async(
            v_smem.index(i), v_head, first, length, stride_kv, copy_layout, BLOCK_N, HEAD_DIM
        )
        async_copy.commit_group()
    delta_C = _row_dots(
        out_TqNH, do_TqNH, q_begin, q_start, q_len, stride_o, head, copy_layout, BLOCK_M, HEAD_DIM
    )
    rows_C = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout))
    gl.store(delta_NTq + head * total_q + q_begin + rows_C, delta_C, mask=rows_C < q_len)
    rows_M = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    row_ok_M = rows_M < q_len
    delta_M = gl.convert_layout(delta_C, gl.SliceLayout(1, s_layout))
    lse_M = gl.load(lse_NTq + head * total_q + q_begin + rows_M, mask=row_ok_M, other=float("inf"))
    lse_M = lse_M * LOG2E

    # Key blocks from ``full_stop`` on cross the causal diagonal or the sequence's end.
    full_stop = k_len
    if CAUSAL:
        full_stop = gl.minimum(full_stop, q_start + 1 + diag)
    full_stop = gl.minimum(gl.maximum(full_stop, 0) // BLOCK_N * BLOCK_N, k_stop)
    no_scores_MN = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    # dQ is carried through the loop as an MMA in flight (waited for inside each step)
    dq_MH = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
    ds_lhs = gl.zeros([BLOCK_M, BLOCK_N], dtype, lhs_layout)
    for j in range(n_blocks):
        block_start = j * BLOCK_N
        async_copy.wait_group(NUM_STAGES - 2)
        _cta_barrier()
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads async
        k_NH = k_smem.index(j % NUM_STAGES)
        v_NH = v_smem.index(j % NUM_STAGES)

        # Stage 1: S and dP issued behind the previous block's dQ MMA; once only this block's
        # two remain in flight, that MMA is done and its ring slot can be refilled.
        s_MN = warpgroup_mma(
            q_smem, k_NH.permute((1, 0)), no_scores_MN, use_acc=False, is_async=True
        )
        dp_MN = warpgroup_mma(
            do_smem, v_NH.permute((1, 0)), no_scores_MN, use_acc=False, is_async=True
        )
        dq_MH, ds_lhs = warpgroup_mma_wait(num_outstanding=2, deps=(dq_MH, ds_lhs))
        ahead = j + NUM_STAGES - 1
        length = gl.where(ahead < n_blocks, k_len, 0)
        slot_ahead = ahead % NUM_STAGES
        _copy_rows_async(
            k_smem.index(slot_ahead),
            k_head,
            ahead * BLOCK_N,
            length,
            stride_kv,
            copy_layout,
            BLOCK_N,
            HEAD_DIM,
        )
        _copy_rows_async(
            v_smem.index(slot_ahead),
            v_head,
            ahead * BLOCK_N,
            length,
            stride_kv,
            copy_layout,
            BLOCK_N,
            HEAD_DIM,
        )
        async_copy.commit_group()

        # Stage 2: P from the saved log-sum-exp while dP finishes; blocks crossing the
        # diagonal or the end are masked.
        s_MN = warpgroup_mma_wait(num_outstanding=1, deps=(s_MN,))
        p_MN = gl.exp2(s_MN * qk_scale_log2 - lse_M[:, None])
        if block_start >= full_stop:
            cols_N = block_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            visible_MN = (cols_N < k_len)[None, :] & row_ok_M[:, None]
            if CAUSAL:
                visible_MN = visible_MN & (cols_N[None, :] <= rows_M[:, None] + diag)
            p_MN = gl.where(visible_MN, p_MN, 0.0)
        dp_MN = warpgroup_mma_wait(num_outstanding=0, deps=(dp_MN,))

        # Stage 3: dS, and dQ += dS K left running into the next block.
        ds_MN = p_MN * (dp_MN - delta_M[:, None])
        ds_lhs = gl.convert_layout(ds_MN.to(dtype), lhs_layout)
        dq_MH = warpgroup_mma(ds_lhs, k_NH, dq_MH, is_async=True)
    dq_MH, ds_lhs = warpgroup_mma_wait(num_outstanding=0, deps=(dq_MH, ds_lhs))
    async_copy.wait_group(0)

    # Stage 4: write the tile's dQ rows.
    dq_CH = gl.convert_layout((dq_MH * scale).to(dq_TqNH.dtype.element_ty), copy_layout)
    _store_rows(
        dq_TqNH, dq_CH, q_begin, q_start, q_len, stride_o, head, copy_layout, BLOCK_M, HEAD_DIM
    )


def forward_supported(k: torch.Tensor) -> bool:
    """Whether the forward's TMA coordinates (32-bit) reach every key row of ``k`` and the
    ring's blocks past it; the alignment ``supported`` asks for suits the descriptors."""
    return 0 < k.shape[0] < 2**31 - 2**16


@functools.cache
def _block_layout(rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a ``[rows, head_dim]`` block (made once: building a layout
    costs about 25 us of host time)."""
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], _GL_DTYPES[dtype])


def _row_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A descriptor of ``t [T, N, H]`` as ``[T, N·H]``, blocks of ``rows`` rows × one head."""
    layout = _block_layout(rows, t.shape[2], t.dtype)
    rows_2d = t.view(t.shape[0], t.shape[1] * t.shape[2])
    return TensorDescriptor(
        rows_2d, list(rows_2d.shape), list(rows_2d.stride()), [rows, t.shape[2]], layout
    )


def launch_forward(
    grid, q, k, v, out, lse, q_offsets, kv_offsets, work,
    *, scale, causal, block_m, block_n, num_warps, num_stages,
):  # fmt: skip
    """Launch the forward kernel with ``triton.py``'s arguments (q, k, v as ``_rows_of_heads``
    leaves them, k and v ``forward_supported``; out contiguous)."""
    total_q, num_heads, head_dim = q.shape
    _jfa_fwd_hopper_kernel[grid](
        q, _row_descriptor(k, block_n), _row_descriptor(v, block_n), out, lse,
        q_offsets, kv_offsets, work.seq_W, work.start_W, work.hi_W,
        num_heads, total_q, scale * LOG2E.value, q.stride(0),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        NUM_STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip


def launch_dq(
    grid, q, k, v, out, dout, lse, delta, dq, q_offsets, kv_offsets, qwork,
    *, scale, causal, block_m, block_n, num_warps, num_stages,
):  # fmt: skip
    """Launch the dQ kernel with ``triton.py``'s arguments (q, k, v as ``_rows_of_heads``
    leaves them; out and dout contiguous); it fills ``delta`` as well."""
    total_q, num_heads, head_dim = q.shape
    _jfa_dq_hopper_kernel[grid](
        q, k, v, out, dout, lse, delta, dq,
        q_offsets, kv_offsets, qwork.seq_W, qwork.start_W, qwork.hi_W,
        num_heads, total_q, scale, scale * LOG2E.value, q.stride(0), k.stride(0),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        NUM_STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip


def launch_dkdv(
    grid, q, k, v, dout, lse, delta, dk, dv, dk_scratch, dv_scratch, q_offsets, kv_offsets, kwork,
    *, scale, causal, block_m, block_n, num_warps, num_stages,
):  # fmt: skip
    """Launch the dK/dV kernel with ``triton.py``'s arguments (q, k, v as ``_rows_of_heads``
    leaves them; dout contiguous)."""
    total_q, num_heads, head_dim = q.shape
    _jfa_dkdv_hopper_kernel[grid](
        q, k, v, dout, lse, delta, dk, dv, dk_scratch, dv_scratch,
        q_offsets, kv_offsets, kwork.seq_W, kwork.start_W, kwork.lo_W, kwork.hi_W, kwork.splits_W,
        num_heads, total_q, scale, scale * LOG2E.value, q.stride(0), k.stride(0),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        NUM_STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip

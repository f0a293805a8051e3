"""dK and dV of jagged flash attention on Hopper, written in Gluon (explicit layouts, async MMAs).

The same work as ``triton.py``'s ``_jfa_dkdv_kernel`` (one program per key tile, query-range
chunk and head, from the same key-tile work list), scheduled by hand. Per program:

    K, V tile [Nk, H]                    → shared memory, once (cp.async)
    for each query block [M, H] of the chunk, NUM_STAGES − 1 blocks ahead (cp.async ring):
        Sᵀ  = K Qᵀ          wgmma, async ┐ both issued before either is waited for
        dPᵀ = V dOᵀ         wgmma, async ┘
        Pᵀ  = exp2(Sᵀ · c − lse)          while dPᵀ is still on the tensor cores
        dV += Pᵀ dO         wgmma, async, Pᵀ straight from registers
        dSᵀ = Pᵀ ⊙ (dPᵀ − δ)              while dV's MMA runs
        dK += dSᵀ Q         wgmma, async, dSᵀ from registers

Why a second kernel: Triton keeps the K and V tiles of its dK/dV kernel in registers (64 per
thread at 8 warps, head dim 128) next to the two float32 accumulators (128), the score tiles
(64) and the addresses; at the 255-register limit it spills (``ptxas``, sm_90), and the compiler
does not overlap the exponentials with the MMAs. Here K and V stay in shared memory, where
``wgmma`` reads its left operand, and the MMAs are issued asynchronously in the order above.

Rows of a query block past the sequence end are copied as zeros (the copy's mask), so a
neighbour's Inf or NaN never meets a zero probability in a matmul; key rows past the end are
zeros too, and their dK/dV rows are not written. Gluon compiles for the GPU only (no
interpreter): the launcher uses this kernel on sm_90 for 2-byte inputs without a relative bias,
where the tile table asks for it (``JaggedAttentionConfig.dkdv_hopper``), and the Triton kernel
everywhere else. The GPU tests run both against each other and against the reference.
"""

import torch
from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from gem_jagged._jit import BATCH_DEPENDENT

LOG2E = gl.constexpr(1.4426950408889634)
# A CTA-wide barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` from 3.7 on.
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
HEAD_DIMS = (64, 128)


def supported(q: torch.Tensor, *, rel_bias: bool, block_n: int, num_warps: int) -> bool:
    """Whether this kernel can run the dK/dV of ``q``'s batch on its device with key tiles of
    ``block_n`` rows on ``num_warps`` warps (16 rows per warp: one wgmma slice each)."""
    return (
        q.is_cuda
        and torch.cuda.get_device_capability(q.device)[0] == 9
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] in HEAD_DIMS
        and not rel_bias
        and block_n == 16 * num_warps
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

    # Stage 5: write the key tile's rows (a split tile adds its part into the float32 scratch).
    rows_N = k_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
    dims_H = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, copy_layout))
    out_NH = (k_begin + rows_N.to(gl.int64))[:, None] * stride_o + head * HEAD_DIM + dims_H[None, :]
    row_ok_NH = (rows_N < k_len)[:, None] & (dims_H < HEAD_DIM)[None, :]
    dk_NH = dk_NH * scale
    if splits > 1:
        gl.atomic_add(
            dk_scratch_TkNH + out_NH, gl.convert_layout(dk_NH, copy_layout), mask=row_ok_NH,
            sem="relaxed",
        )  # fmt: skip
        gl.atomic_add(
            dv_scratch_TkNH + out_NH, gl.convert_layout(dv_NH, copy_layout), mask=row_ok_NH,
            sem="relaxed",
        )  # fmt: skip
    else:
        out_ty: gl.constexpr = dk_TkNH.dtype.element_ty
        gl.store(dk_TkNH + out_NH, gl.convert_layout(dk_NH.to(out_ty), copy_layout), mask=row_ok_NH)
        gl.store(dv_TkNH + out_NH, gl.convert_layout(dv_NH.to(out_ty), copy_layout), mask=row_ok_NH)


def launch_dkdv(
    grid, q, k, v, dout, lse, delta, dk, dv, dk_scratch, dv_scratch, q_offsets, kv_offsets, kwork,
    *, scale, causal, block_m, block_n, num_warps, num_stages,
):  # fmt: skip
    """Launch the kernel with ``triton.py``'s arguments (q, k, v as ``_rows_of_heads`` leaves
    them; dout contiguous)."""
    total_q, num_heads, head_dim = q.shape
    _jfa_dkdv_hopper_kernel[grid](
        q, k, v, dout, lse, delta, dk, dv, dk_scratch, dv_scratch,
        q_offsets, kv_offsets, kwork.seq_W, kwork.start_W, kwork.lo_W, kwork.hi_W, kwork.splits_W,
        num_heads, total_q, scale, scale * LOG2E.value, q.stride(0), k.stride(0),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        NUM_STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip

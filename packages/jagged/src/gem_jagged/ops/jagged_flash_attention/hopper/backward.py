"""The dK/dV and dQ kernels (schedules in the package docstring)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from gem_jagged._jit import BATCH_DEPENDENT

from ._common import (
    LOG2E,
    copy_rows_async,
    copy_stats_async,
    cta_barrier,
    head_rows,
    lhs_layout,
    load_block_pair,
    load_sequence,
    ring_barriers,
    row_copy_layout,
    row_dots,
    store_rows,
    wait_block_pair,
    wgmma_layout,
    work_item,
)


@gluon.jit(do_not_specialize=BATCH_DEPENDENT)
def _jfa_dkdv_hopper_kernel(
    q_desc, k_TkNH, v_TkNH, do_desc, lse_NTq, delta_NTq,
    dk_TkNH, dv_TkNH, dk_scratch_TkNH, dv_scratch_TkNH,
    q_offsets_Bp1, kv_offsets_Bp1, work_5W,
    num_heads, total_q, scale, qk_scale_log2, stride_kv,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    gl.static_assert(BLOCK_N == 16 * num_warps, "one 16-row wgmma slice of the key tile per warp")
    gl.static_assert(NUM_STAGES >= 2, "the ring must hold the block in use and the next")
    item, field, head = work_item(work_5W, num_heads)
    seq = gl.load(item)
    if seq < 0:
        return
    k_start = gl.load(item + field)
    q_lo = gl.load(item + 2 * field)
    q_hi = gl.load(item + 3 * field)
    splits = gl.load(item + 4 * field)
    q_begin, q_len = load_sequence(q_offsets_Bp1, seq)
    k_begin, k_len = load_sequence(kv_offsets_Bp1, seq)
    q_row0 = q_begin.to(gl.int32)  # TMA coordinates are 32-bit (the launcher checks Tq)
    col0 = head * HEAD_DIM
    diag = k_len - q_len
    stride_o = num_heads * HEAD_DIM  # dK, dV and the scratch are contiguous
    dtype: gl.constexpr = k_TkNH.dtype.element_ty

    # Layouts: rows of the key tile over the warps (16 each), as one wgmma slice per warp.
    copy_layout: gl.constexpr = row_copy_layout(HEAD_DIM, num_warps)
    s_layout: gl.constexpr = wgmma_layout(BLOCK_M, num_warps)
    acc_layout: gl.constexpr = wgmma_layout(HEAD_DIM, num_warps)
    lhs_op_layout: gl.constexpr = lhs_layout(acc_layout)
    keys_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_N, HEAD_DIM], dtype
    )

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], keys_smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], keys_smem_layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    stats_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], stats_smem_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], stats_smem_layout)
    stats_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # a query block's, as columns
    ready = ring_barriers(NUM_STAGES)

    k_head = k_TkNH + k_begin * stride_kv + head * HEAD_DIM
    v_head = v_TkNH + k_begin * stride_kv + head * HEAD_DIM
    lse_head = lse_NTq + head * total_q + q_begin
    delta_head = delta_NTq + head * total_q + q_begin

    # Stage 0: the key tile (cp.async, rows past the end as zeros) and the first query blocks
    # of the ring (TMA) in flight together.
    n_blocks = gl.cdiv(q_hi - q_lo, BLOCK_M)
    copy_rows_async(k_smem, k_head, k_start, k_len, stride_kv, copy_layout, BLOCK_N, HEAD_DIM)
    copy_rows_async(v_smem, v_head, k_start, k_len, stride_kv, copy_layout, BLOCK_N, HEAD_DIM)
    for i in gl.static_range(NUM_STAGES - 1):
        load_block_pair(
            q_desc, do_desc, q_smem.index(i), do_smem.index(i), ready.index(i),
            q_row0 + q_lo + i * BLOCK_M, col0, i < n_blocks,
        )  # fmt: skip
        copy_stats_async(
            lse_smem.index(i), delta_smem.index(i), lse_head, delta_head, q_lo + i * BLOCK_M,
            gl.where(i < n_blocks, q_len, 0), BLOCK_M, num_warps,
        )  # fmt: skip
    async_copy.commit_group()
    async_copy.wait_group(0)
    cta_barrier()
    fence_async_shared()  # cp.async wrote the key tile through the generic proxy

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
        async_copy.wait_group(NUM_STAGES - 2)  # this block's log-sum-exp and δ
        cta_barrier()  # every warp is done with block j − 1's slot (and sees block j's stats)
        ahead = j + NUM_STAGES - 1
        load_block_pair(
            q_desc, do_desc, q_smem.index(ahead % NUM_STAGES), do_smem.index(ahead % NUM_STAGES),
            ready.index(ahead % NUM_STAGES), q_row0 + q_lo + ahead * BLOCK_M, col0,
            ahead < n_blocks,
        )  # fmt: skip
        # The block's log-sum-exp and δ travel with it, a step ahead, by cp.async: loaded from
        # global memory in the step itself, they stall the warps at their first use (the top
        # stall site under Nsight Compute).
        copy_stats_async(
            lse_smem.index(ahead % NUM_STAGES), delta_smem.index(ahead % NUM_STAGES),
            lse_head, delta_head, q_lo + ahead * BLOCK_M,
            gl.where(ahead < n_blocks, q_len, 0), BLOCK_M, num_warps,
        )  # fmt: skip
        async_copy.commit_group()
        block_start = q_lo + j * BLOCK_M
        rows_M = block_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        row_ok_M = rows_M < q_len
        q_MH = q_smem.index(j % NUM_STAGES)
        do_MH = do_smem.index(j % NUM_STAGES)
        wait_block_pair(
            q_MH, do_MH, ready.index(j % NUM_STAGES), (j // NUM_STAGES) & 1, block_start, q_len,
            copy_layout, BLOCK_M, True,
        )  # fmt: skip

        # Stage 2: both score-shaped products on the tensor cores at once.
        s_NM = warpgroup_mma(
            k_smem, q_MH.permute((1, 0)), no_scores_NM, use_acc=False, is_async=True
        )
        dp_NM = warpgroup_mma(
            v_smem, do_MH.permute((1, 0)), no_scores_NM, use_acc=False, is_async=True
        )
        s_NM = warpgroup_mma_wait(num_outstanding=1, deps=(s_NM,))

        # Stage 3: Pᵀ from the saved log-sum-exp, then dV += Pᵀ dO while dPᵀ finishes.
        lse_M = lse_smem.index(j % NUM_STAGES).load(stats_layout)
        lse_M = gl.where(row_ok_M, lse_M, float("inf"))  # rows past the end read zeros
        p_NM = gl.exp2(s_NM * qk_scale_log2 - (lse_M * LOG2E)[None, :])
        if CAUSAL:
            if block_start < mask_stop:
                p_NM = gl.where(cols_N[:, None] <= rows_M[None, :] + diag, p_NM, 0.0)
        p_lhs = gl.convert_layout(p_NM.to(dtype), lhs_op_layout)
        dv_NH = warpgroup_mma(p_lhs, do_MH, dv_NH, is_async=True)
        dp_NM = warpgroup_mma_wait(num_outstanding=1, deps=(dp_NM,))

        # Stage 4: dSᵀ and dK += dSᵀ Q; both accumulators settle before the ring slot is reused.
        # δ is read here rather than with the log-sum-exp: ptxas then spills nothing (loaded
        # earlier, δ stays live across the MMAs and spills).
        delta_M = delta_smem.index(j % NUM_STAGES).load(stats_layout)
        ds_NM = p_NM * (dp_NM - delta_M[None, :])
        ds_lhs = gl.convert_layout(ds_NM.to(dtype), lhs_op_layout)
        dk_NH = warpgroup_mma(ds_lhs, q_MH, dk_NH, is_async=True)
        dv_NH, dk_NH, p_lhs, ds_lhs = warpgroup_mma_wait(
            num_outstanding=0, deps=(dv_NH, dk_NH, p_lhs, ds_lhs)
        )

    # Stage 5: write the key tile's rows (a split tile adds its part into the float32 scratch),
    # one accumulator at a time through the copy layout (coalesced rows).
    dk_NH = dk_NH * scale
    offsets_CH, mask_CH = head_rows(
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
    q_TqNH, k_desc, v_desc, out_TqNH, do_TqNH, lse_NTq, delta_NTq, dq_TqNH,
    q_offsets_Bp1, kv_offsets_Bp1, work_5W,
    num_heads, total_q, scale, qk_scale_log2, stride_q,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    gl.static_assert(BLOCK_M == 16 * num_warps, "one 16-row wgmma slice of the query tile per warp")
    gl.static_assert(NUM_STAGES >= 2, "the ring must hold the block in use and the next")
    item, field, head = work_item(work_5W, num_heads)
    seq = gl.load(item)
    if seq < 0:
        return
    q_start = gl.load(item + field)
    k_stop = gl.load(item + 3 * field)
    q_begin, q_len = load_sequence(q_offsets_Bp1, seq)
    k_begin, k_len = load_sequence(kv_offsets_Bp1, seq)
    k_row0 = k_begin.to(gl.int32)  # TMA coordinates are 32-bit (the launcher checks Tk)
    col0 = head * HEAD_DIM
    diag = k_len - q_len  # query i sees key j iff j <= i + diag (bottom-right causal)
    stride_o = num_heads * HEAD_DIM  # O, dO and dQ are contiguous
    dtype: gl.constexpr = q_TqNH.dtype.element_ty

    copy_layout: gl.constexpr = row_copy_layout(HEAD_DIM, num_warps)
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N, num_warps)
    acc_layout: gl.constexpr = wgmma_layout(HEAD_DIM, num_warps)
    lhs_op_layout: gl.constexpr = lhs_layout(acc_layout)
    rows_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_M, HEAD_DIM], dtype
    )

    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], rows_smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    # A query tile as tall as a key block lands in the ring's last K slot, which the ring's
    # first fill leaves free, and moves to registers before step 0 refills that slot (O lands in
    # the last V slot likewise, below); another stays in shared memory of its own.
    IN_RING: gl.constexpr = BLOCK_M == BLOCK_N
    if IN_RING:
        q_landing = k_smem.index(NUM_STAGES - 1)
    else:
        q_landing = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], rows_smem_layout)
    ready = ring_barriers(NUM_STAGES)

    q_head = q_TqNH + q_begin * stride_q + head * HEAD_DIM
    do_head = do_TqNH + q_begin * stride_o + head * HEAD_DIM

    # Stage 0: the query and dO tiles (cp.async) and the first key blocks of the ring (TMA) in
    # flight; meanwhile δ = rowsum(dO ⊙ O), stored for the dK/dV kernel (each query row is in
    # one tile).
    n_blocks = gl.cdiv(k_stop, BLOCK_N)
    copy_rows_async(q_landing, q_head, q_start, q_len, stride_q, copy_layout, BLOCK_M, HEAD_DIM)
    copy_rows_async(do_smem, do_head, q_start, q_len, stride_o, copy_layout, BLOCK_M, HEAD_DIM)
    # With a ring slot free, O comes along by cp.async and δ is summed from shared memory: O and
    # dO loaded into registers stall the warps here.
    if IN_RING:
        o_landing = v_smem.index(NUM_STAGES - 1)
        o_head = out_TqNH + q_begin * stride_o + head * HEAD_DIM
        copy_rows_async(o_landing, o_head, q_start, q_len, stride_o, copy_layout, BLOCK_M, HEAD_DIM)
    async_copy.commit_group()
    for i in gl.static_range(NUM_STAGES - 1):
        load_block_pair(
            k_desc, v_desc, k_smem.index(i), v_smem.index(i), ready.index(i),
            k_row0 + i * BLOCK_N, col0, i < n_blocks,
        )  # fmt: skip
    rows_C = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout))
    if not IN_RING:
        delta_C = row_dots(
            out_TqNH, do_TqNH, q_begin, q_start, q_len, stride_o, head, copy_layout, BLOCK_M,
            HEAD_DIM,
        )  # fmt: skip
        gl.store(delta_NTq + head * total_q + q_begin + rows_C, delta_C, mask=rows_C < q_len)
    rows_M = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    row_ok_M = rows_M < q_len
    if not IN_RING:
        delta_M = gl.convert_layout(delta_C, gl.SliceLayout(1, s_layout))
    lse_M = gl.load(lse_NTq + head * total_q + q_begin + rows_M, mask=row_ok_M, other=float("inf"))
    lse_M = lse_M * LOG2E
    async_copy.wait_group(0)
    cta_barrier()
    fence_async_shared()  # cp.async wrote the query, dO (and O) tiles through the generic proxy
    if IN_RING:
        o_CH = o_landing.load(copy_layout).to(gl.float32)
        do_CH = do_smem.load(copy_layout).to(gl.float32)
        delta_C = gl.sum(o_CH * do_CH, axis=1)
        gl.store(delta_NTq + head * total_q + q_begin + rows_C, delta_C, mask=rows_C < q_len)
        delta_M = gl.convert_layout(delta_C, gl.SliceLayout(1, s_layout))
        q_op = q_landing.load(lhs_op_layout)
    else:
        q_op = q_landing

    # Key blocks from ``full_stop`` on cross the causal diagonal or the sequence's end.
    full_stop = k_len
    if CAUSAL:
        full_stop = gl.minimum(full_stop, q_start + 1 + diag)
    full_stop = gl.minimum(gl.maximum(full_stop, 0) // BLOCK_N * BLOCK_N, k_stop)
    no_scores_MN = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    # dQ is carried through the loop as an MMA in flight (waited for inside each step)
    dq_MH = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
    ds_lhs = gl.zeros([BLOCK_M, BLOCK_N], dtype, lhs_op_layout)
    for j in range(n_blocks):
        block_start = j * BLOCK_N
        k_NH = k_smem.index(j % NUM_STAGES)
        v_NH = v_smem.index(j % NUM_STAGES)
        wait_block_pair(
            k_NH, v_NH, ready.index(j % NUM_STAGES), (j // NUM_STAGES) & 1, block_start, k_len,
            copy_layout, BLOCK_N, True,
        )  # fmt: skip

        # Stage 1: S and dP issued behind the previous block's dQ MMA; once only this block's
        # two remain in flight, that MMA is done and its ring slot can be refilled.
        s_MN = warpgroup_mma(q_op, k_NH.permute((1, 0)), no_scores_MN, use_acc=False, is_async=True)
        dp_MN = warpgroup_mma(
            do_smem, v_NH.permute((1, 0)), no_scores_MN, use_acc=False, is_async=True
        )
        dq_MH, ds_lhs = warpgroup_mma_wait(num_outstanding=2, deps=(dq_MH, ds_lhs))
        cta_barrier()  # every warp is done with block j − 1's slot
        ahead = j + NUM_STAGES - 1
        load_block_pair(
            k_desc, v_desc, k_smem.index(ahead % NUM_STAGES), v_smem.index(ahead % NUM_STAGES),
            ready.index(ahead % NUM_STAGES), k_row0 + ahead * BLOCK_N, col0, ahead < n_blocks,
        )  # fmt: skip

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
        ds_lhs = gl.convert_layout(ds_MN.to(dtype), lhs_op_layout)
        dq_MH = warpgroup_mma(ds_lhs, k_NH, dq_MH, is_async=True)
    dq_MH, ds_lhs = warpgroup_mma_wait(num_outstanding=0, deps=(dq_MH, ds_lhs))

    # Stage 4: write the tile's dQ rows.
    dq_CH = gl.convert_layout((dq_MH * scale).to(dq_TqNH.dtype.element_ty), copy_layout)
    store_rows(
        dq_TqNH, dq_CH, q_begin, q_start, q_len, stride_o, head, copy_layout, BLOCK_M, HEAD_DIM
    )

"""The forward kernel (schedule in the package docstring)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from gem_jagged._jit import BATCH_DEPENDENT

from ._common import (
    copy_rows_async,
    cta_barrier,
    lhs_layout,
    load_block_pair,
    load_sequence,
    ring_barriers,
    row_copy_layout,
    store_rows,
    wait_block_pair,
    wgmma_layout,
    work_item,
)


@gluon.jit
def _online_softmax_step(
    s_MN, m_M, l_M, rows_M, block_start, full_stop, k_len, diag, qk_scale_log2,
    CAUSAL: gl.constexpr, SCALE_SIGN: gl.constexpr, BLOCK_N: gl.constexpr, DTYPE: gl.constexpr,
    LHS_LAYOUT: gl.constexpr,
):  # fmt: skip
    """One key block of the online softmax over raw scores ``s_MN`` (before the scale ``c`` =
    ``qk_scale_log2``): ``(P as an MMA left operand, α, m, l)``, with ``m`` the running row
    maximum of ``s · c``. Blocks from ``full_stop`` on cross the causal diagonal or the
    sequence's end and are masked; a row that has seen no key keeps ``m = −inf`` safely.

    In the other blocks the maximum is taken of the raw scores, ``max(s · c) = c · max(s · σ) ·
    σ`` with ``σ = SCALE_SIGN`` the sign of ``c`` (exact: rounding is monotone), so that each
    exponent ``s · c − m`` is one fused multiply-add instead of a multiply and a subtraction."""
    if block_start >= full_stop:
        s_MN = s_MN * qk_scale_log2
        cols_N = block_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_MN.type.layout))
        visible_MN = (cols_N < k_len)[None, :] & (rows_M >= 0)[:, None]
        if CAUSAL:
            visible_MN = visible_MN & (cols_N[None, :] <= rows_M[:, None] + diag)
        s_MN = gl.where(visible_MN, s_MN, float("-inf"))
        m_new_M = gl.maximum(m_M, gl.max(s_MN, axis=1))
        m_use_M = gl.where(m_new_M == float("-inf"), 0.0, m_new_M)
        p_MN = gl.exp2(s_MN - m_use_M[:, None])
    else:
        block_max_M = gl.max(s_MN * SCALE_SIGN, axis=1) * (qk_scale_log2 * SCALE_SIGN)
        m_new_M = gl.maximum(m_M, block_max_M)
        m_use_M = m_new_M  # finite: every score of the block is visible
        p_MN = gl.exp2(s_MN * qk_scale_log2 - m_use_M[:, None])
    alpha_M = gl.exp2(m_M - m_use_M)
    l_M = l_M * alpha_M + gl.sum(p_MN, axis=1)
    return gl.convert_layout(p_MN.to(DTYPE), LHS_LAYOUT), alpha_M, m_new_M, l_M


@gluon.jit(do_not_specialize=BATCH_DEPENDENT)
def _jfa_fwd_hopper_kernel(
    q_TqNH, k_desc, v_desc, out_TqNH, lse_NTq,
    q_offsets_Bp1, kv_offsets_Bp1, work_5W,
    num_heads, total_q, qk_scale_log2, stride_q,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    SCALE_SIGN: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
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
    dtype: gl.constexpr = q_TqNH.dtype.element_ty

    copy_layout: gl.constexpr = row_copy_layout(HEAD_DIM, num_warps)
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N, num_warps)
    acc_layout: gl.constexpr = wgmma_layout(HEAD_DIM, num_warps)
    lhs_op_layout: gl.constexpr = lhs_layout(acc_layout)
    rows_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_M, HEAD_DIM], dtype
    )
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], rows_smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready = ring_barriers(NUM_STAGES)

    # Stage 0: the query tile (cp.async, rows past the end as zeros) and a full ring of key
    # blocks (TMA) in flight.
    n_blocks = gl.cdiv(k_stop, BLOCK_N)
    q_head = q_TqNH + q_begin * stride_q + head * HEAD_DIM
    copy_rows_async(q_smem, q_head, q_start, q_len, stride_q, copy_layout, BLOCK_M, HEAD_DIM)
    async_copy.commit_group()
    for i in gl.static_range(NUM_STAGES):
        load_block_pair(
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
    cta_barrier()
    fence_async_shared()  # cp.async wrote the query tile through the generic proxy

    if n_blocks > 0:
        # Stage 1 (block 0): S and its softmax; P₀ V₀ is issued with block 1's scores.
        wait_block_pair(
            k_smem.index(0), v_smem.index(0), ready.index(0), 0, 0, k_len,
            copy_layout, BLOCK_N, False,
        )  # fmt: skip
        s_MN = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), no_scores_MN, use_acc=False)
        p_lhs, alpha_M, m_M, l_M = _online_softmax_step(
            s_MN, m_M, l_M, rows_M, 0, full_stop, k_len, diag, qk_scale_log2,
            CAUSAL, SCALE_SIGN, BLOCK_N, dtype, lhs_op_layout,
        )  # fmt: skip
        # Stage 2 (blocks 1 …): Sⱼ and Pⱼ₋₁ Vⱼ₋₁ on the tensor cores together; Sⱼ's softmax runs
        # while Pⱼ₋₁ Vⱼ₋₁ finishes; then O is rescaled and block j − 1's ring slot refilled.
        for j in range(1, n_blocks):
            wait_block_pair(
                k_smem.index(j % NUM_STAGES), v_smem.index(j % NUM_STAGES),
                ready.index(j % NUM_STAGES), (j // NUM_STAGES) & 1, j * BLOCK_N, k_len,
                copy_layout, BLOCK_N, False,
            )  # fmt: skip
            s_MN = warpgroup_mma(
                q_smem, k_smem.index(j % NUM_STAGES).permute((1, 0)), no_scores_MN,
                use_acc=False, is_async=True,
            )  # fmt: skip
            acc_MH = warpgroup_mma(p_lhs, v_smem.index((j - 1) % NUM_STAGES), acc_MH, is_async=True)
            s_MN = warpgroup_mma_wait(num_outstanding=1, deps=(s_MN,))
            p_next, alpha_M, m_M, l_M = _online_softmax_step(
                s_MN, m_M, l_M, rows_M, j * BLOCK_N, full_stop, k_len, diag, qk_scale_log2,
                CAUSAL, SCALE_SIGN, BLOCK_N, dtype, lhs_op_layout,
            )  # fmt: skip
            acc_MH, p_lhs = warpgroup_mma_wait(num_outstanding=0, deps=(acc_MH, p_lhs))
            acc_MH = acc_MH * gl.convert_layout(alpha_M, gl.SliceLayout(1, acc_layout))[:, None]
            p_lhs = p_next
            cta_barrier()  # every warp is done with block j − 1's slot
            refill = j - 1 + NUM_STAGES
            load_block_pair(
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
    store_rows(
        out_TqNH, out_CH, q_begin, q_start, q_len, stride_o, head, copy_layout, BLOCK_M, HEAD_DIM
    )
    gl.store(lse_NTq + head * total_q + q_begin + rows_M, lse_M, mask=rows_M < q_len)

"""Pieces the Gluon kernels share: row copies into shared memory, row offsets, stores."""

from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

LOG2E = gl.constexpr(1.4426950408889634)
# A CTA-wide barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` from 3.7 on.
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def work_item(work_5W, num_heads):
    """This program's work-list item and head: ``(item, W, head)`` with ``item`` pointing at
    the item's ``seq`` entry in the packed list ``[5, W]`` (``gem_jagged._worklist``'s
    ``TileWorkList``: rows seq, start, lo, hi, splits), so field ``f`` is ``item[f · W]``.

    Heads outermost: program ``pid`` takes slot ``pid mod W`` of head ``pid div W``, so one
    head's tiles run (heaviest first) before the next head's start, and the rows the running
    programs stream (one head's K and V, or Q and dO) can stay in L2."""
    pid = gl.program_id(0)
    num_slots = gl.num_programs(0) // num_heads
    return work_5W + pid % num_slots, num_slots, pid // num_slots


@gluon.jit
def load_sequence(offsets_Bp1, seq):
    """``(first token as int64, length as int32)`` of sequence ``seq``."""
    begin = gl.load(offsets_Bp1 + seq).to(gl.int64)
    return begin, (gl.load(offsets_Bp1 + seq + 1) - begin).to(gl.int32)


@constexpr_function
def wgmma_layout(cols, num_warps):
    """The accumulator layout of a ``[16 · num_warps, cols]`` wgmma product: 16 rows a warp."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 16]
    )


@constexpr_function
def lhs_layout(acc_layout):
    """Registers feeding 2-byte elements to a wgmma with ``acc_layout`` as its left operand."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)


@constexpr_function
def row_copy_layout(head_dim, num_warps):
    """16-byte vectors along the head dim, whole rows per group of threads."""
    threads_per_row = head_dim // 8
    return gl.BlockedLayout(
        [1, 8], [32 // threads_per_row, threads_per_row], [num_warps, 1], [1, 0]
    )


@gluon.jit
def copy_rows_async(
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
def copy_stats_async(
    lse_dst, delta_dst, lse_head, delta_head, first, length,
    ROWS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Start copying the log-sum-exp and δ of query rows ``[first, first + ROWS)`` (float32,
    one head's) into shared memory; rows at or past ``length`` are written as zeros."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    rows_R = first + gl.arange(0, ROWS, layout=layout)
    ok_R = rows_R < length
    async_copy.async_copy_global_to_shared(lse_dst, lse_head + rows_R, mask=ok_R)
    async_copy.async_copy_global_to_shared(delta_dst, delta_head + rows_R, mask=ok_R)


@gluon.jit
def ring_barriers(NUM_STAGES: gl.constexpr):
    """One initialised mbarrier per ring slot, each flipping when its slot's copies land."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    return ready


@gluon.jit
def load_block_pair(a_desc, b_desc, a_dst, b_dst, ready, row, col, pred):
    """Start the TMA copies of one block of each of two row tensors (K and V, or Q and dO)
    into a ring slot; ``ready`` flips when both have landed. Skipped where ``pred`` is false
    (past the last block)."""
    mbarrier.expect(ready, 2 * a_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [row, col], ready, a_dst, pred=pred)
    tma.async_copy_global_to_shared(b_desc, [row, col], ready, b_dst, pred=pred)


@gluon.jit
def wait_block_pair(
    a_dst, b_dst, ready, phase, first, length,
    LAYOUT: gl.constexpr, ROWS: gl.constexpr, ZERO_A: gl.constexpr,
):  # fmt: skip
    """Wait for a ring slot filled by ``load_block_pair``. A block running past the sequence's
    end holds the next sequence's rows there (or the copy engine's zeros past the tensor):
    their scores are masked, but a row of Inf or NaN would still reach a product through a
    zero factor, so the second block's rows at or past ``length`` are zeroed in shared memory,
    and the first's where ``ZERO_A`` (the forward's K rows only meet masked scores)."""
    mbarrier.wait(ready, phase)
    if first + ROWS > length:
        keep_R = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT)) < length
        if ZERO_A:
            a_dst.store(gl.where(keep_R[:, None], a_dst.load(LAYOUT), 0.0))
        b_dst.store(gl.where(keep_R[:, None], b_dst.load(LAYOUT), 0.0))
        fence_async_shared()  # generic-proxy stores, then wgmma's async-proxy reads
        cta_barrier()


@gluon.jit
def head_rows(
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
def row_dots(
    a_TNH, b_TNH, seq_begin, first, length, stride, head,
    LAYOUT: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """``rowsum(a ⊙ b)`` in float32 over rows ``[first, first + ROWS)`` of one head."""
    offsets_RH, mask_RH = head_rows(seq_begin, first, length, stride, head, LAYOUT, ROWS, HEAD_DIM)
    a_RH = gl.load(a_TNH + offsets_RH, mask=mask_RH, other=0.0).to(gl.float32)
    b_RH = gl.load(b_TNH + offsets_RH, mask=mask_RH, other=0.0).to(gl.float32)
    return gl.sum(a_RH * b_RH, axis=1)


@gluon.jit
def store_rows(
    dst_TNH, tile_RH, seq_begin, first, length, stride, head,
    LAYOUT: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """Store ``tile_RH`` (in ``LAYOUT``) as rows ``[first, first + ROWS)`` of one head, those
    in the sequence only."""
    offsets_RH, mask_RH = head_rows(seq_begin, first, length, stride, head, LAYOUT, ROWS, HEAD_DIM)
    gl.store(dst_TNH + offsets_RH, tile_RH, mask=mask_RH)

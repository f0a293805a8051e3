"""BlockAttention Triton kernels: one program per (block, head), RoPE fused, no loop over keys.

Legend (shape suffixes): ``T`` tokens, ``B`` sequences, ``N`` heads, ``H`` head dim, ``H2`` half
of it, ``M`` query rows of a block, ``K`` key rows of the same block (both ``BLOCK``, the block
size rounded up to a power of two), ``W`` work items (blocks). ``q_TNH`` is a query tensor,
``offsets_Bp1`` the offsets, ``block_ends_B`` the running block count per sequence.

A block holds at most a few hundred tokens, so its whole score matrix fits on chip: the forward
loads q, k, v of the block, rotates q and k in registers (the first half of the head dim against
the second, angle ``position · theta^(−2d/H)`` with the position counted from the sequence
start), takes an exact softmax and writes the output. Nothing else is saved: the backward
program of a block recomputes the rotation and the probabilities, forms
``dS = P ⊙ (dP − rowsum(P ⊙ dP))``, and rotates ``dQ``/``dK`` back by the transpose before
storing them, so no rotated copy of q or k ever reaches memory and every gradient row is written
by exactly one program (deterministic, no atomics).

Which block a program owns comes from a per-block table built once per offsets tensor: one
small kernel writes ``block_ends_B``, the running count of blocks up to each sequence (a
sequence of ``L`` tokens has ``cdiv(L, block_size)`` blocks). The grid is sized from host-known
shapes, ``cdiv(T, block_size) + B`` (an upper bound on the blocks), so the launch needs no host
synchronisation; program ``w`` counts the sequences whose blocks end at or before ``w`` (one
vector load per 256 sequences), which is its sequence, and programs past the last block exit.
All blocks cost about the same, so there is nothing to sort. The table is kept in the batch's
``JaggedBatch`` and handed from the forward to the backward, so an eager training step issues the two
attention kernels and nothing else.
"""

import math

import torch
import triton.language as tl

from gem_jagged._intmath import cdiv
from gem_jagged._jit import jit

from .config import BlockAttentionConfig, padded_block

LOG2E = tl.constexpr(1.4426950408889634)


@jit
def _rope_trig(pos_M, LOG2_THETA, H: tl.constexpr, H2: tl.constexpr):
    """``cos, sin [M, H2]`` of ``pos · theta^(−2d/H)``."""
    inv_freq = tl.exp2(-(tl.arange(0, H2).to(tl.float32) * 2.0 / H) * LOG2_THETA)
    angle = pos_M.to(tl.float32)[:, None] * inv_freq[None, :]
    return tl.cos(angle), tl.sin(angle)


@jit
def _load_halves(ptr, rows, valid, stride_t, head, H: tl.constexpr, H2: tl.constexpr):
    col = head * H + tl.arange(0, H2)
    base = ptr + rows.to(tl.int64)[:, None] * stride_t + col[None, :]
    lo = tl.load(base, mask=valid[:, None], other=0.0)
    hi = tl.load(base + H2, mask=valid[:, None], other=0.0)
    return lo, hi


@jit
def _store_halves(ptr, rows, valid, stride_t, head, lo, hi, H: tl.constexpr, H2: tl.constexpr):
    col = head * H + tl.arange(0, H2)
    base = ptr + rows.to(tl.int64)[:, None] * stride_t + col[None, :]
    tl.store(base, lo.to(ptr.dtype.element_ty), mask=valid[:, None])
    tl.store(base + H2, hi.to(ptr.dtype.element_ty), mask=valid[:, None])


@jit
def _mm(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@jit
def _block_ends_kernel(offsets_Bp1, block_ends_B, num_seqs, block_size, CHUNK: tl.constexpr):
    """One program: ``block_ends[b] = Σ_{c ≤ b} cdiv(L_c, block_size)``, CHUNK sequences a step."""
    carry = tl.zeros((), tl.int32)
    for base in range(0, num_seqs, CHUNK):
        idx = base + tl.arange(0, CHUNK)
        inside = idx < num_seqs
        lo = tl.load(offsets_Bp1 + idx, mask=inside, other=0)
        hi = tl.load(offsets_Bp1 + idx + 1, mask=inside, other=0)
        blocks = ((hi - lo + block_size - 1) // block_size).to(tl.int32)
        tl.store(block_ends_B + idx, tl.cumsum(blocks, axis=0) + carry, mask=inside)
        carry += tl.sum(blocks, axis=0)


@jit
def _owned_block(block_ends_B, num_seqs, block_size, SEARCH: tl.constexpr):
    """(sequence, first position) of this program's block; sequence ``num_seqs`` if none."""
    pid = tl.program_id(0)
    seq = tl.zeros((), tl.int32)
    for base in range(0, num_seqs, SEARCH):
        idx = base + tl.arange(0, SEARCH)
        ends = tl.load(block_ends_B + idx, mask=idx < num_seqs, other=2147483647)
        seq += tl.sum((ends <= pid).to(tl.int32), axis=0)
    first_block = tl.load(block_ends_B + seq - 1, mask=seq > 0, other=0)
    return seq, (pid - first_block) * block_size


@jit
def _block_probs(
    q_ptr, k_ptr, offsets_ptr, seq, block_start, stride_qt, stride_kt,
    block_size, scale, LOG2_THETA,
    H: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """Shared prologue of both passes: rows, rotated halves and exact softmax ``P [M, K]``."""
    H2: tl.constexpr = H // 2
    head = tl.program_id(1)
    seq_begin = tl.load(offsets_ptr + seq)
    seq_len = tl.load(offsets_ptr + seq + 1) - seq_begin
    local = tl.arange(0, BLOCK)
    pos = block_start + local  # position in the sequence
    valid = (local < block_size) & (pos < seq_len)
    rows = seq_begin + pos
    q1, q2 = _load_halves(q_ptr, rows, valid, stride_qt, head, H, H2)
    k1, k2 = _load_halves(k_ptr, rows, valid, stride_kt, head, H, H2)
    cos = tl.zeros((BLOCK, H2), tl.float32)
    sin = tl.zeros((BLOCK, H2), tl.float32)
    if ROPE:  # rotate in fp32, then round to the input dtype as a materialised copy would be
        cos, sin = _rope_trig(pos, LOG2_THETA, H, H2)
        q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
        k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
        q1 = (q1f * cos - q2f * sin).to(q_ptr.dtype.element_ty)
        q2 = (q2f * cos + q1f * sin).to(q_ptr.dtype.element_ty)
        k1 = (k1f * cos - k2f * sin).to(k_ptr.dtype.element_ty)
        k2 = (k2f * cos + k1f * sin).to(k_ptr.dtype.element_ty)
    s_MK = _mm(q1, tl.trans(k1), IEEE) + _mm(q2, tl.trans(k2), IEEE)
    s_MK = s_MK * (scale * LOG2E)
    visible = valid[None, :]
    if CAUSAL:
        visible = visible & (local[None, :] <= local[:, None])
    s_MK = tl.where(visible, s_MK, -1.0e30)
    row_max = tl.max(s_MK, axis=1)
    p_MK = tl.exp2(s_MK - row_max[:, None])
    p_MK = p_MK / tl.sum(p_MK, axis=1)[:, None]
    return head, rows, valid, q1, q2, k1, k2, cos, sin, p_MK


@jit
def _block_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, offsets_ptr, block_ends_B, num_seqs,
    stride_qt, stride_kt, stride_vt, stride_ot, block_size, scale, LOG2_THETA,
    H: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr,
    IEEE: tl.constexpr, SEARCH: tl.constexpr,
):  # fmt: skip
    # Stage 1: find the block, rotate its q, k and take the softmax of its scores.
    seq, block_start = _owned_block(block_ends_B, num_seqs, block_size, SEARCH)
    if seq >= num_seqs:
        return
    head, rows, valid, q1, q2, k1, k2, cos, sin, p_MK = _block_probs(
        q_ptr, k_ptr, offsets_ptr, seq, block_start, stride_qt, stride_kt,
        block_size, scale, LOG2_THETA, H, CAUSAL, ROPE, BLOCK, IEEE,
    )  # fmt: skip
    # Stage 2: O = P V, written in two halves of the head dim.
    H2: tl.constexpr = H // 2
    v1, v2 = _load_halves(v_ptr, rows, valid, stride_vt, head, H, H2)
    p = p_MK.to(v1.dtype)
    _store_halves(out_ptr, rows, valid, stride_ot, head, _mm(p, v1, IEEE), _mm(p, v2, IEEE), H, H2)


@jit
def _block_attention_bwd_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr, offsets_ptr, block_ends_B, num_seqs,
    stride_qt, stride_kt, stride_vt, stride_dot, stride_dqt, stride_dkt, stride_dvt,
    block_size, scale, LOG2_THETA,
    H: tl.constexpr, CAUSAL: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr,
    IEEE: tl.constexpr, SEARCH: tl.constexpr,
):  # fmt: skip
    # Stage 1: find the block, recompute the rotated halves and P exactly as the forward did.
    seq, block_start = _owned_block(block_ends_B, num_seqs, block_size, SEARCH)
    if seq >= num_seqs:
        return
    head, rows, valid, q1, q2, k1, k2, cos, sin, p_MK = _block_probs(
        q_ptr, k_ptr, offsets_ptr, seq, block_start, stride_qt, stride_kt,
        block_size, scale, LOG2_THETA, H, CAUSAL, ROPE, BLOCK, IEEE,
    )  # fmt: skip
    H2: tl.constexpr = H // 2
    v1, v2 = _load_halves(v_ptr, rows, valid, stride_vt, head, H, H2)
    do1, do2 = _load_halves(do_ptr, rows, valid, stride_dot, head, H, H2)
    # Stage 2: dV = Pᵀ dO; dP = dO Vᵀ; dS = P ⊙ (dP − rowsum(P ⊙ dP)).
    pT = tl.trans(p_MK).to(do1.dtype)
    _store_halves(
        dv_ptr, rows, valid, stride_dvt, head, _mm(pT, do1, IEEE), _mm(pT, do2, IEEE), H, H2
    )
    dp_MK = _mm(do1, tl.trans(v1), IEEE) + _mm(do2, tl.trans(v2), IEEE)
    ds_MK = p_MK * (dp_MK - tl.sum(p_MK * dp_MK, axis=1)[:, None]) * scale
    ds = ds_MK.to(q1.dtype)
    dsT = tl.trans(ds_MK).to(q1.dtype)
    # Stage 3: gradients of the rotated q, k, then the transpose rotation back to q, k.
    dq1, dq2 = _mm(ds, k1, IEEE), _mm(ds, k2, IEEE)
    dk1, dk2 = _mm(dsT, q1, IEEE), _mm(dsT, q2, IEEE)
    if ROPE:
        dq1, dq2 = dq1 * cos + dq2 * sin, dq2 * cos - dq1 * sin
        dk1, dk2 = dk1 * cos + dk2 * sin, dk2 * cos - dk1 * sin
    _store_halves(dq_ptr, rows, valid, stride_dqt, head, dq1, dq2, H, H2)
    _store_halves(dk_ptr, rows, valid, stride_dkt, head, dk1, dk2, H, H2)


_SEARCH = 256  # sequences per vector load of the block search
_TABLE_CHUNK = 1024  # sequences per step of the table kernel


def block_table(offsets_Bp1: torch.Tensor, block_size: int) -> torch.Tensor:
    """``block_ends_B`` (int32): the running count of blocks of each sequence of
    ``offsets_Bp1``, the table the kernels search for their block's sequence."""
    num_seqs = offsets_Bp1.numel() - 1
    block_ends_B = torch.empty(max(num_seqs, 1), dtype=torch.int32, device=offsets_Bp1.device)
    _block_ends_kernel[(1,)](offsets_Bp1, block_ends_B, num_seqs, block_size, _TABLE_CHUNK)
    return block_ends_B


def batch_block_table(batch, block_size: int) -> torch.Tensor:
    """``block_table`` of a ``JaggedBatch``, built at its first use and kept in the batch."""
    return batch.memo(
        ("block_attention.block_table", block_size),
        lambda: block_table(batch.offsets, block_size),
    )


def _launch_args(q_TNH, offsets_Bp1, block_size, rope_theta, block_ends_B):
    num_seqs = offsets_Bp1.numel() - 1
    if block_ends_B is None:
        block_ends_B = block_table(offsets_Bp1, block_size)
    grid = (cdiv(q_TNH.shape[0], block_size) + num_seqs, q_TNH.shape[1])
    flags = dict(
        H=q_TNH.shape[2], ROPE=rope_theta is not None,
        BLOCK=padded_block(block_size), IEEE=q_TNH.dtype == torch.float32,
        SEARCH=_SEARCH,
    )  # fmt: skip
    log2_theta = math.log2(rope_theta) if rope_theta is not None else 0.0
    return grid, block_ends_B, num_seqs, log2_theta, flags


def block_attention_forward(q_TNH, k_TNH, v_TNH, offsets_Bp1, *, block_size, causal, rope_theta,
                            scale, config: BlockAttentionConfig,
                            block_ends_B: torch.Tensor | None = None):  # fmt: skip
    """Output ``[T, N, H]``; ``block_ends_B`` (``block_table``) is built here when not given."""
    q_TNH, k_TNH, v_TNH = q_TNH.contiguous(), k_TNH.contiguous(), v_TNH.contiguous()
    out = torch.empty_like(q_TNH)
    grid, block_ends_B, num_seqs, log2_theta, flags = _launch_args(
        q_TNH, offsets_Bp1, block_size, rope_theta, block_ends_B
    )
    if grid[0] > 0:
        _block_attention_fwd_kernel[grid](
            q_TNH, k_TNH, v_TNH, out, offsets_Bp1, block_ends_B, num_seqs,
            q_TNH.stride(0), k_TNH.stride(0), v_TNH.stride(0), out.stride(0),
            block_size, scale, log2_theta, CAUSAL=causal,
            num_warps=config.fwd_warps, num_stages=config.stages, **flags,
        )  # fmt: skip
    return out


def block_attention_backward(do_TNH, q_TNH, k_TNH, v_TNH, offsets_Bp1, *, block_size, causal,
                             rope_theta, scale, config: BlockAttentionConfig,
                             block_ends_B: torch.Tensor | None = None):  # fmt: skip
    """``(dq, dk, dv)`` with respect to the un-rotated q and k."""
    do_TNH = do_TNH.contiguous()
    q_TNH, k_TNH, v_TNH = q_TNH.contiguous(), k_TNH.contiguous(), v_TNH.contiguous()
    dq, dk, dv = torch.empty_like(q_TNH), torch.empty_like(k_TNH), torch.empty_like(v_TNH)
    grid, block_ends_B, num_seqs, log2_theta, flags = _launch_args(
        q_TNH, offsets_Bp1, block_size, rope_theta, block_ends_B
    )
    if grid[0] > 0:
        _block_attention_bwd_kernel[grid](
            q_TNH, k_TNH, v_TNH, do_TNH, dq, dk, dv, offsets_Bp1, block_ends_B, num_seqs,
            q_TNH.stride(0), k_TNH.stride(0), v_TNH.stride(0), do_TNH.stride(0),
            dq.stride(0), dk.stride(0), dv.stride(0), block_size, scale, log2_theta,
            CAUSAL=causal, num_warps=config.bwd_warps, num_stages=config.stages, **flags,
        )  # fmt: skip
    return dq, dk, dv

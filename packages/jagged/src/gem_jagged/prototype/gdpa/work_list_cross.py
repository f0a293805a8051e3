"""Cross-attention and PMA on GDPA's work-list kernels (prototype: kept for sweeps).

Legend (shape suffixes): ``T`` tokens, ``B`` sequences, ``N`` heads, ``H`` head dim, ``S`` PMA
seeds, ``W`` work items, ``NB`` relative bias buckets; ``offsets_Bp1`` an offsets tensor.

The kernels are those of the self-attention schedule (``worklist_schedule.py``) in their two
other forms:

- PMA forward: one program per (key chunk of ``pma_chunk`` keys, head, seed tile); a sequence's
  chunk partials add up in an fp32 output by atomics (one add per chunk and output row).
  Backward: one program per (key tile, head) over every seed, adding its dQ share to a shared
  fp32 buffer.
- cross-attention: the forward of self-attention on the query list; the dK/dV key tiles split
  their query range (``split_rows`` rows a part, at most ``max_splits`` parts), their dK/dV
  added in fp32.

Against the per-sequence schedule these pay for the device work-list builds (dozens of tiny
launches), which outweigh the attention itself on the short problems of cross-attention over
candidates and of PMA; production therefore never takes this path.
"""

from dataclasses import dataclass

import torch

from gem_jagged._intmath import cdiv
from gem_jagged._worklist import TileWorkList, key_tiles
from gem_jagged.ops.gdpa.config import Arch, GdpaTiles, seed_block
from gem_jagged.ops.gdpa.triton import backward_bias, kernel_flags
from gem_jagged.ops.gdpa.worklist_schedule import (
    key_work,
    launch_dkdv,
    launch_dq,
    launch_forward,
    query_work,
)

__all__ = [
    "WorkListOptions",
    "gdpa_backward_work_list",
    "gdpa_forward_work_list",
    "work_list_options_for",
]


@dataclass(frozen=True, kw_only=True)
class WorkListOptions:
    """``pma_chunk``: keys per PMA forward program. ``split_rows``, ``max_splits``: a
    cross-attention dK/dV key tile splits its query range into parts of ``split_rows`` rows, at
    most ``max_splits`` of them."""

    pma_chunk: int = 256
    split_rows: int = 512
    max_splits: int = 16


def work_list_options_for(*, arch: Arch) -> WorkListOptions:
    """The options the sweeps use: small chunks under the interpreter, the GPU's otherwise."""
    if arch == "interpreter":
        return WorkListOptions(pma_chunk=32, split_rows=32, max_splits=4)
    return WorkListOptions()


def _seed_offsets(kv_offsets: torch.Tensor, num_seeds: int) -> torch.Tensor:
    """PMA: every sequence has the same ``S`` queries (the seeds)."""
    num_seqs = kv_offsets.numel() - 1
    return torch.arange(num_seqs + 1, device=kv_offsets.device, dtype=torch.int64) * num_seeds


def _pma_key_work(batch, kv_offsets, num_seeds, *, total_kv, block, causal, align) -> TileWorkList:
    return batch.memo(
        ("gdpa.pma_key_tiles", num_seeds, total_kv, block, causal, align),
        lambda: key_tiles(
            _seed_offsets(kv_offsets, num_seeds), kv_offsets, total_kv=total_kv, block=block,
            causal=causal, align=align,
        ),
    )  # fmt: skip


def gdpa_forward_work_list(
    q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, *, activation, causal, scale,
    out_scale, broadcast_q, rel_bias_NB, batch, tiles: GdpaTiles, options: WorkListOptions,
):  # fmt: skip
    """Cross-attention (or PMA with ``broadcast_q``) forward on the work-list kernels.

    The arguments are those of ``gem_jagged.ops.gdpa.triton.gdpa_forward`` (``q_offsets_Bp1``
    is ignored for PMA) plus ``options``. Returns ``out [Tq, N, H]`` (``[B·S, N, H]`` for PMA)
    in q's dtype.
    """
    q_TNH, k_TNH, v_TNH = q_TNH.contiguous(), k_TNH.contiguous(), v_TNH.contiguous()
    num_heads, head_dim = k_TNH.shape[1], k_TNH.shape[2]
    has_bias = rel_bias_NB is not None
    bias = rel_bias_NB.contiguous() if has_bias else q_TNH
    radius = (rel_bias_NB.shape[1] - 1) // 2 if has_bias else 0
    common = kernel_flags(
        q_TNH, activation=activation, causal=causal, has_bias=has_bias, tiles=tiles
    )
    launch = dict(scale=scale, out_scale=out_scale, radius=radius, tiles=tiles, common=common)
    if broadcast_q:
        num_seeds = q_TNH.shape[0]
        num_seqs = kv_offsets_Bp1.numel() - 1
        out = torch.zeros(num_seqs * num_seeds, num_heads, head_dim, device=q_TNH.device)
        block_m = seed_block(num_seeds)
        work = _pma_key_work(
            batch, kv_offsets_Bp1, num_seeds, total_kv=k_TNH.shape[0], block=options.pma_chunk,
            causal=causal, align=1,
        )  # fmt: skip
        launch_forward(
            q_TNH, k_TNH, v_TNH, out, bias, kv_offsets_Bp1, kv_offsets_Bp1, work,
            grid_z=cdiv(num_seeds, block_m), num_seeds=num_seeds, broadcast_q=True,
            block_m=block_m, kv_chunk=options.pma_chunk, **launch,
        )  # fmt: skip
        return out.to(q_TNH.dtype)
    out = torch.empty(q_TNH.shape[0], num_heads, head_dim, device=q_TNH.device, dtype=q_TNH.dtype)
    work = query_work(
        batch, q_offsets_Bp1, kv_offsets_Bp1, total_q=q_TNH.shape[0], block=tiles.fwd_m,
        causal=causal,
    )  # fmt: skip
    launch_forward(
        q_TNH, k_TNH, v_TNH, out, bias, q_offsets_Bp1, kv_offsets_Bp1, work, grid_z=1,
        num_seeds=0, broadcast_q=False, block_m=tiles.fwd_m, kv_chunk=tiles.fwd_n, **launch,
    )  # fmt: skip
    return out


def gdpa_backward_work_list(
    do_TNH, q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, *, activation, causal, scale,
    out_scale, broadcast_q, rel_bias_NB, batch, tiles: GdpaTiles, options: WorkListOptions,
):  # fmt: skip
    """The backward of ``gdpa_forward_work_list``; returns ``(dq, dk, dv, d_rel_bias or None)``
    in the inputs' dtypes."""
    do_TNH = do_TNH.contiguous()
    q_TNH, k_TNH, v_TNH = q_TNH.contiguous(), k_TNH.contiguous(), v_TNH.contiguous()
    num_heads = k_TNH.shape[1]
    device = q_TNH.device
    has_bias, bias, num_buckets, nb_pow2, radius = backward_bias(rel_bias_NB, q_TNH)
    common = kernel_flags(
        q_TNH, activation=activation, causal=causal, has_bias=has_bias, tiles=tiles,
        nb_pow2=nb_pow2,
    )  # fmt: skip
    launch = dict(scale=scale, out_scale=out_scale, radius=radius, tiles=tiles, common=common)
    if broadcast_q:
        num_seeds = q_TNH.shape[0]
        block_m = seed_block(num_seeds)
        dq = torch.zeros(q_TNH.shape, device=device, dtype=torch.float32)
        work = _pma_key_work(
            batch, kv_offsets_Bp1, num_seeds, total_kv=k_TNH.shape[0], block=tiles.dkdv_n,
            causal=causal, align=block_m,
        )  # fmt: skip
        dk, dv = torch.empty_like(k_TNH), torch.empty_like(v_TNH)
        dbias = dq  # a placeholder pointer without a bias
        if has_bias:
            dbias = torch.zeros((work.num_slots, num_heads, nb_pow2), device=device)
        launch_dkdv(
            q_TNH, k_TNH, v_TNH, do_TNH, dk, dv, dq, bias, dbias,
            _seed_offsets(kv_offsets_Bp1, num_seeds), kv_offsets_Bp1, work, num_seeds=num_seeds,
            broadcast_q=True, atomic_kv=False, block_m=block_m, **launch,
        )  # fmt: skip
    else:
        dq = torch.empty_like(q_TNH)
        work = key_work(
            batch, q_offsets_Bp1, kv_offsets_Bp1, total_kv=k_TNH.shape[0], block=tiles.dkdv_n,
            causal=causal, align=tiles.dkdv_m, split=(options.split_rows, options.max_splits),
        )  # fmt: skip
        dk = torch.zeros(k_TNH.shape, device=device, dtype=torch.float32)
        dv = torch.zeros(v_TNH.shape, device=device, dtype=torch.float32)
        launch_dkdv(
            q_TNH, k_TNH, v_TNH, do_TNH, dk, dv, dq, bias, dq, q_offsets_Bp1, kv_offsets_Bp1,
            work, num_seeds=0, broadcast_q=False, atomic_kv=True, block_m=tiles.dkdv_m, **launch,
        )  # fmt: skip
        queries = query_work(
            batch, q_offsets_Bp1, kv_offsets_Bp1, total_q=q_TNH.shape[0], block=tiles.dq_m,
            causal=causal,
        )  # fmt: skip
        dbias = launch_dq(
            q_TNH, k_TNH, v_TNH, do_TNH, dq, bias, q_offsets_Bp1, kv_offsets_Bp1, queries,
            has_bias=has_bias, nb_pow2=nb_pow2, **launch,
        )  # fmt: skip
    d_rel_bias = dbias.sum(0)[:, :num_buckets].to(rel_bias_NB.dtype) if has_bias else None
    return dq.to(q_TNH.dtype), dk.to(k_TNH.dtype), dv.to(v_TNH.dtype), d_rel_bias

"""GDPA's Triton launchers: the schedule each kind of call takes.

Legend (shape suffixes): ``T`` tokens, ``B`` sequences, ``N`` heads, ``H`` head dim, ``NB``
relative bias buckets (``2R+1``); ``q_TNH`` a query tensor, ``offsets_Bp1`` an offsets tensor.

- self-attention: the work-list schedule (``worklist_schedule.py``): device work lists of query
  and key tiles, heavy tiles first, memoised in the caller's ``JaggedBatch``; the forward's query
  list is handed to the backward's dQ kernel.
- cross-attention and PMA: the per-sequence schedule (``per_sequence_schedule.py``): a
  ``(B, N, SPLIT)`` grid with no work list, whose build would cost more than the attention
  itself for short candidate keys and for a few seeds.

The tiles, program counts and activation form come in ``tiles`` (``config.tiles_for``); nothing
here reads a module table.
"""

import torch

from gem_jagged._intmath import next_power_of_2
from gem_jagged._worklist import TileWorkList

from . import per_sequence_schedule, worklist_schedule
from .config import GdpaTiles, activation_code

__all__ = ["gdpa_backward", "gdpa_forward", "kernel_flags"]


def kernel_flags(q_TNH, *, activation, causal, has_bias, tiles: GdpaTiles, nb_pow2=None) -> dict:
    """The constexprs every GDPA kernel takes (``NB_POW2`` for the backward kernels)."""
    flags = dict(
        H=q_TNH.shape[2], ACT=activation_code(activation, sigmoid=tiles.sigmoid), CAUSAL=causal,
        HAS_BIAS=has_bias, IEEE=q_TNH.dtype == torch.float32,
    )  # fmt: skip
    if nb_pow2 is not None:
        flags["NB_POW2"] = nb_pow2
    return flags


def backward_bias(rel_bias_NB, q_TNH) -> tuple[bool, torch.Tensor, int, int, int]:
    """``(has_bias, bias, num_buckets, nb_pow2, radius)`` as the backward kernels take them;
    without a bias, ``q_TNH`` stands in for the pointer the kernels never read."""
    has_bias = rel_bias_NB is not None
    bias = rel_bias_NB.contiguous() if has_bias else q_TNH
    num_buckets = rel_bias_NB.shape[1] if has_bias else 1
    return has_bias, bias, num_buckets, next_power_of_2(num_buckets), (num_buckets - 1) // 2


def gdpa_forward(
    q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, *, activation, causal, scale,
    out_scale, broadcast_q, rel_bias_NB, is_cross, batch, tiles: GdpaTiles,
    return_work: bool = False,
):  # fmt: skip
    """Launch the forward kernel.

    Args:
        q_TNH: ``[Tq, N, H]`` queries (``[S, N, H]`` seeds with ``broadcast_q``).
        k_TNH, v_TNH: ``[Tk, N, H]`` keys and values, q's dtype.
        q_offsets_Bp1, kv_offsets_Bp1: ``[B+1]`` int32/int64 offsets; never None here (self:
            the query offsets twice; PMA: the key offsets twice).
        activation, causal, scale, out_scale, broadcast_q: as for ``gem_jagged.gdpa``.
        rel_bias_NB: ``[N, 2R+1]`` relative bias or None.
        is_cross: the call is cross-attention (or PMA): the per-sequence schedule.
        batch: the ``JaggedBatch`` the offsets come from; it keeps the work lists.
        tiles: ``config.tiles_for(...)`` or a variant of it.
        return_work: also return the self-attention query-tile list (None for the others).

    Returns:
        ``out [Tq, N, H]`` (``[B·S, N, H]`` for PMA) in q's dtype, or ``(out, work)``.
    """
    q_TNH, k_TNH, v_TNH = q_TNH.contiguous(), k_TNH.contiguous(), v_TNH.contiguous()
    has_bias = rel_bias_NB is not None
    bias = rel_bias_NB.contiguous() if has_bias else q_TNH
    radius = (rel_bias_NB.shape[1] - 1) // 2 if has_bias else 0
    common = kernel_flags(
        q_TNH, activation=activation, causal=causal, has_bias=has_bias, tiles=tiles
    )
    work = None
    if broadcast_q or is_cross:
        out = per_sequence_schedule.forward_per_sequence(
            q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, bias, radius, scale, out_scale,
            broadcast_q, tiles, common,
        )  # fmt: skip
    else:
        out, work = worklist_schedule.forward_self(
            q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, bias=bias, radius=radius,
            scale=scale, out_scale=out_scale, causal=causal, batch=batch, tiles=tiles,
            common=common,
        )  # fmt: skip
    return (out, work) if return_work else out


def gdpa_backward(
    do_TNH, q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, *, activation, causal, scale,
    out_scale, broadcast_q, rel_bias_NB, is_cross, batch, tiles: GdpaTiles,
    query_work: TileWorkList | None = None,
):  # fmt: skip
    """Launch the backward kernels; the arguments are ``gdpa_forward``'s, with ``do_TNH`` the
    output's gradient and ``query_work`` the forward's query-tile list
    (``gdpa_forward(..., return_work=True)``), reused when its tiles have the dQ kernel's height.

    Returns:
        ``(dq, dk, dv, d_rel_bias or None)`` in the inputs' dtypes.
    """
    do_TNH = do_TNH.contiguous()
    q_TNH, k_TNH, v_TNH = q_TNH.contiguous(), k_TNH.contiguous(), v_TNH.contiguous()
    has_bias, bias, num_buckets, nb_pow2, radius = backward_bias(rel_bias_NB, q_TNH)
    common = kernel_flags(
        q_TNH, activation=activation, causal=causal, has_bias=has_bias, tiles=tiles,
        nb_pow2=nb_pow2,
    )  # fmt: skip
    if broadcast_q or is_cross:
        dq, dk, dv, dbias = per_sequence_schedule.backward_per_sequence(
            do_TNH, q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, bias, radius, scale,
            out_scale, broadcast_q, has_bias, nb_pow2, tiles, common,
            keys_fit_one_tile=batch.kv_lengths_known_within(1, tiles.dkdv_n),
        )  # fmt: skip
    else:
        dq, dk, dv, dbias = worklist_schedule.backward_self(
            do_TNH, q_TNH, k_TNH, v_TNH, q_offsets_Bp1, kv_offsets_Bp1, bias=bias,
            radius=radius, has_bias=has_bias, nb_pow2=nb_pow2, scale=scale, out_scale=out_scale,
            causal=causal, batch=batch, tiles=tiles, common=common, query_work_list=query_work,
        )  # fmt: skip
    d_rel_bias = dbias.sum(0)[:, :num_buckets].to(rel_bias_NB.dtype) if has_bias else None
    return dq.to(q_TNH.dtype), dk.to(k_TNH.dtype), dv.to(v_TNH.dtype), d_rel_bias

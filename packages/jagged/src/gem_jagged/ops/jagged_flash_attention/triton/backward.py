"""The jagged flash attention backward: which kernels run, in which order (dQ first, its δ
read by dK/dV; or dQ written by the dK/dV kernel for short keys), on the Triton or Gluon side."""

import torch

from .. import hopper
from ..config import DqPlacement, KernelImpl, Schedule
from .common import _rows_of_heads
from .dkdv import backward_dkdv
from .dq import backward_dq
from .token_tiles import token_tiles_backward


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
    cfg = config
    if cfg.schedule == Schedule.TOKEN_TILES:
        return token_tiles_backward(
            dout, q, k, v, out, lse, batch, causal=causal, scale=scale, rel_bias=rel_bias,
            config=cfg,
        )  # fmt: skip
    q, k, v = _rows_of_heads(q, k, v)
    dout, out = dout.contiguous(), out.contiguous()
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

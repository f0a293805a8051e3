"""FlexAttention over the packed history: the strong PyTorch-native anchor of the jagged kernels.

A careful torchtitan user with jagged histories does not pad them: they pack the batch's ``T``
tokens into one sequence ``[1, N, T, H]`` and hand ``torch.nn.attention.flex_attention`` a
``BlockMask`` that lets a token see the earlier tokens of its own document (the document id of
every token, from the batch's offsets). The ``BlockMask`` records, per 128 × 128 tile, whether
the tile is empty, full or partial, so the kernel skips the tiles between documents and the work
follows the real causal pairs, as the jagged kernels' does. The learned relative bias is a
``score_mod`` that reads ``rel_bias[h, clamp(j − i, −R, R) + R]``; FlexAttention differentiates
through the captured tensor, so ``rel_bias`` gets its gradient. Within a document ``j − i`` of the
packed indices is the in-document distance, so the packed indices need no per-token positions.

``FlexMasks`` holds one batch's masks: the history's (document + causal), PMA's (seed row ``r``
belongs to sample ``r // S``) and the candidate cross-attention's (candidate token ``r`` to sample
``r // C``), each a document mask over the keys. The model builds it once per batch in its
forward and passes it to every layer: one ``create_block_mask`` per mask and batch, none per
layer. It is a plain object the caller holds; nothing is kept between batches.

FlexAttention is softmax attention. The jagged model pools with GDPA (SiLU in place of softmax),
which flex cannot express (a ``score_mod`` acts on scores before the softmax, not in its place);
the native anchor pools with softmax, as a native user would build it.

Backends (``model.flex_backend``):

- ``compiled``: ``flex_attention`` and ``create_block_mask`` each ``torch.compile``d once, here at
  module level, as torchtitan's FlexAttention wrapper does. Without compilation flex runs an
  unfused implementation that materialises the ``[N, T, T]`` scores. ``--compile`` also compiles
  each block around it (the norms, projections and SwiGLU).
- ``eager``: the uncompiled ``flex_attention``. FlexAttention has no backward on the CPU, so this
  path is for inference there (the tests compare its forward).
- ``dense``: the same ``score_mod`` and ``mask_mod`` evaluated on the full ``[N, Q, K]`` score
  matrix in plain PyTorch, differentiable everywhere: the CPU's training path and the tests'.
- ``auto``: ``compiled`` on CUDA, ``dense`` elsewhere.
"""

import math
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from gem_train.config import FLEX_BACKENDS

# The BlockMask's tile: document ids are padded to a multiple of it, so that a mask_mod never
# indexes past the end of the id vector on a partial tile.
FLEX_TILE = 128

compiled_flex_attention = torch.compile(flex_attention)
compiled_create_block_mask = torch.compile(create_block_mask)

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def resolve_flex_backend(backend: str, device: torch.device) -> str:
    """``backend`` with ``auto`` made concrete: ``compiled`` on CUDA, ``dense`` elsewhere.

    Raises:
        ValueError: ``backend`` is not one of ``FLEX_BACKENDS``.
    """
    if backend not in FLEX_BACKENDS:
        raise ValueError(f"flex backend must be one of {FLEX_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "compiled" if device.type == "cuda" else "dense"
    return backend


def document_ids(offsets_Bp1: torch.Tensor, total: int) -> torch.Tensor:
    """``[round_up(T, FLEX_TILE)]`` int32: the sample of each packed token, ``-1`` past ``T``.

    ``total`` (``T = offsets[-1]``, known on the host) sizes the vector without a device sync.
    """
    lengths_B = (offsets_Bp1[1:] - offsets_Bp1[:-1]).long()
    samples_B = torch.arange(lengths_B.numel(), device=offsets_Bp1.device, dtype=torch.int32)
    doc_T = torch.repeat_interleave(samples_B, lengths_B, output_size=total)
    padded = -(-total // FLEX_TILE) * FLEX_TILE
    return torch.cat([doc_T, doc_T.new_full((padded - total,), -1)])


def relative_bias_score_mod(rel_bias_NR: torch.Tensor) -> ScoreMod:
    """The ``score_mod`` adding ``rel_bias[h, clamp(kv − q, −R, R) + R]`` (``rel_bias [N, 2R+1]``)."""
    radius = (rel_bias_NR.shape[1] - 1) // 2

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + rel_bias_NR[h, (kv_idx - q_idx).clamp(-radius, radius) + radius]

    return score_mod


def dense_flex_attention(
    q_1NQH: torch.Tensor,
    k_1NKH: torch.Tensor,
    v_1NKH: torch.Tensor,
    *,
    mask_mod: MaskMod,
    score_mod: ScoreMod | None = None,
) -> torch.Tensor:
    """What ``flex_attention`` computes, on the full score matrix in plain PyTorch.

    Args:
        q_1NQH: ``[1, N, Q, H]`` queries, any float dtype.
        k_1NKH, v_1NKH: ``[1, N, K, H]`` keys and values, q's dtype and device.
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool``, evaluated on broadcast index grids.
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score`` on the scaled scores, or None.

    Returns:
        ``[1, N, Q, H]`` in q's dtype: softmax attention (scale ``1/sqrt(H)``) over the visible
        keys; a query that sees no key outputs zeros, as flex does.
    """
    heads, q_len, head_dim = q_1NQH.shape[1:]
    kv_len, device = k_1NKH.shape[2], q_1NQH.device
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    h = torch.arange(heads, device=device)[None, :, None, None]
    q_idx = torch.arange(q_len, device=device)[None, None, :, None]
    kv_idx = torch.arange(kv_len, device=device)[None, None, None, :]
    scores_1NQK = torch.matmul(q_1NQH, k_1NKH.transpose(-1, -2)).float() / math.sqrt(head_dim)
    if score_mod is not None:
        scores_1NQK = score_mod(scores_1NQK, b, h, q_idx, kv_idx)
    visible = mask_mod(b, h, q_idx, kv_idx).expand(1, heads, q_len, kv_len)
    scores_1NQK = scores_1NQK.masked_fill(~visible, float("-inf"))
    has_key = visible.any(dim=-1, keepdim=True)
    # A row that sees nothing would softmax to NaN; it gets zeros instead.
    probs_1NQK = torch.softmax(scores_1NQK.masked_fill(~has_key, 0.0), dim=-1) * has_key
    return torch.matmul(probs_1NQK.to(v_1NKH.dtype), v_1NKH)


class FlexMasks:
    """The document masks of one batch, built once in the model's forward, read by every layer.

    Args:
        offsets_Bp1: ``[B+1]`` int32/int64 offsets of the histories (a ``JaggedBatch``'s).
        total: ``T``, the batch's history tokens (``offsets[-1]``, known on the host).
        seeds: PMA's seeds per sample ``S``, or 0 when PMA does not use flex.
        candidates: candidate tokens per sample ``C``, or 0 when the cross-attention does not.
        history: build the history's document + causal mask.
        backend: one of ``FLEX_BACKENDS``; ``auto`` resolves on the offsets' device.
        bwd_stages: pipeline stages of the compiled backward kernels, or 0 for inductor's
            choice (``model.flex_bwd_stages``).

    Raises:
        ValueError: an unknown ``backend``.
    """

    def __init__(
        self,
        offsets_Bp1: torch.Tensor,
        *,
        total: int,
        seeds: int,
        candidates: int,
        history: bool,
        backend: str,
        bwd_stages: int = 0,
    ):
        self.backend = resolve_flex_backend(backend, offsets_Bp1.device)
        self.kernel_options = {"bwd_num_stages": bwd_stages} if bwd_stages else None
        self.total, self.num_samples = total, offsets_Bp1.numel() - 1
        doc_T = document_ids(offsets_Bp1, total)
        self.doc_T = doc_T

        def history_mask(b, h, q_idx, kv_idx):
            return (doc_T[q_idx] == doc_T[kv_idx]) & (kv_idx <= q_idx)

        def rows_of(per_sample: int) -> MaskMod:
            def mask(b, h, q_idx, kv_idx):
                return (q_idx // per_sample) == doc_T[kv_idx]

            return mask

        self.mask_mods: dict[str, MaskMod] = {}
        if history:
            self.mask_mods["history"] = history_mask
        if seeds:
            self.mask_mods["pma"] = rows_of(seeds)
        if candidates:
            self.mask_mods["cross"] = rows_of(candidates)
        q_lens = {
            "history": total,
            "pma": self.num_samples * seeds,
            "cross": self.num_samples * candidates,
        }
        self.block_masks: dict[str, BlockMask] = {}
        if self.backend != "dense" and total > 0:
            make = compiled_create_block_mask if self.backend == "compiled" else create_block_mask
            for name, mask_mod in self.mask_mods.items():
                self.block_masks[name] = make(
                    mask_mod, None, None, q_lens[name], total, device=offsets_Bp1.device
                )

    def attend(
        self,
        which: str,
        q_QNH: torch.Tensor,
        k_TNH: torch.Tensor,
        v_TNH: torch.Tensor,
        *,
        score_mod: ScoreMod | None = None,
    ) -> torch.Tensor:
        """Softmax attention of ``q`` over the packed history under mask ``which``.

        Args:
            which: ``"history"``, ``"pma"`` or ``"cross"`` (one this object was built with).
            q_QNH: ``[Q, N, H]`` queries: ``Q = T`` (history), ``B·S`` (pma) or ``B·C`` (cross).
            k_TNH, v_TNH: ``[T, N, H]`` keys and values of the packed history, q's dtype.
            score_mod: added to the scaled scores (the relative bias), or None.

        Returns:
            ``[Q, N, H]`` in q's dtype; a query with no visible key (an empty history's seeds)
            gets zeros.

        Raises:
            KeyError: ``which`` was not built.
        """
        if which not in self.mask_mods:
            raise KeyError(f"no {which!r} mask in this batch's FlexMasks ({list(self.mask_mods)})")
        # shapes, not the host attributes: under torch.compile a shape stays symbolic
        if k_TNH.shape[0] == 0 or q_QNH.shape[0] == 0:
            return torch.zeros_like(q_QNH)
        q, k, v = (t.transpose(0, 1)[None] for t in (q_QNH, k_TNH, v_TNH))  # [1, N, L, H]
        if self.backend == "dense":
            mask_mod = self.mask_mods[which]
            out = dense_flex_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
        else:
            attend = compiled_flex_attention if self.backend == "compiled" else flex_attention
            out = attend(
                q, k, v, score_mod=score_mod, block_mask=self.block_masks[which],
                kernel_options=self.kernel_options,
            )  # fmt: skip
        return out[0].transpose(0, 1)

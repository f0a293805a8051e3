"""Jagged flash attention: exact softmax attention over jagged sequences, never padded.

``jagged_flash_attention(q, k, v, q_offsets, kv_offsets=None, *, causal=False, scale=None,
rel_bias=None, max_q_len=None, max_kv_len=None, backend="auto")`` attends each sequence's queries
to that sequence's keys: ``q [Tq, N, H]`` with ``q_offsets [B+1]``, ``k, v [Tk, N, H]`` with
``kv_offsets [B+1]`` (``None``: self-attention, the query offsets). Causal masking is aligned
bottom-right (query ``i`` of ``Lq`` sees key ``j`` iff ``j ≤ i + Lk − Lq``), as FlashAttention
does; ``rel_bias [N, 2R+1]`` adds ``rel_bias[n, clamp(j − i, −R, R) + R]`` to every score and
gets a gradient. A query row that sees no key outputs zeros. ``max_q_len`` / ``max_kv_len`` are
launch hints (the backward pass uses ``max_q_len`` to size its split of long sequences); they
never truncate anything. Without the hint, an eager call takes the longest sequence from the
offsets' host check when it ran (it does once per offsets tensor); otherwise the token count.

``q_offsets`` may be a ``gem_jagged.JaggedBatch`` instead (``kv_offsets`` then stays None: the
batch holds both sides): a model builds one per batch, and every call shares its checks, length
range and work lists (``gem_jagged.batch``). A plain tensor gets a batch built for the call.

q, k and v may instead be torchrec ``JaggedTensor``s or jagged nested tensors, which carry their
offsets (``gem_jagged._jagged_inputs``); the output is then of their kind.

``config=`` (a ``JaggedAttentionConfig``, ``config.py``) fixes the Triton kernels' tiles and
code paths; without it ``config_for`` picks them from the device, dtype, head dim, keys per
sequence and bias.

``backend="auto"`` runs the Triton kernels (``triton/``, and the Gluon kernels of ``hopper/``
on sm_90) on CUDA tensors and the PyTorch reference (``reference.py``) on CPU tensors. The op is a
``torch.library`` custom op with a fake implementation and autograd (``_op.py``), so
``torch.compile(fullgraph=True)`` traces it and CUDA graphs capture it (nothing in the Triton
path synchronises with the host); eager calls skip the custom-op machinery for the same kernels
where nothing could observe the difference (``gem_jagged._dispatch``).
"""

import math

import torch

from gem_jagged._checks import (
    check_head_dim,
    check_rel_bias,
    check_same,
    check_tokens,
    check_values,
    resolve_backend,
)
from gem_jagged._dispatch import custom_op_required
from gem_jagged._jagged_inputs import unwrap_jagged
from gem_jagged.batch import JaggedBatch, as_batch

from . import _op
from .config import JaggedAttentionConfig, Schedule

__all__ = ["jagged_flash_attention"]

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def jagged_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | JaggedBatch | None = None,
    kv_offsets: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    rel_bias: torch.Tensor | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    backend: str = "auto",
    config: JaggedAttentionConfig | None = None,
) -> torch.Tensor:
    """Softmax attention per jagged sequence.

    Args:
        q: ``[Tq, N, H]`` queries, float16/bfloat16/float32 (any float dtype on the reference
            backend); H in {32, 64, 128}. Or a torchrec ``JaggedTensor`` / jagged nested tensor
            (``[B, j, N, H]``) carrying its offsets; k and v are then of the same kind.
        k, v: ``[Tk, N, H]`` keys and values, q's dtype and device.
        q_offsets: ``[B+1]`` int32/int64 offsets of the query sequences, or a ``JaggedBatch``;
            None when q carries its offsets.
        kv_offsets: ``[B+1]`` offsets of the key sequences (cross-attention), or None for
            self-attention (``Tk = Tq``, the query offsets). Jagged k and v whose offsets are
            not q's make cross-attention.
        causal: mask aligned bottom-right: query i of Lq sees key j iff j ≤ i + Lk − Lq.
        scale: score scale, default ``1/sqrt(H)``.
        rel_bias: ``[N, 2R+1]`` learned bias added as ``rel_bias[n, clamp(j − i, −R, R) + R]``;
            it receives a gradient.
        max_q_len, max_kv_len: launch hints (longest sequences); never truncate anything. A
            checked ``JaggedBatch`` knows them already.
        backend: "auto" (Triton on CUDA, the reference on CPU), "triton" or "reference".
        config: the Triton kernels' tiles and code paths (``JaggedAttentionConfig``); None
            lets ``config_for`` pick from the device, dtype, head dim, keys per sequence and
            bias. Ignored by the reference backend. ``schedule=Schedule.TOKEN_TILES`` packs
            consecutive tokens of many short sequences into each tile (self-attention only;
            ``config_for`` does not pick it).

    Returns:
        ``[Tq, N, H]`` in q's dtype; a query row that sees no key is zeros. Of q's kind, with
        q's offsets, for jagged inputs.

    Raises:
        TypeError / ValueError naming the argument: wrong types, shapes, dtypes, devices,
        unsupported head dims, offsets that are invalid or do not end at the token counts;
        TypeError when ``config`` is not a ``JaggedAttentionConfig`` or None; ValueError for
        jagged inputs of mixed kinds or with offsets passed beside them.
    """
    q, k, v, q_offsets, kv_offsets, wrap = unwrap_jagged(q, k, v, q_offsets, kv_offsets)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_values(name, x)
    check_same([("q", q), ("k", k), ("v", v)])
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k has {k.shape[1]} heads but q has {q.shape[1]}; they must match")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k has head dim {k.shape[2]} but q has {q.shape[2]}; they must match")
    check_head_dim("q", q.shape[2])
    if q_offsets is None:
        raise ValueError(
            "q_offsets is required for plain q, k, v (or pass torchrec JaggedTensors or jagged "
            "nested tensors, which carry their offsets)"
        )
    batch = as_batch(q_offsets, kv_offsets, max_len=max_q_len, max_kv_len=max_kv_len)
    if batch.device != q.device:
        raise ValueError(f"q_offsets is on {batch.device} but q is on {q.device}")
    check_tokens("q_offsets", batch.length_range, q.shape[0], values="q")
    if batch.is_self_attention:
        if k.shape[0] != q.shape[0]:
            raise ValueError(
                f"kv_offsets=None means self-attention, but k has {k.shape[0]} tokens and q has "
                f"{q.shape[0]}; pass kv_offsets for cross-attention"
            )
    else:
        check_tokens("kv_offsets", batch.kv_length_range, k.shape[0], values="k")
    check_rel_bias(rel_bias, num_heads=q.shape[1], like=q)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[2])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    if config is not None and not isinstance(config, JaggedAttentionConfig):
        raise TypeError(f"config must be a JaggedAttentionConfig or None, got {config!r}")
    if config is not None and config.schedule == Schedule.TOKEN_TILES:
        if not batch.is_self_attention:
            raise ValueError(
                "config.schedule=Schedule.TOKEN_TILES runs self-attention only "
                "(kv_offsets=None); use Schedule.PER_SEQUENCE for cross-attention"
            )
    backend = resolve_backend(backend, q.device)
    if backend == "triton" and q.dtype not in TRITON_DTYPES:
        raise TypeError(
            f"q has dtype {q.dtype}; the triton backend supports {TRITON_DTYPES} "
            "(use backend='reference' for others)"
        )
    if backend == "triton" and not custom_op_required(q, k, v, rel_bias):
        return wrap(
            _op.eager_triton_attention(
                q, k, v, batch, rel_bias, causal=bool(causal), scale=float(scale), config=config
            )
        )
    config_ints = None if config is None or backend != "triton" else config.as_ints()
    out, _, _ = _op.attention_forward(
        q, k, v, batch.offsets, batch.kv_offsets, rel_bias, bool(causal), float(scale),
        batch.max_len, backend, config_ints,
    )  # fmt: skip
    return wrap(out)

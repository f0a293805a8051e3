"""BlockAttention: softmax attention inside fixed blocks of each jagged sequence, RoPE fused.

Each sequence of ``q, k, v [T, N, H]`` (jagged by ``offsets [B+1]``) is cut into blocks of
``block_size`` tokens counted from its start; a token attends only to tokens of its own block
(causally by default). With ``rope_theta`` the half-split rotary embedding (as in Llama) rotates
q and k by the token's position in its sequence inside the kernel, in the forward and again in
the backward, so no rotated copy is written and gradients are with respect to the un-rotated
q and k. The cost is linear in the tokens: one program per (block, head), no loop over keys.

q, k and v may be torchrec ``JaggedTensor``s or jagged nested tensors of one set of sequences
instead, which carry their offsets; the output is then of their kind
(``gem_jagged._jagged_inputs``).
"""

import math

import torch

from ..._checks import check_head_dim, check_same, check_tokens, check_values, resolve_backend
from ..._dispatch import custom_op_required
from ..._jagged_inputs import unwrap_jagged
from ...batch import BATCH_ARGUMENTS, JaggedBatch, as_batch
from ._op import BlockAttentionTritonFunction, block_attention_op, resolve_config
from .config import BlockAttentionConfig, config_for

__all__ = ["BlockAttentionConfig", "block_attention", "config_for"]

MAX_BLOCK_SIZE = 128
MAX_FP32_BLOCK_SIZE = 64  # Triton backend: a whole fp32 block's operands must fit on chip


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor | JaggedBatch | None = None,
    *,
    block_size: int = 64,
    causal: bool = True,
    rope_theta: float | None = None,
    scale: float | None = None,
    backend: str = "auto",
    config: BlockAttentionConfig | None = None,
) -> torch.Tensor:
    """Block-local softmax attention over jagged sequences.

    Args:
        q, k, v: ``[T, N, H]`` float tensors of one dtype and device; H in {32, 64, 128}. Or
            three torchrec ``JaggedTensor``s / jagged nested tensors (``[B, j, N, H]``) of the
            same sequences, carrying their offsets.
        offsets: ``[B+1]`` int32/int64 offsets, or a self-attention ``JaggedBatch``; None for
            jagged q, k, v.
        block_size: tokens per block, counted from each sequence's start; 1 to 128 (the whole
            block's scores stay on chip), at most 64 for fp32 inputs on the Triton backend.
        causal: a token sees only the tokens of its block up to itself.
        rope_theta: rotary embedding base (> 1), applied to q and k inside the kernel from
            each token's position in its sequence; None for no rotation.
        scale: score scale, default ``1/sqrt(H)``.
        backend: "auto" (Triton on CUDA, the reference on CPU), "triton" or "reference".
        config: the Triton kernels' ``BlockAttentionConfig`` (warps, stages); None picks
            ``config_for(block_size=block_size, head_dim=H)``. The reference backend ignores it.

    Returns:
        ``[T, N, H]`` in q's dtype; gradients are with respect to the un-rotated q and k. Of
        q's kind, with q's offsets, for jagged inputs.

    Raises:
        TypeError / ValueError naming the argument for bad types, shapes, block sizes,
        ``rope_theta`` values, offsets or ``config``, for jagged inputs of mixed kinds, of
        different sequences, or with offsets passed beside them.
    """
    q, k, v, offsets, _, wrap = unwrap_jagged(
        q, k, v, offsets, None, names=("offsets", None), self_attention=True
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_values(name, t)
    check_same([("q", q), ("k", k), ("v", v)])
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k and v must have the same shape [T, N, H], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    check_head_dim("q", q.shape[2])
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    if rope_theta is not None and not (math.isfinite(rope_theta) and rope_theta > 1.0):
        raise ValueError(f"rope_theta must be a finite number > 1 (e.g. 10000.0), got {rope_theta}")
    if offsets is None:
        raise ValueError(
            "offsets is required for plain q, k, v (or pass torchrec JaggedTensors or jagged "
            "nested tensors, which carry their offsets)"
        )
    batch = as_batch(offsets, names=BATCH_ARGUMENTS)
    if not batch.is_self_attention:
        raise ValueError("block_attention is self-attention: pass a JaggedBatch without kv_offsets")
    if batch.device != q.device:
        raise ValueError(f"offsets is on {batch.device} but q is on {q.device}")
    check_tokens("offsets", batch.length_range, q.shape[0], values="q")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    backend = resolve_backend(backend, q.device)
    if backend == "triton" and q.dtype == torch.float32 and block_size > MAX_FP32_BLOCK_SIZE:
        raise ValueError(
            f"fp32 inputs support block_size up to {MAX_FP32_BLOCK_SIZE} on the Triton backend, "
            f"got {block_size}: the backward of a 128-token fp32 block needs ~320 KiB of shared "
            f"memory (an H200 has 227 KiB); use bf16/fp16 inputs or backend='reference'"
        )
    rope_theta = None if rope_theta is None else float(rope_theta)
    if config is not None and not isinstance(config, BlockAttentionConfig):
        raise TypeError(
            f"config must be a BlockAttentionConfig or None, got {type(config).__name__}"
        )
    config = resolve_config(config, q, block_size)
    if backend == "triton" and not custom_op_required(q, k, v):
        out = BlockAttentionTritonFunction.apply(
            q, k, v, batch, block_size, bool(causal), rope_theta, scale, config
        )
    else:
        out = block_attention_op(
            q, k, v, batch.offsets, block_size, bool(causal), rope_theta, scale, backend,
            config.as_ints(),
        )  # fmt: skip
    return wrap(out)

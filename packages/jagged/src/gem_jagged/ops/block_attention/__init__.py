"""BlockAttention: softmax attention inside fixed blocks of each jagged sequence, RoPE fused.

Each sequence of ``q, k, v [T, N, H]`` (jagged by ``offsets [B+1]``) is cut into blocks of
``block_size`` tokens counted from its start; a token attends only to tokens of its own block
(causally by default). With ``rope_theta`` the half-split rotary embedding (as in Llama) rotates
q and k by the token's position in its sequence inside the kernel, in the forward and again in
the backward, so no rotated copy is written and gradients are with respect to the un-rotated
q and k. The cost is linear in the tokens: one program per (block, head), no loop over keys.
"""

import math

import torch

from ..._checks import check_head_dim, check_offsets, check_same, check_values, resolve_backend
from ._op import BlockAttentionTritonFunction, block_attention_op

__all__ = ["block_attention"]

MAX_BLOCK_SIZE = 128
MAX_FP32_BLOCK_SIZE = 64  # Triton backend: a whole fp32 block's operands must fit on chip


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_size: int = 64,
    causal: bool = True,
    rope_theta: float | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Block-local softmax attention; output ``[T, N, H]``. ``scale`` defaults to ``1/sqrt(H)``.

    ``block_size`` is at most 128 tokens (the whole block's scores stay on chip), 64 for fp32
    inputs on the Triton backend.
    """
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
    check_offsets("offsets", offsets, total=q.shape[0], device=q.device)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    backend = resolve_backend(backend, q.device)
    if backend == "triton" and q.dtype == torch.float32 and block_size > MAX_FP32_BLOCK_SIZE:
        raise ValueError(
            f"fp32 inputs support block_size up to {MAX_FP32_BLOCK_SIZE} on the Triton backend, "
            f"got {block_size}: the backward of a 128-token fp32 block needs ~320 KiB of shared "
            f"memory (an H200 has 227 KiB); use bf16/fp16 inputs or backend='reference'"
        )
    rope_theta = None if rope_theta is None else float(rope_theta)
    if backend == "triton" and not torch.compiler.is_compiling():
        return BlockAttentionTritonFunction.apply(
            q, k, v, offsets, block_size, bool(causal), rope_theta, scale
        )
    return block_attention_op(
        q, k, v, offsets, block_size, bool(causal), rope_theta, scale, backend
    )

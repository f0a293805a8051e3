"""BlockAttention reference: plain PyTorch, one sequence at a time, blocks batched.

Each sequence is cut into blocks of ``block_size`` tokens counted from its start (the last block
may be shorter) and softmax attention runs inside each block only, causal by default. With
``rope_theta`` the rotary embedding of Llama (half-split: the first half of the head dim rotates
against the second, frequency ``theta^(−2d/H)`` for pair ``d``) rotates q and k by the token's
position in its sequence before the scores; gradients are with respect to the un-rotated inputs,
which is the rotation's transpose applied to the gradients of the rotated ones.

The backward is written out (``dS = P ⊙ (dP − rowsum(P ⊙ dP))``) rather than left to autograd, so
that it reads as the kernel's math and runs inside the custom op.
"""

import math

import torch
import torch.nn.functional as F


def rope_cos_sin(length: int, head_dim: int, theta: float, *, dtype, device):
    """``cos, sin [L, H/2]`` of the angles ``position · theta^(−2d/H)``."""
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(half, device=device, dtype=dtype) * 2 / head_dim)
    angles = torch.arange(length, device=device, dtype=dtype)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False):
    """Half-split rotation of ``x [L, N, H]``; ``inverse`` applies the transpose (for gradients)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], (-sin if inverse else sin)[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _blocked(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[L, N, H] -> [nb, bs, N, H]``, zero-padding the last block."""
    pad = -x.shape[0] % block_size
    x = F.pad(x, (0, 0, 0, 0, 0, pad))
    return x.reshape(-1, block_size, *x.shape[1:])


def _sequence_blocks(q_b, k_b, v_b, *, block_size, causal, rope_theta, scale):
    """Rotated, blocked inputs and the softmax weights ``P [nb, N, bs, bs]`` of one sequence."""
    length = q_b.shape[0]
    trig = None
    if rope_theta is not None:
        angle_dtype = torch.float64 if q_b.dtype == torch.float64 else torch.float32
        trig = rope_cos_sin(length, q_b.shape[-1], rope_theta, dtype=angle_dtype, device=q_b.device)
        q_b = rotate(q_b.to(angle_dtype), *trig).to(q_b.dtype)
        k_b = rotate(k_b.to(angle_dtype), *trig).to(k_b.dtype)
    qr, kr, vb = (_blocked(t, block_size) for t in (q_b, k_b, v_b))
    key_valid = (torch.arange(qr.shape[0] * block_size, device=q_b.device) < length).reshape(
        -1, 1, 1, block_size
    )
    mask = key_valid
    if causal:
        mask = mask & torch.ones(block_size, block_size, dtype=torch.bool, device=q_b.device).tril()
    scores = torch.einsum("bqnh,bknh->bnqk", qr, kr) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return qr, kr, vb, probs, trig


def _sequences(offsets):
    bounds = offsets.tolist()
    return [(bounds[b], bounds[b + 1]) for b in range(len(bounds) - 1) if bounds[b + 1] > bounds[b]]


def block_attention_reference(q, k, v, offsets, *, block_size=64, causal=True, rope_theta=None,
                              scale=None):  # fmt: skip
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros_like(q)
    for lo, hi in _sequences(offsets):
        _, _, vb, probs, _ = _sequence_blocks(
            q[lo:hi], k[lo:hi], v[lo:hi], block_size=block_size, causal=causal,
            rope_theta=rope_theta, scale=scale,
        )  # fmt: skip
        o = torch.einsum("bnqk,bknh->bqnh", probs, vb).reshape(-1, *q.shape[1:])
        out[lo:hi] = o[: hi - lo]
    return out


def block_attention_reference_backward(grad_out, q, k, v, offsets, *, block_size=64, causal=True,
                                       rope_theta=None, scale=None):  # fmt: skip
    """``(dq, dk, dv)`` with respect to the un-rotated q and k."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for lo, hi in _sequences(offsets):
        length = hi - lo
        qr, kr, vb, probs, trig = _sequence_blocks(
            q[lo:hi], k[lo:hi], v[lo:hi], block_size=block_size, causal=causal,
            rope_theta=rope_theta, scale=scale,
        )  # fmt: skip
        do = _blocked(grad_out[lo:hi], block_size)
        dp = torch.einsum("bqnh,bknh->bnqk", do, vb)
        ds = probs * (dp - (probs * dp).sum(-1, keepdim=True))
        dv_b = torch.einsum("bnqk,bqnh->bknh", probs, do)
        dq_b = torch.einsum("bnqk,bknh->bqnh", ds, kr) * scale
        dk_b = torch.einsum("bnqk,bqnh->bknh", ds, qr) * scale
        dq_b, dk_b, dv_b = (t.reshape(-1, *q.shape[1:])[:length] for t in (dq_b, dk_b, dv_b))
        if trig is not None:
            dq_b = rotate(dq_b.to(trig[0].dtype), *trig, inverse=True).to(q.dtype)
            dk_b = rotate(dk_b.to(trig[0].dtype), *trig, inverse=True).to(k.dtype)
        dq[lo:hi], dk[lo:hi], dv[lo:hi] = dq_b, dk_b, dv_b
    return dq, dk, dv

"""GDPA reference: plain PyTorch, one sequence at a time.

Generalized dot-product attention replaces softmax by a pointwise activation:

    out_b = out_scale · (act(scale · Q_b K_bᵀ + bias) ⊙ mask) V_b

for every sequence ``b``. Without a row normalisation each (query, key) pair contributes
independently, so masked pairs are simply dropped (``act(0)`` is not zero for every activation,
e.g. sigmoid, so the mask multiplies *after* the activation). Causal masking is aligned
bottom-right, as for the softmax op: query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys
sees keys ``j ≤ i + Lk − Lq``. With ``broadcast_q`` (PMA) the same seeds ``q [S, N, H]`` attend
over every sequence's keys and the output stacks ``S`` rows per sequence.

This is the oracle of the tests and the CPU backend: readable, differentiable by autograd, slow.
"""

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "sigmoid", "identity")


def activation_fn(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "identity":
        return x
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def activation_slope(name: str, x: torch.Tensor) -> torch.Tensor:
    """``act'(x)``, written out so the backward needs no autograd."""
    if name == "silu":
        sig = torch.sigmoid(x)
        return sig * (1 + x * (1 - sig))
    if name == "gelu":
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        return cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    if name == "gelu_tanh":
        c = math.sqrt(2 / math.pi)
        t = torch.tanh(c * (x + 0.044715 * x**3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    if name == "relu":
        return (x > 0).to(x.dtype)
    if name == "sigmoid":
        sig = torch.sigmoid(x)
        return sig * (1 - sig)
    if name == "identity":
        return torch.ones_like(x)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def rel_bias_buckets(radius: int, lq: int, lk: int, device) -> torch.Tensor:
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return (j - i).clamp(-radius, radius) + radius


def rel_bias_table(rel_bias: torch.Tensor, lq: int, lk: int) -> torch.Tensor:
    """``[N, Lq, Lk]`` bias ``rel_bias[n, clamp(j − i, −R, R) + R]``."""
    radius = (rel_bias.shape[1] - 1) // 2
    return rel_bias[:, rel_bias_buckets(radius, lq, lk, rel_bias.device)]


def gdpa_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    *,
    activation: str = "silu",
    causal: bool = False,
    scale: float | None = None,
    out_scale: float = 1.0,
    broadcast_q: bool = False,
    rel_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence GDPA; ``q_offsets`` is unused when ``broadcast_q`` is set."""
    out = q.new_zeros((0, q.shape[1], v.shape[2]))
    pieces = [out]
    for _, _q_b, _k_b, v_b, scores, mask in _sequences(
        q, k, v, q_offsets, kv_offsets, causal, scale, broadcast_q, rel_bias
    ):
        weights = activation_fn(activation, scores) * mask
        pieces.append(torch.einsum("nqk,knh->qnh", weights, v_b) * out_scale)
    return torch.cat(pieces, 0)


def _sequences(q, k, v, q_offsets, kv_offsets, causal, scale, broadcast_q, rel_bias):
    """Yield (row slices, q_b, k_b, v_b, scores [N, Lq, Lk], mask [Lq, Lk]) per sequence."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kv_bounds = kv_offsets.tolist()
    q_bounds = None if broadcast_q else q_offsets.tolist()
    for b in range(len(kv_bounds) - 1):
        q_rows = slice(0, q.shape[0]) if broadcast_q else slice(q_bounds[b], q_bounds[b + 1])
        kv_rows = slice(kv_bounds[b], kv_bounds[b + 1])
        q_b, k_b, v_b = q[q_rows], k[kv_rows], v[kv_rows]
        lq, lk = q_b.shape[0], k_b.shape[0]
        scores = torch.einsum("qnh,knh->nqk", q_b, k_b) * scale
        if rel_bias is not None:
            scores = scores + rel_bias_table(rel_bias, lq, lk).to(scores.dtype)
        mask = torch.ones(lq, lk, dtype=scores.dtype, device=q.device)
        if causal:
            i = torch.arange(lq, device=q.device)[:, None]
            j = torch.arange(lk, device=q.device)[None, :]
            mask = (j <= i + lk - lq).to(scores.dtype)
        yield (q_rows, kv_rows), q_b, k_b, v_b, scores, mask


def gdpa_reference_backward(
    grad_out, q, k, v, q_offsets, kv_offsets, *, activation, causal, scale, out_scale,
    broadcast_q, rel_bias,
):  # fmt: skip
    """``(dq, dk, dv, d_rel_bias or None)`` written out: recompute, then

    ``dV = Pᵀ dO``, ``dS = (dO Vᵀ) ⊙ act'(S) ⊙ mask``, ``dQ = scale·dS K``, ``dK = scale·dSᵀ Q``,
    and the bias gradient sums ``dS`` over the pairs of each bucket.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_bias = None if rel_bias is None else torch.zeros_like(rel_bias)
    out_row = 0
    for (q_rows, kv_rows), q_b, k_b, v_b, scores, mask in _sequences(
        q, k, v, q_offsets, kv_offsets, causal, scale, broadcast_q, rel_bias
    ):
        lq, lk = q_b.shape[0], k_b.shape[0]
        do_b = grad_out[out_row : out_row + lq]
        out_row += lq
        weights = activation_fn(activation, scores) * mask * out_scale
        dv[kv_rows] += torch.einsum("nqk,qnh->knh", weights, do_b)
        ds = torch.einsum("qnh,knh->nqk", do_b, v_b) * activation_slope(activation, scores)
        ds = ds * mask * out_scale
        dq[q_rows] += torch.einsum("nqk,knh->qnh", ds, k_b) * scale
        dk[kv_rows] += torch.einsum("nqk,qnh->knh", ds, q_b) * scale
        if d_bias is not None:
            radius = (rel_bias.shape[1] - 1) // 2
            bucket = rel_bias_buckets(radius, lq, lk, q.device).reshape(-1)
            d_bias.index_add_(1, bucket, ds.reshape(ds.shape[0], -1).to(d_bias.dtype))
    return dq, dk, dv, d_bias

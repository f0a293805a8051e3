"""Jagged flash attention, the readable way: one dense softmax attention per sequence.

This is the oracle the Triton kernels are tested against and the CPU backend. For each sequence
``b`` it slices ``Lq`` queries and ``Lk`` keys out of the jagged values, forms the full
``[N, Lq, Lk]`` score matrix ``scale · Q Kᵀ``, adds the relative bias
``rel_bias[n, clamp(j − i, −R, R) + R]``, hides the keys a query must not see (causal, aligned
bottom-right: query ``i`` sees key ``j`` iff ``j ≤ i + Lk − Lq``), and takes a softmax over the
keys. A query row that sees no key at all outputs zeros and gets a log-sum-exp of ``+inf`` (the
convention the kernels share, so that the backward pass gives it probability zero).

Everything runs in the dtype of the inputs, so running it in fp16 measures how far a plain
PyTorch computation in that dtype lands from fp64: the yardstick of the project's tolerance rule.
The forward is differentiable by autograd (the tests take fp64 gradients that way);
``jagged_flash_attention_reference_backward`` writes the same gradients out by hand, per
sequence, for the reference backend of the custom op (autograd cannot run inside an op):

    P = softmax(S),  dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ⊙ (dP − rowsum(dO ⊙ O)),
    dQ = scale · dS K,  dK = scale · dSᵀ Q,  d rel_bias[n, b] = Σ_{(i, j) in bucket b} dS[n, i, j].
"""

import torch


def relative_bias_index(lq: int, lk: int, radius: int, device) -> torch.Tensor:
    """``[Lq, Lk]`` bucket index ``clamp(j − i, −R, R) + R`` of every (query i, key j) pair."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return (j - i).clamp(-radius, radius) + radius


def visible_keys(lq: int, lk: int, *, causal: bool, device) -> torch.Tensor:
    """``[Lq, Lk]`` boolean: may query i see key j (bottom-right causal alignment)."""
    if not causal:
        return torch.ones(lq, lk, dtype=torch.bool, device=device)
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i + (lk - lq)


def _sequence_probs(q_NLH, k_NLH, scale, rel_bias, causal):
    """Probabilities ``[N, Lq, Lk]`` (zero rows where nothing is visible), scores, visibility."""
    lq, lk = q_NLH.shape[1], k_NLH.shape[1]
    scores_NQK = torch.matmul(q_NLH, k_NLH.transpose(1, 2)) * scale
    if rel_bias is not None:
        radius = (rel_bias.shape[1] - 1) // 2
        index_QK = relative_bias_index(lq, lk, radius, q_NLH.device)
        scores_NQK = scores_NQK + rel_bias.to(q_NLH.dtype)[:, index_QK]
    visible_QK = visible_keys(lq, lk, causal=causal, device=q_NLH.device)
    scores_NQK = scores_NQK.masked_fill(~visible_QK, float("-inf"))
    has_key_Q = visible_QK.any(dim=1)
    # Rows that see nothing would softmax to NaN; give them zeros instead.
    safe_NQK = scores_NQK.masked_fill(~has_key_Q[None, :, None], 0.0)
    probs_NQK = torch.softmax(safe_NQK, dim=-1) * has_key_Q[None, :, None]
    return probs_NQK, scores_NQK, has_key_Q


def jagged_flash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    rel_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention per sequence; returns ``(out [Tq, N, H], lse [N, Tq])``.

    ``lse`` is the natural log-sum-exp of each query row's visible scores (``+inf`` for a row that
    sees no key); it is float32 unless the inputs are float64.
    """
    q_bounds = q_offsets.tolist()
    kv_bounds = kv_offsets.tolist()
    num_heads = q.shape[1]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for b in range(len(q_bounds) - 1):
        qs, qe = q_bounds[b], q_bounds[b + 1]
        ks, ke = kv_bounds[b], kv_bounds[b + 1]
        q_NLH = q[qs:qe].transpose(0, 1)
        k_NLH = k[ks:ke].transpose(0, 1)
        v_NLH = v[ks:ke].transpose(0, 1)
        probs_NQK, scores_NQK, has_key_Q = _sequence_probs(q_NLH, k_NLH, scale, rel_bias, causal)
        outs.append(torch.matmul(probs_NQK, v_NLH).transpose(0, 1))
        lse_NQ = torch.logsumexp(scores_NQK.to(lse_dtype), dim=-1)
        lses.append(torch.where(has_key_Q[None, :], lse_NQ, float("inf")))
    if not outs:
        return q.new_zeros(q.shape), torch.zeros(num_heads, 0, dtype=lse_dtype, device=q.device)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def jagged_flash_attention_reference_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    rel_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, d_rel_bias)`` by the formulas of the module docstring, per sequence."""
    q_bounds = q_offsets.tolist()
    kv_bounds = kv_offsets.tolist()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbias = None if rel_bias is None else torch.zeros_like(rel_bias, dtype=q.dtype)
    for b in range(len(q_bounds) - 1):
        qs, qe = q_bounds[b], q_bounds[b + 1]
        ks, ke = kv_bounds[b], kv_bounds[b + 1]
        q_NLH = q[qs:qe].transpose(0, 1)
        k_NLH = k[ks:ke].transpose(0, 1)
        v_NLH = v[ks:ke].transpose(0, 1)
        do_NLH = dout[qs:qe].transpose(0, 1)
        probs_NQK, _, _ = _sequence_probs(q_NLH, k_NLH, scale, rel_bias, causal)
        out_NLH = torch.matmul(probs_NQK, v_NLH)
        dv[ks:ke] = torch.matmul(probs_NQK.transpose(1, 2), do_NLH).transpose(0, 1)
        dp_NQK = torch.matmul(do_NLH, v_NLH.transpose(1, 2))
        delta_NQ1 = (do_NLH * out_NLH).sum(-1, keepdim=True)
        ds_NQK = probs_NQK * (dp_NQK - delta_NQ1)
        dq[qs:qe] = (torch.matmul(ds_NQK, k_NLH) * scale).transpose(0, 1)
        dk[ks:ke] = (torch.matmul(ds_NQK.transpose(1, 2), q_NLH) * scale).transpose(0, 1)
        if dbias is not None:
            radius = (rel_bias.shape[1] - 1) // 2
            index_QK = relative_bias_index(qe - qs, ke - ks, radius, q.device)
            dbias.index_add_(1, index_QK.flatten(), ds_NQK.flatten(1))
    if dbias is not None:
        dbias = dbias.to(rel_bias.dtype)
    return dq, dk, dv, dbias

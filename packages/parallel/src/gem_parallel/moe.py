"""Mixture-of-experts layer with expert parallelism and sync-free all-to-all token dispatch.

Routing: a linear router scores every token against every expert; softmax, then each token picks
its ``top_k`` experts and keeps their probabilities as gate weights. The layer's output is the
gate-weighted sum of the chosen experts' outputs; each expert is a two-matrix SiLU feed-forward
(``silu(x @ w_in) @ w_out``), so an all-zero input row gives an all-zero output row.

Dispatch without a device-to-host sync. The usual all-to-all sends a different number of tokens
to each peer, so every rank must first learn the split sizes on the host (a ``.tolist()`` that
stalls the GPU). Here every (expert, source rank) pair owns a fixed number of *slots*, the
capacity ``C``, so the buffers have static shapes:

1. Each (token, choice) gets a slot: its rank among the assignments to the same expert, in token
   order (a stable sort by expert; see ``_slots``). Assignments with slot >= C are dropped and
   counted in ``MoE.dropped_assignments`` (a device tensor: reading it is the caller's choice,
   never a hidden sync). The capacity is a function of a token count ``N``: with
   ``capacity_factor=None`` it is ``N`` itself, which no expert can exceed (a token picks an
   expert at most once), so nothing is ever dropped; a capacity factor trades that guarantee for
   smaller buffers, ``C = ceil(factor · N · top_k / E)``.

   Which ``N``? The all-to-all needs every rank of the expert-parallel group to use the same
   ``C``, agreed without communication. With ``max_tokens_per_rank=B`` set, ``N = B``: a bound
   every rank shares by construction (a config value), so ranks may pass *different* token
   counts ``T <= B`` (jagged batches) and the buffers still match; a rank passing ``T > B`` gets
   a ``ValueError`` (a shape check on the host, no sync). Without a bound, ``N = T``, the local
   token count: fine on one process, but under expert parallelism every rank of the group must
   then pass the same ``T`` (equal-sized batches). The price of the bound is buffer size and
   expert FLOPs proportional to ``B`` rather than ``T``; a tight bound (or a capacity factor)
   keeps it small. Exchanging the per-expert counts and sizing the buffers from the group's
   maximum would be tighter but needs that maximum on the host, the sync this layer avoids.
2. Tokens are scattered into a zero buffer ``[E, C, d]`` (expert-major, so the slice for the
   ``ep`` ranks is contiguous), exchanged with one ``all_to_all_single`` of equal splits, and the
   received ``[ep, E_local, C, d]`` is regrouped to ``[E_local, ep·C, d]``: one batched matmul per
   expert matrix, empty slots included (they are zeros and cost FLOPs, not correctness).
3. The outputs travel back by the same all-to-all and are gathered from the slots, weighted by
   the gates and summed over the choices.

Gradients: the all-to-all with equal splits is its own transpose, so its backward is the same
all-to-all of the gradients. An expert's weight gradient sums the contributions of every rank of
its ``ep`` group, while data parallelism averages over the other ranks only; the layer scales
the expert weights' gradients by ``1/ep`` so that, after FSDP's average, every parameter carries
the mean gradient over all ranks, as in single-process training on the concatenated batch.

``moe_reference`` is the same computation written as a loop over tokens and choices.

Shape suffixes: ``T`` local tokens, ``k`` choices per token, ``A = T·k`` assignments, ``E``
experts, ``C`` capacity (slots per expert and source rank), ``d`` model width.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoEConfig:
    """An MoE layer's shape and dispatch capacity.

    ``d_model`` tokens' width, ``d_hidden`` each expert's hidden width, ``num_experts`` E,
    ``top_k`` experts per token (≤ E). ``capacity_factor``: slots per expert as a multiple of an
    even share (``ceil(factor · T · top_k / E)``, at most T); None never drops an assignment.
    ``max_tokens_per_rank``: a bound on the tokens any rank passes, shared by the ranks of an
    expert-parallel group, so that they may pass different counts (jagged batches). ``ValueError``
    for a size below 1, ``top_k > num_experts`` or a factor ≤ 0.
    """

    d_model: int
    d_hidden: int
    num_experts: int
    top_k: int = 2
    capacity_factor: float | None = None  # None: no assignment is ever dropped
    # Tokens any rank may pass; the capacity derives from it, so it must be the same on every
    # rank of an expert-parallel group. None: from each call's own token count.
    max_tokens_per_rank: int | None = None

    def __post_init__(self):
        for name in ("d_model", "d_hidden", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {self.capacity_factor}")
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < 1:
            raise ValueError(
                f"max_tokens_per_rank must be >= 1 or None, got {self.max_tokens_per_rank}"
            )

    def dispatch_capacity(self, num_tokens: int) -> int:
        """Slots per (expert, source rank) for a call with ``num_tokens`` tokens: the capacity of
        ``max_tokens_per_rank`` when set (after checking the call stays within it), else of
        ``num_tokens``."""
        bound = self.max_tokens_per_rank
        if bound is None:
            return self.capacity(num_tokens)
        if num_tokens > bound:
            raise ValueError(
                f"MoE input has {num_tokens} tokens but max_tokens_per_rank={bound}; the bound is "
                "shared by every rank of the expert-parallel group and sizes the all-to-all "
                "buffers, so raise max_tokens_per_rank (on every rank) or pass fewer tokens"
            )
        return self.capacity(bound)

    def capacity(self, num_tokens: int) -> int:
        """Slots per expert for ``num_tokens`` tokens (≥ 1): all of them without a factor."""
        if self.capacity_factor is None:
            return max(1, num_tokens)
        return max(
            1,
            min(
                num_tokens,
                math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts),
            ),
        )


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with equal splits along dim 0; backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def _slots(expert_A: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each assignment's rank among the assignments to the same expert, in assignment order.

    A stable sort groups the assignments by expert; an assignment's slot is its position in the
    sorted order minus where its expert's group starts (counts by ``scatter_add``: ``bincount``
    would read its size on the host). O(A log A) time and O(A + E) memory, no host sync.
    """
    A = expert_A.numel()
    sorted_expert_A, order_A = torch.sort(expert_A, stable=True)
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=expert_A.device)
    counts_E.scatter_add_(0, expert_A, torch.ones_like(expert_A))
    starts_E = counts_E.cumsum(0) - counts_E
    position_A = torch.arange(A, device=expert_A.device)
    return torch.empty_like(expert_A).scatter_(0, order_A, position_A - starts_E[sorted_expert_A])


class GroupedExperts(nn.Module):
    """``num_experts`` SiLU feed-forwards stored as two batched weights ``[E, d, h]``, ``[E, h, d]``."""

    def __init__(self, num_experts: int, d_model: int, d_hidden: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(num_experts, d_model, d_hidden) / math.sqrt(d_model))
        self.w_out = nn.Parameter(torch.randn(num_experts, d_hidden, d_model) / math.sqrt(d_hidden))
        self.grad_scale = 1.0

    def forward(self, x_ECd: torch.Tensor) -> torch.Tensor:
        """``silu(x @ w_in) @ w_out`` per expert: ``x [E, C, d_model]`` -> ``[E, C, d_model]``."""
        w_in, w_out = self.w_in, self.w_out
        if self.grad_scale != 1.0:
            w_in, w_out = (
                _ScaleGrad.apply(w_in, self.grad_scale),
                _ScaleGrad.apply(w_out, self.grad_scale),
            )
        return torch.bmm(F.silu(torch.bmm(x_ECd, w_in.to(x_ECd.dtype))), w_out.to(x_ECd.dtype))


class MoE(nn.Module):
    """Top-k mixture of experts with fixed-capacity dispatch (see the module docstring).

    ``MoE(config)`` holds a bias-free router ``[E, d_model]`` and the experts' batched weights;
    ``shard_experts(ep_group)`` (``apply_dense_parallel`` calls it) keeps this rank's ``E / ep``
    experts and dispatches over the group. ``dropped_assignments`` is a device tensor: the
    assignments the last forward dropped for capacity.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.d_model, config.num_experts, bias=False)
        self.experts = GroupedExperts(config.num_experts, config.d_model, config.d_hidden)
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size = 1
        self.dropped_assignments = torch.zeros((), dtype=torch.long)

    @torch.no_grad()
    def shard_experts(self, ep_group: dist.ProcessGroup) -> None:
        """Keep only this rank's ``E / ep`` experts (contiguous block) and dispatch over ``ep_group``."""
        if self.ep_group is not None:
            raise RuntimeError("shard_experts was already called on this MoE")
        ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if self.config.num_experts % ep:
            raise ValueError(
                f"num_experts={self.config.num_experts} is not divisible by the expert-parallel "
                f"group size {ep}"
            )
        local = self.config.num_experts // ep
        block = slice(rank * local, (rank + 1) * local)
        self.experts.w_in = nn.Parameter(self.experts.w_in[block].clone())
        self.experts.w_out = nn.Parameter(self.experts.w_out[block].clone())
        self.experts.grad_scale = 1.0 / ep
        self.ep_group, self.ep_size = ep_group, ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., d_model]`` (any float dtype) -> the same shape: each token's gate-weighted
        sum of its ``top_k`` experts' outputs (dropped assignments contribute zero). Never syncs
        with the host. ``ValueError`` for a wrong last dimension, or more tokens than
        ``max_tokens_per_rank``."""
        shape, cfg = x.shape, self.config
        if shape[-1] != cfg.d_model:
            raise ValueError(
                f"x must have last dimension d_model={cfg.d_model}, got shape {tuple(shape)}"
            )
        x_Td = x.reshape(-1, cfg.d_model)
        T, E, k = x_Td.shape[0], cfg.num_experts, cfg.top_k
        C = cfg.dispatch_capacity(T)

        probs_TE = torch.softmax(self.router(x_Td).float(), dim=-1)
        gate_Tk, expert_Tk = torch.topk(probs_TE, k, dim=-1)
        expert_A = expert_Tk.reshape(-1)  # A = T·k assignments, token-major
        slot_A = _slots(expert_A, E)
        kept_A = slot_A < C
        self.dropped_assignments = (~kept_A).sum()
        trash = E * C  # one spare row takes every dropped assignment
        row_A = torch.where(kept_A, expert_A * C + slot_A, torch.full_like(slot_A, trash))

        token_A = x_Td[:, None, :].expand(T, k, cfg.d_model).reshape(T * k, cfg.d_model)
        buffer = x_Td.new_zeros(E * C + 1, cfg.d_model).index_add(0, row_A, token_A)
        send_ECd = buffer[:trash].view(E, C, cfg.d_model)

        if self.ep_group is None:
            out_ECd = self.experts(send_ECd)
        else:
            ep, local = self.ep_size, E // self.ep_size
            recv = _AllToAll.apply(send_ECd, self.ep_group).view(ep, local, C, cfg.d_model)
            hidden = self.experts(recv.transpose(0, 1).reshape(local, ep * C, cfg.d_model))
            back = hidden.view(local, ep, C, cfg.d_model).transpose(0, 1).reshape(E, C, cfg.d_model)
            out_ECd = _AllToAll.apply(back, self.ep_group)

        rows = torch.cat([out_ECd.reshape(E * C, cfg.d_model), out_ECd.new_zeros(1, cfg.d_model)])
        weighted_A = rows.index_select(0, row_A) * (gate_Tk.reshape(-1, 1) * kept_A[:, None]).to(
            rows.dtype
        )
        return weighted_A.view(T, k, cfg.d_model).sum(1).reshape(shape)


def moe_reference(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    *,
    top_k: int,
    capacity: int | None = None,
) -> torch.Tensor:
    """Readable MoE: loop over tokens and their choices, first come first served per expert."""
    x_Td = x.reshape(-1, x.shape[-1])
    probs = torch.softmax((x_Td @ router_weight.T).float(), dim=-1)
    gates, experts = torch.topk(probs, top_k, dim=-1)
    used = [0] * w_in.shape[0]
    rows = []
    for t in range(x_Td.shape[0]):
        row = torch.zeros_like(x_Td[t])
        for j in range(top_k):
            e = int(experts[t, j])
            if capacity is None or used[e] < capacity:
                y = F.silu(x_Td[t] @ w_in[e]) @ w_out[e]
                row = row + gates[t, j].to(y.dtype) * y
            used[e] += 1
        rows.append(row)
    return torch.stack(rows).reshape(x.shape)

"""Row-wise Adagrad applied inside the embedding lookup's backward: no dense table gradient.

A dense optimizer treats an embedding table like any weight: the backward materialises a
``[num_embeddings, D]`` gradient (zero-filled, then scattered into), and AdamW then reads and
writes the whole table and two moments of its size, although a batch touches a few thousand
of its rows. For gem-small (2.1M rows of 128) that is about 8 GB of memory traffic a step for
what is a sparse update, and three extra table-sized buffers of memory.

``RowwiseAdagrad`` is the optimizer recommendation systems train their tables with (FBGEMM's
``EXACT_ROWWISE_ADAGRAD``, fused into the backward of its table-batched embeddings): one fp32
accumulator per row, and for each row ``r`` the batch touches, with ``g_r`` the sum of the
gradients of every lookup of ``r`` in the batch,

    state[r] += mean(g_r²)
    weight[r] -= lr · g_r / (sqrt(state[r]) + eps)

Rows the batch does not touch are left alone: their state and values do not move.

The update (``rowwise_adagrad_update_``) has fixed shapes, so it needs no host synchronisation
and captures in a CUDA graph. The ``n`` looked-up ids are sorted; a position starting a run of
equal ids opens a segment; ``cumsum`` numbers the segments, so ``U ≤ n`` unique rows land in
slots ``0…U−1`` of ``n``-row buffers (their gradient sums by ``index_add_``, their ids by
``scatter``), and slots ``U…n−1`` stay zero. The state and weight updates are added with
``index_add_``: the unused slots point at row 0 and add exactly zero to it, so they change
nothing whatever order the adds run in. ``rowwise_adagrad_reference`` is the same
update written plainly, for tests.

The update runs when the backward reaches the lookup, before the dense optimizer's step (as
FBGEMM's fused optimizers do), and the table's ``.grad`` stays ``None``: dense optimizers skip
the table, and gradient clipping does not see it. On GPUs the gradient sums use atomics, so
their rounding order, and the last bits of the result, can vary from run to run.
"""

import torch
import torch.nn.functional as F


class RowwiseAdagrad:
    """Settings of the fused row-wise Adagrad; ``lr`` may be changed between steps (schedules)."""

    def __init__(self, *, lr: float = 0.01, eps: float = 1e-8):
        if not lr > 0:
            raise ValueError(f"lr: expected a positive learning rate, got {lr}")
        if not eps > 0:
            raise ValueError(f"eps: expected a positive epsilon, got {eps}")
        self.lr = float(lr)
        self.eps = float(eps)

    def __repr__(self) -> str:
        return f"RowwiseAdagrad(lr={self.lr:g}, eps={self.eps:g})"


@torch.no_grad()
def rowwise_adagrad_update_(
    weight: torch.Tensor, state: torch.Tensor, ids: torch.Tensor, grad_rows: torch.Tensor, *,
    lr: float, eps: float,
) -> None:  # fmt: skip
    """Apply row-wise Adagrad in place to the rows ``ids [n]`` of ``weight [N, D]`` and
    ``state [N]`` (float32; the update is computed in its dtype), given the gradient
    ``grad_rows [n, D]`` of each lookup."""
    n = ids.numel()
    if n == 0:
        return
    sorted_ids, order = torch.sort(ids)
    grads = grad_rows.reshape(n, weight.shape[1])[order].to(state.dtype)
    opens = torch.ones(n, dtype=torch.bool, device=ids.device)
    opens[1:] = sorted_ids[1:] != sorted_ids[:-1]
    segment = torch.cumsum(opens, 0) - 1  # [n]: slot of each lookup's row
    sums = torch.zeros_like(grads).index_add_(0, segment, grads)  # [n, D], slots ≥ U zero
    rows = torch.zeros_like(sorted_ids).scatter_(0, segment, sorted_ids)  # slots ≥ U: row 0
    state.index_add_(0, rows, sums.square().mean(1))
    step = sums.mul_(-lr).div_(state[rows].sqrt().add_(eps)[:, None])
    weight.index_add_(0, rows, step.to(weight.dtype))


@torch.no_grad()
def rowwise_adagrad_reference(
    weight: torch.Tensor, state: torch.Tensor, ids: torch.Tensor, grad_rows: torch.Tensor, *,
    lr: float, eps: float,
) -> None:  # fmt: skip
    """``rowwise_adagrad_update_`` written plainly: one row at a time."""
    grad_rows = grad_rows.reshape(ids.numel(), weight.shape[1]).to(state.dtype)
    for row in torch.unique(ids).tolist():
        g = grad_rows[ids == row].sum(0)
        state[row] += g.square().mean()
        weight[row] -= (lr * g / (state[row].sqrt() + eps)).to(weight.dtype)


class _FusedRowwiseLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)``; the backward updates the looked-up rows in place."""

    @staticmethod
    def forward(ctx, ids, weight, state, optimizer):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.state, ctx.optimizer = weight, state, optimizer
        return F.embedding(ids, weight.detach())

    @staticmethod
    def backward(ctx, grad_rows):
        (ids,) = ctx.saved_tensors
        rowwise_adagrad_update_(
            ctx.weight.data, ctx.state, ids, grad_rows, lr=ctx.optimizer.lr, eps=ctx.optimizer.eps
        )
        return None, None, None, None


def fused_lookup(
    ids: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, optimizer: RowwiseAdagrad
) -> torch.Tensor:
    """Rows ``weight[ids]``, whose backward applies ``optimizer`` to them in place."""
    return _FusedRowwiseLookup.apply(ids, weight, state, optimizer)

"""The ``torch.library`` custom ops behind ``jagged_flash_attention``, and their autograd.

Two ops keep the kernels opaque to ``torch.compile`` while letting it trace through them:

- ``gem_jagged::jagged_flash_attention_fwd`` returns ``(out [Tq, N, H], lse [N, Tq], work)``;
  ``lse`` (natural log-sum-exp of each query row, ``+inf`` for a row that sees no key) is what
  the backward pass needs to rebuild the probabilities without storing them, and ``work`` (the
  Triton forward's query-tile work list, int32 ``[5, W]``; empty for the reference) spares the
  backward building it again.
- ``gem_jagged::jagged_flash_attention_bwd`` returns ``(dq, dk, dv, d_rel_bias)``; without a bias
  the last one is an empty tensor (custom ops cannot return ``None``).

Each op has a fake implementation (shapes only) for tracing, and the forward op's autograd
formula calls the backward op. The ``backend`` argument picks the Triton kernels or the PyTorch
reference; the reference's backward writes the gradient formulas out per sequence.

The eager fast path. Going through a Python custom op costs tens of microseconds of host time
per call, twice per training step (the dispatcher's boxed call, the autograd wrapper, the
compiler's ``disable`` guard), which is a visible share of a small batch's step. So eager calls
of the Triton backend (``eager_triton_attention``) run the same kernels through a plain
``torch.autograd.Function`` when nothing needs to see the op: not while ``torch.compile``
traces (it must see the custom op), not under a ``TorchDispatchMode`` (selective activation
checkpointing, FLOP counters and fake tensors identify the op by name), and only on plain
tensors (a tensor subclass dispatches through the custom op).

Launch plans (``_plan``) serve both: the fast path under the public function's key, and the
custom ops' Triton implementations under a key of their own, since a graph compiled by
``torch.compile`` calls the ops at every step with the same shapes and offsets. Without them
the ops issued a J1 step in about 2 ms of host time against 0.9 ms of kernels, and the compiled
step ran 0.66x FlexAttention (docs/performance.md, 2026-12-02, seventeenth session). The
forward op returns a copy of the work list (the compiler owns the op's outputs; the list is
the cache's), and the backward op leaves that copy out of what a plan keeps.
"""

import torch

from . import _plan
from .reference import jagged_flash_attention_reference, jagged_flash_attention_reference_backward
from .triton import RecordedBackward, forward_work_slots, jfa_backward, jfa_forward


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("gem_jagged::jagged_flash_attention_fwd", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    rel_bias: torch.Tensor | None,
    causal: bool,
    scale: float,
    max_q_len: int | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "triton":
        key = _op_plan_key(q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len)
        out, lse, work = eager_forward(
            q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale,
            plan=_plan.lookup(key, q_offsets, kv_offsets), plan_key=key,
        )  # fmt: skip
        return out, lse, work.clone()  # the compiler owns what the op returns, not the cache
    with torch.no_grad():
        out, lse = jagged_flash_attention_reference(
            q, k, v, q_offsets, kv_offsets, causal=causal, scale=scale, rel_bias=rel_bias
        )
    work = torch.empty(5, 0, dtype=torch.int32, device=q.device)
    return out.contiguous(), lse.contiguous(), work


@attention_forward.register_fake
def _(q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len, backend):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))
    slots = 0
    if backend == "triton":
        slots = forward_work_slots(q, k, q_offsets, rel_bias=rel_bias is not None)
    return out, lse, q.new_empty((5, slots), dtype=torch.int32)


@torch.library.custom_op("gem_jagged::jagged_flash_attention_bwd", mutates_args=())
def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    work: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    rel_bias: torch.Tensor | None,
    causal: bool,
    scale: float,
    max_q_len: int | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "triton":
        key = _op_plan_key(q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len)
        # A plan keeps the lists its launches read: the cache's, never the op's output ``work``
        # (a compiler may reuse the memory of a saved tensor once the backward is done).
        dq, dk, dv, dbias = planned_backward(
            key, dout, q, k, v, out, lse, work if key is None else None, q_offsets, kv_offsets,
            rel_bias, causal, scale, max_q_len,
        )  # fmt: skip
    else:
        dq, dk, dv, dbias = jagged_flash_attention_reference_backward(
            dout, q, k, v, q_offsets, kv_offsets, causal=causal, scale=scale, rel_bias=rel_bias
        )
    if dbias is None:
        dbias = q.new_empty(0)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias.contiguous()


@attention_backward.register_fake
def _(
    dout, q, k, v, out, lse, work, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len,
    backend,
):  # fmt: skip
    dbias = q.new_empty(0) if rel_bias is None else torch.empty_like(rel_bias)
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
        dbias,
    )


def _op_plan_key(q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len):
    """The launch-plan key of a call of the custom ops (``_plan.key_of``), apart from the
    public function's keys: a compiled graph calls the ops, and its step is as host-bound as
    an eager one."""
    return _plan.key_of(
        q, k, v, q_offsets, kv_offsets, causal=causal, scale=scale, rel_bias=rel_bias,
        hints=(max_q_len, "custom op"), backend="triton",
    )  # fmt: skip


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len, backend = inputs
    out, lse, work = output
    ctx.mark_non_differentiable(lse, work)
    ctx.save_for_backward(q, k, v, out, lse, work, q_offsets, kv_offsets, rel_bias)
    ctx.options = (causal, scale, max_q_len, backend)


def _backward(ctx, dout, _dlse, _dwork):
    q, k, v, out, lse, work, q_offsets, kv_offsets, rel_bias = ctx.saved_tensors
    causal, scale, max_q_len, backend = ctx.options
    dq, dk, dv, dbias = attention_backward(
        dout, q, k, v, out, lse, work, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len,
        backend,
    )  # fmt: skip
    return dq, dk, dv, None, None, (dbias if rel_bias is not None else None), None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Eager fast path (Triton backend, no tracing or dispatch mode): the same kernels, less host work
# ----------------------------------------------------------------------------------------------


def eager_path_allowed(*tensors: torch.Tensor | None) -> bool:
    """True when nothing would observe the custom op (see the module docstring)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len, plan, plan_key
    ):
        ctx.descriptors = {}  # the forward's TMA descriptors, for the backward's launches
        out, lse, work = eager_forward(
            q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, plan=plan,
            plan_key=plan_key, descriptors=ctx.descriptors,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, work, q_offsets, kv_offsets, rel_bias)
        ctx.options = (causal, scale, max_q_len)
        ctx.plan_key = plan_key
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, work, q_offsets, kv_offsets, rel_bias = ctx.saved_tensors
        dq, dk, dv, dbias = planned_backward(
            ctx.plan_key, dout, q, k, v, out, lse, work, q_offsets, kv_offsets, rel_bias,
            *ctx.options, descriptors=ctx.descriptors,
        )  # fmt: skip
        return dq, dk, dv, None, None, dbias, None, None, None, None, None


def planned_backward(
    key, dout, q, k, v, out, lse, work, q_offsets, kv_offsets, rel_bias, causal, scale,
    max_q_len, *, descriptors=None,
):  # fmt: skip
    """``jfa_backward``'s ``(dq, dk, dv, d_rel_bias)``: through the backward plan of ``key``
    (``_plan.BackwardPlan``) when there is one and it launches; otherwise the ordinary way,
    recording a plan under ``key`` (if not None) when its launches allow one."""
    plan = _plan.backward_plan(key, q_offsets, kv_offsets)
    if plan is not None:
        grads = plan.backward(dout, q, k, v, out, lse, q_offsets, kv_offsets)
        if grads is not None:
            return *grads, None
    record = None if key is None else RecordedBackward()
    grads = jfa_backward(
        dout, q, k, v, out, lse, q_offsets, kv_offsets, causal=causal, scale=scale,
        rel_bias=rel_bias, max_q_len=max_q_len, forward_work=work, descriptors=descriptors,
        record=record,
    )  # fmt: skip
    if record is not None:
        _plan.remember_backward(key, record, q, k, v, out, lse, q_offsets, kv_offsets)
    return grads


def eager_forward(
    q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, *, plan, plan_key, descriptors=None
):  # fmt: skip
    """``(out, lse, work)``: through ``plan`` (``_plan.ForwardPlan``) when one is given and it
    launches; otherwise through ``jfa_forward``, recording a plan under ``plan_key`` (if not
    None) when its launch allows one."""
    if plan is not None:
        result = plan.forward(q, k, v)
        if result is not None:
            return result
    recorded = [] if plan_key is not None else None
    out, lse, work = jfa_forward(
        q, k, v, q_offsets, kv_offsets, causal=causal, scale=scale, rel_bias=rel_bias,
        descriptors=descriptors, record=recorded,
    )  # fmt: skip
    if recorded:
        _plan.remember(
            plan_key, recorded[0], out, lse, work, q_offsets, kv_offsets, causal=causal,
            scale=scale,
        )  # fmt: skip
    return out, lse, work


def eager_triton_attention(
    q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len, *, plan=None,
    plan_key=None,
):  # fmt: skip
    """The Triton forward (with autograd when a gradient is wanted) without the custom op;
    ``plan`` and ``plan_key`` as ``eager_forward`` takes them."""
    inputs = (q, k, v) if rel_bias is None else (q, k, v, rel_bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _TritonAttention.apply(
            q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len, plan, plan_key
        )
    return eager_forward(
        q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, plan=plan, plan_key=plan_key
    )[0]

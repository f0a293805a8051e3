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
formula calls the backward op. The ops take the offsets that a ``JaggedBatch`` owns (its private
copies) and the batch's length hint, and rebuild a batch over them for the launchers.

Both ops take the kernel config as ``config: int[]?``: a ``JaggedAttentionConfig`` written by
``as_ints`` (a custom op cannot take a dataclass), or None, where the implementation, the fake
and the backward each pick ``config_for_inputs`` from the same host-known shapes (so their work
lists agree).

Eager calls of the Triton backend take ``_TritonAttention``, a plain ``torch.autograd.Function``
over the same launchers, where ``gem_jagged._dispatch`` allows it: it keeps the caller's
``JaggedBatch`` (so its work lists serve every layer and the backward) and the forward's TMA
descriptors for the backward's launches.
"""

import torch

from gem_jagged._flops import attention_pairs, register_attention_formulas
from gem_jagged.batch import JaggedBatch

from .config import JaggedAttentionConfig, config_for_inputs
from .reference import jagged_flash_attention_reference, jagged_flash_attention_reference_backward


def _kernels():
    """The Triton launchers, imported on first use: the reference backend runs without triton."""
    from . import triton

    return triton


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _config(config_ints, q, k, q_offsets, rel_bias) -> JaggedAttentionConfig:
    """The config the custom op was given (``as_ints``), or the one ``config_for`` picks."""
    if config_ints is not None:
        return JaggedAttentionConfig.from_ints(list(config_ints))
    return config_for_inputs(q, k, q_offsets, rel_bias=rel_bias is not None)


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
    config: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "triton":
        batch = JaggedBatch.of_owned(q_offsets, kv_offsets, max_len=max_q_len)
        cfg = _config(config, q, k, q_offsets, rel_bias)
        return _kernels().jfa_forward(
            q, k, v, batch, causal=causal, scale=scale, rel_bias=rel_bias, config=cfg
        )
    with torch.no_grad():
        out, lse = jagged_flash_attention_reference(
            q, k, v, q_offsets, kv_offsets, causal=causal, scale=scale, rel_bias=rel_bias
        )
    work = torch.empty(5, 0, dtype=torch.int32, device=q.device)
    return out.contiguous(), lse.contiguous(), work


@attention_forward.register_fake
def _(q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len, backend, config=None):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))
    slots = 0
    if backend == "triton":
        cfg = _config(config, q, k, q_offsets, rel_bias)
        slots = _kernels().forward_work_slots(q, q_offsets, config=cfg)
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
    config: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "triton":
        batch = JaggedBatch.of_owned(q_offsets, kv_offsets, max_len=max_q_len)
        dq, dk, dv, dbias = _kernels().jfa_backward(
            dout, q, k, v, out, lse, batch, causal=causal, scale=scale, rel_bias=rel_bias,
            config=_config(config, q, k, q_offsets, rel_bias), forward_work=work,
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
    backend, config=None,
):  # fmt: skip
    dbias = q.new_empty(0) if rel_bias is None else torch.empty_like(rel_bias)
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
        dbias,
    )


def _setup_context(ctx, inputs, output):
    q, k, v, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len, backend, *config = inputs
    out, lse, work = output
    ctx.mark_non_differentiable(lse, work)
    ctx.save_for_backward(q, k, v, out, lse, work, q_offsets, kv_offsets, rel_bias)
    ctx.options = (causal, scale, max_q_len, backend, config[0] if config else None)


def _backward(ctx, dout, _dlse, _dwork):
    q, k, v, out, lse, work, q_offsets, kv_offsets, rel_bias = ctx.saved_tensors
    causal, scale, max_q_len, backend, config = ctx.options
    dq, dk, dv, dbias = attention_backward(
        dout, q, k, v, out, lse, work, q_offsets, kv_offsets, rel_bias, causal, scale, max_q_len,
        backend, config,
    )  # fmt: skip
    dbias = dbias if rel_bias is not None else None
    return dq, dk, dv, None, None, dbias, None, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def _pairs(q, k, q_offsets, kv_offsets, causal):
    pairs = attention_pairs(
        q_offsets, kv_offsets, causal=causal, total_q=q.shape[0], total_kv=k.shape[0]
    )
    return pairs, q.shape[1], q.shape[2]


register_attention_formulas(
    torch.ops.gem_jagged.jagged_flash_attention_fwd,
    torch.ops.gem_jagged.jagged_flash_attention_bwd,
    forward_pairs=lambda q, k, v, q_off, kv_off, rel_bias, causal, *_: _pairs(
        q, k, q_off, kv_off, causal
    ),
    backward_pairs=lambda dout, q, k, v, out, lse, work, q_off, kv_off, rel_bias, causal, *_: (
        _pairs(q, k, q_off, kv_off, causal)
    ),
)


class _TritonAttention(torch.autograd.Function):
    """The Triton launchers behind autograd, without the custom op (``gem_jagged._dispatch``)."""

    @staticmethod
    def forward(ctx, q, k, v, rel_bias, batch, causal, scale, config):
        ctx.descriptors = {}  # the forward's TMA descriptors, for the backward's launches
        out, lse, work = _kernels().jfa_forward(
            q, k, v, batch, causal=causal, scale=scale, rel_bias=rel_bias, config=config,
            descriptors=ctx.descriptors,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, work, rel_bias)
        ctx.batch, ctx.options = batch, (causal, scale, config)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, work, rel_bias = ctx.saved_tensors
        causal, scale, config = ctx.options
        dq, dk, dv, dbias = _kernels().jfa_backward(
            dout, q, k, v, out, lse, ctx.batch, causal=causal, scale=scale, rel_bias=rel_bias,
            config=config, forward_work=work, descriptors=ctx.descriptors,
        )  # fmt: skip
        return dq, dk, dv, dbias, None, None, None, None


def eager_triton_attention(q, k, v, batch, rel_bias, *, causal, scale, config=None):
    """The Triton forward (with autograd when a gradient is wanted) without the custom op;
    ``config`` None: ``config_for_inputs`` picks."""
    if config is None:
        config = config_for_inputs(q, k, batch.offsets, rel_bias=rel_bias is not None)
    inputs = (q, k, v) if rel_bias is None else (q, k, v, rel_bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _TritonAttention.apply(q, k, v, rel_bias, batch, causal, scale, config)
    return _kernels().jfa_forward(
        q, k, v, batch, causal=causal, scale=scale, rel_bias=rel_bias, config=config
    )[0]

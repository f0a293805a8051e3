"""The SwiGLU gate in one pass: ``h = silu(a) ⊙ b`` from ``u = [a | b]``, and its gradient.

A SwiGLU feed-forward computes ``a`` and ``b`` with one linear of twice the hidden width (``u =
x W13ᵀ``, ``[T, 2F]``: one GEMM, and under a low-precision recipe one quantization of ``x``),
then gates. As separate PyTorch ops the gate is two elementwise kernels forward (``silu``, then
the product, with ``silu(a)`` written out and read back) and four backward, and autograd keeps
``silu(a)`` as well as ``a`` and ``b``: at 53K tokens × 2816 each tensor is 300 MB, and a block
moves about 3.8 GB through memory for the gate alone. Fused, the forward reads ``a, b`` and
writes ``h`` (0.9 GB); the backward reads ``dh, a, b`` and writes ``da, db`` (1.5 GB),
recomputing ``silu`` on the fly; only ``u`` is saved.

With ``σ = sigmoid(a)``:

    h  = a σ b
    da = dh · b · σ (1 + a (1 − σ))
    db = dh · a σ

The kernels compute in float32 and round once to the inputs' dtype (the unfused ops round
``silu(a)`` before the product). ``reference.py`` holds the formula in PyTorch and the backward
formula; ``triton.py`` the kernels; ``_op.py`` the custom op.
"""

import torch
from gem_lowprec._checks import Backend, check_backend, resolve_backend
from gem_lowprec.ops.swiglu._op import swiglu_backward_op, swiglu_op
from gem_lowprec.ops.swiglu.reference import swiglu_backward_reference, swiglu_reference

__all__ = [
    "swiglu",
    "swiglu_backward_op",
    "swiglu_backward_reference",
    "swiglu_op",
    "swiglu_reference",
]


def _check(u: torch.Tensor) -> None:
    if u.dim() != 2 or u.shape[1] % 2:
        raise ValueError(f"u: expected [T, 2F] (an even last dim), got {tuple(u.shape)}")
    if not u.is_floating_point():
        raise ValueError(f"u: expected a floating dtype, got {u.dtype}")


def swiglu(u: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """``silu(u[..., :F]) * u[..., F:]``, fused forward and backward (one pass each way).

    Args:
        u: ``[..., 2F]`` of a floating dtype (float32, float16, bfloat16 on the Triton backend;
            any float dtype on the reference); leading dims are flattened and restored.
        backend: ``"auto"`` (Triton on CUDA tensors, the reference on CPU tensors),
            ``"triton"`` or ``"reference"``. Gradients flow to ``u`` on either.

    Returns:
        ``h [..., F]`` in u's dtype.

    Raises:
        ValueError: an odd last dim, a non-floating dtype, or an unknown backend.
    """
    check_backend(backend)
    lead = u.shape[:-1]
    u2 = u.reshape(-1, u.shape[-1])
    _check(u2)
    h = swiglu_op(u2, resolve_backend(backend, u.device))
    return h.reshape(*lead, u.shape[-1] // 2)

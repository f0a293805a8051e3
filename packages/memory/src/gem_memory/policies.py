"""The four things a region can do with its activations, and how each is applied to a module.

- ``keep``: nothing changes; autograd saves what each op needs.
- ``selective``: non-reentrant ``torch.utils.checkpoint`` with a selective-checkpoint policy
  (``create_selective_checkpoint_contexts``): the outputs of matmuls, convolutions and attention
  kernels are saved, everything else (norms, activations, residual adds, reshapes) is recomputed
  in the backward. Recompute costs little time (pointwise ops are memory-bound and cheap next to
  the matmuls) and frees the large pointwise intermediates such as the MLP's activated hidden.
- ``full``: non-reentrant checkpoint of the whole region: only its inputs are saved and the
  forward runs again in the backward.
- ``quantized``: no recompute; the saved tensors are kept in FP8 or MX
  (``gem_memory.quantized_activations``) and restored in the backward. Under ``torch.compile``
  such a region runs eagerly (the compiler is told to skip it); the others stay compiled.

A policy is applied by replacing the module's ``forward`` with a wrapper (the module's class,
parameters and state-dict keys are untouched); ``torch.compile`` traces through the wrapper, and
non-reentrant checkpoint with selective policies is supported by its partitioner.
"""

import functools

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .quantize import QuantizedConfig, saved_tensor_packing

__all__ = ["POLICIES", "RECOMPUTE_POLICIES", "wrap_forward", "set_policy", "original_forward"]

POLICIES = ("keep", "selective", "full", "quantized")
RECOMPUTE_POLICIES = ("keep", "selective", "full")

_ATTR = "_gem_memory_original_forward"

# Outputs of these ops are saved under ``selective``: the expensive ones to recompute.
_SAVED_OPS = {
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(torch.ops.aten, name)
}
# Custom ops of these namespaces are attention kernels (gem_jagged's), saved like SDPA.
_SAVED_NAMESPACES = ("gem_jagged",)


def _save_matmul_and_attention(ctx, op, *args, **kwargs):
    namespace = getattr(op, "namespace", "")
    if op in _SAVED_OPS or namespace in _SAVED_NAMESPACES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_selective_context = functools.partial(
    create_selective_checkpoint_contexts, _save_matmul_and_attention
)


def wrap_forward(forward, policy: str, quantized: QuantizedConfig | None = None):
    """``forward`` run under ``policy`` (a function with the same signature)."""
    if policy == "keep":
        return forward
    if policy == "full":

        def full_forward(*args, **kwargs):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

        return functools.wraps(forward)(full_forward)
    if policy == "selective":

        def selective_forward(*args, **kwargs):
            return checkpoint(
                forward, *args, use_reentrant=False, context_fn=_selective_context, **kwargs
            )

        return functools.wraps(forward)(selective_forward)
    if policy == "quantized":
        config = quantized or QuantizedConfig()

        # The pack hook keeps Python state (which storages were packed), which torch.compile
        # cannot trace: under compile a quantized region runs eagerly, the rest stays compiled.
        def quantized_forward(*args, **kwargs):
            with saved_tensor_packing(config):
                return forward(*args, **kwargs)

        return torch.compiler.disable(functools.wraps(forward)(quantized_forward))
    raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")


def original_forward(module: torch.nn.Module):
    """The module's forward before any policy was set on it."""
    saved = module.__dict__.get(_ATTR)
    return saved[1] if saved is not None else module.forward


def set_policy(
    module: torch.nn.Module,
    policy: str,
    quantized: QuantizedConfig | None = None,
    *,
    compile=None,
):
    """Run ``module`` under ``policy`` from now on.

    ``compile``: ``None``, or a function such as ``torch.compile`` applied to the policy's forward
    (compiling the forward, not the module's ``__call__``, keeps module hooks outside the graph and
    the checkpoint inside it); ``quantized`` regions are never compiled. ``keep`` without
    ``compile`` restores the original forward.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    if policy == "keep" and compile is None and _ATTR not in module.__dict__:
        return
    if _ATTR not in module.__dict__:
        module.__dict__[_ATTR] = ("forward" in module.__dict__, module.forward)
    had_own_forward, forward = module.__dict__[_ATTR]
    if policy == "keep" and compile is None:
        del module.__dict__[_ATTR]
        if had_own_forward:
            module.forward = forward
        else:
            del module.forward
        return
    wrapped = wrap_forward(forward, policy, quantized)
    # A quantized region stays eager: its hooks hold Python state that cannot be traced.
    module.forward = compile(wrapped) if compile is not None and policy != "quantized" else wrapped

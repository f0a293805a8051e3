"""When an op may bypass its ``torch.library`` custom op: one rule for every op of the package.

Each op is a custom op (a fake implementation, registered autograd), which is what
``torch.compile`` traces, what selective activation checkpointing sees to decide save or
recompute, and what ``FlopCounterMode`` counts. Going through a Python custom op also costs tens
of microseconds of host time per call (schema binding, the autograd and backend redispatch, the
compiler's ``disable`` guard), twice per training step; an eager call of a short attention is
host-bound on that. So an eager call runs the same launchers through a plain
``torch.autograd.Function`` instead, but only when nothing could observe the difference:

- not while ``torch.compile`` traces (it must see the custom op);
- not under any ``TorchDispatchMode`` (selective checkpointing, FLOP counters, fake tensors and
  debug modes identify ops by name at dispatch);
- only for plain tensors and ``nn.Parameter``s (a model's learned bias is one; any other tensor
  subclass dispatches through the custom op).
"""

import torch

__all__ = ["custom_op_required"]

# ``nn.Parameter`` is a subclass in name only: it dispatches as a plain tensor.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def custom_op_required(*tensors: torch.Tensor | None) -> bool:
    """True when the call must go through the op's custom op (the module docstring's rule)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return True
    return any(t is not None and type(t) not in _PLAIN_TYPES for t in tensors)

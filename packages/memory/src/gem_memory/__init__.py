"""gem_memory: AutoAC, activation checkpointing with a memory budget per region.

Big local batches of jagged sequences need more activation memory than a GPU has. PyTorch offers
one global knob per compiled graph (``torch._functorch.config.activation_memory_budget``, a ratio)
and manual selective checkpointing. AutoAC instead gives each region (a repeated block, a head)
its own policy, chosen so that memory goes where keeping activations saves the most recompute:

    plan = gem_memory.plan_checkpointing(model, batch, budget_bytes=60 * 2**30)
    print(plan)            # one row per region: policy, bytes kept, recompute cost
    plan.apply(model)      # in place; works under torch.compile

A region's policy is one of ``keep``, ``selective`` (save matmul and attention outputs, recompute
the pointwise ops), ``full`` (recompute the region) and ``quantized`` (keep saved tensors in FP8 or
MX). ``quantized_activations(fmt)`` is the context manager behind the last one, usable alone.

Modules: ``meter`` (how peak memory is measured), ``quantize`` and ``mxfp4`` (packing saved
tensors), ``policies`` (applying a policy to a module), ``regions`` (which modules are regions),
``timeline`` (region edges in one step), ``profile`` (measuring regions), ``solver`` (the exact
dynamic program), ``plan`` (the public entry point).
"""

from importlib.metadata import PackageNotFoundError, version

from .meter import measure_peak
from .plan import CheckpointPlan, plan_checkpointing
from .policies import POLICIES, set_policy
from .profile import ModelProfile, profile_model
from .quantize import FORMATS, PackingStats, QuantizedConfig, quantized_activations
from .regions import default_regions

try:
    __version__ = version("gem-memory")
except PackageNotFoundError:  # the source tree on PYTHONPATH (the GPU image), not installed
    __version__ = "0.1.0"

__all__ = [
    "CheckpointPlan",
    "FORMATS",
    "ModelProfile",
    "POLICIES",
    "PackingStats",
    "QuantizedConfig",
    "default_regions",
    "measure_peak",
    "plan_checkpointing",
    "profile_model",
    "quantized_activations",
    "set_policy",
]

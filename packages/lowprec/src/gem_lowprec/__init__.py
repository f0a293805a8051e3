"""gem_lowprec: MX / FP8 formats, near-bandwidth quantize kernels, the fused dense kernels (a
SwiGLU gate), a low-precision linear and FP8 all-gather for FSDP2.

- ``to_mx`` / ``to_mx_2d`` / ``to_mx_rowcol`` -> ``MXTensor``: OCP microscaling with E8M0 scales,
  bit-exact between the integer reference (CPU) and the Triton kernels (GPU); ``codec`` holds
  the bit-level rules once.
- ``quantize_mx_k128`` / ``quantize_mx_k128_rowcol``: MX merged into the 1×128 blocks of
  Hopper's blockwise fp8 GEMM.
- ``rmsnorm_to_mx``: RMSNorm fused with 1×32 MX quantization.
- ``swiglu``: the SwiGLU gate ``silu(a) ⊙ b`` in one pass each way.
- ``LowPrecisionLinear`` and ``convert(model, recipe, skip=...)`` with the recipes ``mxfp8``,
  ``fp8_rowwise`` and ``bf16``; ``Fp8Decisions`` holds which shapes fall back to BF16, from an
  ``Fp8Table`` made once and broadcast (``plan_fp8`` / ``restore_fp8`` / ``fp8_state``: every
  rank chooses the same) or timed in the process.
- ``hadamard``: seeded random Hadamard transform; ``fsdp``: the FP8 all-gather weight for FSDP2.

Modules load on first use, so ``import gem_lowprec`` does not import triton.
"""

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("gem-lowprec")
except PackageNotFoundError:  # the source tree on PYTHONPATH (the GPU image), not installed
    __version__ = "0.1.0"

# Type checkers read these imports; at run time ``__getattr__`` below imports on first use.
if TYPE_CHECKING:
    from gem_lowprec.conversion import convert
    from gem_lowprec.fallback import Fp8Decisions
    from gem_lowprec.fp8_plan import fp8_state, plan_fp8, restore_fp8
    from gem_lowprec.fp8_table import Fp8Table
    from gem_lowprec.linear import LowPrecisionLinear
    from gem_lowprec.mx_tensor import MXLayout, MXTensor
    from gem_lowprec.ops.mx_quantize import (
        quantize_mx_k128,
        quantize_mx_k128_rowcol,
        to_mx,
        to_mx_2d,
        to_mx_rowcol,
    )
    from gem_lowprec.ops.rmsnorm_mx import rmsnorm_to_mx
    from gem_lowprec.ops.swiglu import swiglu
    from gem_lowprec.recipes import Recipe, recipe

_EXPORTS = {
    "MXTensor": "gem_lowprec.mx_tensor",
    "MXLayout": "gem_lowprec.mx_tensor",
    "to_mx": "gem_lowprec.ops.mx_quantize",
    "to_mx_2d": "gem_lowprec.ops.mx_quantize",
    "to_mx_rowcol": "gem_lowprec.ops.mx_quantize",
    "quantize_mx_k128": "gem_lowprec.ops.mx_quantize",
    "quantize_mx_k128_rowcol": "gem_lowprec.ops.mx_quantize",
    "rmsnorm_to_mx": "gem_lowprec.ops.rmsnorm_mx",
    "swiglu": "gem_lowprec.ops.swiglu",
    "LowPrecisionLinear": "gem_lowprec.linear",
    "Fp8Decisions": "gem_lowprec.fallback",
    "Fp8Table": "gem_lowprec.fp8_table",
    "plan_fp8": "gem_lowprec.fp8_plan",
    "restore_fp8": "gem_lowprec.fp8_plan",
    "fp8_state": "gem_lowprec.fp8_plan",
    "convert": "gem_lowprec.conversion",
    "Recipe": "gem_lowprec.recipes",
    "recipe": "gem_lowprec.recipes",
}

__all__ = [
    "MXTensor",
    "MXLayout",
    "to_mx",
    "to_mx_2d",
    "to_mx_rowcol",
    "quantize_mx_k128",
    "quantize_mx_k128_rowcol",
    "rmsnorm_to_mx",
    "swiglu",
    "LowPrecisionLinear",
    "Fp8Decisions",
    "Fp8Table",
    "plan_fp8",
    "restore_fp8",
    "fp8_state",
    "convert",
    "Recipe",
    "recipe",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gem_lowprec' has no attribute {name!r}")

"""Low-precision training recipes as config dataclasses, one concern each.

A ``Recipe`` says how a ``LowPrecisionLinear`` computes its three GEMMs (forward ``y = x Wᵀ``,
input-gradient ``dx = dy W``, weight-gradient ``dW = dyᵀ x``):

- ``mxfp8``: MX data (E8M0 scale per 32 along K). On Hopper, which has no MX matmul, four adjacent
  scales along K are merged into one 1×128 block by shifting the smaller blocks' fp8 values down
  whole binades, and the product runs as a 1×128 blockwise fp8 GEMM (``torch._scaled_mm``); on
  the CPU the same merged operands are multiplied in float32 (an emulation with the same math).
- ``fp8_rowwise``: one power-of-two float32 scale per row of each operand (as torchao's rowwise
  recipe rounds them), ``torch._scaled_mm`` rowwise (Hopper's fastest fp8 path). An fp8
  weight-gradient folds the per-token scale of one operand into the other (``linear.py``).
- ``bf16``: no quantization (``F.linear``).

Forward and input-gradient run in fp8; the weight-gradient runs in BF16 by default
(``weight_grad="bf16"``) or fp8 (``"fp8"``, optionally with a random Hadamard transform along the
token dim, ``WeightGradConfig.hadamard_block``). ``FallbackConfig`` decides per shape whether the
low-precision path is used at all: shapes the fp8 kernels cannot take, and on a GPU shapes where a
one-time measurement (per recipe, K, N, dtype and token count rounded up to a power of two) does
not find the fp8 path ``min_speedup`` times faster than BF16, run in BF16 and say so.
"""

from dataclasses import dataclass, field, replace
from typing import Literal

import torch

RecipeName = Literal["mxfp8", "fp8_rowwise", "bf16"]
RECIPES = ("mxfp8", "fp8_rowwise", "bf16")


@dataclass(frozen=True)
class QuantConfig:
    """The fp8 element formats of the operands and the MX scale rule."""

    elem_dtype: torch.dtype = torch.float8_e4m3fn  # forward operands
    grad_elem_dtype: torch.dtype = torch.float8_e4m3fn  # the output gradient
    scale_mode: Literal["rceil", "floor"] = "rceil"  # MX scale rule (mxfp8 only)


@dataclass(frozen=True)
class WeightGradConfig:
    """The weight-gradient's precision, and the optional Hadamard rotation before fp8."""

    precision: Literal["bf16", "fp8"] = "bf16"
    hadamard_block: int | None = None  # random Hadamard along tokens before fp8 quantization


@dataclass(frozen=True)
class FallbackConfig:
    """When a shape falls back to BF16 (``gem_lowprec.fallback``).

    Raises:
        ValueError: ``min_speedup`` below 1.
    """

    measure_on_gpu: bool = True  # time fp8 vs BF16 fwd+bwd once per (K, N, M bucket), keep faster
    warn: bool = True  # warn once per shape that falls back
    # fp8 is kept only when its median time (three interleaved rounds) beats BF16's by this
    # factor: a tie goes to BF16, which is never slower than itself
    min_speedup: float = 1.02

    def __post_init__(self):
        if not self.min_speedup >= 1.0:
            raise ValueError(f"min_speedup must be a number >= 1.0, got {self.min_speedup!r}")


@dataclass(frozen=True)
class Recipe:
    """A low-precision recipe: its name and one config per concern.

    Raises:
        ValueError: an unknown name or weight-gradient precision, or a Hadamard block that is
            not a power of two in [16, 256].
    """

    name: RecipeName = "mxfp8"
    quant: QuantConfig = field(default_factory=QuantConfig)
    weight_grad: WeightGradConfig = field(default_factory=WeightGradConfig)
    fallback: FallbackConfig = field(default_factory=FallbackConfig)

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"recipe name must be one of {RECIPES}, got {self.name!r}")
        if self.weight_grad.precision not in ("bf16", "fp8"):
            raise ValueError(
                f"weight_grad.precision must be 'bf16' or 'fp8', got {self.weight_grad.precision!r}"
            )
        block = self.weight_grad.hadamard_block
        if block is not None and (block < 16 or block > 256 or block & (block - 1)):
            raise ValueError(
                f"weight_grad.hadamard_block must be a power of two in [16, 256], got {block}"
            )


def recipe(
    name: RecipeName,
    *,
    weight_grad: Literal["bf16", "fp8"] = "bf16",
    hadamard_block: int | None = None,
    **quant,
) -> Recipe:
    """Shorthand for a ``Recipe`` with the default fallback: ``recipe("mxfp8",
    weight_grad="fp8")``.

    Args:
        name: ``"mxfp8"``, ``"fp8_rowwise"`` or ``"bf16"``.
        weight_grad: the weight-gradient's precision.
        hadamard_block: a random Hadamard transform along tokens before an fp8 weight-gradient
            (a power of two in [16, 256]), or None.
        **quant: ``QuantConfig`` fields (``elem_dtype``, ``grad_elem_dtype``, ``scale_mode``).

    Raises:
        ValueError: as for ``Recipe``; TypeError: an unknown ``QuantConfig`` field.
    """
    return Recipe(
        name=name,
        quant=replace(QuantConfig(), **quant),
        weight_grad=WeightGradConfig(precision=weight_grad, hadamard_block=hadamard_block),
    )

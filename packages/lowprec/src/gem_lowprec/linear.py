"""``LowPrecisionLinear``: a drop-in ``nn.Linear`` whose GEMMs run in fp8 per a ``Recipe``.

The forward ``y = x Wᵀ`` and the input-gradient run in fp8; the weight-gradient in BF16 by
default or in fp8 (``_linear_fp8.py`` has how each recipe quantizes each of the three GEMMs).
Each call first asks the module's ``Fp8Decisions`` (``fallback.py``) whether its shape runs fp8
at all: a shape the fp8 kernels cannot take, or, on a GPU, one where fp8 is measured no faster
than BF16, runs ``F.linear`` instead and says so once. A checkpoint recomputation repeats the
choice its own forward made, so the saved tensors of both passes match.

``measure_pending(model)`` and ``fallback_report(model)`` reach the decisions of every
low-precision linear in a model; ``use_decisions(model, decisions)`` gives them all one
(``gem_lowprec.fp8_plan`` builds a table-mode one, the same on every rank).
"""

import torch
import torch.nn.functional as F
from torch import nn

from gem_lowprec._linear_fp8 import UnitScales, fp8_linear
from gem_lowprec.fallback import Fp8Decisions
from gem_lowprec.recipes import Recipe

__all__ = [
    "LowPrecisionLinear",
    "decisions_of",
    "fallback_report",
    "measure_pending",
    "use_decisions",
]

_CHOICES_KEPT = 64  # token counts whose last choice a module remembers for recomputation


class LowPrecisionLinear(nn.Linear):
    """``nn.Linear`` with fp8 GEMMs per ``recipe`` (same parameters, same state dict).

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        recipe: how the GEMMs are quantized (default ``Recipe()``: mxfp8, BF16 weight-gradient,
            measured fallback).
        decisions: the ``Fp8Decisions`` to consult and record in; linears sharing one time each
            shape once. Default: a new one for this module.

    Inputs ``x [..., in_features]`` of any float dtype; under autocast the input is cast to the
    autocast dtype first and the output has it, as for ``nn.Linear``. The fp8 path needs (rows
    of x) M % 16 == 0 and K, N multiples of 128 (mxfp8) or 16 (fp8_rowwise); other shapes run
    BF16 with a warning.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: Recipe | None = None,
        decisions: Fp8Decisions | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_lowprec(recipe if recipe is not None else Recipe(), decisions)

    def _init_lowprec(self, recipe: Recipe, decisions: Fp8Decisions | None) -> None:
        self.recipe = recipe
        self.decisions = decisions if decisions is not None else Fp8Decisions()
        self._unit_scales = UnitScales()
        self._choice_by_m: dict[int, bool] = {}

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: Recipe, *, decisions: Fp8Decisions | None = None
    ) -> "LowPrecisionLinear":
        """A ``LowPrecisionLinear`` sharing ``linear``'s weight and bias (not copies)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._init_lowprec(recipe, decisions)
        return new

    def _use_fp8(self, x2: torch.Tensor, out_dtype: torch.dtype) -> bool:
        m = x2.shape[0]
        if self.decisions.table is not None:
            # a table's choice is a function of the shape alone: a recomputation makes its
            # forward's choice without a record, and torch.compile traces the lookup
            return self.decisions.use_fp8(
                self.recipe, m, self.in_features, self.out_features, x2, self.weight, out_dtype
            )
        if torch._C._current_graph_task_id() != -1 and m in self._choice_by_m:
            return self._choice_by_m[m]  # a recomputation repeats its forward's choice
        use = self.decisions.use_fp8(
            self.recipe, m, self.in_features, self.out_features, x2, self.weight, out_dtype
        )
        self._choice_by_m[m] = use
        if len(self._choice_by_m) > _CHOICES_KEPT:
            del self._choice_by_m[next(iter(self._choice_by_m))]
        return use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recipe.name == "bf16":
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        out_dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):
            # the GEMM's input is the autocast dtype, as nn.Linear's is: an fp32 input (the
            # embeddings, say) is rounded to it before quantizing, like every other input
            out_dtype = torch.get_autocast_dtype(x.device.type)
            x2 = x2.to(out_dtype)
        if not self._use_fp8(x2, out_dtype):
            return F.linear(x, self.weight, self.bias)
        y = fp8_linear(x2.contiguous(), self.weight, self.recipe, out_dtype, self._unit_scales)
        if self.bias is not None:
            y = y + self.bias.to(out_dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


def decisions_of(model: nn.Module) -> list[Fp8Decisions]:
    """The distinct ``Fp8Decisions`` objects of ``model``'s low-precision linears."""
    seen: dict[int, Fp8Decisions] = {}
    for module in model.modules():
        if isinstance(module, LowPrecisionLinear):
            seen.setdefault(id(module.decisions), module.decisions)
    return list(seen.values())


def measure_pending(model: nn.Module) -> int:
    """``Fp8Decisions.measure_pending()`` for every decisions object of ``model``'s
    low-precision linears; returns how many shapes were timed. Call it between training steps
    (a plain context: timing inside checkpointed or hooked regions is never allowed)."""
    return sum(decisions.measure_pending() for decisions in decisions_of(model))


def fallback_report(model: nn.Module) -> dict[tuple, str]:
    """``{(recipe, M bucket, K, N, dtype): reason}`` for every shape of ``model``'s
    low-precision linears that ran in BF16."""
    report: dict[tuple, str] = {}
    for decisions in decisions_of(model):
        report.update(decisions.fallback_report())
    return report


def use_decisions(model: nn.Module, decisions: Fp8Decisions) -> int:
    """Give every low-precision linear of ``model`` ``decisions`` (and ``convert``'s report,
    ``model.lowprec_conversion``, if there is one); returns how many linears took it. Each
    forgets the choices it kept for recomputation, which the old decisions made.

    Raises:
        TypeError: ``decisions`` is not an ``Fp8Decisions``.
    """
    if not isinstance(decisions, Fp8Decisions):
        raise TypeError(f"decisions must be an Fp8Decisions, got {type(decisions).__name__}")
    count = 0
    for module in model.modules():
        if isinstance(module, LowPrecisionLinear):
            module.decisions = decisions
            module._choice_by_m.clear()
            count += 1
    report = getattr(model, "lowprec_conversion", None)
    if report is not None:
        report.decisions = decisions
    return count

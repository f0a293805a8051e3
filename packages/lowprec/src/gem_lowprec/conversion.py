"""``convert(model, recipe, skip=...)``: swap ``nn.Linear`` modules for ``LowPrecisionLinear``.

Parameters are shared, not copied, so optimizer state and checkpoints are unaffected. Modules
whose qualified name matches a ``skip`` pattern (``fnmatch`` style) stay in BF16: by default the
heads and output layers (``*head*``, ``*output*``, ``*classifier*``) and, with ``keep_last=True``,
the last ``nn.Linear`` of the model, the quantization-sensitive end of the network. The decisions
are stored on the model as ``model.lowprec_conversion`` (converted and skipped names with reasons,
and the ``Fp8Decisions`` every converted linear shares: each shape is timed once per model).
"""

from dataclasses import dataclass, field
from fnmatch import fnmatch

from torch import nn

from gem_lowprec.fallback import Fp8Decisions
from gem_lowprec.linear import LowPrecisionLinear
from gem_lowprec.recipes import Recipe
from gem_lowprec.recipes import recipe as make_recipe

DEFAULT_SKIP = ("*head*", "*output*", "*classifier*")


@dataclass
class ConversionReport:
    """What ``convert`` did: the converted names, the skipped ones with why, and the decisions
    object the converted linears share."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    decisions: Fp8Decisions = field(default_factory=Fp8Decisions)


def convert(
    model: nn.Module,
    recipe: Recipe | str,
    *,
    skip: tuple[str, ...] | list[str] = DEFAULT_SKIP,
    keep_last: bool = True,
    decisions: Fp8Decisions | None = None,
) -> nn.Module:
    """Swap every eligible ``nn.Linear`` in ``model`` for a ``LowPrecisionLinear`` (in place,
    sharing the parameters) and return the model.

    Args:
        model: any module; its ``nn.Linear`` submodules (not already low-precision) are the
            candidates.
        recipe: a ``Recipe`` or a recipe name (``"mxfp8"``, ``"fp8_rowwise"``, ``"bf16"``).
        skip: ``fnmatch`` patterns of qualified names that stay ``nn.Linear``.
        keep_last: keep the model's last ``nn.Linear`` too.
        decisions: the ``Fp8Decisions`` the converted linears share (default: a new one).

    Returns:
        ``model``, with ``model.lowprec_conversion`` a ``ConversionReport``.

    Raises:
        TypeError: ``recipe`` is neither a ``Recipe`` nor a string.
        ValueError: an unknown recipe name.
    """
    if isinstance(recipe, str):
        recipe = make_recipe(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe or a recipe name, got {type(recipe).__name__}")
    linears = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not isinstance(mod, LowPrecisionLinear)
    ]
    report = ConversionReport(decisions=decisions if decisions is not None else Fp8Decisions())
    last = linears[-1][0] if linears else None
    for name, mod in linears:
        if any(fnmatch(name, pattern) for pattern in skip):
            report.skipped[name] = "matches a skip pattern"
            continue
        if keep_last and name == last:
            report.skipped[name] = "last linear layer (keep_last=True)"
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(
            parent, child, LowPrecisionLinear.from_linear(mod, recipe, decisions=report.decisions)
        )
        report.converted.append(name)
    model.lowprec_conversion = report
    return model

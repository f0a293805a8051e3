"""``convert(model, recipe, skip=...)``: swap ``nn.Linear`` modules for ``LowPrecisionLinear``.

Parameters are shared, not copied, so optimizer state and checkpoints are unaffected. Modules
whose qualified name matches a ``skip`` pattern (``fnmatch`` style) stay in BF16: by default the
heads and output layers (``*head*``, ``*output*``, ``*classifier*``) and, with ``keep_last=True``,
the last ``nn.Linear`` of the model, the quantization-sensitive end of the network. The decisions
are stored on the model as ``model.lowprec_conversion`` (converted and skipped names with reasons).
"""

from dataclasses import dataclass, field
from fnmatch import fnmatch

from torch import nn

from gem_lowprec.linear import LowPrecisionLinear
from gem_lowprec.recipes import Recipe
from gem_lowprec.recipes import recipe as make_recipe

DEFAULT_SKIP = ("*head*", "*output*", "*classifier*")


@dataclass
class ConversionReport:
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def convert(
    model: nn.Module,
    recipe: Recipe | str,
    *,
    skip: tuple[str, ...] | list[str] = DEFAULT_SKIP,
    keep_last: bool = True,
) -> nn.Module:
    """Swap every eligible ``nn.Linear`` in ``model`` (in place) and return the model."""
    if isinstance(recipe, str):
        recipe = make_recipe(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe or a recipe name, got {type(recipe).__name__}")
    linears = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not isinstance(mod, LowPrecisionLinear)
    ]
    report = ConversionReport()
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
        setattr(parent, child, LowPrecisionLinear.from_linear(mod, recipe))
        report.converted.append(name)
    model.lowprec_conversion = report
    return model

"""Which submodules are regions: the units that get one activation policy each.

By default the regions are the model's repeated blocks and its heads: every child of an
``nn.ModuleList`` or ``nn.ModuleDict`` (the outermost ones; a list inside a block belongs to the
block), and every top-level child whose name contains ``head``. Users may name any submodules
instead (names as ``model.named_modules()`` gives them); regions may not nest.
"""

import torch
from torch import nn

__all__ = ["default_regions", "resolve_regions"]


def default_regions(model: nn.Module) -> list[str]:
    """Names of the children of the outermost module lists and dicts, and of top-level heads."""
    names: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                names.extend(f"{full}.{n}" for n, _ in child.named_children())
            elif not prefix and "head" in name.lower():
                names.append(full)
            else:
                visit(full, child)

    visit("", model)
    return names


def resolve_regions(model: nn.Module, regions) -> dict[str, nn.Module]:
    """``{name: module}`` for the requested regions, with clear errors for bad names."""
    modules = dict(model.named_modules())
    if regions is None:
        names = default_regions(model)
        if not names:
            raise ValueError(
                "regions: the model has no nn.ModuleList/nn.ModuleDict of blocks and no top-level "
                "head to use as default regions; pass regions=[...] with submodule names "
                f"(for example {_examples(modules)})"
            )
    else:
        if isinstance(regions, str):
            raise TypeError(
                f"regions: expected a list of submodule names, got the string {regions!r}"
            )
        names = list(regions)
        if not names:
            raise ValueError("regions: expected at least one submodule name, got an empty list")
        unknown = [n for n in names if n not in modules]
        if unknown:
            raise ValueError(
                f"regions: no submodule named {unknown} in {type(model).__name__}; "
                f"known names include {_examples(modules)}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"regions: names repeat in {names}")
    for a in names:
        for b in names:
            if a != b and (a == "" or b.startswith(a + ".")):
                raise ValueError(f"regions: {b!r} lies inside {a!r}; regions may not nest")
    return {name: modules[name] for name in names}


def _examples(modules: dict[str, torch.nn.Module], limit: int = 12) -> list[str]:
    names = [n for n in modules if n]
    return names[:limit] + (["..."] if len(names) > limit else [])

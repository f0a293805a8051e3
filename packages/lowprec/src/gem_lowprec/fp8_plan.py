"""Making the fp8-or-BF16 choices once, before training, identically on every rank.

The measured mode of ``Fp8Decisions`` times shapes inside the training process, so two ranks
can choose differently and train different numerics. A distributed trainer instead:

1. converts its model (``convert``), then calls ``plan_fp8(model, m_values=..., device=...)``
   on every rank: rank ``src`` lists the model's low-precision shapes (``linear_shapes``) and
   builds an ``Fp8Table`` for the M buckets asked for (``build_table``: measured with
   ``fallback.measure_fp8_against_bf16`` on a GPU, the shape rule on the CPU), the table is
   broadcast (``broadcast_table``), and every linear gets the same table-mode ``Fp8Decisions``;
2. stores ``fp8_state(model)`` (the table and the choices made) in its checkpoint and run
   summary;
3. on resume calls ``restore_fp8(model, state)`` instead of ``plan_fp8``: the saved table,
   no timing, the same choices.

The choice depends on the key's M bucket. Ranks whose token counts fall in different buckets
may take different paths in one step; a table built for one M (``m_values=[m]``) gives every M
of a shape that one choice (the nearest-bucket rule), the same on every rank.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gem_lowprec.fallback import Fp8Decisions, m_bucket, measure_fp8_against_bf16, shape_problem
from gem_lowprec.fp8_table import Fp8Choice, Fp8Key, Fp8Table, dtype_name, recipe_id
from gem_lowprec.linear import LowPrecisionLinear, decisions_of, use_decisions
from gem_lowprec.recipes import Recipe

__all__ = [
    "LinearShape",
    "broadcast_table",
    "build_table",
    "fp8_state",
    "linear_shapes",
    "m_buckets",
    "plan_fp8",
    "restore_fp8",
]


@dataclass(frozen=True)
class LinearShape:
    """A low-precision linear's GEMM: its recipe, ``K = in_features``, ``N = out_features``
    and weight dtype."""

    recipe: Recipe
    k: int
    n: int
    w_dtype: torch.dtype


def linear_shapes(model: nn.Module) -> list[LinearShape]:
    """Every distinct ``LinearShape`` of ``model``'s ``LowPrecisionLinear`` s that consult their
    decisions (recipe ``bf16`` never does), in a fixed order."""
    shapes = {
        LinearShape(mod.recipe, mod.in_features, mod.out_features, mod.weight.dtype)
        for mod in model.modules()
        if isinstance(mod, LowPrecisionLinear) and mod.recipe.name != "bf16"
    }
    return sorted(shapes, key=lambda s: (recipe_id(s.recipe), s.k, s.n, str(s.w_dtype)))


def m_buckets(
    *, m_values: Iterable[int] | None = None, m_range: tuple[int, int] | None = None
) -> list[int]:
    """The M buckets (powers of two, ``fallback.m_bucket``) to cover: those of ``m_values``,
    or every one from ``m_range = (lo, hi)``'s to ``hi``'s. Give exactly one.

    Raises:
        ValueError: both or neither given, an M that is not a positive int, or ``lo > hi``.
    """
    if (m_values is None) == (m_range is None):
        raise ValueError("give exactly one of m_values (token counts) and m_range (lo, hi)")
    if m_values is not None:
        values = list(m_values)
        if not values or not all(_positive_int(m) for m in values):
            raise ValueError(f"m_values must be positive ints, at least one, got {values!r}")
        return sorted({m_bucket(m) for m in values})
    if not (
        isinstance(m_range, tuple | list)
        and len(m_range) == 2
        and all(_positive_int(m) for m in m_range)
        and m_range[0] <= m_range[1]
    ):
        raise ValueError(f"m_range must be (lo, hi), positive ints with lo <= hi, got {m_range!r}")
    lo, hi = (m_bucket(m).bit_length() for m in m_range)
    return [1 << (b - 1) for b in range(lo, hi + 1)]


def build_table(
    shapes: Iterable[LinearShape],
    *,
    device: torch.device | str,
    m_values: Iterable[int] | None = None,
    m_range: tuple[int, int] | None = None,
    x_dtype: torch.dtype = torch.bfloat16,
    out_dtype: torch.dtype | None = None,
    measure: Callable[..., tuple[bool, str]] | None = None,
) -> Fp8Table:
    """An ``Fp8Table`` with an entry per shape and M bucket (``m_buckets``).

    A key the fp8 kernels cannot take (``fallback.shape_problem`` at the bucket's M) is BF16;
    the others are measured: ``measure(recipe, m, k, n, x_dtype, w_dtype, out_dtype, device)
    -> (keep_fp8, why)`` with ``m`` the bucket, by default ``measure_fp8_against_bf16`` on a
    CUDA ``device``. On the CPU with no ``measure`` the shape rule decides (fp8 wherever the
    kernels take the shape): the CPU's timings say nothing about a GPU's.

    Args:
        shapes: ``linear_shapes(model)``.
        device: where to measure.
        m_values, m_range: the token counts to cover (see ``m_buckets``).
        x_dtype: the dtype of the GEMMs' input as the linears see it (under autocast, the
            autocast dtype).
        out_dtype: their output dtype; default ``x_dtype``.
        measure: replaces the timing (tests, or a trainer's own measurement).

    Raises:
        ValueError: as for ``m_buckets``; an ``x_dtype`` or ``out_dtype`` a linear does not
            take.
    """
    buckets = m_buckets(m_values=m_values, m_range=m_range)
    device = torch.device(device)
    out_dtype = out_dtype or x_dtype
    names = (dtype_name(x_dtype), dtype_name(out_dtype))
    if measure is None and device.type == "cuda":
        measure = measure_fp8_against_bf16
    entries: dict[Fp8Key, Fp8Choice] = {}
    for shape in shapes:
        for m in buckets:
            key = Fp8Key(recipe_id(shape.recipe), shape.k, shape.n, *names, m)
            problem = shape_problem(shape.recipe, m, shape.k, shape.n)
            if problem is not None:
                entries[key] = Fp8Choice(False, problem)
            elif measure is None:
                entries[key] = Fp8Choice(
                    True, f"shape rule: fp8 takes the shape (not measured on {device.type})"
                )
            else:
                keep, why = measure(
                    shape.recipe, m, shape.k, shape.n, x_dtype, shape.w_dtype, out_dtype, device
                )
                entries[key] = Fp8Choice(bool(keep), str(why))
    return Fp8Table(entries)


def broadcast_table(
    table: Fp8Table | None, *, src: int = 0, group: dist.ProcessGroup | None = None
) -> Fp8Table:
    """Rank ``src``'s ``table`` on every rank of ``group`` (the others may pass None), sent as
    its ``to_dict()`` through ``dist.broadcast_object_list``; without an initialised process
    group, ``table`` itself.

    Raises:
        ValueError: rank ``src`` has no table.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if table is None:
            raise ValueError(
                "table must be an Fp8Table when there is no process group to receive one"
            )
        return table
    if dist.get_rank() == src and not isinstance(table, Fp8Table):
        raise ValueError(f"table must be an Fp8Table on rank src={src}, got {type(table).__name__}")
    payload = [table.to_dict() if dist.get_rank() == src else None]
    dist.broadcast_object_list(payload, src=src, group=group)
    return Fp8Table.from_dict(payload[0])


def plan_fp8(
    model: nn.Module,
    *,
    device: torch.device | str,
    m_values: Iterable[int] | None = None,
    m_range: tuple[int, int] | None = None,
    x_dtype: torch.dtype = torch.bfloat16,
    out_dtype: torch.dtype | None = None,
    measure: Callable[..., tuple[bool, str]] | None = None,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
) -> Fp8Decisions:
    """Build the table on rank ``src`` (``build_table(linear_shapes(model), ...)``), broadcast
    it, and give every ``LowPrecisionLinear`` of ``model`` one table-mode ``Fp8Decisions``
    holding it (returned). Call it on every rank, after ``convert`` and before training; only
    rank ``src`` measures. Arguments as for ``build_table`` and ``broadcast_table``."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    table = None
    if rank == src:
        table = build_table(
            linear_shapes(model), device=device, m_values=m_values, m_range=m_range,
            x_dtype=x_dtype, out_dtype=out_dtype, measure=measure,
        )  # fmt: skip
    decisions = Fp8Decisions(table=broadcast_table(table, src=src, group=group))
    use_decisions(model, decisions)
    return decisions


def fp8_state(model: nn.Module) -> dict:
    """``Fp8Decisions.state_dict()`` of the one decisions object ``model``'s low-precision
    linears share: the table and the choices made, for a checkpoint and a run summary.

    Raises:
        ValueError: the linears hold several decisions objects (or none).
    """
    found = decisions_of(model)
    if len(found) != 1:
        raise ValueError(
            f"model's low-precision linears must share one Fp8Decisions (plan_fp8 or convert "
            f"gives them one), found {len(found)}"
        )
    return found[0].state_dict()


def restore_fp8(model: nn.Module, state: dict) -> Fp8Decisions:
    """Resume: give ``model``'s low-precision linears the table-mode decisions saved as
    ``fp8_state(model)`` (``Fp8Decisions.from_state_dict``); returns them."""
    decisions = Fp8Decisions.from_state_dict(state)
    use_decisions(model, decisions)
    return decisions


def _positive_int(m) -> bool:
    return isinstance(m, int) and not isinstance(m, bool) and m > 0

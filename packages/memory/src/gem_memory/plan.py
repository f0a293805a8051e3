"""``plan_checkpointing`` and the ``CheckpointPlan`` it returns.

AutoAC in one call: find the regions (the model's repeated blocks and heads by default), profile
each once under every policy (``gem_memory.profile``), and pick the policy per region that
minimises the recompute cost with the predicted peak of a training step under ``budget_bytes``
(``gem_memory.solver``). The budget is absolute bytes: on CUDA everything the process has
allocated when planning counts (parameters, inputs, optimizer state), on the CPU the parameters,
buffers and inputs. A budget below what any plan can reach is an error that names the smallest
feasible budget.
"""

from dataclasses import dataclass

import torch

from .policies import POLICIES, set_policy
from .profile import ModelProfile, profile_model
from .quantize import QuantizedConfig
from .regions import resolve_regions
from .solver import min_peak, solve

__all__ = ["CheckpointPlan", "plan_checkpointing"]

_MIB = 2.0**20


@dataclass(frozen=True)
class CheckpointPlan:
    """One policy per region, with the prediction it was chosen by."""

    policies: dict[str, str]  # region name -> policy, in execution order
    budget_bytes: int
    predicted_peak_bytes: int
    recompute_cost: float  # total, in the unit of ``cost``
    cost: str  # "time" (ms per step) or "flops"
    profile: ModelProfile

    def apply(self, model: torch.nn.Module, *, compile=None) -> torch.nn.Module:
        """Set each region's policy on ``model`` in place (any earlier plan is replaced).

        ``compile`` (e.g. ``torch.compile``) compiles each region's forward with its policy
        inside; compiling the whole model afterwards (``torch.compile(model)``) works too.
        """
        modules = resolve_regions(model, list(self.policies))
        for name, policy in self.policies.items():
            set_policy(modules[name], policy, self.profile.quantized, compile=compile)
        return model

    def remove(self, model: torch.nn.Module) -> torch.nn.Module:
        """Put every region of this plan back to ``keep``."""
        for module in resolve_regions(model, list(self.policies)).values():
            set_policy(module, "keep")
        return model

    def __str__(self) -> str:
        header = ("region", "policy", "kept MiB", "keep-all MiB", "recompute ms", "recompute GFLOP")
        rows = []
        for region in self.profile.regions:
            policy = self.policies[region.name]
            rows.append(
                (
                    region.name,
                    policy,
                    f"{region.policies[policy].saved_bytes / _MIB:.2f}",
                    f"{region.policies['keep'].saved_bytes / _MIB:.2f}"
                    if "keep" in region.policies
                    else "out of memory",
                    f"{region.recompute_ms(policy):.3f}",
                    f"{region.recompute_flops(policy) / 1e9:.3f}",
                )
            )
        widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
        line = (
            lambda cells: "| "
            + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
            + " |"
        )
        unit = "ms" if self.cost == "time" else "FLOP"
        return "\n".join(
            [
                line(header),
                "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                *(line(r) for r in rows),
                f"predicted peak {self.predicted_peak_bytes / _MIB:.2f} MiB "
                f"(budget {self.budget_bytes / _MIB:.2f} MiB, static "
                f"{self.profile.static_bytes / _MIB:.2f} MiB); "
                f"recompute cost {self.recompute_cost:.4g} {unit} per step",
            ]
        )


def plan_checkpointing(
    model: torch.nn.Module,
    sample_inputs,
    *,
    budget_bytes: int,
    regions=None,
    solver: str = "dp",
    policies=POLICIES,
    quantized_format: str = "fp8_e4m3",
    quantized_min_bytes: int = 64 * 1024,
    loss_fn=None,
    cost: str = "time",
    compile=None,
    profile: ModelProfile | None = None,
) -> CheckpointPlan:
    """Choose a policy per region so that a training step's predicted peak fits ``budget_bytes``.

    ``sample_inputs``: a tensor or a tuple of positional inputs (a real batch: memory scales with
    it). ``regions``: submodule names (default: the repeated blocks and the heads).
    ``solver``: ``"dp"`` (exact dynamic program) or ``"exhaustive"`` (every plan; small models).
    ``policies``: the policies allowed, a subset of ``("keep", "selective", "full", "quantized")``.
    ``loss_fn``: maps the model's output to the scalar loss (default: the sum of its outputs).
    ``cost``: what to minimise, measured recompute ``"time"`` or recomputed ``"flops"``.
    ``compile``: profile the regions compiled by this function (e.g. ``torch.compile``), as
    ``plan.apply(model, compile=...)`` will run them.
    ``profile``: a ``ModelProfile`` from ``profile_model`` to plan again without profiling.
    ``quantized_format`` / ``quantized_min_bytes``: the ``quantized`` policy's
    ``QuantizedConfig``.

    Returns:
        A ``CheckpointPlan``: ``policies`` by region, the predicted peak and the recompute cost;
        ``apply(model, compile=None)`` sets them, ``remove(model)`` undoes them, ``str(plan)`` is
        a table.

    Raises:
        ValueError: a non-positive budget, or one below every plan's peak (the message names
            the smallest feasible budget); regions that differ from a given profile's; allowed
            policies not profiled, or none that fits a region; and as ``profile_model`` raises.
        torch.cuda.OutOfMemoryError: as ``profile_model`` raises.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes: expected a positive number of bytes, got {budget_bytes!r}")
    if profile is None:
        profile = profile_model(
            model,
            sample_inputs,
            regions=regions,
            loss_fn=loss_fn,
            policies=policies,
            quantized=QuantizedConfig(quantized_format, quantized_min_bytes),
            compile=compile,
        )
    elif regions is not None and set(regions) != {r.name for r in profile.regions}:
        raise ValueError(
            f"regions: {list(regions)} differ from the profile's {[r.name for r in profile.regions]}"
        )
    allowed = tuple(p for p in POLICIES if p in policies)
    missing = [
        p
        for p in allowed
        if any(p not in r.policies and p not in r.out_of_memory for r in profile.regions)
    ]
    if missing:
        raise ValueError(f"policies: {missing} were not profiled; profile them or leave them out")
    unplannable = [r.name for r in profile.regions if not any(p in r.policies for p in allowed)]
    if unplannable:
        raise ValueError(
            f"policies: every allowed policy {allowed} ran out of device memory when profiled for "
            f"regions {unplannable}; allow 'full' or plan a smaller batch"
        )
    result = solve(profile, budget_bytes, policies=allowed, solver=solver, cost=cost)
    if result is None:
        floor, _ = min_peak(profile, policies=allowed)
        raise ValueError(
            f"budget_bytes={budget_bytes} ({budget_bytes / _MIB:.2f} MiB) is below the smallest "
            f"feasible peak of this model with policies {allowed}: {floor} bytes "
            f"({floor / _MIB:.2f} MiB, of which {profile.static_bytes / _MIB:.2f} MiB static); "
            f"raise budget_bytes to at least {floor}"
        )
    chosen, score = result
    return CheckpointPlan(
        policies={r.name: p for r, p in zip(profile.regions, chosen, strict=True)},
        budget_bytes=budget_bytes,
        predicted_peak_bytes=profile.predict_peak(chosen),
        recompute_cost=score,
        cost=cost,
        profile=profile,
    )

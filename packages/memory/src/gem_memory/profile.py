"""Profiling: what each region costs in memory and time under each policy.

The planner predicts the peak of a training step from measurements, not from a formula. Three
passes over the model, then one small experiment per region and policy:

1. Capture: a forward under ``torch.no_grad`` records each region's inputs (cloned) and checks
   that every region runs exactly once per step.
2. Timeline: one real step (forward, loss, backward) with every region fully recomputed (the
   least memory, so profiling works at batches that do not fit without checkpointing; ``full``
   must be among the policies for that, else ``selective`` or ``keep`` is used), under a meter
   (``gem_memory.meter``) with a mark where each region's forward begins and ends and where its
   backward begins (its output's gradient arrives) and ends (its inputs' gradients are done).
   Between the marks lie the parts of the step that belong to no region (embeddings, the loss,
   gradients flowing between blocks); their peaks become offsets that do not depend on the plan.
3. Isolation: each region runs alone on its captured inputs, under each policy, three ways: under
   the meter (bytes it keeps from forward to backward, the peak of its forward, the extra peak of
   its backward), under ``FlopCounterMode`` (FLOPs of forward, recompute and backward), and
   timed. The region's output gradient is injected by a sink function that holds nothing, so the
   bytes left after the forward are exactly those autograd keeps for this region's backward.
   A policy that runs out of device memory even alone (``keep`` of one large block at a batch
   that only fits with checkpointing) is recorded as such and never chosen; the region's
   recompute costs are then counted from its cheapest policy that fits instead of from ``keep``
   (every plan picks one policy per region, so the best plan is the same).

The prediction for a plan is then the largest of:
``forward_base + kept bytes of earlier regions + this region's forward peak``,
``backward_base + kept bytes of this and earlier regions + this region's backward extra``, and
each outside segment's offset plus the kept bytes of the regions alive during it, plus the static
bytes (parameters, buffers, inputs). ``gem_memory.solver`` searches the plans.
"""

import gc
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from .meter import default_loss, make_meter, static_bytes
from .policies import POLICIES, set_policy
from .quantize import QuantizedConfig
from .regions import resolve_regions
from .timeline import record_timeline

__all__ = ["PolicyProfile", "RegionProfile", "ModelProfile", "profile_model"]


@dataclass(frozen=True)
class PolicyProfile:
    """One region under one policy, measured alone."""

    saved_bytes: int  # kept from the end of the region's forward until its backward
    forward_peak: int  # most bytes alive during its forward, its own inputs included
    backward_extra: int  # most bytes alive during its backward above what was alive at its start
    step_ms: float  # forward + backward time
    flops: float  # forward + backward (+ recompute) FLOPs counted by FlopCounterMode


@dataclass(frozen=True)
class RegionProfile:
    """One region's profile: its own input bytes, the outside bytes alive when its forward and
    backward begin, its forward FLOPs, a ``PolicyProfile`` per policy measured, and the policies
    that ran out of device memory even alone (never chosen)."""

    name: str
    input_bytes: int  # bytes of the inputs that belong to this region alone
    forward_base: (
        int  # outside bytes alive when its forward begins (earlier regions' kept bytes excluded)
    )
    backward_base: int  # outside bytes alive when its backward begins
    forward_flops: float
    policies: dict[str, PolicyProfile] = field(default_factory=dict)
    out_of_memory: tuple[str, ...] = ()  # policies that did not fit on the device even alone

    def _baseline(self) -> PolicyProfile:
        """``keep``, or when it did not fit, the fastest policy that did."""
        if "keep" in self.policies:
            return self.policies["keep"]
        return min(self.policies.values(), key=lambda p: (p.step_ms, p.flops))

    def recompute_ms(self, policy: str) -> float:
        """Step time ``policy`` adds over ``keep`` (or the fastest policy that fit), ≥ 0."""
        return max(0.0, self.policies[policy].step_ms - self._baseline().step_ms)

    def recompute_flops(self, policy: str) -> float:
        """FLOPs ``policy`` adds over ``keep`` (or the fastest policy that fit), ≥ 0."""
        return max(0.0, self.policies[policy].flops - self._baseline().flops)


@dataclass(frozen=True)
class ModelProfile:
    """Everything the solver needs; regions in the order the forward runs them."""

    regions: tuple[RegionProfile, ...]
    static_bytes: int
    # outside_offsets[k]: peak of the outside segments during which regions[:k] keep their
    # activations, minus those regions' kept bytes under the timeline's policy.
    outside_offsets: tuple[int, ...]
    quantized: QuantizedConfig
    device: str

    def predict_peak(self, policies) -> int:
        """Predicted peak bytes of one step (static included) with ``policies[i]`` per region."""
        peak = self.outside_offsets[0]
        kept = 0
        for i, (region, policy) in enumerate(zip(self.regions, policies, strict=True)):
            p = region.policies[policy]
            peak = max(
                peak,
                region.forward_base + kept + p.forward_peak,
                region.backward_base + kept + p.saved_bytes + p.backward_extra,
            )
            kept += p.saved_bytes
            peak = max(peak, self.outside_offsets[i + 1] + kept)
        return self.static_bytes + peak


class _Sink(torch.autograd.Function):
    """Ends a region's isolated forward without saving its output; feeds fixed output grads."""

    @staticmethod
    def forward(ctx, grads, *outputs):
        ctx.grads = grads
        return outputs[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.grads)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Isolated:
    """One region with its captured inputs, ready to run alone under any policy."""

    def __init__(self, module, args, kwargs, requires_grad, cloned, grads):
        self.module = module
        flat, self.spec = tree_flatten((args, kwargs))
        self.leaves = [
            t.detach().requires_grad_(rg) if isinstance(t, torch.Tensor) else t
            for t, rg in zip(flat, requires_grad, strict=True)
        ]
        self.cloned = cloned
        self.grads = grads

    def step(self, meter=None):
        """Forward + backward; with a meter, returns (input bytes, forward mark, backward mark)."""
        flat = [
            leaf.clone() if c else leaf for leaf, c in zip(self.leaves, self.cloned, strict=True)
        ]
        in_bytes = meter.live if meter is not None else 0
        args, kwargs = tree_unflatten(flat, self.spec)
        out = self.module(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(outs) != len(self.grads):
            raise RuntimeError(
                f"region {type(self.module).__name__}: outputs requiring grad changed between runs"
            )
        sink = _Sink.apply(self.grads, *outs) if outs else None
        del flat, args, kwargs, out, outs
        forward = meter.mark() if meter is not None else None
        if sink is not None:
            sink.backward()
        del sink
        backward = meter.mark() if meter is not None else None
        for p in self.module.parameters():
            p.grad = None
        return in_bytes, forward, backward

    def measure(self, policy: str, quantized: QuantizedConfig, *, reps: int, compile=None):
        device = self.grads[0].device if self.grads else torch.device("cpu")
        try:
            set_policy(self.module, policy, quantized)
            with FlopCounterMode(display=False) as counter:  # eager: the counter sees aten ops
                self.step()
            set_policy(self.module, policy, quantized, compile=compile)
            if device.type == "cuda" or compile is not None:
                self.step()  # warm-up: workspaces and compilation are not the region's memory
            meter = make_meter(device)
            with meter:
                meter.mark()
                in_bytes, fwd, bwd = self.step(meter)
            times = []
            for _ in range(reps):
                _sync(device)
                t0 = time.perf_counter()
                self.step()
                _sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
        finally:
            set_policy(self.module, "keep")
        return PolicyProfile(
            saved_bytes=fwd.live,
            forward_peak=fwd.peak,
            backward_extra=max(0, bwd.peak - fwd.live),
            step_ms=statistics.median(times),
            flops=float(counter.get_total_flops()),
        ), in_bytes


def _forward_flops(module, args, kwargs) -> float:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(*args, **kwargs)
    return float(counter.get_total_flops())


def profile_model(
    model: torch.nn.Module,
    sample_inputs,
    *,
    regions=None,
    loss_fn=None,
    policies=POLICIES,
    quantized: QuantizedConfig | None = None,
    timing_reps: int = 3,
    compile=None,
) -> ModelProfile:
    """Measure every region under every policy in ``policies`` (see the module docstring).

    ``compile`` (e.g. ``torch.compile``) is applied to each region's forward as
    ``CheckpointPlan.apply(model, compile=...)`` will apply it, so that memory and time are those
    of the compiled regions; FLOPs are always counted eagerly.

    The model's gradients and random-number state are restored afterwards, and any policy set on a
    region before (an applied plan) is put back.

    Args:
        model: the model; its regions must each run exactly once per forward.
        sample_inputs: a tensor or a tuple of positional inputs (a real batch).
        regions: submodule names (default ``default_regions(model)``).
        loss_fn: output -> scalar loss (default: the sum of the outputs needing grad).
        policies: a subset of ``POLICIES`` (``keep`` is always added: the baseline).
        quantized: the ``QuantizedConfig`` of the ``quantized`` policy.
        timing_reps: timed repetitions per region and policy (the median counts).
        compile: as ``plan.apply(model, compile=...)`` will run the regions.

    Returns:
        A ``ModelProfile``.

    Raises:
        ValueError: bad regions (unknown, nested, repeated, none found), an unknown policy, or a
            region that does not run exactly once per forward.
        torch.cuda.OutOfMemoryError: the timeline's policy (``full`` when allowed) does not fit
            even for one region alone; the message names it.
    """
    inputs = tuple(sample_inputs) if isinstance(sample_inputs, (tuple, list)) else (sample_inputs,)
    named = resolve_regions(model, regions)
    policies = _check_policies(policies)
    quantized = quantized or QuantizedConfig()
    loss_fn = loss_fn or default_loss
    params = list(model.parameters())
    saved_grads = [p.grad for p in params]
    saved_forwards = {name: _detach_forward(m) for name, m in named.items()}
    device = next(
        (t.device for t in tree_leaves(list(inputs)) if isinstance(t, torch.Tensor)), None
    )
    device = device or (params[0].device if params else torch.device("cpu"))
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            timeline_policy = next(p for p in ("full", "selective", "keep") if p in policies)
            if compile is not None or device.type == "cuda":
                _warm_up(model, inputs, named, loss_fn, timeline_policy, quantized, compile)
            for p in params:
                p.grad = None
            static = static_bytes(model, *inputs)
            captured, order = _capture(model, inputs, named)
            shared = _shared_masks(captured, order, model, inputs)
            timeline = record_timeline(
                model,
                inputs,
                named,
                order,
                shared,
                loss_fn,
                device,
                compile,
                timeline_policy,
                quantized,
            )
            profiles = _isolate(
                named, order, captured, shared, timeline, policies, quantized, timing_reps, compile
            )
            return _assemble(profiles, timeline, order, static, quantized, device)
    finally:
        for p, g in zip(params, saved_grads, strict=True):
            p.grad = g
        for name, m in named.items():
            _restore_forward(m, saved_forwards[name])


def _warm_up(model, inputs, named, loss_fn, policy, quantized, compile) -> None:
    """One step before anything is measured: compilation, and on CUDA the library workspaces
    that stay allocated (they belong to the static bytes, not to any region)."""
    for m in named.values():
        set_policy(m, policy, quantized, compile=compile)
    try:
        loss_fn(model(*inputs)).backward()
    finally:
        for m in named.values():
            set_policy(m, "keep")


def _check_policies(policies) -> tuple[str, ...]:
    policies = tuple(policies)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"policies: expected a subset of {POLICIES}, got unknown {unknown}")
    if "keep" not in policies:
        policies = ("keep", *policies)  # the baseline every cost is measured against
    return policies


def _detach_forward(module):
    state = {
        k: module.__dict__[k]
        for k in ("forward", "_gem_memory_original_forward")
        if k in module.__dict__
    }
    set_policy(module, "keep")
    return state


def _restore_forward(module, state) -> None:
    set_policy(module, "keep")
    module.__dict__.update(state)


def _capture(model, inputs, named):
    """Region inputs from a no-grad forward (held, so storages stay distinct); execution order."""
    captured: dict[str, tuple] = {}
    calls = dict.fromkeys(named, 0)
    order: list[str] = []

    def pre_hook(name):
        def hook(module, args, kwargs):
            calls[name] += 1
            if calls[name] == 1:
                order.append(name)
                detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t
                captured[name] = (_map(detach, args), _map(detach, kwargs))

        return hook

    handles = [m.register_forward_pre_hook(pre_hook(n), with_kwargs=True) for n, m in named.items()]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    bad = {n: c for n, c in calls.items() if c != 1}
    if bad:
        raise ValueError(
            f"regions: each region must run exactly once per forward; calls per region: {bad}"
        )
    return captured, order


def _map(fn, tree):
    flat, spec = tree_flatten(tree)
    return tree_unflatten([fn(x) for x in flat], spec)


def _shared_masks(captured, order, model, inputs) -> dict[str, list[bool]]:
    """Per region and flat input leaf: is it shared (with another region, or held statically)?"""
    static = {
        t.untyped_storage()._cdata
        for t in [*model.parameters(), *model.buffers(), *tree_leaves(list(inputs))]
        if isinstance(t, torch.Tensor)
    }
    uses: dict[int, int] = {}
    flats = {}
    for name in order:
        flat, _ = tree_flatten(captured[name])
        flats[name] = flat
        for key in {t.untyped_storage()._cdata for t in flat if isinstance(t, torch.Tensor)}:
            uses[key] = uses.get(key, 0) + 1
    return {
        name: [
            isinstance(t, torch.Tensor)
            and (t.untyped_storage()._cdata in static or uses[t.untyped_storage()._cdata] > 1)
            for t in flats[name]
        ]
        for name in order
    }


def _isolate(named, order, captured, shared, tl, policies, quantized, reps, compile):
    profiles = {}
    for name in order:
        module = named[name]
        args, kwargs = captured[name]
        flat, _ = tree_flatten((args, kwargs))
        cloned = [
            isinstance(t, torch.Tensor) and not sh for t, sh in zip(flat, shared[name], strict=True)
        ]
        grads = tuple(
            torch.randn(shape, dtype=dtype, device=dev) for shape, dtype, dev in tl.outputs[name]
        )
        iso = _Isolated(module, args, kwargs, tl.requires_grad[name], cloned, grads)
        measured, out_of_memory = {}, []
        in_bytes = 0
        for policy in policies:
            try:
                measured[policy], in_bytes = iso.measure(
                    policy, quantized, reps=reps, compile=compile
                )
            except torch.cuda.OutOfMemoryError:
                out_of_memory.append(policy)
                _release(module)
        if tl.policy not in measured:
            raise torch.cuda.OutOfMemoryError(
                f"region {name!r}: policy {tl.policy!r} ran out of device memory even alone "
                f"(out of memory under {out_of_memory}); a smaller batch is needed to profile it"
            )
        profiles[name] = (
            in_bytes, _forward_flops(module, args, kwargs), measured, tuple(out_of_memory)
        )  # fmt: skip
    return profiles


def _release(module) -> None:
    """Drop what a failed isolated step left behind: gradients and cached device blocks."""
    for p in module.parameters():
        p.grad = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _assemble(profiles, tl, order, static, quantized, device) -> ModelProfile:
    n = len(order)
    kept = [profiles[name][2][tl.policy].saved_bytes for name in order]
    offsets = [0] * (n + 1)
    forward_base, backward_base = {}, {}
    alive: set[int] = set()
    in_forward: int | None = None
    in_backward: set[int] = set()
    for kind, i, m in tl.events:
        if in_forward is None and not in_backward:  # the segment ending here is outside regions
            k = max(alive) + 1 if alive else 0
            offsets[k] = max(offsets[k], m.peak - sum(kept[j] for j in alive))
        for j in [j for j in in_backward if j in tl.without_exit]:
            in_backward.discard(j)
            alive.discard(j)
        if kind == "fwd_enter":
            in_forward = i
            forward_base[i] = m.live - sum(kept[j] for j in alive) - profiles[order[i]][0]
        elif kind == "fwd_exit":
            in_forward = None
            alive.add(i)
        elif kind == "bwd_enter":
            in_backward.add(i)
            backward_base[i] = m.live - sum(kept[j] for j in alive | {i})
        elif kind == "bwd_exit":
            in_backward.discard(i)
            alive.discard(i)
    regions = []
    for i, name in enumerate(order):
        in_bytes, fwd_flops, measured, out_of_memory = profiles[name]
        regions.append(
            RegionProfile(
                name=name,
                input_bytes=in_bytes,
                forward_base=forward_base[i],
                backward_base=backward_base.get(i, forward_base[i] + in_bytes),
                forward_flops=fwd_flops,
                policies=measured,
                out_of_memory=out_of_memory,
            )
        )
    return ModelProfile(tuple(regions), static, tuple(offsets), quantized, str(device))

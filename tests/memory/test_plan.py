"""AutoAC on a toy stack: exact solver, budgets that hold, clear errors, identical gradients."""

import functools
import itertools

import gem_memory
import pytest
import torch
from gem_memory.plan import CheckpointPlan
from gem_memory.profile import ModelProfile, PolicyProfile, RegionProfile
from gem_memory.quantize import QuantizedConfig
from gem_memory.solver import min_peak, solve
from hypothesis import given
from hypothesis import strategies as st

REGIONS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]


@pytest.fixture(scope="module")
def toy_profile(toy_factory):
    make_toy, toy_batch = toy_factory
    model, x = make_toy(), toy_batch()
    profile = gem_memory.profile_model(
        model, x, quantized=QuantizedConfig("fp8_e4m3", min_bytes=4096), timing_reps=1
    )
    return model, x, profile


def _grads(model, x):
    for p in model.parameters():
        p.grad = None
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_default_regions_are_the_blocks_and_the_head(toy_factory):
    make_toy, _ = toy_factory
    assert gem_memory.default_regions(make_toy()) == REGIONS


def test_profile_orders_regions_by_execution(toy_profile):
    _, _, profile = toy_profile
    assert [r.name for r in profile.regions] == REGIONS
    for r in profile.regions:
        kept = {p: r.policies[p].saved_bytes for p in gem_memory.POLICIES}
        assert kept["full"] < kept["selective"] < kept["keep"]
        assert kept["quantized"] < kept["keep"]
        assert r.recompute_flops("full") > 0 and r.recompute_flops("keep") == 0


@given(data=st.data())
def test_budgets_hold_and_peaks_fall_with_the_budget(toy_profile, data):
    model, x, profile = toy_profile
    policies = gem_memory.POLICIES
    floor, _ = min_peak(profile, policies=policies)
    top = profile.predict_peak(["keep"] * len(REGIONS))
    budgets = sorted(
        data.draw(st.lists(st.integers(floor, int(top * 1.05)), min_size=2, max_size=3)),
        reverse=True,
    )
    measured = []
    try:
        for budget in budgets:
            plan = gem_memory.plan_checkpointing(model, x, budget_bytes=budget, profile=profile)
            assert plan.predicted_peak_bytes <= budget
            plan.apply(model)
            peak = gem_memory.measure_peak(model, x)
            assert abs(peak - plan.predicted_peak_bytes) <= 0.1 * plan.predicted_peak_bytes
            measured.append(peak)
    finally:
        for name in REGIONS:
            gem_memory.set_policy(model.get_submodule(name), "keep")
    assert measured == sorted(measured, reverse=True), (budgets, measured)


@given(budget_fraction=st.floats(0.0, 1.0))
def test_dp_equals_exhaustive_search_on_the_toy(toy_profile, budget_fraction):
    _, _, profile = toy_profile
    policies = gem_memory.POLICIES
    floor, _ = min_peak(profile, policies=policies)
    top = profile.predict_peak(["keep"] * len(REGIONS))
    budget = int(floor + budget_fraction * (top - floor))
    for cost in ("time", "flops"):
        dp = solve(profile, budget, policies=policies, solver="dp", cost=cost)
        brute = solve(profile, budget, policies=policies, solver="exhaustive", cost=cost)
        assert dp == brute


def _synthetic_profile(draw) -> ModelProfile:
    n = draw(st.integers(1, 5))
    sizes = st.integers(0, 1000)
    regions = []
    for i in range(n):
        policies = {
            p: PolicyProfile(
                saved_bytes=draw(sizes),
                forward_peak=draw(sizes),
                backward_extra=draw(sizes),
                step_ms=draw(st.sampled_from([1.0, 1.5, 2.0, 3.0])),
                flops=float(draw(st.integers(0, 5))),
            )
            for p in gem_memory.POLICIES
        }
        regions.append(RegionProfile(f"r{i}", 0, draw(sizes), draw(sizes), 0.0, policies))
    offsets = tuple(draw(sizes) for _ in range(n + 1))
    return ModelProfile(tuple(regions), draw(sizes), offsets, QuantizedConfig(), "cpu")


@given(data=st.data())
def test_dp_equals_exhaustive_search_and_min_peak_is_the_floor(data):
    profile = _synthetic_profile(data.draw)
    policies = gem_memory.POLICIES
    all_plans = list(itertools.product(policies, repeat=len(profile.regions)))
    floor, floor_plan = min_peak(profile, policies=policies)
    assert floor == min(profile.predict_peak(p) for p in all_plans)
    assert profile.predict_peak(floor_plan) == floor
    budget = data.draw(st.integers(floor - 10, floor + 3000))
    dp = solve(profile, budget, policies=policies, solver="dp")
    assert dp == solve(profile, budget, policies=policies, solver="exhaustive")
    assert (dp is None) == (budget < floor)


def test_budget_below_the_floor_names_the_smallest_feasible_budget(toy_profile):
    model, x, profile = toy_profile
    floor, _ = min_peak(profile, policies=gem_memory.POLICIES)
    with pytest.raises(ValueError, match=f"at least {floor}"):
        gem_memory.plan_checkpointing(model, x, budget_bytes=floor - 1, profile=profile)
    plan = gem_memory.plan_checkpointing(model, x, budget_bytes=floor, profile=profile)
    assert plan.predicted_peak_bytes == floor
    with pytest.raises(ValueError, match="budget_bytes"):
        gem_memory.plan_checkpointing(model, x, budget_bytes=0, profile=profile)


def test_unknown_nested_and_repeated_regions_are_clear_errors(toy_factory):
    make_toy, toy_batch = toy_factory
    model, x = make_toy(), toy_batch(length=8)
    with pytest.raises(ValueError, match=r"no submodule named \['blocks.9'\]"):
        gem_memory.plan_checkpointing(model, x, budget_bytes=1 << 30, regions=["blocks.9"])
    with pytest.raises(ValueError, match="may not nest"):
        gem_memory.plan_checkpointing(
            model, x, budget_bytes=1 << 30, regions=["blocks", "blocks.1"]
        )
    with pytest.raises(TypeError, match="list of submodule names"):
        gem_memory.plan_checkpointing(model, x, budget_bytes=1 << 30, regions="blocks.1")
    model.blocks[1] = model.blocks[0]  # the same module runs twice per step
    with pytest.raises(ValueError, match="exactly once"):
        gem_memory.plan_checkpointing(model, x, budget_bytes=1 << 30, regions=["blocks.0"])


def test_recompute_only_plans_give_identical_gradients(toy_profile):
    model, x, profile = toy_profile
    reference = _grads(model, x)
    recompute = ("keep", "selective", "full")
    plans = [dict.fromkeys(REGIONS, p) for p in recompute[1:]]
    plans.append(dict(zip(REGIONS, itertools.cycle(recompute), strict=False)))
    floor, _ = min_peak(profile, policies=recompute)
    chosen = gem_memory.plan_checkpointing(
        model, x, budget_bytes=floor, profile=profile, policies=recompute
    )
    assert set(chosen.policies.values()) <= set(recompute)
    plans.append(chosen.policies)
    for policies in plans:
        plan = CheckpointPlan(policies, 0, 0, 0.0, "time", profile)
        plan.apply(model)
        try:
            got = _grads(model, x)
        finally:
            plan.remove(model)
        assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True)), policies


def test_quantized_plan_gradients_are_close(toy_profile):
    model, x, profile = toy_profile
    reference = _grads(model, x)
    plan = CheckpointPlan(dict.fromkeys(REGIONS, "quantized"), 0, 0, 0.0, "time", profile)
    plan.apply(model)
    try:
        got = _grads(model, x)
    finally:
        plan.remove(model)
    total = torch.cat([g.flatten() for g in reference])
    error = torch.cat([(a - b).flatten() for a, b in zip(got, reference, strict=True)])
    assert 0 < (error.norm() / total.norm()).item() <= 2.0**-4


def test_apply_remove_and_print(toy_profile):
    model, x, profile = toy_profile
    floor, _ = min_peak(profile, policies=gem_memory.POLICIES)
    plan = gem_memory.plan_checkpointing(model, x, budget_bytes=floor, profile=profile)
    text = str(plan)
    for name in REGIONS:
        assert name in text
    assert "predicted peak" in text and "budget" in text
    plan.apply(model)
    plan.apply(model)  # applying again replaces, never stacks wrappers
    wrapped = [n for n in REGIONS if "forward" in vars(model.get_submodule(n))]
    assert wrapped == [n for n, p in plan.policies.items() if p != "keep"]
    plan.remove(model)
    assert not any("forward" in vars(model.get_submodule(n)) for n in REGIONS)


def test_plan_works_under_torch_compile(toy_factory):
    """Each region's forward compiled with its policy inside (as the benchmark runs it)."""
    make_toy, toy_batch = toy_factory
    torch._dynamo.reset()
    x = toy_batch(length=16)
    reference = _grads(make_toy(depth=2), x)
    model = make_toy(depth=2)
    policies = {"blocks.0": "selective", "blocks.1": "full", "head": "quantized"}
    profile = ModelProfile((), 0, (0,), QuantizedConfig(min_bytes=0), "cpu")
    plan = CheckpointPlan(policies, 0, 0, 0.0, "time", profile)
    plan.apply(model, compile=functools.partial(torch.compile, backend="aot_eager"))
    got = _grads(model, x)
    for (name, _), a, b in zip(model.named_parameters(), got, reference, strict=True):
        if name == "head.3.bias":  # needs no saved activation: exact
            assert torch.equal(a, b), name
        else:  # upstream of the head's quantized activations
            torch.testing.assert_close(a, b, rtol=2.0**-3, atol=2.0**-4 * b.abs().max().item())
    plan.remove(model)
    assert torch.equal(_grads(model, x)[0], reference[0])


@pytest.mark.gpu
def test_budgets_hold_on_the_gpu_by_max_memory_allocated(toy_factory):
    make_toy, toy_batch = toy_factory
    model = make_toy(dim=256, heads=4, depth=4).cuda()
    x = toy_batch(batch=8, length=512).cuda()
    profile = gem_memory.profile_model(model, x, timing_reps=2)
    floor, _ = min_peak(profile, policies=gem_memory.POLICIES)
    top = profile.predict_peak(["keep"] * len(REGIONS))
    measured = []
    for fraction in (1.0, 0.75, 0.5, 0.25, 0.0):
        budget = int(floor + fraction * (top - floor))
        plan = gem_memory.plan_checkpointing(model, x, budget_bytes=budget, profile=profile)
        plan.apply(model)
        peak = gem_memory.measure_peak(model, x)  # torch.cuda.max_memory_allocated
        plan.remove(model)
        assert abs(peak - plan.predicted_peak_bytes) <= 0.1 * plan.predicted_peak_bytes, (
            budget,
            peak,
            plan.predicted_peak_bytes,
        )
        measured.append(peak)
    assert measured == sorted(measured, reverse=True)


def test_profile_of_compiled_regions_predicts_their_peak(toy_factory):
    """Profiling with ``compile=`` measures the compiled regions, as the benchmark plans them."""
    make_toy, toy_batch = toy_factory
    torch._dynamo.reset()
    compile_fn = functools.partial(torch.compile, backend="aot_eager")
    model, x = make_toy(depth=1), toy_batch(length=16)
    profile = gem_memory.profile_model(
        model, x, policies=("keep", "full"), timing_reps=1, compile=compile_fn
    )
    for policy in ("keep", "full"):
        plan = CheckpointPlan(
            dict.fromkeys(["blocks.0", "head"], policy), 0, 0, 0.0, "time", profile
        )
        plan.apply(model, compile=compile_fn)
        peak = gem_memory.measure_peak(model, x)
        plan.remove(model)
        predicted = profile.predict_peak([policy, policy])
        assert abs(peak - predicted) <= 0.1 * predicted, (policy, peak, predicted)


def test_a_policy_out_of_memory_alone_is_never_chosen(toy_factory, monkeypatch):
    """``keep`` of one region running out of memory while profiled alone (a batch that only fits
    with checkpointing) leaves that region with the other policies, its costs counted from the
    cheapest of them; the rest of the model plans as before."""
    from gem_memory import profile as profile_module

    make_toy, toy_batch = toy_factory
    model, x = make_toy(), toy_batch()
    measure = profile_module._Isolated.measure

    def measure_or_oom(self, policy, *args, **kwargs):
        if self.module is model.blocks[1] and policy == "keep":
            raise torch.cuda.OutOfMemoryError("pretend: blocks.1 keeps too much")
        return measure(self, policy, *args, **kwargs)

    monkeypatch.setattr(profile_module._Isolated, "measure", measure_or_oom)
    profile = gem_memory.profile_model(model, x, policies=("keep", "selective", "full"))
    region = {r.name: r for r in profile.regions}["blocks.1"]
    assert region.out_of_memory == ("keep",) and "keep" not in region.policies
    assert min(region.recompute_ms(p) for p in region.policies) == 0.0
    generous = 10 * profile.predict_peak(["full"] * len(profile.regions))
    plan = gem_memory.plan_checkpointing(
        model, x, budget_bytes=generous, profile=profile, policies=("keep", "selective", "full")
    )
    assert plan.policies["blocks.1"] != "keep"
    # With room to spare every region takes its cheapest policy (``keep``, or one that timed as
    # fast: on a busy CPU a tie goes to the plan that keeps fewer bytes).
    for region in profile.regions:
        chosen = region.recompute_ms(plan.policies[region.name])
        assert chosen == min(region.recompute_ms(p) for p in region.policies), region.name
    assert "out of memory" in str(plan)
    with pytest.raises(ValueError, match=r"ran out of device memory.*\['blocks.1'\]"):
        gem_memory.plan_checkpointing(
            model, x, budget_bytes=generous, profile=profile, policies=("keep",)
        )


def test_the_timeline_policy_out_of_memory_is_a_clear_error(toy_factory, monkeypatch):
    from gem_memory import profile as profile_module

    make_toy, toy_batch = toy_factory
    model, x = make_toy(), toy_batch()
    measure = profile_module._Isolated.measure

    def measure_or_oom(self, policy, *args, **kwargs):
        if self.module is model.head and policy == "full":
            raise torch.cuda.OutOfMemoryError("pretend: the head does not fit at all")
        return measure(self, policy, *args, **kwargs)

    monkeypatch.setattr(profile_module._Isolated, "measure", measure_or_oom)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="region 'head': policy 'full'"):
        gem_memory.profile_model(model, x, policies=("keep", "full"))

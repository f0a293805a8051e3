"""Composing a local batch: forced samples, exact counts, targets hit, the look-ahead respected."""

import numpy as np
import pytest
from gem_loadbalance import batch_target, plan_local_batch
from gem_loadbalance.local_batch import deadline_floor
from hypothesis import given
from hypothesis import strategies as st


@given(
    st.integers(0, 2**16),
    st.integers(1, 64),
    st.integers(0, 2),
    st.integers(0, 3),
    st.floats(0.5, 1.5),
)
def test_plan_takes_forced_count_and_lookahead(seed, count, lookahead, max_delay, scale):
    rng = np.random.default_rng(seed)
    step = 5
    natural = np.repeat(np.arange(step - max_delay, step + lookahead + 2), count)
    # The oldest batch (when it is not the current one) is partly emitted already.
    natural = natural[rng.integers(0, count + 1) if max_delay else 0 :]
    costs = np.exp(rng.normal(0, 1, natural.size))
    target = scale * count * costs.mean()
    chosen = plan_local_batch(
        costs,
        natural,
        step=step,
        count=count,
        target=target,
        max_delay=max_delay,
        lookahead=lookahead,
    )
    assert chosen.size == count == np.unique(chosen).size
    forced = np.flatnonzero(natural <= step - max_delay)
    assert set(forced.tolist()) <= set(chosen.tolist())
    assert natural[chosen].max() <= step + lookahead


def test_plan_lands_on_reachable_targets():
    rng = np.random.default_rng(0)
    costs = np.exp(rng.normal(0, 1.5, 3072))
    natural = np.repeat(np.arange(3), 1024)
    for scale in (0.8, 1.0, 1.2):
        target = scale * 1024 * costs.mean()
        chosen = plan_local_batch(costs, natural, step=0, count=1024, target=target, max_delay=2)
        assert costs[chosen].sum() == pytest.approx(target, rel=1e-4)


def test_plan_prefers_urgent_heavy_samples():
    # Two heavy samples, one from the oldest batch: the target has room for exactly one.
    costs = np.array([10.0, 1.0, 1.0, 1.0, 10.0, 1.0, 1.0, 1.0])
    natural = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    chosen = plan_local_batch(costs, natural, step=0, count=4, target=13.0, max_delay=2)
    assert 0 in chosen.tolist() and 4 not in chosen.tolist()


def test_target_is_clipped_to_the_headroom():
    kwargs = dict(count=10, mean_cost=2.0, pool_count=30, headroom=0.01, gain=1.0)
    assert batch_target(pool_cost=60.0, **kwargs) == 20.0
    assert batch_target(pool_cost=600.0, **kwargs) == pytest.approx(20.2)
    assert batch_target(pool_cost=0.0, **kwargs) == pytest.approx(19.8)


def test_deadline_floor_spreads_piled_up_heavy_samples():
    costs = np.array([50.0, 50.0, 50.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    natural = np.array([0, 0, 1, 1, 1, 2, 2, 2, 2])
    # Step 2, max_delay 2: batch 0's two heavy samples are due now; batch 1's one next step.
    floor = deadline_floor(costs, natural, step=2, count=3, max_delay=2)
    assert floor == pytest.approx(max(100.0 + 1.0, (152.0 + 0.0) / 2))


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="count must lie"):
        plan_local_batch(np.ones(3), np.zeros(3, int), step=0, count=4, target=1.0, max_delay=1)
    with pytest.raises(ValueError, match="delay limit"):
        plan_local_batch(np.ones(3), np.zeros(3, int), step=5, count=2, target=1.0, max_delay=1)
    with pytest.raises(ValueError, match="1-D of one length"):
        plan_local_batch(np.ones(3), np.zeros(2, int), step=0, count=1, target=1.0, max_delay=1)

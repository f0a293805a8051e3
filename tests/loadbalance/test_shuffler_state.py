"""A shuffler's saved state is checked against the source it resumes, field by field.

A state saved over another source of the same shape, or with corrupt values, would otherwise be
accepted and the resumed batches would silently differ from the uninterrupted run's.
"""

import copy
import json

import numpy as np
import pytest
from gem_loadbalance import BaseBatchShuffler


def _source(seed, sizes=(5,) * 8):
    rng = np.random.default_rng(seed)
    costs = np.exp(rng.normal(0.0, 1.5, size=sum(sizes))).round(3)
    source, start = [], 0
    for size in sizes:
        source.append([(start + i, float(costs[start + i])) for i in range(size)])
        start += size
    return source


def _shuffler(source):
    return BaseBatchShuffler(source, cost=lambda s: s[1], local_batch_size=4)


def _state_after(source, batches=3):
    shuffler = _shuffler(source)
    iterator = iter(shuffler)
    for _ in range(batches):
        next(iterator)
    return shuffler.state_dict()


def _resume(source, state):
    shuffler = _shuffler(source)
    shuffler.load_state_dict(state)
    return list(shuffler)


def test_a_valid_state_still_resumes_exactly():
    source = _source(0)
    uninterrupted = list(_shuffler(source))
    state = json.loads(json.dumps(_state_after(source)))
    assert uninterrupted[3:] == _resume(source, state)


def test_a_state_over_another_source_of_the_same_shape_is_refused():
    state = _state_after(_source(0))
    with pytest.raises(ValueError, match="source_digest"):
        _resume(_source(1), state)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf"), "x"])
def test_nan_negative_or_non_numeric_pool_costs_are_refused_on_load(bad):
    state = _state_after(_source(0))
    assert state["pool_costs"], "the pool holds samples after 3 batches"
    state["pool_costs"][0] = bad
    with pytest.raises(ValueError, match="pool_costs"):
        _shuffler(_source(0)).load_state_dict(state)


def test_pool_costs_that_differ_from_the_source_are_refused():
    source = _source(0)
    state = _state_after(source)
    state["pool_costs"][0] *= 1.5
    with pytest.raises(ValueError, match="pool_costs"):
        _resume(source, state)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("step", -1),
        ("step", 1.5),
        ("consumed_samples", -3),
        ("consumed_sub_batches", "2"),
        ("pool_positions", [3, 1]),
        ("pool_positions", [10**6]),
        ("cost_sum", float("nan")),
        ("cost_count", -1),
        ("emitted", 10**6),
        ("delay_counts", {0: -5}),
        ("last_target", float("nan")),
        ("source_digest", 7),
    ],
)
def test_corrupt_fields_are_refused_naming_the_field(field, value):
    state = _state_after(_source(0))
    state[field] = value
    with pytest.raises(ValueError, match=field):
        _shuffler(_source(0)).load_state_dict(state)


@pytest.mark.parametrize("key", sorted(_state_after(_source(0))))
def test_a_missing_key_is_named(key):
    state = copy.deepcopy(_state_after(_source(0)))
    del state[key]
    with pytest.raises(ValueError, match=repr(key)):
        _shuffler(_source(0)).load_state_dict(state)


def test_a_corrupt_running_estimate_is_refused_on_resume():
    source = _source(0)
    state = _state_after(source)
    state["cost_sum"] += 1.0
    with pytest.raises(ValueError, match="cost_sum"):
        _resume(source, state)

"""Partitioners: exact cover, equal counts where promised, and quality against brute force."""

import itertools

import numpy as np
import pytest
import torch
from gem_loadbalance import METHODS, max_over_mean, part_loads, partition
from hypothesis import given
from hypothesis import strategies as st

costs_strategy = st.one_of(
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=0, max_size=60),
    st.builds(
        lambda n, seed: np.exp(np.random.default_rng(seed).normal(0, 2, n)).tolist(),
        st.integers(0, 200),
        st.integers(0, 2**16),
    ),
)


@given(costs_strategy, st.integers(1, 12), st.sampled_from(METHODS))
def test_every_index_exactly_once_and_counts(costs, k, method):
    parts = partition(costs, k, method=method)
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    if method != "greedy":
        assert {len(p) for p in parts} <= {len(costs) // k, len(costs) // k + 1}


def _optimum_equal_counts(costs, k):
    """Brute force: the smallest max part over every assignment with counts n//k or n//k + 1."""
    n = len(costs)
    labels = np.array(list(itertools.product(range(k), repeat=n)))  # [k**n, n]
    one_hot = labels[:, :, None] == np.arange(k)  # [k**n, n, k]
    counts = one_hot.sum(axis=1)
    loads = (one_hot * np.asarray(costs)[None, :, None]).sum(axis=1)
    valid = counts.max(axis=1) - counts.min(axis=1) <= 1
    return float(loads.max(axis=1)[valid].min())


@given(
    st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=2, max_size=8),
    st.integers(2, 3),
)
def test_capped_methods_against_brute_force(costs, k):
    costs = np.asarray(costs)
    optimum = _optimum_equal_counts(costs, k)
    for method in ("lpt_capped", "kk"):
        heaviest = part_loads(costs, partition(costs, k, method=method)).max()
        # Graham's 4/3 bound holds for LPT; both methods must at least reach the optimum.
        assert heaviest >= optimum - 1e-9
        assert heaviest <= 4 / 3 * optimum + 1e-9 or heaviest <= costs.max() + 1e-9


def test_greedy_meets_grahams_bound():
    costs = np.random.default_rng(0).uniform(1, 10, size=7)
    heaviest = part_loads(costs, partition(costs, 3, method="greedy")).max()
    lower_bound = max(costs.sum() / 3, costs.max())
    assert heaviest <= (4 / 3 - 1 / 9) * _optimum_equal_counts(costs, 3) + 1e-9
    assert heaviest >= lower_bound - 1e-9


def test_many_items_per_part_balance_closely():
    uniform = np.random.default_rng(1).uniform(1, 2, size=4096)
    for method in METHODS:
        assert max_over_mean(part_loads(uniform, partition(uniform, 16, method=method))) < 1.001
    # Heavy tails: the LPT methods stay close; balanced KK can leave a few parts several percent
    # heavy (its merges only see each partial partition's spread), one reason LPT is the default.
    heavy = np.exp(np.random.default_rng(1).normal(0, 1, size=4096))
    for method in ("lpt_capped", "greedy"):
        assert max_over_mean(part_loads(heavy, partition(heavy, 16, method=method))) < 1.01


def test_tensor_input_and_deterministic():
    costs = torch.tensor([5.0, 1.0, 3.0, 3.0, 2.0, 2.0])
    assert partition(costs, 2) == partition(costs.numpy(), 2)
    assert partition(costs, 2, method="kk") == partition(costs, 2, method="kk")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="k must be"):
        partition([1.0], 0)
    with pytest.raises(ValueError, match="method"):
        partition([1.0], 1, method="best")
    with pytest.raises(ValueError, match="non-negative"):
        partition([1.0, -1.0], 2)
    with pytest.raises(ValueError, match="1-D"):
        partition([[1.0]], 1)

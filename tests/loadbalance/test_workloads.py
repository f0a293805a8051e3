"""The benchmark workloads: the figures docs/workloads states, determinism, the shapes of J6/J7."""

import dataclasses

import numpy as np
import pytest
from gem_loadbalance.workloads import (
    WORKLOADS,
    AttentionWorkload,
    LogNormalLengths,
    UniformLengths,
    lengths,
    lognormal_lengths,
)


def test_j1_is_the_batch_the_tables_measure():
    j1 = lengths("J1")
    assert j1.dtype == np.int64 and j1.shape == (64,)
    assert round(int(j1.sum()) / 1000, 1) == 52.5 and int(j1.max()) == 3635
    assert round(1 - j1.sum() / (j1.size * j1.max()), 2) == 0.77  # padding of a padded batch
    assert j1.min() >= 32


def test_the_definition_is_the_numpy_formula():
    rng = np.random.default_rng(0)
    expected = np.clip(np.exp(rng.normal(np.log(512), 1.0, size=64)), 32, 16384).astype(np.int64)
    assert np.array_equal(lengths("J1"), expected)
    assert np.array_equal(lengths("J7"), np.random.default_rng(5).integers(1, 49, 3000))


def test_draws_are_deterministic_and_seeded():
    for wid in WORKLOADS:
        assert np.array_equal(lengths(wid), lengths(wid)), wid
    assert np.array_equal(lengths("J1", seed=0), lengths("J1"))
    assert not np.array_equal(lengths("J1", seed=1), lengths("J1"))
    assert np.array_equal(lengths("B1", seed=[0, 3, 2]), lengths("B1", seed=[0, 3, 2]))


def test_derived_workloads_share_their_lengths():
    assert np.array_equal(lengths("J3"), lengths("J1"))
    assert np.array_equal(lengths("J4"), lengths("J1"))
    assert np.array_equal(lengths("J5"), lengths("J2"))
    b1 = WORKLOADS["B1"]
    assert dataclasses.replace(b1.lengths, batch=64) == WORKLOADS["J1"].lengths
    assert lengths("B1").shape == (b1.local_batch,) == (1024,)


def test_j6_and_j7_shapes():
    j6, j7 = WORKLOADS["J6"], WORKLOADS["J7"]
    assert isinstance(j6, AttentionWorkload) and (j6.heads, j6.head_dim) == (8, 64)
    assert (j7.heads, j7.head_dim) == (4, 64)
    assert isinstance(j6.lengths, LogNormalLengths) and isinstance(j7.lengths, UniformLengths)
    l6 = lengths("J6")
    assert l6.shape == (192,) and l6.min() >= 4 and l6.max() <= 24000
    l7 = lengths("J7")
    assert l7.dtype == np.int64 and l7.shape == (3000,)
    assert l7.min() == 1 and l7.max() == 48  # both ends of [1, 48] occur in 3000 draws


def test_draw_and_lognormal_lengths_agree():
    dist = WORKLOADS["J2"].lengths
    a = dist.draw(np.random.default_rng(9), 100)
    b = lognormal_lengths(np.random.default_rng(9), 100, median=2048, sigma=1.0, lo=256, hi=20000)
    assert np.array_equal(a, b) and a.min() >= 256 and a.max() <= 20000


def test_errors():
    with pytest.raises(KeyError, match="unknown workload 'J9'.*J1"):
        lengths("J9")
    with pytest.raises(ValueError, match="lo <= hi"):
        LogNormalLengths(batch=4, median=10, sigma=1.0, lo=5, hi=4, seed=0)
    with pytest.raises(ValueError, match="lo <= hi"):
        UniformLengths(batch=4, lo=5, hi=4, seed=0)

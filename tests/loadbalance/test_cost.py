"""Cost model: the formula, its input handling, and the non-negative fit to step times."""

import numpy as np
import pytest
import torch
from gem_loadbalance import CostModel, expected_sample_cost, fit_cost_model, sample_cost


def test_formula_on_every_input_kind():
    assert sample_cost(1024, a=1.0, b=1 / 1024) == 2048.0
    np.testing.assert_allclose(sample_cost([0, 2, 4], a=2.0, b=0.5), [0.0, 6.0, 16.0])
    out = sample_cost(torch.tensor([1, 3]), a=1.0, b=1.0)
    assert out.dtype == torch.float64 and out.tolist() == [2.0, 12.0]
    assert expected_sample_cost(np.array([2, 4]), a=2.0, b=0.5) == 11.0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="lengths must be non-negative"):
        sample_cost([-1], a=1.0, b=1.0)
    with pytest.raises(TypeError, match="integers"):
        sample_cost([1.5], a=1.0, b=1.0)
    with pytest.raises(TypeError, match="integers"):
        sample_cost(torch.tensor([1.0]), a=1.0, b=1.0)
    with pytest.raises(ValueError, match="b must be"):
        sample_cost([1], a=1.0, b=-1.0)
    with pytest.raises(ValueError, match="at least one length"):
        expected_sample_cost([], a=1.0, b=1.0)
    with pytest.raises(ValueError, match="one time per entry"):
        fit_cost_model([[1, 2]], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least 3 measured steps"):
        fit_cost_model([[1, 2]], [1.0])


def test_fit_recovers_coefficients_from_noisy_step_times():
    rng = np.random.default_rng(0)
    steps = [
        np.clip(np.exp(rng.normal(np.log(512), 1.0, 256)), 32, 16384).astype(np.int64)
        for _ in range(40)
    ]
    a, b, overhead = 2e-6, 3e-9, 5e-3
    times = [overhead + a * s.sum() + b * (s.astype(np.float64) ** 2).sum() for s in steps]
    times = np.asarray(times) * (1 + 0.01 * rng.standard_normal(len(times)))
    model = fit_cost_model(steps, times)
    assert isinstance(model, CostModel)
    assert model.a == pytest.approx(a, rel=0.15)
    assert model.b == pytest.approx(b, rel=0.05)
    assert model.r2 > 0.95
    np.testing.assert_allclose(model.sample_cost([10]), [model.a * 10 + model.b * 100])


def test_fit_never_returns_negative_coefficients():
    # Times that fall with length would need a < 0; the constrained fit pins a at zero instead.
    steps = [[10], [20], [30], [40]]
    model = fit_cost_model(steps, [4.0, 3.0, 2.0, 1.0], fit_overhead=False)
    assert model.a >= 0 and model.b >= 0 and model.overhead == 0.0

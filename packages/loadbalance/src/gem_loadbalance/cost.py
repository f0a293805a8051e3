"""The cost model: what one sample costs to train, and how to fit it to measured step times.

A sample whose sequence has ``L`` tokens costs about ``a·L + b·L²``: the linear term covers the
per-token work (embeddings, MLPs, projections), the quadratic term the attention over the sequence.
``b / a`` is roughly the inverse of the length at which attention starts to dominate (1/1024 on
workload B1). The balancer only needs costs up to a common factor, but the ratio ``b / a`` decides
which samples count as heavy, so it should come from the real kernels: ``fit_cost_model`` takes
per-step token statistics and measured step times and fits ``time ≈ overhead + a·ΣL + b·ΣL²`` by
non-negative least squares (every subset of free coefficients is tried and the best feasible fit
kept, exact for three unknowns).

``expected_sample_cost`` turns a sample of lengths (dataset metadata, read identically by every
rank) into the mean cost per sample: the common anchor ``BaseBatchShuffler(expected_cost=...)``
aims at, so that all ranks agree on their target from the first step.
"""

from dataclasses import dataclass
from itertools import combinations

import numpy as np
import torch

__all__ = ["CostModel", "sample_cost", "expected_sample_cost", "fit_cost_model"]


def _lengths_array(name: str, lengths) -> np.ndarray:
    if isinstance(lengths, torch.Tensor):
        if lengths.is_floating_point() or lengths.is_complex():
            raise TypeError(f"{name} must hold integers, got a tensor of dtype {lengths.dtype}")
        array = lengths.detach().cpu().numpy()
    else:
        array = np.asarray(lengths)
        if array.size == 0:
            array = array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.size and array.min() < 0:
        raise ValueError(f"{name} must be non-negative, got a minimum of {int(array.min())}")
    return array.astype(np.float64)


def _check_coefficient(name: str, value) -> float:
    value = float(value)
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite non-negative number, got {value}")
    return value


def sample_cost(lengths, *, a: float, b: float):
    """``a·L + b·L²`` per sample, as float64.

    Args:
        lengths: non-negative integer lengths of any shape: an int, a sequence, a numpy array or
            an integer tensor (any device).
        a, b: the cost per token and per token squared (finite, ≥ 0).

    Returns:
        A float64 tensor of ``lengths``' shape on its device for a tensor; a float for a scalar;
        a float64 numpy array otherwise.

    Raises:
        TypeError: a floating-point or complex tensor (lengths are counts).
        ValueError: a negative length, or ``a`` / ``b`` negative or not finite.
    """
    a = _check_coefficient("a", a)
    b = _check_coefficient("b", b)
    if isinstance(lengths, torch.Tensor):
        if lengths.is_floating_point() or lengths.is_complex():
            raise TypeError(f"lengths must hold integers, got a tensor of dtype {lengths.dtype}")
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError(f"lengths must be non-negative, got a minimum of {int(lengths.min())}")
        as_float = lengths.to(torch.float64)
        return a * as_float + b * as_float * as_float
    array = _lengths_array("lengths", lengths)
    cost = a * array + b * array * array
    return float(cost) if cost.ndim == 0 else cost


def expected_sample_cost(lengths, *, a: float, b: float) -> float:
    """Mean of ``sample_cost`` over a sample of lengths: the anchor every rank can share.

    ``lengths`` as for ``sample_cost`` (at least one); returns a float. ``ValueError`` for an
    empty sample and as ``sample_cost`` raises.
    """
    costs = sample_cost(lengths, a=a, b=b)
    if isinstance(costs, torch.Tensor):
        costs = costs.cpu().numpy()
    costs = np.atleast_1d(costs)
    if costs.size == 0:
        raise ValueError("lengths must hold at least one length to estimate an expected cost")
    return float(np.mean(costs))


@dataclass(frozen=True)
class CostModel:
    """``time ≈ overhead + a·ΣL + b·ΣL²`` per step; ``r2`` is the fit's coefficient of determination."""

    a: float
    b: float
    overhead: float
    r2: float

    def sample_cost(self, lengths):
        """``sample_cost(lengths, a=self.a, b=self.b)``."""
        return sample_cost(lengths, a=self.a, b=self.b)


def fit_cost_model(step_lengths, step_times, *, fit_overhead: bool = True) -> CostModel:
    """Fit ``a``, ``b`` (and a fixed per-step ``overhead``) to measured step times.

    ``step_lengths`` holds one sequence of lengths per measured step (the samples that step
    trained on), ``step_times`` the matching times (any unit; the coefficients come out in it).
    All coefficients are constrained to be non-negative; with ``fit_overhead=False`` the overhead
    is 0. Returns a ``CostModel`` with the fit's ``r2``.

    Raises:
        ValueError: ``step_times`` not 1-D with one entry per step, negative or non-finite times,
            fewer steps than free coefficients (3, or 2 without the overhead), or bad lengths.
    """
    step_lengths = list(step_lengths)
    times = np.asarray(step_times, dtype=np.float64)
    if times.ndim != 1 or times.size != len(step_lengths):
        raise ValueError(
            f"step_times must be 1-D with one time per entry of step_lengths ({len(step_lengths)}), "
            f"got shape {times.shape}"
        )
    if not np.all(np.isfinite(times)) or np.any(times < 0):
        raise ValueError("step_times must be finite and non-negative")
    columns = []
    for i, lengths in enumerate(step_lengths):
        array = _lengths_array(f"step_lengths[{i}]", lengths).ravel()
        columns.append((array.sum(), (array * array).sum()))
    features = np.asarray(columns, dtype=np.float64).reshape(-1, 2)
    if fit_overhead:
        features = np.hstack([features, np.ones((features.shape[0], 1))])
    n_free = features.shape[1]
    if times.size < n_free:
        raise ValueError(
            f"need at least {n_free} measured steps to fit {n_free} coefficients, got {times.size}"
        )
    # Columns are scaled to unit norm so that ΣL² (~1e9) and the overhead column (1) condition well.
    norms = np.linalg.norm(features, axis=0)
    norms[norms == 0] = 1.0
    scaled = features / norms
    best_coef, best_residual = np.zeros(n_free), float(np.sum(times * times))
    for size in range(1, n_free + 1):
        for subset in combinations(range(n_free), size):
            cols = list(subset)
            solution, *_ = np.linalg.lstsq(scaled[:, cols], times, rcond=None)
            if np.any(solution < 0):
                continue
            coef = np.zeros(n_free)
            coef[cols] = solution
            residual = float(np.sum((scaled @ coef - times) ** 2))
            if residual < best_residual:
                best_coef, best_residual = coef, residual
    coef = best_coef / norms
    total = float(np.sum((times - times.mean()) ** 2))
    r2 = 1.0 - best_residual / total if total > 0 else 1.0
    return CostModel(
        a=float(coef[0]), b=float(coef[1]), overhead=float(coef[2]) if fit_overhead else 0.0, r2=r2
    )

"""The project's benchmark workloads: jagged length distributions J1–J7 and the load-balance step B1.

Every benchmark, the trainer's default data and the load-balance simulator draw their sequence
lengths from here, so that numbers from different people and different weeks compare. A length
distribution is a small frozen dataclass that draws int64 lengths from a numpy ``Generator``:

- :class:`LogNormalLengths`: ``L = clip(exp(Normal(log(median), sigma)), lo, hi)`` truncated to
  int64, the heavy-tailed shape of user histories (J1–J6, and B1's per-rank batches);
- :class:`UniformLengths`: ``rng.integers(lo, hi + 1, batch)``, tiny histories (J7).

``lengths(workload_id)`` draws a workload's lengths with its own seed, exactly as the benchmark
tables were measured: the numpy calls and their order are part of the definition, since a
different call sequence draws different lengths from the same seed. ``seed=`` draws another
sample of the same distribution (an int or a sequence of ints, anything
``np.random.default_rng`` takes; B1 seeds each rank's step with ``[seed, step, rank]``).

The attention workloads also name their heads and head dim (J1–J5: 4 heads of 128; J6: 8 of 64;
J7: 4 of 64). J3 and J4 draw their jagged side as J1 does and J5 as J2 does; their fixed side
(64 keys per sample for J3, 32 learned seeds for J4, 64-token blocks for J5) is in ``what``.
This module lives in gem_loadbalance because the balancer's simulator is the one package that
needs the distributions at run time; the benchmarks and the trainer import it from here.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "WORKLOADS",
    "AttentionWorkload",
    "LoadBalanceWorkload",
    "LogNormalLengths",
    "UniformLengths",
    "lengths",
    "lognormal_lengths",
]

Seed = int | Sequence[int]


def lognormal_lengths(
    rng: np.random.Generator, n: int, *, median: float, sigma: float, lo: int, hi: int
) -> np.ndarray:
    """``n`` lengths ``clip(exp(Normal(log(median), sigma)), lo, hi)`` from ``rng``.

    Args:
        rng: the generator to draw from (it advances by ``n`` normal draws).
        n: how many lengths.
        median: the median length before clipping (> 0).
        sigma: the standard deviation of ``log(L)`` (≥ 0).
        lo, hi: the clip range, inclusive.

    Returns:
        int64 array ``[n]``, each value in ``[lo, hi]`` (the clipped float truncated toward zero).
    """
    return np.clip(np.exp(rng.normal(np.log(median), sigma, size=n)), lo, hi).astype(np.int64)


@dataclass(frozen=True)
class LogNormalLengths:
    """``batch`` lengths ``clip(exp(Normal(log(median), sigma)), lo, hi)`` drawn with ``seed``."""

    batch: int
    median: float
    sigma: float
    lo: int
    hi: int
    seed: int

    def __post_init__(self):
        if self.batch < 0 or self.median <= 0 or self.sigma < 0 or not 0 <= self.lo <= self.hi:
            raise ValueError(
                f"need batch >= 0, median > 0, sigma >= 0 and 0 <= lo <= hi, got {self}"
            )

    def draw(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray:
        """``n`` lengths (default ``batch``) from ``rng``: int64 ``[n]`` in ``[lo, hi]``."""
        n = self.batch if n is None else n
        return lognormal_lengths(
            rng, n, median=self.median, sigma=self.sigma, lo=self.lo, hi=self.hi
        )


@dataclass(frozen=True)
class UniformLengths:
    """``batch`` lengths uniform over the integers ``lo..hi`` (both included), drawn with ``seed``."""

    batch: int
    lo: int
    hi: int
    seed: int

    def __post_init__(self):
        if self.batch < 0 or not 0 <= self.lo <= self.hi:
            raise ValueError(f"need batch >= 0 and 0 <= lo <= hi, got {self}")

    def draw(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray:
        """``n`` lengths (default ``batch``) from ``rng``: int64 ``[n]`` in ``[lo, hi]``."""
        n = self.batch if n is None else n
        return rng.integers(self.lo, self.hi + 1, n).astype(np.int64, copy=False)


LengthDistribution = LogNormalLengths | UniformLengths


@dataclass(frozen=True)
class AttentionWorkload:
    """A jagged attention workload: its length distribution, heads and head dim (bf16 on a GPU)."""

    id: str
    what: str
    lengths: LengthDistribution
    heads: int = 4
    head_dim: int = 128


@dataclass(frozen=True)
class LoadBalanceWorkload:
    """A data-parallel step: ``ranks`` ranks, each a local batch of ``local_batch`` samples read
    as sub-batches of ``sub_batch``, each sample costing ``a·L + b·L²``. ``lengths`` draws one
    rank's natural local batch (its ``batch`` is ``local_batch``)."""

    id: str
    what: str
    lengths: LogNormalLengths
    ranks: int
    local_batch: int
    sub_batch: int
    a: float
    b: float


_J1 = LogNormalLengths(batch=64, median=512, sigma=1.0, lo=32, hi=16384, seed=0)
_J2 = LogNormalLengths(batch=16, median=2048, sigma=1.0, lo=256, hi=20000, seed=1)

WORKLOADS: dict[str, AttentionWorkload | LoadBalanceWorkload] = {
    w.id: w
    for w in (
        AttentionWorkload("J1", "causal self-attention over user history", _J1),
        AttentionWorkload("J2", "long-tail self-attention", _J2),
        AttentionWorkload(
            "J3", "cross-attention: jagged Q as J1 over 64 keys per sample, non-causal", _J1
        ),
        AttentionWorkload("J4", "PMA: 32 learned seeds over jagged K/V as J1, non-causal", _J1),
        AttentionWorkload("J5", "BlockAttention, 64-token blocks with RoPE, lengths as J2", _J2),
        AttentionWorkload(
            "J6",
            "heavy-tailed self-attention at head dim 64",
            LogNormalLengths(batch=192, median=256, sigma=1.4, lo=4, hi=24000, seed=11),
            heads=8,
            head_dim=64,
        ),
        AttentionWorkload(
            "J7",
            "tiny histories (the tile-packing regime)",
            UniformLengths(batch=3000, lo=1, hi=48, seed=5),
            heads=4,
            head_dim=64,
        ),
        LoadBalanceWorkload(
            "B1",
            "rank balance: 64 ranks, local batch 1024 from 128-sample sub-batches, J1 lengths",
            LogNormalLengths(batch=1024, median=512, sigma=1.0, lo=32, hi=16384, seed=0),
            ranks=64,
            local_batch=1024,
            sub_batch=128,
            a=1.0,
            b=1.0 / 1024,
        ),
    )
}


def lengths(workload_id: str, *, seed: Seed | None = None) -> np.ndarray:
    """The sequence lengths of workload ``workload_id``.

    Args:
        workload_id: a key of ``WORKLOADS`` ("J1" … "J7", "B1").
        seed: ``None`` draws the workload's own sample (the one its benchmark tables measure);
            an int or a sequence of ints draws another sample of the same distribution.

    Returns:
        int64 array ``[batch]`` (B1: one rank's natural local batch of 1024).

    Raises:
        KeyError: ``workload_id`` names no workload; the message lists the known ids.
    """
    if workload_id not in WORKLOADS:
        raise KeyError(f"unknown workload {workload_id!r}; known: {', '.join(WORKLOADS)}")
    dist = WORKLOADS[workload_id].lengths
    return dist.draw(np.random.default_rng(dist.seed if seed is None else seed))

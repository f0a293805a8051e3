"""Base Batch Shuffling: balanced local batches on every rank, with no communication at all.

Every rank reads its own stream of sub-batches (say 128 samples each) and trains on local batches
of ``local_batch_size`` samples. With heavy-tailed sequence lengths the unluckiest rank of a step
draws far more work than the mean and every other rank waits for it. Rebalancing globally needs
an all-to-all per step; this shuffler instead makes every rank's batch cost the *same target*, so
that ranks agree without talking.

How a step is formed
    The shuffler keeps a pool: the samples of the batch being formed, ``lookahead`` further local
    batches read ahead, and samples held back from earlier batches. Sample ``p`` of the stream
    (counting from 0) belongs to *natural* batch ``p // local_batch_size``, the batch it would be
    in without shuffling. ``local_batch.plan_local_batch`` picks ``local_batch_size`` pooled samples
    whose total cost lands on the target; a sample may leave up to ``lookahead`` batches early and
    at most ``max_delay`` batches late (it is forced in at its limit). Every sample comes out
    exactly once; only the final batch may be shorter, and it is dropped only with
    ``drop_last=True``.
The target
    ``count · mean_cost``, moved toward the pool's excess but clipped to ``headroom`` either side
    (``local_batch.batch_target``), and raised when heavy samples pile up near their delay limit
    (``local_batch.deadline_floor``). Every rank must hold the same ``mean_cost``, or the ranks
    aim at different targets and that disagreement is imbalance. Three ways to get it:
    ``expected_cost`` (``expected_sample_cost`` over lengths every rank reads alike, e.g. dataset
    metadata), mixed with this rank's reads as if it were ``prior_weight`` samples (``inf``:
    fixed); otherwise ``calibration="agree"`` (the default): one all-reduce of the first
    look-ahead's cost over the ranks (``gem_loadbalance.agreement``), kept fixed for the run;
    or ``calibration="running"``, each rank's own running estimate, which disagrees across
    ranks by about cost CV / sqrt(samples read) for hundreds of steps. ``headroom`` (0.5% by
    default) bounds the heaviest rank at ``1 + headroom`` times neutral; so tight a clip needs
    ``max_delay=4`` (the default) so that a burst of heavy samples can leave over enough batches.
    ``python -m gem_loadbalance.simulate`` measures how much of the improvement a global
    repartition would give each of these captures (workload B1).
Determinism and resume
    The batches depend only on the stream and the configuration; ``seed`` only permutes the samples
    inside each emitted batch (per-step generator, so no generator state needs saving).
    ``state_dict()`` records the step, how far the source was read, a digest of what was read
    (``gem_loadbalance.state``), which stream positions sit in the pool and their costs, the
    estimator's sums and the delay histogram; a shuffler rebuilt over the same source and given
    ``load_state_dict(state)`` re-reads the source from its start up to that point (samples are
    opaque and never serialized) and then continues with exactly the batches the uninterrupted
    run would have produced. Every field is checked on load and again against what the replay
    re-reads, so a state over another source, or a corrupt one, is refused with the field named
    instead of resuming into different batches.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass

import numpy as np

from .agreement import agree_on_mean
from .local_batch import batch_target, deadline_floor, plan_local_batch
from .state import STATE_VERSION, SourceDigest, check_state

__all__ = ["ShufflerConfig", "ShufflerStats", "BaseBatchShuffler"]


@dataclass(frozen=True)
class ShufflerConfig:
    """What the shuffler does; every field is part of the saved state and checked on load."""

    local_batch_size: int
    lookahead: int = 2
    max_delay: int = 4
    headroom: float = 0.005
    gain: float = 1.0
    expected_cost: float | None = None
    prior_weight: float = float(2**20)
    calibration: str = "agree"
    seed: int = 0
    drop_last: bool = False

    def __post_init__(self):
        for name in ("local_batch_size", "lookahead", "max_delay", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.local_batch_size < 1:
            raise ValueError(f"local_batch_size must be >= 1, got {self.local_batch_size}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.lookahead < 0 or self.max_delay < 0:
            raise ValueError(
                f"lookahead and max_delay must be >= 0, got {self.lookahead} and {self.max_delay}"
            )
        for name in ("headroom", "gain"):
            value = float(getattr(self, name))
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not float(self.prior_weight) >= 0:
            raise ValueError(f"prior_weight must be >= 0 (inf: fixed), got {self.prior_weight}")
        if self.calibration not in ("agree", "running"):
            raise ValueError(f"calibration must be 'agree' or 'running', got {self.calibration!r}")
        if self.expected_cost is not None:
            value = float(self.expected_cost)
            if not np.isfinite(value) or value <= 0:
                raise ValueError(f"expected_cost must be a finite number > 0, got {value}")


@dataclass(frozen=True)
class ShufflerStats:
    """What the shuffler reports: batches and samples emitted, and how far samples moved.

    ``delay_counts[d]`` counts samples emitted ``d`` batches after their natural batch
    (negative: early, thanks to the look-ahead). ``last_target`` and ``last_cost`` describe the
    most recent batch.
    """

    batches: int
    samples: int
    delay_counts: dict[int, int]
    last_target: float
    last_cost: float

    @property
    def max_delay_seen(self) -> int:
        return max(self.delay_counts, default=0)


class _Pool:
    """The samples read but not yet emitted, in stream order; new sub-batches wait in chunks."""

    def __init__(self):
        self.positions = np.zeros(0, dtype=np.int64)
        self.costs = np.zeros(0, dtype=np.float64)
        self.samples: list = []
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, positions: np.ndarray, costs: np.ndarray, samples: list) -> None:
        self._chunks.append((positions, costs))
        self.samples.extend(samples)

    def consolidate(self) -> None:
        if self._chunks:
            self.positions = np.concatenate([self.positions, *(p for p, _ in self._chunks)])
            self.costs = np.concatenate([self.costs, *(c for _, c in self._chunks)])
            self._chunks = []

    def remove(self, chosen: np.ndarray) -> None:
        self.consolidate()
        keep = np.ones(self.costs.size, dtype=bool)
        keep[chosen] = False
        kept = np.flatnonzero(keep)
        self.positions, self.costs = self.positions[kept], self.costs[kept]
        self.samples = [self.samples[i] for i in kept.tolist()]


class BaseBatchShuffler:
    """Iterate over ``sub_batches`` and yield balanced local batches (lists of samples).

    ``sub_batches`` is re-iterable (a list, a ``DataLoader``, ...); each item is an iterable of
    opaque samples. Price samples with ``cost(sample) -> float`` or, faster, with
    ``sub_batch_cost(sub_batch) -> sequence of floats`` (exactly one of the two).

    Args:
        local_batch_size: samples per yielded batch (≥ 1).
        seed: permutes the samples inside each batch (≥ 0); the choice of samples ignores it.
        lookahead: local batches read ahead of the one being formed (≥ 0).
        max_delay: batches a sample may leave after its natural batch (≥ 0).
        headroom: the target's clip either side of neutral, a fraction (≥ 0).
        gain: the share of the pool's excess cost the target moves by (≥ 0).
        expected_cost: a shared expected cost of a sample (> 0), e.g.
            ``expected_sample_cost`` over lengths every rank reads alike; None: ``calibration``
            decides.
        prior_weight: how many samples ``expected_cost`` counts for in the running estimate
            (≥ 0; ``float("inf")``: ``expected_cost`` is used as is).
        calibration: without ``expected_cost``, ``"agree"`` (one all-reduce of the first
            look-ahead's cost sum and count over ``group`` before the first batch, then fixed;
            every rank must iterate) or ``"running"`` (each rank's own running estimate).
        group: the ``torch.distributed`` process group of ``"agree"``; None: the default group
            when ``torch.distributed`` is initialized, else this process alone. Not saved.
        drop_last: drop a short final batch.

    Yields lists of samples. Raises ``ValueError`` (or ``TypeError`` for a wrong type) for a bad
    option, both or neither of ``cost`` / ``sub_batch_cost``, a source that is not iterable, a
    pricing function that returns the wrong number of costs or negative ones, a batch that
    cannot be formed under ``max_delay``, ``calibration="agree"`` inside a ``DataLoader`` worker
    of a distributed job, and (on resume) a state or a source that is not the saved one.
    """

    def __init__(
        self,
        sub_batches: Iterable,
        *,
        cost: Callable[[object], float] | None = None,
        sub_batch_cost: Callable[[object], Iterable[float]] | None = None,
        local_batch_size: int,
        seed: int = 0,
        lookahead: int = 2,
        max_delay: int = 4,
        headroom: float = 0.005,
        gain: float = 1.0,
        expected_cost: float | None = None,
        prior_weight: float = float(2**20),
        calibration: str = "agree",
        group=None,
        drop_last: bool = False,
    ):
        if (cost is None) == (sub_batch_cost is None):
            raise ValueError("give exactly one of cost (per sample) and sub_batch_cost")
        if not isinstance(sub_batches, Iterable):
            raise TypeError(
                f"sub_batches must be an iterable of sub-batches, got {type(sub_batches).__name__}"
            )
        self.config = ShufflerConfig(
            local_batch_size=local_batch_size,
            lookahead=lookahead,
            max_delay=max_delay,
            headroom=headroom,
            gain=gain,
            expected_cost=None if expected_cost is None else float(expected_cost),
            prior_weight=float(prior_weight),
            calibration=calibration,
            seed=seed,
            drop_last=drop_last,
        )
        self._sub_batches = sub_batches
        self._cost = cost
        self._sub_batch_cost = sub_batch_cost
        self._group = group
        self._reset()
        self._resume_from: dict | None = None

    # ----------------------------------------------------------------------------- state
    def _reset(self):
        self._step = 0
        self._consumed_samples = 0
        self._consumed_sub_batches = 0
        self._digest = SourceDigest()
        self._pool = _Pool()
        self._cost_sum = 0.0
        self._cost_count = 0
        self._agreed_cost: float | None = None
        self._delay_counts: dict[int, int] = {}
        self._emitted = 0
        self._last_target = 0.0
        self._last_cost = 0.0

    def state_dict(self) -> dict:
        """The state after the most recently yielded batch (plain Python types only)."""
        return {
            "version": STATE_VERSION,
            "config": asdict(self.config),
            "step": self._step,
            "consumed_samples": self._consumed_samples,
            "consumed_sub_batches": self._consumed_sub_batches,
            "source_digest": self._digest.hexdigest(),
            "pool_positions": self._pool_view().positions.tolist(),
            "pool_costs": self._pool_view().costs.tolist(),
            "cost_sum": self._cost_sum,
            "cost_count": self._cost_count,
            "agreed_cost": self._agreed_cost,
            "delay_counts": {int(k): int(v) for k, v in self._delay_counts.items()},
            "emitted": self._emitted,
            "last_target": self._last_target,
            "last_cost": self._last_cost,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` on the next ``iter()`` (which re-reads the source up to it).

        ``ValueError`` naming the key or field for a state not saved by ``state_dict()`` (or of
        another version), lacking a key, saved under another configuration, or with a field of
        the wrong type, out of range or inconsistent (``gem_loadbalance.state.check_state``).
        What can only be checked against the source (``source_digest``, ``pool_costs``,
        ``cost_sum``) raises at the next ``iter()``, while the source is re-read.
        """
        self._resume_from = check_state(state, config=asdict(self.config))

    def stats(self) -> ShufflerStats:
        """Batches and samples emitted so far, the delay histogram and the last batch's target."""
        return ShufflerStats(
            batches=self._step,
            samples=self._emitted,
            delay_counts=dict(sorted(self._delay_counts.items())),
            last_target=self._last_target,
            last_cost=self._last_cost,
        )

    # ----------------------------------------------------------------------------- reading
    def _pool_view(self) -> _Pool:
        self._pool.consolidate()
        return self._pool

    def _price(self, sub_batch, samples: list) -> np.ndarray:
        if self._sub_batch_cost is not None:
            costs = np.asarray(self._sub_batch_cost(sub_batch), dtype=np.float64).ravel()
            if costs.size != len(samples):
                raise ValueError(
                    f"sub_batch_cost returned {costs.size} costs for a sub-batch of "
                    f"{len(samples)} samples"
                )
        else:
            costs = np.array([float(self._cost(s)) for s in samples], dtype=np.float64)
        if costs.size and (not np.all(np.isfinite(costs)) or costs.min() < 0):
            raise ValueError("sample costs must be finite and non-negative")
        return costs

    def _read_one(self, source: Iterator) -> bool:
        """Read the next sub-batch into the pool; False once the source is exhausted."""
        try:
            sub_batch = next(source)
        except StopIteration:
            return False
        samples = list(sub_batch)
        costs = self._price(sub_batch, samples)
        start = self._consumed_samples
        self._pool.add(np.arange(start, start + len(samples), dtype=np.int64), costs, samples)
        self._consumed_samples += len(samples)
        self._consumed_sub_batches += 1
        self._digest.update(costs)
        self._cost_sum += float(costs.sum())
        self._cost_count += costs.size
        return True

    def _replay(self, source: Iterator, state: dict) -> None:
        """Re-read and re-price the source up to the saved point, check it against ``state`` and
        rebuild the pool from the saved positions."""
        self._reset()
        wanted = state["pool_positions"]
        position, cursor, pool_costs = 0, 0, []
        for n in range(state["consumed_sub_batches"]):
            try:
                sub_batch = next(source)
            except StopIteration:
                raise ValueError(
                    f"the source ended after {n} sub-batches but the state was saved after "
                    f"{state['consumed_sub_batches']}: it is not the same source"
                ) from None
            samples = list(sub_batch)
            costs = self._price(sub_batch, samples)
            self._digest.update(costs)
            self._cost_sum += float(costs.sum())
            for sample, cost in zip(samples, costs.tolist(), strict=True):
                if cursor < len(wanted) and wanted[cursor] == position:
                    self._pool.samples.append(sample)
                    pool_costs.append(cost)
                    cursor += 1
                position += 1
        if position != state["consumed_samples"] or cursor != len(wanted):
            raise ValueError(
                f"replaying the source gave {position} samples, the state expects "
                f"{state['consumed_samples']}: it is not the same source"
            )
        if self._digest.hexdigest() != state["source_digest"]:
            raise ValueError(
                f"state field 'source_digest' is {state['source_digest']} but re-reading the "
                f"source gives {self._digest.hexdigest()}: it is not the same source (or its "
                "samples are priced differently)"
            )
        differ = np.flatnonzero(np.asarray(pool_costs) != np.asarray(state["pool_costs"]))
        if differ.size:
            i = int(differ[0])
            raise ValueError(
                f"state field 'pool_costs' is corrupt: position {wanted[i]} costs "
                f"{pool_costs[i]} in the source, {state['pool_costs'][i]} in the state"
            )
        if self._cost_sum != state["cost_sum"]:
            raise ValueError(
                f"state field 'cost_sum' is {state['cost_sum']} but the source re-read sums to "
                f"{self._cost_sum}"
            )
        self._pool.positions = np.asarray(wanted, dtype=np.int64)
        self._pool.costs = np.asarray(pool_costs, dtype=np.float64)
        self._step = state["step"]
        self._consumed_samples = state["consumed_samples"]
        self._consumed_sub_batches = state["consumed_sub_batches"]
        self._cost_count = state["cost_count"]
        self._agreed_cost = state["agreed_cost"]
        self._delay_counts = dict(state["delay_counts"])
        self._emitted = state["emitted"]
        self._last_target = state["last_target"]
        self._last_cost = state["last_cost"]

    def _mean_cost(self) -> float:
        cfg = self.config
        if cfg.expected_cost is not None:
            weight = cfg.prior_weight
            if np.isinf(weight):
                return cfg.expected_cost
            return (weight * cfg.expected_cost + self._cost_sum) / (weight + self._cost_count)
        if self._agreed_cost is not None:
            return self._agreed_cost
        return self._cost_sum / self._cost_count if self._cost_count else 0.0

    def _agree_once(self) -> None:
        """Before the first batch: every rank's mean over the first look-ahead, all-reduced."""
        cfg = self.config
        if cfg.expected_cost is None and cfg.calibration == "agree" and self._step == 0:
            if self._agreed_cost is None:
                self._agreed_cost = agree_on_mean(
                    self._cost_sum, self._cost_count, group=self._group
                )

    # ----------------------------------------------------------------------------- batches
    def __iter__(self) -> Iterator[list]:
        source = iter(self._sub_batches)
        if self._resume_from is not None:
            state, self._resume_from = self._resume_from, None
            self._replay(source, state)
        else:
            self._reset()
        return self._batches(source)

    def _batches(self, source: Iterator) -> Iterator[list]:
        cfg = self.config
        size = cfg.local_batch_size
        exhausted = False
        while True:
            horizon = (self._step + cfg.lookahead + 1) * size
            while not exhausted and self._consumed_samples < horizon:
                exhausted = not self._read_one(source)
            self._agree_once()
            pool = self._pool_view()
            if not pool.positions.size:
                return
            count = min(size, pool.positions.size)
            if count < size and cfg.drop_last:
                return
            natural = pool.positions // size
            target = batch_target(
                count=count,
                mean_cost=self._mean_cost(),
                pool_cost=float(pool.costs.sum()),
                pool_count=pool.costs.size,
                headroom=cfg.headroom,
                gain=cfg.gain,
            )
            floor = deadline_floor(
                pool.costs, natural, step=self._step, count=count, max_delay=cfg.max_delay
            )
            target = max(target, floor)
            chosen = plan_local_batch(
                pool.costs,
                natural,
                step=self._step,
                count=count,
                target=target,
                max_delay=cfg.max_delay,
                lookahead=cfg.lookahead,
            )
            order = np.random.default_rng([cfg.seed, self._step]).permutation(chosen.size)
            chosen = chosen[order]
            batch = [pool.samples[i] for i in chosen.tolist()]
            delays, delay_n = np.unique(self._step - natural[chosen], return_counts=True)
            for d, n in zip(delays.tolist(), delay_n.tolist(), strict=True):
                self._delay_counts[d] = self._delay_counts.get(d, 0) + n
            self._last_target = float(target)
            self._last_cost = float(pool.costs[chosen].sum())
            pool.remove(chosen)
            self._step += 1
            self._emitted += len(batch)
            yield batch

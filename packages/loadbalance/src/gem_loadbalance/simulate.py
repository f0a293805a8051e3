"""Simulate many ranks, each with its own stream, and measure how evenly their steps cost.

``python -m gem_loadbalance.simulate --ranks 64`` reproduces workload B1: every rank reads
128-sample sub-batches whose lengths follow J1 (log-normal, median 512, sigma 1.0, clipped to
[32, 16384]; rank ``r`` draws step ``s`` from ``default_rng([seed, s, r])``) and trains on local
batches of 1024 samples priced ``L + L²/1024``. For each step it records the heaviest rank's cost
over the mean rank's cost for

- no shuffling: every rank trains on its natural batch, as it was read;
- the Base Batch Shuffler as it runs by default (``calibration="agree"``): the mean cost
  all-reduced once over every rank's first look-ahead, then fixed; the simulation computes that
  all-reduce's value directly (the sum of the ranks' costs over the sum of their counts) and
  gives it as ``expected_cost`` with ``prior_weight=inf``, which is what the agreement does;
- the Base Batch Shuffler with the running estimate of the mean cost (``calibration="running"``,
  nothing shared at all),
  from a cold start (the estimate begins with the first look-ahead) and as it stands after
  ``warm_steps`` earlier steps of training (each rank's estimator state after reading that much of
  its own stream, which is exactly a prior of that weight at that rank's historical mean);
- the Base Batch Shuffler given ``expected_cost`` from a shared calibration sample of lengths
  (drawn from a seed no rank reads), the anchor a real job computes from dataset metadata;
- a global optimum: all ranks' samples of the step partitioned together (capped LPT, and
  optionally Karmarkar–Karp), which needs an all-to-all in a real job.

It prints the mean and p99 of the per-step ratio, the share of the possible improvement captured,
``(none - shuffler) / (none - optimum)`` on the means, the shuffler's planning time per local
batch and how far samples moved. ``--plot FILE.png`` draws the per-step ratios with matplotlib
(the optional ``plot`` extra, ``gem-loadbalance[plot]``); without it the command prints one line
saying so instead. Each rank's stream holds ``lookahead`` batches beyond the measured steps, so
every measured step has its full look-ahead (as in the middle of a long run).

The defaults are workload B1 as ``gem_loadbalance.workloads`` defines it.
"""

import argparse
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .cost import expected_sample_cost, sample_cost
from .partition import max_over_mean, part_loads, partition
from .shuffler import BaseBatchShuffler, ShufflerConfig
from .workloads import WORKLOADS, lognormal_lengths

__all__ = [
    "AGREED",
    "NO_MATPLOTLIB",
    "SimulationConfig",
    "SimulationResult",
    "main",
    "plot_ratios",
    "simulate",
]

_CALIBRATION_SEED = 2**31 - 1
_HISTORY_SEED = 2**31 - 2
_B1 = WORKLOADS["B1"]
AGREED = "shuffler, agreed at start (the default)"
NO_MATPLOTLIB = "matplotlib is not installed (pip install 'gem-loadbalance[plot]'): no plot"


@dataclass(frozen=True)
class SimulationConfig:
    """One simulation: the workload (B1 by default) and the shuffler's settings.

    ``ranks`` ranks run ``steps`` measured steps of ``local_batch`` samples each, read as
    sub-batches of ``sub_batch``; lengths are log-normal (``median``, ``sigma``) clipped to
    ``[min_len, max_len]``; a sample costs ``a·L + b·L²``; rank ``r`` draws step ``s`` from
    ``default_rng([seed, s, r])``. ``lookahead``, ``max_delay``, ``headroom`` and ``gain`` are the
    shuffler's (``BaseBatchShuffler``); ``warm_steps`` adds the running estimate after that many
    earlier steps (0: skip); ``calibration_samples`` is the size of the shared calibration sample;
    ``optimum_methods`` the partition methods of the global optimum. ``ValueError`` on a count
    below 1 (``warm_steps`` below 0), ``min_len > max_len`` or no optimum method.
    """

    ranks: int = _B1.ranks
    steps: int = 100
    local_batch: int = _B1.local_batch
    sub_batch: int = _B1.sub_batch
    median: float = _B1.lengths.median
    sigma: float = _B1.lengths.sigma
    min_len: int = _B1.lengths.lo
    max_len: int = _B1.lengths.hi
    a: float = _B1.a
    b: float = _B1.b
    seed: int = _B1.lengths.seed
    lookahead: int = ShufflerConfig.lookahead
    max_delay: int = ShufflerConfig.max_delay
    headroom: float = ShufflerConfig.headroom
    gain: float = ShufflerConfig.gain
    warm_steps: int = 1000
    calibration_samples: int = 2**20
    optimum_methods: tuple[str, ...] = ("lpt_capped",)

    def __post_init__(self):
        if self.warm_steps < 0:
            raise ValueError(f"warm_steps must be >= 0, got {self.warm_steps}")
        for name in ("ranks", "steps", "local_batch", "sub_batch", "calibration_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.min_len <= self.max_len:
            raise ValueError(f"need 0 < min_len <= max_len, got {self.min_len}, {self.max_len}")
        if not self.optimum_methods:
            raise ValueError("optimum_methods must name at least one partition method")


@dataclass
class SimulationResult:
    """Per-step max/mean ratios by setting, plus the shufflers' timing and delay reports."""

    ratios: dict[str, np.ndarray]
    plan_ms: dict[str, float] = field(default_factory=dict)
    delay_counts: dict[str, dict[int, int]] = field(default_factory=dict)

    @property
    def optimum(self) -> np.ndarray:
        return np.min([v for k, v in self.ratios.items() if k.startswith("global")], axis=0)

    def captured(self, setting: str) -> float:
        """Share of the possible improvement captured, on the means over steps."""
        none, best = self.ratios["no shuffling"].mean(), self.optimum.mean()
        return float((none - self.ratios[setting].mean()) / (none - best)) if none > best else 1.0


def _lengths(cfg: SimulationConfig, n: int, seed) -> np.ndarray:
    return lognormal_lengths(
        np.random.default_rng(seed),
        n,
        median=cfg.median,
        sigma=cfg.sigma,
        lo=cfg.min_len,
        hi=cfg.max_len,
    )


def natural_batch_lengths(cfg: SimulationConfig, rank: int, step: int) -> np.ndarray:
    """The lengths (int64 ``[local_batch]``) of rank ``rank``'s natural batch at step ``step``."""
    return _lengths(cfg, cfg.local_batch, [cfg.seed, step, rank])


def _rank_sub_batches(cfg: SimulationConfig, rank: int):
    for step in range(cfg.steps + cfg.lookahead):
        lengths = natural_batch_lengths(cfg, rank, step)
        for start in range(0, cfg.local_batch, cfg.sub_batch):
            yield lengths[start : start + cfg.sub_batch]


class _RankStreams:
    """A re-iterable source per rank (what a data loader would be)."""

    def __init__(self, cfg: SimulationConfig, rank: int):
        self.cfg, self.rank = cfg, rank

    def __iter__(self):
        return _rank_sub_batches(self.cfg, self.rank)


def agreed_mean(cfg: SimulationConfig) -> float:
    """The mean cost ``calibration="agree"`` all-reduces: every rank's first look-ahead
    (``lookahead + 1`` local batches), summed over the ranks and divided by their count."""
    first = range(cfg.lookahead + 1)
    total, count = 0.0, 0
    for r in range(cfg.ranks):  # each rank's sum as that rank's shuffler accumulates it
        rank_sum = 0.0
        for step in first:
            lengths = natural_batch_lengths(cfg, r, step)
            for start in range(0, cfg.local_batch, cfg.sub_batch):
                costs = sample_cost(lengths[start : start + cfg.sub_batch], a=cfg.a, b=cfg.b)
                rank_sum += float(costs.sum())
        total += rank_sum
        count += len(first) * cfg.local_batch
    return total / count


def simulate(cfg: SimulationConfig, *, progress=None) -> SimulationResult:
    """Run every setting over ``cfg.steps`` steps (see the module docstring).

    Args:
        cfg: the workload and the shuffler's settings.
        progress: called as ``progress(step, steps)`` after each step, if given.

    Returns:
        A ``SimulationResult``: per-step max/mean ratios (float ``[steps]``) by setting, the
        shufflers' planning time per local batch and their delay histograms.

    Raises:
        ValueError: from the shuffler or the partitioner when the settings cannot be met (say, a
            local batch larger than what the look-ahead can hold).
    """
    a, b = cfg.a, cfg.b
    price = lambda sub_batch: sample_cost(np.asarray(sub_batch), a=a, b=b)
    calibration = _lengths(cfg, cfg.calibration_samples, [cfg.seed, _CALIBRATION_SEED])
    # Each setting: (expected_cost, prior_weight) per rank.
    shuffler_settings = {
        AGREED: [(agreed_mean(cfg), float("inf"))] * cfg.ranks,
        "shuffler, running estimate (cold)": [(None, 0.0)] * cfg.ranks,
    }
    if cfg.warm_steps:
        history = cfg.warm_steps * cfg.local_batch
        shuffler_settings[f"shuffler, running estimate after {cfg.warm_steps} steps"] = [
            (
                expected_sample_cost(
                    _lengths(cfg, history, [cfg.seed, _HISTORY_SEED, r]), a=a, b=b
                ),
                history,
            )
            for r in range(cfg.ranks)
        ]
    shared = expected_sample_cost(calibration, a=a, b=b)
    shuffler_settings["shuffler, calibrated expected_cost"] = [
        (shared, float(cfg.calibration_samples))
    ] * cfg.ranks
    shufflers, iterators = {}, {}
    for name, anchors in shuffler_settings.items():
        shufflers[name] = [
            BaseBatchShuffler(
                _RankStreams(cfg, r),
                sub_batch_cost=price,
                local_batch_size=cfg.local_batch,
                seed=cfg.seed,
                lookahead=cfg.lookahead,
                max_delay=cfg.max_delay,
                headroom=cfg.headroom,
                gain=cfg.gain,
                expected_cost=anchors[r][0],
                prior_weight=anchors[r][1],
                calibration="running",
            )
            for r in range(cfg.ranks)
        ]
        iterators[name] = [iter(s) for s in shufflers[name]]
    names = ["no shuffling", *shuffler_settings, *(f"global {m}" for m in cfg.optimum_methods)]
    ratios = {name: np.zeros(cfg.steps) for name in names}
    plan_seconds = dict.fromkeys(shuffler_settings, 0.0)
    for step in range(cfg.steps):
        natural = [
            sample_cost(natural_batch_lengths(cfg, r, step), a=a, b=b) for r in range(cfg.ranks)
        ]
        ratios["no shuffling"][step] = max_over_mean([c.sum() for c in natural])
        for name, rank_iterators in iterators.items():
            loads = []
            for it in rank_iterators:
                start = time.perf_counter()
                batch = next(it)
                plan_seconds[name] += time.perf_counter() - start
                loads.append(float(sample_cost(np.asarray(batch), a=a, b=b).sum()))
            ratios[name][step] = max_over_mean(loads)
        everything = np.concatenate(natural)
        for method in cfg.optimum_methods:
            parts = partition(everything, cfg.ranks, method=method)
            ratios[f"global {method}"][step] = max_over_mean(part_loads(everything, parts))
        if progress is not None:
            progress(step + 1, cfg.steps)
    batches = cfg.steps * cfg.ranks
    return SimulationResult(
        ratios=ratios,
        plan_ms={name: 1e3 * s / batches for name, s in plan_seconds.items()},
        delay_counts={
            name: _merge_delays(s.stats().delay_counts for s in shufflers[name])
            for name in shuffler_settings
        },
    )


def _merge_delays(histograms) -> dict[int, int]:
    merged: dict[int, int] = {}
    for histogram in histograms:
        for delay, n in histogram.items():
            merged[delay] = merged.get(delay, 0) + n
    return dict(sorted(merged.items()))


def format_table(cfg: SimulationConfig, result: SimulationResult) -> str:
    """The result as a Markdown table (one row per setting) under a line describing ``cfg``."""
    header = [
        "setting",
        "mean max/mean",
        "p99 max/mean",
        "captured",
        "ms/batch",
        "delays (batches: share)",
    ]
    rows = []
    for name, values in result.ratios.items():
        captured = result.captured(name) if not name.startswith("global") else float("nan")
        if name == "no shuffling":
            captured = 0.0
        delays = result.delay_counts.get(name)
        delay_text = "—"
        if delays:
            total = sum(delays.values())
            delay_text = " ".join(f"{d:+d}:{n / total:.1%}" for d, n in delays.items())
        rows.append(
            [
                name,
                f"{values.mean():.4f}",
                f"{np.quantile(values, 0.99):.4f}",
                "—" if np.isnan(captured) else f"{captured:.1%}",
                f"{result.plan_ms[name]:.2f}" if name in result.plan_ms else "—",
                delay_text,
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        f"B1-style simulation: {cfg.ranks} ranks, {cfg.steps} steps, local batch {cfg.local_batch} "
        f"from {cfg.sub_batch}-sample sub-batches, lengths lognormal(median {cfg.median:g}, "
        f"sigma {cfg.sigma:g}) clipped to [{cfg.min_len}, {cfg.max_len}], cost {cfg.a:g}·L + "
        f"{cfg.b:g}·L², lookahead {cfg.lookahead}, max_delay {cfg.max_delay}, headroom "
        f"{cfg.headroom:g}, seed {cfg.seed}",
        "",
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
    return "\n".join(lines)


def _parse_args(argv):
    defaults = SimulationConfig()
    parser = argparse.ArgumentParser(
        prog="python -m gem_loadbalance.simulate",
        description="Per-step rank imbalance with and without Base Batch Shuffling (workload B1).",
    )
    parser.add_argument("--ranks", type=int, default=defaults.ranks)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--local-batch", type=int, default=defaults.local_batch)
    parser.add_argument("--sub-batch", type=int, default=defaults.sub_batch)
    parser.add_argument("--median", type=float, default=defaults.median)
    parser.add_argument("--sigma", type=float, default=defaults.sigma)
    parser.add_argument("--min-len", type=int, default=defaults.min_len)
    parser.add_argument("--max-len", type=int, default=defaults.max_len)
    parser.add_argument("--a", type=float, default=defaults.a, help="cost per token")
    parser.add_argument("--b", type=float, default=defaults.b, help="cost per token squared")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--lookahead", type=int, default=defaults.lookahead)
    parser.add_argument("--max-delay", type=int, default=defaults.max_delay)
    parser.add_argument("--headroom", type=float, default=defaults.headroom)
    parser.add_argument("--gain", type=float, default=defaults.gain)
    parser.add_argument(
        "--warm-steps",
        type=int,
        default=defaults.warm_steps,
        help="also run the running estimate as it stands after this many earlier steps (0: skip)",
    )
    parser.add_argument("--calibration-samples", type=int, default=defaults.calibration_samples)
    parser.add_argument(
        "--optimum",
        default=",".join(defaults.optimum_methods),
        help="comma-separated partition methods for the global optimum (lpt_capped, kk, greedy)",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the per-step ratios into a PNG")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> SimulationResult:
    """The command line: parse ``argv`` (default ``sys.argv[1:]``), simulate, print the table
    (and progress lines on stderr unless ``--quiet``), draw ``--plot`` if asked; returns the
    result. Bad arguments exit through argparse (status 2)."""
    args = _parse_args(argv)
    cfg = SimulationConfig(
        ranks=args.ranks,
        steps=args.steps,
        local_batch=args.local_batch,
        sub_batch=args.sub_batch,
        median=args.median,
        sigma=args.sigma,
        min_len=args.min_len,
        max_len=args.max_len,
        a=args.a,
        b=args.b,
        seed=args.seed,
        lookahead=args.lookahead,
        max_delay=args.max_delay,
        headroom=args.headroom,
        gain=args.gain,
        warm_steps=args.warm_steps,
        calibration_samples=args.calibration_samples,
        optimum_methods=tuple(m.strip() for m in args.optimum.split(",") if m.strip()),
    )
    started = time.perf_counter()
    every = max(1, cfg.steps // 10)

    def progress(step, steps):
        if not args.quiet and (step % every == 0 or step == steps):
            elapsed = time.perf_counter() - started
            print(f"step {step}/{steps}  {elapsed:.1f} s", file=sys.stderr, flush=True)

    result = simulate(cfg, progress=progress)
    print(format_table(cfg, result))
    if args.plot:
        print("\n" + plot_ratios(args.plot, result.ratios))
    return result


def plot_ratios(path: str, ratios: dict[str, np.ndarray]) -> str:
    """Draw each setting's per-step max/mean against the step into the PNG ``path``.

    Args:
        path: the file to write.
        ratios: setting name -> per-step ratios (float ``[steps]``), as ``SimulationResult.ratios``.

    Returns:
        The line to print: ``"plot written to PATH"``, or ``NO_MATPLOTLIB`` when matplotlib (the
        ``plot`` extra) is not installed, in which case nothing is written.
    """
    try:
        import matplotlib
    except ImportError:
        return NO_MATPLOTLIB
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.6))
    for name, values in ratios.items():
        ax.plot(np.arange(len(values)), values, label=name, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean rank cost")
    ax.set_title("per-step max/mean rank cost")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot written to {path}"


if __name__ == "__main__":
    main()

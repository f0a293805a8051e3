"""B1: rank balance with Base Batch Shuffling against no shuffling and a global optimum.

Three tables, all on the CPU (the balancer is host-side Python):

1. The B1 simulation (64 ranks, local batch 1024 from 128-sample sub-batches, J1 lengths, cost
   ``L + L²/1024``): per-step max/mean rank cost, mean and p99, for no shuffling, the shuffler
   (as it runs by default, the mean agreed once over every rank's first look-ahead; the cold
   running estimate; the running estimate as it stands after 1000 steps; a calibrated shared
   ``expected_cost``) and the global capped-LPT optimum; the share of the possible improvement
   captured. The goal row is the default's share.
2. Partition methods head to head with few items per part (6, 8, 16) and more (128), on B1's
   heavy-tailed costs and on mild (uniform) costs: the heaviest part over the lower bound
   ``max(mean part, largest item)``, so the figure over-states the gap to the true optimum.
3. Planning time per 1024-sample local batch, wall and CPU: the planner alone on a B1 pool,
   and a whole ``next()`` of the shuffler (reading and pricing sub-batches included). On a
   shared machine the CPU column is the honest one.

``--smoke`` runs tiny sizes in seconds.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402
from gem_loadbalance import (  # noqa: E402
    BaseBatchShuffler,
    ShufflerConfig,
    part_loads,
    partition,
    sample_cost,
)
from gem_loadbalance.local_batch import batch_target, deadline_floor, plan_local_batch  # noqa: E402
from gem_loadbalance.simulate import (  # noqa: E402
    AGREED,
    SimulationConfig,
    _RankStreams,
    format_table,
    simulate,
)

B1 = common.WORKLOADS["B1"]
DEFAULTS = ShufflerConfig(local_batch_size=1)  # the shuffler's default options


def b1_costs(n, seed):
    """The costs of ``n`` samples of B1's lengths drawn with ``seed``."""
    lengths = B1.lengths.draw(np.random.default_rng(seed), n)
    return sample_cost(lengths, a=B1.a, b=B1.b)


def partition_table(parts, items_per_part, draws):
    rows = []
    for dist in ("B1 heavy tail", "uniform"):
        for per in items_per_part:
            ratios = {m: [] for m in ("lpt_capped", "kk", "greedy")}
            for d in range(draws):
                n = parts * per
                costs = (
                    b1_costs(n, 1000 + d)
                    if dist == "B1 heavy tail"
                    else np.random.default_rng(1000 + d).uniform(1.0, 2.0, n)
                )
                bound = max(costs.sum() / parts, costs.max())
                for method in ratios:
                    heaviest = part_loads(costs, partition(costs, parts, method=method)).max()
                    ratios[method].append(heaviest / bound)
            rows.append(
                [dist, per] + [f"{np.mean(ratios[m]):.4f}" for m in ("lpt_capped", "kk", "greedy")]
            )
    return rows


def _median_ms(fn, calls):
    """Median wall and CPU (process) milliseconds of ``fn(i)`` over ``calls`` calls."""
    wall, cpu = [], []
    for i in range(calls):
        w0, c0 = time.perf_counter(), time.process_time()
        fn(i)
        wall.append((time.perf_counter() - w0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def planner_ms(local_batch, calls):
    costs = b1_costs(3 * local_batch, 7)
    natural = np.repeat(np.arange(3), local_batch)
    mean = float(costs.mean())

    def plan(i):
        target = batch_target(
            count=local_batch,
            mean_cost=mean,
            pool_cost=float(costs.sum()),
            pool_count=costs.size,
            headroom=DEFAULTS.headroom,
            gain=DEFAULTS.gain,
        )
        floor = deadline_floor(
            costs, natural, step=2, count=local_batch, max_delay=DEFAULTS.max_delay
        )
        target = max(target, floor)
        plan_local_batch(
            costs, natural, step=2, count=local_batch, target=target * (0.98 + 0.0004 * i),
            max_delay=DEFAULTS.max_delay, lookahead=DEFAULTS.lookahead,
        )  # fmt: skip

    return _median_ms(plan, calls)


def shuffler_next_ms(cfg, calls):
    price = lambda sub_batch: sample_cost(np.asarray(sub_batch), a=cfg.a, b=cfg.b)
    shuffler = BaseBatchShuffler(
        _RankStreams(cfg, 0), sub_batch_cost=price, local_batch_size=cfg.local_batch
    )
    iterator = iter(shuffler)
    return _median_ms(lambda i: next(iterator), calls)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds on a CPU")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    if args.smoke:
        cfg = SimulationConfig(
            ranks=8, steps=5, local_batch=128, sub_batch=32, warm_steps=2, calibration_samples=4096
        )
        items, parts, draws, calls = (6, 16), 8, 2, 5
    else:
        cfg = SimulationConfig(steps=args.steps)
        items, parts, draws, calls = (6, 8, 16, 128), 64, 10, 100
    print(f"# B1 load balance ({common.environment()})")
    started = time.perf_counter()
    result = simulate(cfg)
    print(f"\n## B1 simulation ({time.perf_counter() - started:.0f} s)\n")
    print(format_table(cfg, result))

    common.print_table(
        f"partition methods: heaviest part / max(mean part, largest item), {parts} parts, "
        f"mean of {draws} draws",
        ["costs", "items per part", "lpt_capped", "kk", "greedy"],
        partition_table(parts, items, draws),
    )
    plan = planner_ms(cfg.local_batch, calls)
    whole = shuffler_next_ms(
        SimulationConfig(
            ranks=1, steps=calls + 4, local_batch=cfg.local_batch, sub_batch=cfg.sub_batch
        ),
        calls,
    )
    common.print_table(
        f"planning time per local batch of {cfg.local_batch} samples (median of {calls}; goal < 5 ms)",
        ["what", "wall ms", "CPU ms"],
        [
            ["planner (target, deadline floor, plan)", *plan],
            ["shuffler next() incl. reading and pricing", *whole],
        ],
    )
    common.record(
        "loadbalance_b1",
        none_max_over_mean=float(result.ratios["no shuffling"].mean()),
        calibrated_max_over_mean=float(result.ratios["shuffler, calibrated expected_cost"].mean()),
        captured_calibrated=result.captured("shuffler, calibrated expected_cost"),
        captured_cold=result.captured("shuffler, running estimate (cold)"),
        default_max_over_mean=float(result.ratios[AGREED].mean()),
        captured_default=result.captured(AGREED),
        plan_ms=plan[0],
        next_ms=whole[0],
    )
    common.record_goal(
        benchmark="loadbalance_b1",
        goal="Base Batch Shuffling (default calibration), share of the possible improvement",
        workload="B1",
        gemkit=float(result.ratios[AGREED].mean()),
        anchor="global optimum",
        anchor_value=float(result.optimum.mean()),
        ratio=result.captured(AGREED),
        unit="max/mean",
        basis="simulated steps",
        target=0.97,
    )


if __name__ == "__main__":
    main()

"""Does fp8 training keep the model's quality? gem-small's final NE with each low-precision
recipe against BF16, the same seeds and batches, measured in one run.

Every linear the fp8 kernels take runs in fp8 (``lowprec.fp8_plan=rule``: the measured plan
would keep slow shapes in BF16 and so test less of fp8). BF16 is the anchor
(``lowprec.recipe=none`` under the same BF16 autocast). Each seed initialises the model
differently and trains on the same batches under every recipe; the figure per recipe is the
mean final NE over the seeds, and the goal (#37: within 0.1% of BF16) is the ratio of BF16's mean
NE to the recipe's (greater is better; 0.999 is 0.1% worse). The spread of BF16's own NE over
the seeds is printed beside it: a difference smaller than that spread is not distinguishable
from another seed.

    python benchmarks/gem_train/bench_fp8_quality.py                 # 3 seeds, 300 steps
    python benchmarks/gem_train/bench_fp8_quality.py --seeds 0 1 --steps 200

``--smoke`` runs the tiny config for a few steps on the CPU (fp8 emulated): it checks the script.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

RECIPES = {
    "bf16": {"lowprec.recipe": "none"},
    "mxfp8": {"lowprec.recipe": "mxfp8", "lowprec.fp8_plan": "rule"},
    "fp8_rowwise": {"lowprec.recipe": "fp8_rowwise", "lowprec.fp8_plan": "rule"},
}
TARGET = 0.999  # BF16 NE / fp8 NE: at most 0.1% worse


def final_ne(recipe: str, seed: int, *, steps: int, smoke: bool) -> tuple[float, int]:
    """The run's final held-out NE (CTR) and how many (shape, tokens) keys ran in fp8."""
    from gem_train.config import apply_overrides, named_config
    from gem_train.train import train

    flags = {"steps": str(steps), "seed": str(seed), "memory.autoac": "false",
             "metrics.progress": "false"} | RECIPES[recipe]  # fmt: skip
    if smoke:
        flags |= {"device": "cpu", "model.d_model": "128", "model.ffn_hidden": "256",
                  "model.mlp_hidden": "128", "data.eval_batches": "2",
                  "lowprec.token_multiple": "128", "lowprec.autocast_bf16": "false"}  # fmt: skip
    summary = train(apply_overrides(named_config("tiny" if smoke else "gem-small"), flags))
    entries = (summary["fp8_decisions"] or {}).get("table", {}).get("entries", [])
    return summary["final_ne"], sum(1 for e in entries if e["keep_fp8"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
    args = parser.parse_args()
    steps, seeds = (6, args.seeds[:1]) if args.smoke else (args.steps, args.seeds)
    print(f"fp8 quality: {common.environment()}; {steps} steps, seeds {seeds}", flush=True)
    ne: dict[str, list[float]] = {recipe: [] for recipe in RECIPES}
    fp8_keys: dict[str, int] = {}
    for seed in seeds:
        for recipe in RECIPES:
            start = time.perf_counter()
            value, fp8_keys[recipe] = final_ne(recipe, seed, steps=steps, smoke=args.smoke)
            ne[recipe].append(value)
            print(f"  seed {seed} {recipe}: NE {value:.5f} ({time.perf_counter() - start:.0f} s)",
                  flush=True)  # fmt: skip
    anchor = statistics.fmean(ne["bf16"])
    spread = max(ne["bf16"]) - min(ne["bf16"])
    rows = []
    for recipe, values in ne.items():
        mean = statistics.fmean(values)
        worst = max(v / b for v, b in zip(values, ne["bf16"], strict=True))
        rows.append([recipe, fp8_keys[recipe], *(f"{v:.5f}" for v in values), f"{mean:.5f}",
                     f"{anchor / mean:.5f}", f"{worst:.5f}"])  # fmt: skip
        if recipe != "bf16":
            common.record_goal(
                benchmark="gem_train_fp8_quality", goal=f"fp8 training NE vs BF16, {recipe}",
                workload=f"{'tiny (smoke)' if args.smoke else 'gem-small'}, {steps} steps, "
                f"{len(seeds)} seeds", gemkit=mean, anchor="BF16, same seeds",
                anchor_value=anchor, ratio=anchor / mean, unit="NE", basis="final held-out NE",
                target=TARGET,
            )  # fmt: skip
    common.print_table(
        f"final NE per recipe; BF16's spread over the seeds {spread:.4f} "
        f"({spread / anchor:.2%} of its mean)",
        ["recipe", "fp8 keys", *(f"seed {s}" for s in seeds), "mean", "BF16 / mean",
         "worst seed / BF16"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()

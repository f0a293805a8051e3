"""Command line of the planner: ``python -m gem_parallel.cli``.

    python -m gem_parallel.cli --gpus 16384 --gpus-per-host 8 --hosts-per-zone 16 --model gem-large
    python -m gem_parallel.cli --gpus 64 --model my_model.json --json

Prints the chosen meshes, the memory per GPU, the estimated step time per collective and tier,
and whether the plan keeps GEM's placement rules (and, when not, which term decided). ``--json``
prints the same as one JSON object. An impossible request exits with status 2 and a message that
names the smallest change that would fit.
"""

import argparse
import json
import sys

from gem_parallel.model_spec import NAMED_SPECS, ModelSpec
from gem_parallel.planner import Plan, PlannerConfig, plan
from gem_parallel.topology import TIER_NAMES, Topology


def format_plan(p: Plan) -> str:
    """A plan as the command line prints it: model, cluster, meshes, memory per GPU by part, the
    step time with one row per collective and tier, and GEM's rules (kept, or broken and why)."""
    lines = [
        f"model    {p.spec.describe()}",
        f"cluster  {p.topology.describe()}",
        f"meshes   {p.layout.describe()}",
        f"         ({p.candidates} candidate plans costed; engine {p.config.engine}, sparse "
        f"{p.config.sparse_mode})",
        "",
        f"memory per GPU: {p.memory_bytes / 1e9:.1f} GB of {p.topology.usable_memory_bytes / 1e9:.1f} GB usable",
    ]
    for name, nbytes in sorted(p.memory.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:32s} {nbytes / 1e9:10.2f} GB")
    lines += [
        "",
        f"step time: {p.step_s * 1e3:.1f} ms = overlap(compute {p.compute_s * 1e3:.1f} ms, "
        f"overlapped collectives {p.overlapped_s * 1e3:.1f} ms) + exposed collectives "
        f"{p.exposed_s * 1e3:.1f} ms",
    ]
    header = f"  {'collective':34s} {'group':44s} {'MB/call':>9s} {'calls':>5s} " + " ".join(
        f"{t + ' ms':>13s}" for t in TIER_NAMES
    )
    lines += [header, "  " + "-" * (len(header) - 2)]
    for c in p.collectives:
        tiers = c.per_tier()
        mark = "" if c.overlapped else " *"
        lines.append(
            f"  {c.name + mark:34s} {c.dim + '=' + c.per_call.group:44s} {c.per_call.nbytes / 1e6:9.1f} "
            f"{c.calls:5d} " + " ".join(f"{tiers.get(t, 0.0) * 1e3:13.2f}" for t in TIER_NAMES)
        )
    lines.append("  (* exposed: on the critical path; the rest overlaps compute)")
    if p.rules:
        lines += ["", "GEM's rules:"] + [f"  - {r}" for r in p.rules]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), plan and print; returns the exit status: 0, or 2
    with a message on stderr when the request is impossible (the message names the smallest
    change that fits). Bad flags exit through argparse (status 2)."""
    parser = argparse.ArgumentParser(
        prog="python -m gem_parallel.cli", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--hosts-per-zone", type=int, default=16)
    parser.add_argument(
        "--model",
        required=True,
        help=f"a named spec ({', '.join(sorted(NAMED_SPECS))}) or a JSON file",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--oversubscription", type=float, default=4.0)
    parser.add_argument("--gpu-memory-gb", type=float, default=141.0)
    parser.add_argument("--engine", choices=("nccl", "copy_engine"), default="nccl")
    parser.add_argument(
        "--sparse-mode", choices=("fully_sharded_2d", "2d"), default="fully_sharded_2d"
    )
    for name in ("dp-shard", "dp-replicate", "ep", "sparse-replicas"):
        parser.add_argument(
            f"--{name}", type=int, default=None, help=f"pin {name.replace('-', '_')}"
        )
    args = parser.parse_args(argv)
    try:
        topology = Topology(
            args.gpus,
            gpus_per_host=args.gpus_per_host,
            hosts_per_zone=args.hosts_per_zone,
            oversubscription=args.oversubscription,
            gpu_memory_bytes=args.gpu_memory_gb * 1e9,
        )
        result = plan(
            topology,
            ModelSpec.load(args.model),
            dp_shard=args.dp_shard,
            dp_replicate=args.dp_replicate,
            ep=args.ep,
            sparse_replicas=args.sparse_replicas,
            config=PlannerConfig(engine=args.engine, sparse_mode=args.sparse_mode),
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

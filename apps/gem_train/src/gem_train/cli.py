"""Command line of the reference trainer.

    gem-train [--config NAME] [--<section>.<field> VALUE ...]       train (default: tiny, CPU)
    gem-train mfu [--config NAME] [flags]                            Local MFU, layer by layer
    gem-train plan [--config NAME] [--gpus N]                        parameters and FLOPs (no run)
    gem-train config [--config NAME] [flags] > run.toml              the resolved config as TOML

``--config`` takes a named config or a TOML file (``PATH.toml``, ``gem_train.config_file``).
Every field of the configuration is a flag (``gem-train --help`` lists them with their defaults for
the chosen config), applied after the named config or file; ``--summary-json PATH`` writes the
run's summary. Under ``torchrun`` every rank runs the same command.
"""

import argparse
import sys

from gem_train.config import (
    NAMED_CONFIGS,
    PLAN_ONLY,
    SHORT_FLAGS,
    ConfigError,
    apply_overrides,
    fields_of,
    named_config,
)
from gem_train.config_file import dump_toml, resolve_config

COMMANDS = {
    "train": "train the model (the default command)",
    "mfu": "measure Local MFU: each layer alone, forward + backward, FLOP-weighted",
    "plan": "print parameters, FLOPs per sample and the memory the run needs, without running",
    "config": "print the resolved config (--config, then flags) as TOML, for --config FILE.toml",
}


def _config_name(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return "tiny"


def build_parser(command: str, config_name: str) -> argparse.ArgumentParser:
    try:
        defaults = resolve_config(config_name)
    except ConfigError:  # reported by ``parse``, with the usage
        defaults = named_config("tiny")
    named = "\n".join(f"  {name:10s} {text}" for name, (text, _) in NAMED_CONFIGS.items())
    commands = "\n".join(f"  {name:10s} {text}" for name, text in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog=f"gem-train{'' if command == 'train' else ' ' + command}",
        usage="%(prog)s [--config NAME] [--<section>.<field> VALUE ...]",
        description=f"gemkit's reference trainer.\n\ncommands:\n{commands}\n\nnamed configs:\n{named}",
        epilog="Flags override single fields of the named config or file; the defaults shown "
        f"are those of {config_name!r}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default="tiny",
        help=f"named config ({', '.join(NAMED_CONFIGS)}) or a TOML file (PATH.toml)",
    )
    if command == "plan":
        parser.add_argument("--gpus", type=_positive_int, default=1, help="GPUs to plan for")
    aliases = {v: k for k, v in SHORT_FLAGS.items()}
    groups = {}
    for name, (owner, _, text) in fields_of(defaults).items():
        if name == "name":
            continue
        section = name.split(".")[0] if "." in name else "run"
        if section not in groups:
            groups[section] = parser.add_argument_group(f"{section} ({type(owner).__name__})")
        value = getattr(owner, name.split(".")[-1])
        flags = [f"--{name}"] + ([f"--{aliases[name]}"] if name in aliases else [])
        groups[section].add_argument(
            *flags,
            dest=name,
            default=None,
            metavar="V",
            help=f"{text} (default: {value!r})".replace("%", "%%"),
        )
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def parse(argv: list[str]):
    command = argv[0] if argv and argv[0] in COMMANDS else "train"
    rest = argv[1:] if argv and argv[0] in COMMANDS else argv
    parser = build_parser(command, _config_name(rest))
    args = parser.parse_args(rest)
    try:
        cfg = resolve_config(args.config)
        overrides = {
            k: v for k, v in vars(args).items() if v is not None and k not in ("config", "gpus")
        }
        cfg = apply_overrides(cfg, overrides)
    except ConfigError as exc:
        parser.error(str(exc))
    return command, cfg, args


def main(argv: list[str] | None = None) -> int:
    command, cfg, args = parse(sys.argv[1:] if argv is None else argv)
    if command == "config":
        print(dump_toml(cfg), end="")
        return 0
    if command == "plan":
        from gem_train.mfu import print_plan

        try:
            print_plan(cfg, gpus=args.gpus)
        except ValueError as exc:  # fits nowhere, bad topology: an answer, not a bug
            print(f"gem-train plan: error: {exc}", file=sys.stderr)
            return 1
        return 0
    if cfg.name in PLAN_ONLY:
        print(
            f"gem-train: error: config {cfg.name!r} is plan only; run `gem-train plan --config {cfg.name}`",
            file=sys.stderr,
        )
        return 2
    if command == "mfu":
        from gem_train.mfu import local_mfu

        local_mfu(cfg)
        return 0
    from gem_train.checkpoint import CheckpointError
    from gem_train.finite import NonFiniteError
    from gem_train.supervision import SupervisorLost
    from gem_train.train import train

    try:
        summary = train(cfg)
    except (ConfigError, NonFiniteError, CheckpointError, SupervisorLost) as exc:
        # a refusal or a stop, not a bug: the message (and its notes), no traceback
        notes = "".join(f"\n{note}" for note in getattr(exc, "__notes__", ()))
        print(f"gem-train: error: {exc}{notes}", file=sys.stderr)
        return 1
    if summary["rank"] == 0:
        skipped = summary["skipped_nonfinite_steps"]
        print(
            f"done: {summary['steps_this_run']} steps, {summary['samples']} samples, "
            f"NE {summary['final_ne']:.4f}, AUC {summary['final_auc']:.4f}, "
            f"{summary['qps']:.0f} QPS, {summary['wall_s']:.1f} s"
            + (f"; {skipped} steps skipped for a non-finite loss or gradient" if skipped else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

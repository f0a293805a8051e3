"""Regenerate the README's results table from the goal rows under ``benchmarks/results/``.

Each GPU run's rows (``$GEMKIT_LOG_DIR/results.jsonl``, written by ``scripts/gpu_check.sh``) are
copied by hand into ``benchmarks/results/<date>-<label>.jsonl``. Among them, the rows that
``benchmarks/common.py: record_goal`` wrote (``"kind": "goal"``) say how one goal stood in that
run. This script reads every such file, keeps for each goal (its ``goal`` text and its
``workload``) the newest row with a finite ratio (the latest date; on the same date, the file
that sorts last and the line that comes last), and writes one markdown table between the two
marker comments of the root README.md. Goals keep the order in which they first appear.

A goal is retired by a row ``{"kind": "retire", "goal": ..., "date": ..., "reason": ...}`` in a
results file (e.g. when a stronger anchor replaces the one it names): its rows dated on or before
the retirement leave the table, and a line under the table names it with the reason, so that
nothing vanishes without a word.

    python scripts/results_table.py          # rewrite the table in README.md
    python scripts/results_table.py --check  # exit 1 if README.md's table is not up to date

Only the standard library is used, so the script runs on the GPU machine's image as well.
"""

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- results-table:begin (scripts/results_table.py writes this table) -->"
END = "<!-- results-table:end -->"
HEADER = [
    "goal",
    "workload",
    "gemkit",
    "anchor",
    "ratio",
    "target",
    "met?",
    "basis",
    "device",
    "date",
]


def goal_rows(paths: list[Path], *, kind: str = "goal") -> list[dict]:
    """The rows of ``kind`` ("goal" or "retire") in ``paths`` (JSON lines), in file then line
    order; other rows are left out.

    Raises:
        ValueError: a line that is not JSON, naming its file and line; a retire row without a
            goal, date or reason.
    """
    rows = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line: {exc}") from exc
            if row.get("kind") == "retire" and not all(row.get(f) for f in RETIRE_FIELDS):
                raise ValueError(f"{path}:{number}: a retire row needs {', '.join(RETIRE_FIELDS)}")
            if row.get("kind") == kind:
                rows.append(row)
    return rows


RETIRE_FIELDS = ("goal", "date", "reason")


def without_retired(rows: list[dict], retirements: list[dict]) -> list[dict]:
    """``rows`` less those of a retired goal dated on or before its (latest) retirement."""
    retired = {}
    for r in retirements:
        retired[r["goal"]] = max(retired.get(r["goal"], r["date"]), r["date"])
    return [row for row in rows if not row["date"] <= retired.get(row["goal"], "")]


def retired_note(retirements: list[dict]) -> str:
    """One line per retired goal, under the table (empty without any)."""
    latest = {r["goal"]: r for r in sorted(retirements, key=lambda r: r["date"])}
    return "".join(
        f"\nRetired {r['date']}: *{goal}* ({r['reason']}).\n" for goal, r in latest.items()
    )


def newest_per_goal(rows: list[dict]) -> list[dict]:
    """For each (goal, workload), the newest row whose ratio is a finite number.

    ``rows`` are in file and line order; a later row of the same date wins. The result keeps
    the order in which each goal first appears (among all rows, measured or not).
    """
    order: dict[tuple[str, str], int] = {}
    best: dict[tuple[str, str], tuple[str, int, dict]] = {}
    for position, row in enumerate(rows):
        key = (row["goal"], row["workload"])
        order.setdefault(key, len(order))
        ratio = row.get("ratio")
        if ratio is None or not math.isfinite(ratio):
            continue
        if key not in best or (row["date"], position) >= best[key][:2]:
            best[key] = (row["date"], position, row)
    return [best[key][2] for key in sorted(best, key=order.__getitem__)]


def _number(value: float) -> str:
    """Three significant figures, whole numbers from 1,000 up (``3,072``)."""
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _figure(value, unit: str) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{_number(value)} {unit}"


def met(row: dict) -> bool | None:
    """Whether the row meets its target (None: no target). The target bounds the ratio, or
    the project's figure itself where ``target_of`` is ``"gemkit"``; met means ≥ target."""
    if row.get("target") is None:
        return None
    bounded = row["gemkit"] if row.get("target_of", "ratio") == "gemkit" else row["ratio"]
    return bounded is not None and bounded >= row["target"]


def render(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (one line per goal, ``HEADER``'s columns)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in rows:
        target = "–"
        if row.get("target") is not None:
            unit = f" {row['unit']}" if row.get("target_of", "ratio") == "gemkit" else ""
            target = f"≥ {row['target']:g}{unit}"
        verdict = {None: "–", True: "yes", False: "**no**"}[met(row)]
        cells = [
            row["goal"],
            row["workload"],
            _figure(row.get("gemkit"), row["unit"]),
            f"{row['anchor']}: {_figure(row.get('anchor_value'), row['unit'])}",
            f"{row['ratio']:#.3g}",
            target,
            verdict,
            row["basis"],
            row["device"],
            row["date"],
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def with_table(text: str, table: str) -> str:
    """``text`` with everything between the ``BEGIN`` and ``END`` lines replaced by ``table``.

    Raises:
        ValueError: if either marker is missing, or they come in the wrong order.
    """
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < 0 or stop < start:
        raise ValueError(f"the README needs the lines {BEGIN!r} and then {END!r}")
    head = text[: start + len(BEGIN)]
    return f"{head}\n{table}{text[stop:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the README's table differs; write nothing"
    )
    args = parser.parse_args(argv)
    paths = sorted(args.results.glob("*.jsonl"))
    retirements = goal_rows(paths, kind="retire")
    rows = without_retired(goal_rows(paths), retirements)
    table = render(newest_per_goal(rows)) + retired_note(retirements)
    text = args.readme.read_text()
    updated = with_table(text, table)
    if args.check:
        if updated != text:
            print(
                f"{args.readme}'s results table is not what {len(paths)} result files give: "
                "run python scripts/results_table.py",
                file=sys.stderr,
            )
            return 1
        return 0
    if updated != text:
        args.readme.write_text(updated)
        print(f"{args.readme}: results table rewritten from {len(paths)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

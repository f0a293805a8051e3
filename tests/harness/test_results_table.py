"""The README's results table is what ``scripts/results_table.py`` makes of ``benchmarks/results/``;
the script keeps the newest row of each goal; ``common.record_goal`` writes such rows."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results_table = _load("results_table", ROOT / "scripts" / "results_table.py")


def test_the_readme_table_is_what_the_committed_results_give(capsys):
    status = results_table.main(["--check"])
    assert status == 0, capsys.readouterr().err + " (run: python scripts/results_table.py)"


def test_every_committed_result_row_is_json_and_every_goal_row_complete():
    files = sorted((ROOT / "benchmarks" / "results").glob("*.jsonl"))
    assert files, "benchmarks/results/ holds no run file"
    needed = {"goal", "workload", "gemkit", "anchor", "anchor_value", "unit", "ratio", "target",
              "target_of", "basis", "device", "torch", "triton", "date"}  # fmt: skip
    for row in results_table.goal_rows(files):
        assert needed <= row.keys(), f"{row.get('goal')}: lacks {needed - row.keys()}"


def goal(name, date, ratio, *, workload="J1 fwd+bwd", target=2.0, target_of="ratio", **more):
    row = dict(kind="goal", benchmark="b", goal=name, workload=workload, gemkit=1.0, anchor="A",
               anchor_value=ratio, unit="ms", ratio=ratio, target=target, target_of=target_of,
               basis="eager", device="GPU", torch="2.11", triton="3.6", date=date)  # fmt: skip
    return {**row, **more}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def fixture_run(tmp_path):
    """Two run files and a README with the markers; returns (results folder, README path)."""
    results = tmp_path / "results"
    results.mkdir()
    write_jsonl(results / "2026-01-01-first.jsonl", [
        {"benchmark": "gpu tests", "result": "3 passed"},  # not a goal row: left out
        goal("speed", "2026-01-01", 1.5),
        goal("bandwidth", "2026-01-01", 0.9, workload="Q1", gemkit=3.6, target=3.5,
             target_of="gemkit", unit="TB/s"),
        goal("share", "2026-01-01", 0.95, workload="B1", target=None),
    ])  # fmt: skip
    write_jsonl(results / "2026-02-01-second.jsonl", [
        goal("speed", "2026-02-01", 2.5),
        goal("speed", "2026-03-01", math.nan),  # the anchor failed: not a measurement
        goal("old", "2025-12-01", 1.0, target=1.0),  # a later file with an older date
        goal("bandwidth", "2025-12-01", 0.5, workload="Q1", gemkit=2.0, target=3.5,
             target_of="gemkit", unit="TB/s"),
    ])  # fmt: skip
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# title\n\nbefore\n\n{results_table.BEGIN}\nstale table\n{results_table.END}\n\nafter\n"
    )
    return results, readme


def test_the_newest_finite_row_of_each_goal_is_kept_in_first_seen_order(fixture_run):
    results, _ = fixture_run
    rows = results_table.newest_per_goal(results_table.goal_rows(sorted(results.glob("*.jsonl"))))
    assert [(r["goal"], r["date"], r["ratio"]) for r in rows] == [
        ("speed", "2026-02-01", 2.5),
        ("bandwidth", "2026-01-01", 0.9),
        ("share", "2026-01-01", 0.95),
        ("old", "2025-12-01", 1.0),
    ]
    assert [results_table.met(r) for r in rows] == [True, True, None, True]


def test_the_table_replaces_only_what_lies_between_the_markers(fixture_run):
    results, readme = fixture_run
    args = ["--results", str(results), "--readme", str(readme)]
    assert results_table.main([*args, "--check"]) == 1
    assert results_table.main(args) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "stale table" not in text
    table = text.split(results_table.BEGIN)[1].split(results_table.END)[0].strip().splitlines()
    assert table[0] == "| " + " | ".join(results_table.HEADER) + " |"
    assert len(table) == 2 + 4
    assert table[2] == (
        "| speed | J1 fwd+bwd | 1 ms | A: 2.5 ms | 2.50 | ≥ 2 | yes | eager | GPU | 2026-02-01 |"
    )
    assert "| 3.6 TB/s | A: 0.9 TB/s | 0.900 | ≥ 3.5 TB/s | yes |" in table[3]
    assert "| 0.950 | – | – |" in table[4]
    assert results_table.main([*args, "--check"]) == 0


def test_a_retired_goal_leaves_the_table_with_a_line_that_names_it(fixture_run):
    results, readme = fixture_run
    write_jsonl(results / "2026-02-02-retire.jsonl", [
        dict(kind="retire", goal="speed", date="2026-02-02", reason="a stronger anchor"),
    ])  # fmt: skip
    assert results_table.main(["--results", str(results), "--readme", str(readme)]) == 0
    table = readme.read_text().split(results_table.BEGIN)[1].split(results_table.END)[0]
    assert "| speed |" not in table
    assert "Retired 2026-02-02: *speed* (a stronger anchor)." in table
    # A row measured after the retirement comes back.
    later = goal("speed", "2026-02-03", 3.0)
    rows = results_table.without_retired(
        [goal("speed", "2026-02-01", 2.5), later],
        [dict(kind="retire", goal="speed", date="2026-02-02", reason="r")],
    )
    assert rows == [later]


def test_a_retire_row_without_its_reason_is_refused(tmp_path):
    path = tmp_path / "run.jsonl"
    write_jsonl(path, [dict(kind="retire", goal="speed", date="2026-01-01")])
    with pytest.raises(ValueError, match=r"run\.jsonl:1: a retire row needs goal, date, reason"):
        results_table.goal_rows([path])


def test_a_target_on_the_figure_itself_is_missed_below_it():
    row = goal("bandwidth", "2026-01-01", 1.2, gemkit=3.17, target=3.5, target_of="gemkit")
    assert results_table.met(row) is False
    assert "| **no** |" in results_table.render([row])


def test_a_readme_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="results-table:begin"):
        results_table.with_table("no markers here\n", "| table |\n")


def test_a_line_that_is_not_json_names_its_file_and_line(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps(goal("speed", "2026-01-01", 2.0)) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"run\.jsonl:2: not a JSON line"):
        results_table.goal_rows([path])


@pytest.fixture
def common():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    return common


def test_record_goal_fills_in_the_device_versions_and_date(common, tmp_path, monkeypatch):
    results = tmp_path / "results.jsonl"
    monkeypatch.setenv("GEMKIT_RESULTS", str(results))
    returned = common.record_goal(
        benchmark="b", goal="speed", workload="J1 fwd+bwd", gemkit=0.5, anchor="A",
        anchor_value=1.0, ratio=2.0, unit="ms", basis=common.GRAPHED, target=2.0,
    )  # fmt: skip
    (written,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert written == returned
    assert written["kind"] == "goal" and written["target_of"] == "ratio"
    assert written["device"] and written["torch"] and written["triton"]
    assert len(written["date"]) == 10 and written["date"][4] == "-"
    assert results_table.met(written) is True


def test_record_goal_refuses_an_unknown_target_kind(common):
    with pytest.raises(ValueError, match="target_of"):
        common.record_goal(
            benchmark="b", goal="g", workload="w", gemkit=1.0, anchor="A", anchor_value=1.0,
            ratio=1.0, unit="ms", basis="eager", target=1.0, target_of="anchor",
        )  # fmt: skip


def test_graphed_or_eager_prefers_graph_replays_on_both_sides(common):
    ms = {"p": 2.0, "a": 4.0, "p (graph)": 1.0, "a (graph)": 3.0}
    assert common.graphed_or_eager(ms, "p", "a") == (1.0, 3.0, common.GRAPHED)
    ms["a (graph)"] = math.nan
    assert common.graphed_or_eager(ms, "p", "a") == (2.0, 4.0, common.EAGER)

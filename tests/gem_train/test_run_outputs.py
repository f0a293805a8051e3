"""What a run records of itself: the resolved config in the summary JSON, TensorBoard's hparams
and every checkpoint; metrics named ``train/...`` and ``eval/...``; a line when it resumes; a
profiler trace of chosen steps; and NE / AUC over every rank's predictions."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from gem_train.config import ConfigError
from gem_train.metrics import gather_over_ranks, quality_of
from gem_train.run_record import flat_config
from gem_train.train import train

sys.path.insert(0, str(Path(__file__).parents[2]))
from tests.parallel.parallel_launch import finish_rank, free_port, launch_spawned  # noqa: E402


def _tensorboard(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    events = EventAccumulator(str(folder))
    events.Reload()
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    return events, dict(hparams)


def test_a_parquet_run_records_its_whole_config_and_names_its_metrics(small, tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard logs need the tensorboard package")
    pytest.importorskip("pyarrow", reason="the Parquet reader needs pyarrow")
    from gem_train.data.parquet import write_example

    data = tmp_path / "rows.parquet"
    write_example(str(data), small().data, small().model, rows=64)
    cfg = small(
        data__source="parquet", data__path=str(data), optim__lr="0.002",
        metrics__tensorboard=str(tmp_path / "tb"), checkpoint__folder=str(tmp_path / "ckpt"),
        metrics__summary_json=str(tmp_path / "summary.json"), steps=4,
    )  # fmt: skip
    summary = train(cfg)
    resolved = flat_config(cfg)
    assert resolved["data.path"] == str(data) and resolved["optim.lr"] == 0.002
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["config"] == resolved == summary["config"]
    (checkpoint,) = (tmp_path / "ckpt").glob("step_*")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["record"]["config"] == resolved

    assert [row["step"] for row in written["history"]] == [2, 4]
    assert all(key == "step" or key.startswith("train/") for key in written["history"][-1])
    events, hparams = _tensorboard(tmp_path / "tb")
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "train/ctr_ne", "train/ctr_auc", "train/qps"} <= scalars
    assert all(tag.startswith(("train/", "eval/")) for tag in scalars), scalars
    assert {"eval/ctr_ne", "eval/ctr_auc"} <= scalars
    assert summary["final"].keys() == {"ctr_ne", "ctr_auc", "cvr_ne", "cvr_auc"}
    for name, value in summary["final"].items():
        if math.isnan(value):  # no meaning here (one class only): no scalar
            assert f"eval/{name}" not in scalars
            continue
        (event,) = events.Scalars(f"eval/{name}")
        assert event.step == 4 and math.isclose(event.value, value, rel_tol=1e-6)
    assert hparams.keys() == resolved.keys()
    for name, value in resolved.items():
        if isinstance(value, bool):
            assert hparams[name].string_value == str(value).lower(), name
        elif isinstance(value, str):
            assert hparams[name].string_value == value, name
        else:
            assert hparams[name].number_value == value, name


def test_a_resumed_run_says_so(small, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    train(small(steps=2, checkpoint__folder=str(folder)))
    assert "resumed" not in capsys.readouterr().out
    train(small(steps=4, checkpoint__folder=str(folder)))
    assert f"resumed from step 2 ({folder / 'step_00000002'})" in capsys.readouterr().out


def test_a_profile_trace_records_the_chosen_steps_on_the_cpu(small, tmp_path, capsys):
    folder = tmp_path / "trace"
    train(small(metrics__profile_trace=str(folder), metrics__profile_first_step=4,
                metrics__profile_steps=2))  # fmt: skip
    (path,) = folder.iterdir()
    assert path.name == "trace_rank0_steps4-5.json"
    assert f"profile trace of steps 4 to 5: {path}" in capsys.readouterr().out
    names = {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}
    assert {"gem-train step 4", "gem-train step 5"} <= names
    assert not {"gem-train step 3", "gem-train step 6"} & names
    assert any(str(name).startswith("aten::") for name in names)  # the steps' ops


def test_a_profile_window_the_run_never_reaches_is_refused_or_told(small, tmp_path, capsys):
    with pytest.raises(ConfigError, match="metrics.profile_first_step must be ≤ steps=6"):
        small(metrics__profile_trace=str(tmp_path), metrics__profile_first_step=7)
    folder = tmp_path / "ckpt"
    train(small(steps=4, checkpoint__folder=str(folder)))
    trace = tmp_path / "trace"
    train(small(checkpoint__folder=str(folder), metrics__profile_trace=str(trace),
                metrics__profile_first_step=2, metrics__profile_steps=2))  # fmt: skip
    assert "no trace; steps 2 to 3 precede this run's first step 5" in capsys.readouterr().out
    assert not trace.exists()


def _predictions(rank: int):
    """Rank-specific logits and labels per task (other sizes and base rates per rank)."""
    g = torch.Generator().manual_seed(rank)
    out = ({}, {})
    for task in ("ctr", "cvr"):
        n = 40 + 17 * rank
        out[0][task] = [torch.randn(n, generator=g) + 2 * rank, torch.randn(5, generator=g)]
        out[1][task] = [(torch.rand(n, generator=g) < 0.2 + 0.5 * rank).float(),
                        torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])]  # fmt: skip
    return out


def _metrics_worker(rank, world, port, result_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    logits, labels = _predictions(rank)
    quality = quality_of(*gather_over_ranks(logits, labels, world=world))
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(quality))
    finish_rank()


def test_ne_and_auc_cover_every_rank(tmp_path):
    """Two gloo ranks holding different predictions compute, each, exactly what one process
    computes over the union of them, not their own share's figures."""
    assert launch_spawned(_metrics_worker, 2, free_port(), str(tmp_path)) == 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    parts = [_predictions(r) for r in (0, 1)]
    union = quality_of(
        *({task: [x for part in parts for x in part[i][task]] for task in ("ctr", "cvr")}
          for i in (0, 1))
    )  # fmt: skip
    assert ranks[0] == ranks[1] == union
    alone = quality_of(*parts[0])
    assert all(alone[key] != union[key] for key in union)  # the test tells the two apart

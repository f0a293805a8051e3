"""End to end: the command line learns the planted signal, writes its summary and logs, runs
under torchrun with gloo, reads Parquet, measures Local MFU and plans gem-large."""

import json
import math
import os
import subprocess
import sys

import pytest
from gem_train import cli
from gem_train.train import train

SUMMARY_KEYS = {"steps", "samples", "final_ne", "final_auc", "qps", "wall_s"}


def _refuse_non_standard_json(token):
    raise AssertionError(f"summary JSON holds {token}, which standard JSON readers reject")


def test_tiny_learns_the_planted_signal(tmp_path):
    """A shortened ``uv run gem-train``: the default tiny model, fewer steps, still learns."""
    summary_path = tmp_path / "summary.json"
    assert (
        cli.main(
            ["--steps", "100", "--metrics.progress", "false", "--summary-json", str(summary_path)]
        )
        == 0
    )
    summary = json.loads(summary_path.read_text(), parse_constant=_refuse_non_standard_json)
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["e2e_mfu"] is None  # no BF16 peak is defined for the CPU
    assert summary["steps"] == 100 and summary["samples"] == 100 * 32  # tiny: batch 32
    assert summary["final_ne"] < 0.97, summary["final"]
    assert summary["final_auc"] > 0.6, summary["final"]
    assert summary["qps"] > 0 and summary["wall_s"] > 0


def test_tiny_learns_with_the_fused_rowwise_adagrad_tables(tmp_path):
    """Native tables that update their touched rows in the backward (no dense table gradient)."""
    summary_path = tmp_path / "summary.json"
    flags = ["--model.embeddings", "native", "--optim.embedding_optimizer", "rowwise_adagrad"]
    flags += ["--optim.embedding_lr", "0.1", "--steps", "100", "--metrics.progress", "false"]
    assert cli.main([*flags, "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    assert summary["final_ne"] < 0.97, summary["final"]
    assert summary["final_auc"] > 0.6, summary["final"]
    assert any("row-wise Adagrad" in note for note in summary["optimisations"])


def test_tensorboard_logs_and_history(small, tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard logs need the tensorboard package")
    summary = train(small(metrics__tensorboard=str(tmp_path / "tb"), metrics__log_every=2))
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    assert [row["step"] for row in summary["history"]] == [2, 4, 6]
    assert {
        "train/loss",
        "train/ctr_ne",
        "train/ctr_auc",
        "train/cvr_ne",
        "train/qps",
        "train/padding_fraction",
        "train/rank_imbalance",
    } <= summary["history"][-1].keys()
    assert summary["history"][-1]["train/rank_imbalance"] == 1.0  # one rank
    assert len(summary["losses"]) == 6 and all(math.isfinite(x) for x in summary["losses"])


def test_trains_from_parquet(small, tmp_path):
    pytest.importorskip("pyarrow", reason="the Parquet reader needs pyarrow")
    from gem_train.data.parquet import write_example

    path = tmp_path / "example.parquet"
    cfg = small()
    write_example(str(path), cfg.data, cfg.model, rows=20)
    summary = train(small(data__source="parquet", data__path=str(path), steps=3))
    assert summary["samples"] == 3 * 8 and math.isfinite(summary["losses"][-1])


def _torchrun_moe(flags, tmp_path, *, ep: int) -> dict:
    summary_path = tmp_path / f"summary_ep{ep}.json"
    moe = {"model.ffn": "moe", "model.n_experts": 2, "parallel.ep": ep}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "gem_train.cli",
        *flags(steps=3, **{"data.eval_batches": 2, **moe}),
        "--summary-json", str(summary_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["world_size"] == 2 and summary["samples"] == 2 * 3 * 8
    assert any("FSDP2" in note and f"ep={ep}" in note for note in summary["optimisations"])
    assert math.isfinite(summary["final_ne"]) and math.isfinite(summary["losses"][-1])
    assert summary["history"][-1]["train/rank_imbalance"] >= 1.0
    assert done.stdout.count("done:") == 1  # only rank 0 reports
    return summary


def test_torchrun_two_processes_with_gloo(flags, tmp_path):
    """MoE experts FSDP-sharded (ep=1), then split over the 2 ranks (ep=2) although their jagged
    batches hold different token counts: nothing is dropped, so both train identically."""
    fsdp, expert_parallel = (_torchrun_moe(flags, tmp_path, ep=ep) for ep in (1, 2))
    assert expert_parallel["losses"] == pytest.approx(fsdp["losses"], rel=1e-5)


def test_mfu_command_reports_every_layer(flags, capsys):
    assert cli.main(["mfu", *flags(**{"metrics.peak_tflops": 1.0})]) == 0
    out = capsys.readouterr().out
    for layer in ("inputs", "block0", "pma", "cross", "interaction"):
        assert f"| {layer} |" in out
    assert "Local MFU (FLOP-weighted):" in out


def test_plan_command_sizes_gem_large(capsys):
    assert cli.main(["plan", "--config", "gem-large", "--gpus", "1024"]) == 0
    out = capsys.readouterr().out
    assert "gem-large:" in out and "dense parameters" in out and '"layout"' in out


def test_token_alignment_padding_leaves_the_training_unchanged(small):
    plain = train(small(steps=3))
    padded = train(small(steps=3, lowprec__token_multiple=64))
    assert padded["samples"] == plain["samples"]
    for a, b in zip(plain["losses"], padded["losses"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (plain["losses"], padded["losses"])


def test_expert_parallel_token_bound_is_shared_and_named(small):
    """Under ``parallel.ep > 1`` every MoE gets the flag's bound (or the data config's largest
    batch), and a rank whose batch exceeds it gets an error naming the flag."""
    import torch
    from gem_train.model.blocks import Block
    from gem_train.optimizations import bound_moe_tokens

    moe = {"model__ffn": "moe", "model__n_experts": 2, "parallel__ep": 2}
    cfg = small(**moe, parallel__ep_max_tokens=5)
    block = Block(cfg.model)
    assert bound_moe_tokens(block, cfg) == 5 and block.ffn.config.max_tokens_per_rank == 5
    assert block.ffn(torch.randn(5, cfg.model.d_model)).shape == (5, cfg.model.d_model)
    with pytest.raises(ValueError, match="6 history tokens .* parallel.ep_max_tokens=5"):
        block.ffn(torch.randn(6, cfg.model.d_model))
    padded = small(**moe, lowprec__token_multiple=100)  # batch 8 × max_len 64 = 512 → 600
    assert bound_moe_tokens(Block(padded.model), padded) == 600

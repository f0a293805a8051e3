"""Named configs, flag overrides and their errors, and the command line's help."""

import pytest
import torch
from gem_train import cli
from gem_train.config import NAMED_CONFIGS, ConfigError, apply_overrides, fields_of, named_config


@pytest.mark.parametrize("name", list(NAMED_CONFIGS))
def test_named_configs_are_valid(name):
    cfg = named_config(name).validate()
    assert cfg.name == name


def test_gem_small_fits_the_issue():
    cfg = named_config("gem-small")
    assert cfg.model.d_model >= 1024
    assert (cfg.data.median_len, cfg.data.sigma, cfg.data.min_len, cfg.data.max_len) == (
        512,
        1.0,
        32,
        16384,
    )


def test_overrides_convert_by_type():
    cfg = apply_overrides(
        named_config("tiny"),
        {
            "model.d_model": "128",
            "optim.lr": "1e-2",
            "data.shuffle": "false",
            "steps": "7",
            "summary-json": "x.json",
        },
    )
    assert (cfg.model.d_model, cfg.optim.lr, cfg.data.shuffle, cfg.steps) == (128, 1e-2, False, 7)
    assert cfg.metrics.summary_json == "x.json"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"model.d_model": "abc"}, "model.d_model must be an integer"),
        ({"model.d_model": "65"}, "model.d_model must be divisible by model.n_heads"),
        (
            {"model.d_model": "32"},
            r"model.d_model / model.n_heads must be a head dim of 32, 64 or 128",
        ),
        ({"model.attention": "flash"}, "model.attention must be one of"),
        ({"data.batch_size": "10"}, "data.batch_size must be a multiple of data.sub_batch_size"),
        ({"optim.lr": "-1"}, "optim.lr must be positive"),
        ({"data.shuffle": "maybe"}, "data.shuffle must be a boolean"),
        ({"model.widht": "3"}, "unknown field 'model.widht'"),
        ({"data.source": "parquet"}, "data.path must be a Parquet file"),
        ({"optim.embedding_optimizer": "sgd"}, "optim.embedding_optimizer must be one of"),
        (
            {"optim.embedding_optimizer": "rowwise_adagrad", "model.embeddings": "torchrec"},
            "optim.embedding_optimizer must be adamw with model.embeddings=torchrec",
        ),
    ],
)
def test_bad_values_name_the_field(flags, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(named_config("tiny"), flags)


def test_every_field_has_help():
    for name, (_, _, text) in fields_of(named_config("tiny")).items():
        assert text, f"{name} has no help text"


def test_help_lists_named_configs_and_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in NAMED_CONFIGS:
        assert name in out
    assert "--model.d_model" in out and "--summary-json" in out and "mfu" in out


def test_bad_flag_exits_with_the_field_named(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model.n_heads", "0"])
    assert exit_info.value.code == 2
    assert "model.n_heads must be a positive integer" in capsys.readouterr().err


def test_plan_only_config_refuses_to_train(capsys):
    assert cli.main(["--config", "gem-large"]) == 2
    assert "plan only" in capsys.readouterr().err


def test_the_fused_embedding_optimizer_needs_native_tables_on_one_process():
    from gem_train.components import fuse_embedding_optimizer
    from gem_train.model import GemModel

    cfg = apply_overrides(
        named_config("tiny"),
        {"optim.embedding_optimizer": "rowwise_adagrad", "model.embeddings": "native"},
    )
    model = GemModel(cfg.model)
    with pytest.raises(ConfigError, match="with 2 processes the tables are sharded"):
        fuse_embedding_optimizer(cfg, model, world=2)
    fused = fuse_embedding_optimizer(cfg, model, world=1)
    assert len(fused) == 2  # the sequence and the pooled collections
    no_tables = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="set model.embeddings=native"):
        fuse_embedding_optimizer(cfg, no_tables, world=1)

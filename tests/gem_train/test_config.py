"""Named configs, flag overrides and their errors, and the command line's help."""

import dataclasses
import math
import re

import pytest
import torch
from gem_train import cli
from gem_train.config import (
    NAMED_CONFIGS,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    apply_overrides,
    fields_of,
    named_config,
)
from gem_train.config_fields import Range
from gem_train.data.synthetic import SyntheticStream


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
        ({"optim.lr": "-1"}, "optim.lr must be finite and > 0"),
        ({"data.shuffle": "maybe"}, "data.shuffle must be a boolean"),
        ({"model.widht": "3"}, "unknown field 'model.widht'"),
        ({"data.source": "parquet"}, "data.path must be a Parquet file"),
        ({"optim.embedding_optimizer": "sgd"}, "optim.embedding_optimizer must be one of"),
        ({"model.jagged_schedule": "tokens"}, "model.jagged_schedule must be one of"),
        (
            {"model.jagged_schedule": "token_tiles", "model.attention": "flex"},
            "model.jagged_schedule must be per_sequence unless model.attention=jagged",
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


def _numeric_fields() -> list[tuple[str, type, object, Range]]:
    """``(flag name, type, owner dataclass, declared range)`` of every int / float field."""
    out = []
    for name, (owner, kind, _) in fields_of(named_config("tiny")).items():
        if kind in (int, float):
            declared = {f.name: f for f in dataclasses.fields(owner)}[name.split(".")[-1]]
            out.append((name, kind, owner, declared.metadata["range"]))
    return out


def _bad_values(kind: type, bounds: Range) -> list:
    """NaN, the infinities, and the nearest values outside the declared range."""
    values = [math.nan, math.inf, -math.inf]
    step = 1 if kind is int else 0.5
    if bounds.low is not None:
        values.append(bounds.low if bounds.low_open else bounds.low - step)
    if bounds.high is not None:
        values.append(bounds.high if bounds.high_open else bounds.high + step)
    return values


BAD_NUMBERS = [
    pytest.param(name, kind, owner, value, id=f"{name}={value}")
    for name, kind, owner, bounds in _numeric_fields()
    for value in _bad_values(kind, bounds)
]


def test_every_numeric_field_declares_its_range():
    fields = _numeric_fields()
    assert len(fields) > 40
    for name, _, _, bounds in fields:
        assert bounds.low is not None or bounds.high is not None, f"{name} declares no range"


@pytest.mark.parametrize(("name", "kind", "owner", "value"), BAD_NUMBERS)
def test_every_numeric_flag_refuses_nan_inf_and_out_of_range(name, kind, owner, value):
    """As a flag (``--data.sigma inf``): refused before anything trains, the field named."""
    text = repr(int(value)) if kind is int and math.isfinite(value) else repr(float(value))
    with pytest.raises(ConfigError, match=rf"^{re.escape(name)} must be "):
        apply_overrides(named_config("tiny"), {name: text})


@pytest.mark.parametrize(("name", "kind", "owner", "value"), BAD_NUMBERS)
def test_every_numeric_field_refuses_bad_values_on_construction(name, kind, owner, value):
    """Built in Python (``DataConfig(sigma=math.inf)``): refused by the dataclass itself."""
    if kind is int and math.isfinite(value):
        value = int(value)
    with pytest.raises(ConfigError, match=rf"^{re.escape(name)} must be "):
        type(owner)(**{name.split(".")[-1]: value})


def test_numeric_messages_say_what_is_expected():
    with pytest.raises(ConfigError, match=r"^data\.sigma must be finite and ≥ 0, got inf$"):
        apply_overrides(named_config("tiny"), {"data.sigma": "inf"})
    with pytest.raises(ConfigError, match=r"^steps must be an integer, got 1\.5$"):
        TrainConfig(steps=1.5)
    with pytest.raises(
        ConfigError, match=r"^optim\.beta2 must be finite and in \[0, 1\), got 1\.0$"
    ):
        OptimConfig(beta2=1.0)
    with pytest.raises(ConfigError, match=r"^model\.d_model must be an integer, got True$"):
        ModelConfig(d_model=True)
    # The bounds themselves are allowed and mean what they say: σ = 0 gives every history one
    # length (teacher_strength = 0: labels independent of the features).
    flat = DataConfig(sigma=0.0, teacher_strength=0.0)
    lengths = SyntheticStream(flat, ModelConfig()).batch(0).lengths
    assert lengths.unique().numel() == 1, lengths

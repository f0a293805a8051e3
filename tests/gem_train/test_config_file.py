"""TOML config files: read with ``--config PATH.toml`` (flags override them), checked exactly as
flags are, and written by ``gem-train config`` so that dump and load give the same config."""

import re

import pytest
from gem_train import cli
from gem_train.config import NAMED_CONFIGS, ConfigError, apply_overrides, fields_of, named_config
from gem_train.config_file import dump_toml, load_toml, resolve_config


def _file(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", list(NAMED_CONFIGS))
def test_dump_then_load_gives_the_same_config(tmp_path, name):
    cfg = apply_overrides(
        named_config(name),
        {
            "optim.lr": "1.25e-07",
            "seed": str(2**63 - 1),
            "data.eval_fraction": "0.3",
            "metrics.summary_json": 'odd "dir"\\\tname\n\x7fé.json',
        },
    )
    path = _file(tmp_path, dump_toml(cfg))
    loaded = load_toml(path)
    assert loaded == cfg
    assert dump_toml(loaded) == path.read_text()


def test_a_file_names_its_base_and_flags_override_it(tmp_path):
    path = _file(
        tmp_path,
        'base = "gem-small"\nsteps = 7\n\n[optim]\nlr = 2e-3\nwarmup_steps = 0\n\n'
        "[data]\nshuffle = false\nsigma = 1\n",
    )
    _, cfg, _ = cli.parse(["--config", str(path), "--optim.lr", "0.5", "--device", "cpu"])
    assert cfg.name == "gem-small" and cfg.model.d_model == 1024  # the base's
    assert (cfg.steps, cfg.optim.warmup_steps, cfg.data.shuffle) == (7, 0, False)  # the file's
    assert cfg.data.sigma == 1.0 and isinstance(cfg.data.sigma, float)
    assert (cfg.optim.lr, cfg.device) == (0.5, "cpu")  # the flags'
    assert resolve_config(str(path)).optim.lr == 2e-3
    assert load_toml(_file(tmp_path, "steps = 3\n")).name == "tiny"  # no base: tiny


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[modle]\nd_model = 3\n", r"unknown section \[modle\]"),
        ("[model]\nwidht = 3\n", "unknown field 'model.widht'"),
        ("stpes = 3\n", "unknown field 'stpes'"),
        ('name = "gem-small"\n', r"unknown field 'name' \(set base instead\)"),
        ("model = 3\n", r"model must be a table \(\[model\]\), got 3"),
        ('base = "gem-huge"\n', "base must be one of"),
        ("[model]\nd_model = 64.5\n", "model.d_model must be an integer, got 64.5"),
        ("[model]\nd_model = 0\n", "model.d_model must be a positive integer, got 0"),
        ("[model]\nd_model = 65\n", "model.d_model must be divisible by model.n_heads"),
        ('[data]\nshuffle = "yes"\n', r"data.shuffle must be a boolean \(true/false\), got 'yes'"),
        ("[data]\npath = 5\n", "data.path must be a string, got 5"),
        ("[optim]\nlr = true\n", "optim.lr must be a number, got True"),
        ("[data]\nsigma = inf\n", "data.sigma must be finite and ≥ 0, got inf"),
        ('[model]\nattention = "flash"\n', "model.attention must be one of"),
        ("[model]\n[model.inner]\nx = 1\n", "unknown field 'model.inner'"),
        ("steps = \n", "is not valid TOML"),
    ],
)
def test_bad_files_are_refused_naming_the_file_and_the_field(tmp_path, text, message):
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(str(path))}\b.*{message}"):
        load_toml(path)


def test_every_numeric_field_is_checked_as_its_flag_is(tmp_path):
    """Out of range in a file, every numeric field gets its flag's message, word for word."""
    checked = 0
    for name, (owner, kind, _) in fields_of(named_config("tiny")).items():
        if kind not in (int, float):
            continue
        bounds = owner.__dataclass_fields__[name.split(".")[-1]].metadata["range"]
        bad = bounds.low - 1 if bounds.low is not None else bounds.high + 1
        bad = int(bad) if kind is int else float(bad)
        section, _, key = name.rpartition(".")
        path = _file(tmp_path, (f"[{section}]\n" if section else "") + f"{key} = {bad!r}\n")
        with pytest.raises(ConfigError) as from_flag:
            apply_overrides(named_config("tiny"), {name: repr(bad)})
        with pytest.raises(ConfigError) as from_file:
            load_toml(path)
        assert str(from_file.value) == f"config file {path}: {from_flag.value}"
        checked += 1
    assert checked > 40


def test_a_missing_file_or_an_unknown_name_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nothing\.toml cannot be read"):
        resolve_config(str(tmp_path / "nothing.toml"))
    with pytest.raises(ConfigError, match=r"or a TOML file \(PATH\.toml\), got 'gem-smal'"):
        resolve_config("gem-smal")


def test_the_config_command_prints_a_file_the_trainer_reads(tmp_path, capsys):
    assert cli.main(["config", "--config", "gem-small", "--optim.lr", "0.25", "--steps", "9"]) == 0
    path = _file(tmp_path, capsys.readouterr().out)
    assert cli.main(["config", "--config", str(path)]) == 0
    assert capsys.readouterr().out == path.read_text()
    cfg = load_toml(path)
    assert (cfg.name, cfg.optim.lr, cfg.steps) == ("gem-small", 0.25, 9)


def test_a_bad_file_exits_with_the_usage_and_the_field(tmp_path, capsys):
    path = _file(tmp_path, "[model]\nn_heads = 0\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--config", str(path)])
    assert exit_info.value.code == 2
    assert f"config file {path}: model.n_heads must be a positive integer" in (
        capsys.readouterr().err
    )

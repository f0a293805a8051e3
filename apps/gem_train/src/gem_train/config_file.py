"""Configs as TOML files: ``gem-train --config run.toml`` reads one, ``gem-train config`` writes one.

A config file names the named config it starts from in a top-level ``base`` (``tiny`` when
absent), may set the run's own fields at the top level (``steps = 500``), and holds one table
per section (``[model]``, ``[data]``, ...) with fields by their names::

    base = "gem-small"
    steps = 500

    [optim]
    lr = 2e-3

    [data]
    source = "parquet"
    path = "rows/"

Each value must have its field's TOML type (an integer, a float or an integer for a float field,
a boolean, a string) and then passes the same checks as a flag (``TrainConfig.validate``: every
numeric field's declared range, the choices, the checks that relate fields). An unknown section or
field, a value of another type or out of range is a ``ConfigError`` naming the file and the field.
Command-line flags apply after the file, so they override it.

``dump_toml`` writes every field of a resolved config (each with its help text as a comment), so
that ``load_toml`` of the dump gives back the same config: a run can be recorded and repeated.
"""

import tomllib
from pathlib import Path
from typing import Any

from gem_train.config import (
    NAMED_CONFIGS,
    SECTIONS,
    ConfigError,
    TrainConfig,
    fields_of,
    named_config,
)
from gem_train.run_record import flat_config

BASE = "base"
DEFAULT_BASE = "tiny"


def resolve_config(name: str) -> TrainConfig:
    """The named config ``name``, or the config of the TOML file ``name`` (ending in ``.toml``).

    Raises:
        ConfigError: an unknown name, or a file that cannot be read or does not hold a valid
            config (the message names the file and the field).
    """
    if name.endswith(".toml"):
        return load_toml(name)
    if name not in NAMED_CONFIGS:
        raise ConfigError(
            f"config must be one of {tuple(NAMED_CONFIGS)} or a TOML file (PATH.toml), got {name!r}"
        )
    return named_config(name)


def load_toml(path: str | Path) -> TrainConfig:
    """The config a TOML file describes: its ``base`` named config with the file's fields set.

    Raises:
        ConfigError: naming the file and the first unknown section or field, or the field whose
            value has the wrong type or fails its check; or the file is unreadable or not TOML.
    """
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    try:
        return _config_of(doc)
    except ConfigError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def _config_of(doc: dict[str, Any]) -> TrainConfig:
    base = doc.pop(BASE, DEFAULT_BASE)
    if not isinstance(base, str) or base not in NAMED_CONFIGS:
        raise ConfigError(f"{BASE} must be one of {tuple(NAMED_CONFIGS)}, got {base!r}")
    cfg = named_config(base)
    known = fields_of(cfg)
    values: dict[str, Any] = {}
    for key, value in doc.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{key} must be a table ([{key}]), got {value!r}")
            values.update({f"{key}.{name}": v for name, v in value.items()})
        elif isinstance(value, dict):
            raise ConfigError(f"unknown section [{key}]; the sections are {', '.join(SECTIONS)}")
        else:
            values[key] = value
    for name, value in values.items():
        # ``name`` is the base's: a file says where it starts from with ``base``
        if name not in known or name == "name":
            hint = f" (set {BASE} instead)" if name == "name" else ""
            raise ConfigError(f"unknown field {name!r}{hint}; `gem-train --help` lists every field")
        owner, kind, _ = known[name]
        setattr(owner, name.split(".")[-1], _typed(name, kind, value))
    return cfg.validate()


def _typed(name: str, kind: type, value: Any) -> Any:
    """``value`` as a ``kind`` field's value; the range and choices are ``validate``'s to check."""
    if kind is bool:
        ok, expected = isinstance(value, bool), "a boolean (true/false)"
    elif kind is int:
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is float:
        ok, expected = isinstance(value, int | float) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    else:
        ok, expected = isinstance(value, str), "a string"
    if not ok:
        raise ConfigError(f"{name} must be {expected}, got {value!r}")
    return value


def dump_toml(cfg: TrainConfig) -> str:
    """Every field of ``cfg`` as a TOML document that ``load_toml`` reads back to ``cfg``."""
    helps = {name: text for name, (_, _, text) in fields_of(cfg).items()}
    top = [
        "# A gem-train config: run it with `gem-train --config FILE.toml`; flags override it.",
        "# the named config this one starts from",
        f"{BASE} = {_toml_value(cfg.name)}",
    ]
    tables: dict[str, list[str]] = {}
    for name, value in flat_config(cfg).items():
        if name == "name":
            continue
        section, _, key = name.rpartition(".")
        lines = top if not section else tables.setdefault(section, ["", f"[{section}]"])
        lines += [f"# {helps[name]}", f"{key} = {_toml_value(value)}"]
    return "\n".join(top + [line for lines in tables.values() for line in lines]) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # a valid config holds finite numbers only, which repr writes as TOML
    return '"' + "".join(_escape(c) for c in str(value)) + '"'


def _escape(char: str) -> str:
    """``char`` inside a TOML basic string: quotes and backslashes escaped, control characters
    as ``\\uXXXX`` (TOML allows none of them raw)."""
    if char in '"\\':
        return "\\" + char
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"\\u{ord(char):04X}"
    return char

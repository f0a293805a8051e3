"""The building blocks of the trainer's configuration dataclasses: fields with a help text and a
declared range, the one generic check of every numeric field, and the error every check raises.

A numeric field says where it is defined which values it accepts (``opt(64, "...",
at_least=1)``); ``check_numbers`` enforces every declaration in one place, so that no field can
be forgotten: the value must have the field's type (an ``int`` field an integer, a ``float``
field a number; ``True`` is not a number here), a float must be finite (NaN and infinities have
no meaning for any field), and the value must lie in the range. Messages name the field and what
it must be: ``data.sigma must be finite and ≥ 0, got inf``.
"""

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, get_type_hints


class ConfigError(ValueError):
    """A configuration value is malformed or inconsistent; the message names the field."""


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts: ``low``/``high`` bounds (``None``: unbounded), each
    inclusive unless its ``*_open`` flag is set. NaN and infinities are always outside."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self, kind: type) -> str:
        """What a valid value is, in words: ``a positive integer``, ``finite and in [0, 1)``."""
        if kind is int and self.high is None and self.low == 1 and not self.low_open:
            return "a positive integer"
        prefix = "an integer" if kind is int else "finite and"
        low, high = (f"{b:d}" if kind is int else f"{b:g}" for b in (self.low or 0, self.high or 0))
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"{prefix} in {left}{low}, {high}{right}"
        if self.low is not None:
            return f"{prefix} {'>' if self.low_open else '≥'} {low}"
        if self.high is not None:
            return f"{prefix} {'<' if self.high_open else '≤'} {high}"
        return "an integer" if kind is int else "finite"


def opt(
    default,
    help: str,
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
):
    """A dataclass field with a help text (shown by ``gem-train --help``) and, for a numeric
    field, the range it accepts (``at_least``/``above`` the low bound, inclusive/exclusive;
    ``at_most``/``below`` the high one), enforced by ``check_numbers``."""
    metadata: dict[str, Any] = {"help": help}
    if isinstance(default, int | float) and not isinstance(default, bool):
        metadata["range"] = Range(
            low=above if above is not None else at_least,
            high=below if below is not None else at_most,
            low_open=above is not None,
            high_open=below is not None,
        )
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def check_numbers(section: str, owner) -> None:
    """Check every ``int`` / ``float`` field of the dataclass ``owner`` against its type and its
    declared ``Range``; ``section`` prefixes the field names in messages (``""`` for the top level).

    Raises:
        ConfigError: naming the first field whose value has the wrong type, is NaN or infinite,
            or lies outside its range (``data.sigma must be finite and ≥ 0, got inf``).
    """
    hints = get_type_hints(type(owner))
    for f in dataclasses.fields(owner):
        kind = hints[f.name]
        if kind not in (int, float):
            continue
        name = f"{section}.{f.name}" if section else f.name
        value, bounds = getattr(owner, f.name), f.metadata["range"]
        number_types = (int,) if kind is int else (int, float)
        require(
            isinstance(value, number_types) and not isinstance(value, bool),
            name,
            "an integer" if kind is int else "a number",
            value,
        )
        require(value in bounds, name, bounds.describe(kind), value)


def require(ok: bool, name: str, expected: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name} must be {expected}, got {value!r}")


def require_choice(name: str, value: Any, choices: tuple) -> None:
    require(value in choices, name, f"one of {choices}", value)

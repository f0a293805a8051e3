"""``Fp8Table``: the fp8-or-BF16 choice per linear shape as plain, JSON-serialisable data.

A key is ``Fp8Key(recipe, k, n, x_dtype, out_dtype, m_bucket)``: the recipe as ``recipe_id``
(its name and every setting that changes the fp8 path's speed), the GEMM's K and N, the dtypes
of the GEMM's input and output as names (``"bfloat16"``, ``"float16"``, ``"float32"``) and the
token count rounded up to a power of two (``fallback.m_bucket``). A value is
``Fp8Choice(keep_fp8, why)``. A table is made once, before training (``fp8_plan.build_table``),
broadcast so that every rank holds the same one, and consulted by an ``Fp8Decisions`` in table
mode, which never times anything.

``lookup`` is deterministic, so every rank holding the same table decides the same: the exact
key; else the entry of the nearest M bucket (in powers of two; a tie takes the smaller bucket)
with the same recipe, K, N and dtypes; else nothing (the caller applies the shape rule).

``to_dict`` / ``from_dict`` give ``{"version": 1, "entries": [{field: value}, ...]}`` with the
entries sorted, so equal tables give equal dicts and equal JSON; ``from_dict`` checks every
field and raises ``ValueError`` naming the one that is wrong.
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

import torch

from gem_lowprec.recipes import Recipe

__all__ = ["DTYPE_NAMES", "Fp8Choice", "Fp8Key", "Fp8Table", "dtype_name", "recipe_id"]

VERSION = 1
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the table's spelling of a dtype).

    Raises:
        ValueError: a dtype a low-precision linear does not take.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype}")
    return name


def recipe_id(recipe: Recipe) -> str:
    """The table's name of a recipe: its name and the settings that change what its fp8 path
    runs, e.g. ``"mxfp8:wgrad=bf16:e4m3/e4m3:rceil"`` (``fallback`` settings only change how a
    choice is made, so they are not part of it)."""
    q, wg = recipe.quant, recipe.weight_grad
    hadamard = f"+hadamard{wg.hadamard_block}" if wg.hadamard_block else ""
    elem, grad = (str(d).removeprefix("torch.float8_").removesuffix("fn") for d in
                  (q.elem_dtype, q.grad_elem_dtype))  # fmt: skip
    return f"{recipe.name}:wgrad={wg.precision}{hadamard}:{elem}/{grad}:{q.scale_mode}"


@dataclass(frozen=True, order=True)
class Fp8Key:
    """One decision's key (see the module docstring)."""

    recipe: str
    k: int
    n: int
    x_dtype: str
    out_dtype: str
    m_bucket: int

    def shape(self) -> tuple:
        """The key without its M bucket: the entries ``lookup`` may borrow from."""
        return (self.recipe, self.k, self.n, self.x_dtype, self.out_dtype)


@dataclass(frozen=True)
class Fp8Choice:
    """Whether the fp8 path runs, and why (a measurement's medians, or the rule applied)."""

    keep_fp8: bool
    why: str


class Fp8Table:
    """fp8-or-BF16 choices per ``Fp8Key`` (see the module docstring).

    Args:
        entries: ``{Fp8Key: Fp8Choice}``; copied.

    Attributes:
        entries: the choices, a plain dict the caller may read.
    """

    def __init__(self, entries: Mapping[Fp8Key, Fp8Choice] | None = None):
        self.entries: dict[Fp8Key, Fp8Choice] = dict(entries or {})

    def lookup(self, key: Fp8Key) -> tuple[Fp8Key, Fp8Choice] | None:
        """The entry deciding ``key`` and its own key: ``key``'s, else the nearest M bucket's of
        the same shape (a tie takes the smaller bucket), else None."""
        if key in self.entries:
            return key, self.entries[key]
        same_shape = [other for other in self.entries if other.shape() == key.shape()]
        if not same_shape:
            return None
        log_m = key.m_bucket.bit_length()
        nearest = min(same_shape, key=lambda o: (abs(o.m_bucket.bit_length() - log_m), o.m_bucket))
        return nearest, self.entries[nearest]

    def to_dict(self) -> dict:
        """``{"version": 1, "entries": [...]}``, JSON-serialisable, entries sorted by key."""
        rows = [{**asdict(key), **asdict(self.entries[key])} for key in sorted(self.entries)]
        return {"version": VERSION, "entries": rows}

    @classmethod
    def from_dict(cls, data) -> "Fp8Table":
        """The table ``to_dict`` gave.

        Raises:
            ValueError: not a dict of that form: a missing, unknown or ill-typed field (the
                message names it, e.g. ``entries[3].m_bucket``), or a key given twice.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"an Fp8Table dict must be a mapping, got {type(data).__name__}")
        if set(data) != {"version", "entries"}:
            raise ValueError(
                f"an Fp8Table dict has exactly the fields 'version' and 'entries', got "
                f"{sorted(map(str, data))}"
            )
        if data["version"] != VERSION:
            raise ValueError(f"version must be {VERSION}, got {data['version']!r}")
        if not isinstance(data["entries"], list):
            raise ValueError(f"entries must be a list, got {type(data['entries']).__name__}")
        entries: dict[Fp8Key, Fp8Choice] = {}
        for i, row in enumerate(data["entries"]):
            key, choice = _parse_entry(row, f"entries[{i}]")
            if key in entries:
                raise ValueError(f"entries[{i}] repeats the key {key}")
            entries[key] = choice
        return cls(entries)

    def __eq__(self, other) -> bool:
        return isinstance(other, Fp8Table) and self.entries == other.entries

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        kept = sum(choice.keep_fp8 for choice in self.entries.values())
        return f"Fp8Table({len(self.entries)} entries, {kept} keep fp8)"


_FIELDS = [f.name for f in fields(Fp8Key)] + [f.name for f in fields(Fp8Choice)]


def _parse_entry(row, where: str) -> tuple[Fp8Key, Fp8Choice]:
    if not isinstance(row, Mapping):
        raise ValueError(f"{where} must be a mapping of {_FIELDS}, got {type(row).__name__}")
    missing = [name for name in _FIELDS if name not in row]
    unknown = sorted(str(name) for name in row if name not in _FIELDS)
    if missing or unknown:
        raise ValueError(
            f"{where} must have the fields {_FIELDS}: missing {missing}, unknown {unknown}"
        )

    def check(name: str, ok: bool, expected: str):
        if not ok:
            raise ValueError(f"{where}.{name} must be {expected}, got {row[name]!r}")

    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    check("recipe", isinstance(row["recipe"], str) and row["recipe"] != "", "a non-empty string")
    for name in ("k", "n"):
        check(name, is_int(row[name]) and row[name] > 0, "a positive int")
    for name in ("x_dtype", "out_dtype"):
        dtype = row[name]
        check(
            name, isinstance(dtype, str) and dtype in DTYPE_NAMES, f"one of {sorted(DTYPE_NAMES)}"
        )
    m = row["m_bucket"]
    check("m_bucket", is_int(m) and m >= 1 and m & (m - 1) == 0, "a power of two >= 1")
    check("keep_fp8", isinstance(row["keep_fp8"], bool), "a bool")
    check("why", isinstance(row["why"], str), "a string")
    key = Fp8Key(**{name: row[name] for name in (f.name for f in fields(Fp8Key))})
    return key, Fp8Choice(keep_fp8=row["keep_fp8"], why=row["why"])

"""Which calls of a ``LowPrecisionLinear`` run fp8 and which fall back to BF16, per shape.

A shape the fp8 path cannot take (K or N not a multiple of 128 for mxfp8, of 16 for rowwise;
tokens not a multiple of 16) runs in BF16, in either of the two modes below.

**Table mode** (``Fp8Decisions(table=...)``; what a distributed trainer uses). The choice for
each (recipe, K, N, dtype, output dtype, M bucket) comes from an ``Fp8Table`` made before
training (``gem_lowprec.fp8_plan``: measured once on one rank's GPU, or the shape rule on the
CPU) and broadcast, so that every rank holds the same table and every rank chooses the same;
nothing is ever timed. A key the table lacks takes the entry of the nearest M bucket of the same
shape, else the shape rule (fp8 where the kernels take the shape): a deterministic rule, the
same on every rank. Every choice made is recorded in ``used`` (with the rule that gave it), and
``state_dict()`` / ``from_state_dict()`` carry the table and those choices through a checkpoint.

**Measured mode** (the default; for a single process that wants its own timings). On a GPU,
with ``FallbackConfig.measure_on_gpu``, fp8 is timed against BF16 (forward + backward) inside
the training process, once per (recipe, K, N, dtype, output dtype, M rounded up to a power of
two), and kept only where its median is ``FallbackConfig.min_speedup`` times faster. Two
processes time on their own and can choose differently (and so train different numerics):
don't use it across ranks. The two paths alternate for three rounds and each
keeps its median: an eager step is often host-bound, and a single round is noisy enough to pick
fp8 where it then runs slower than BF16. A tie goes to BF16, which is never slower than itself.

The timing never runs inside a backward (checkpoint recomputation), while a CUDA graph is
captured, under saved-tensor hooks (a checkpointed forward, activation offloading) or a
dispatch mode: such a call takes the fp8 path unmeasured, and its key is timed at its first call
outside them, or by ``measure_pending()``, which a training loop calls between steps for layers
that only ever run inside checkpointed regions.

All of it (both modes) is state of one ``Fp8Decisions`` object, which the caller can see and share:
``convert`` gives every linear it converts the same one (so a shape is timed once per model),
and a ``LowPrecisionLinear`` built alone makes its own. Every fallback is warned about once per
object and listed by ``fallback_report()``.
"""

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gem_lowprec._linear_fp8 import UnitScales, fp8_linear
from gem_lowprec.fp8_table import Fp8Choice, Fp8Key, Fp8Table, dtype_name, recipe_id
from gem_lowprec.recipes import Recipe

ROUNDS = 3  # interleaved timing rounds per path; each path keeps its median


def m_bucket(m: int) -> int:
    """Token counts share a decision up to the next power of two (jagged batches vary M).

    Comparisons only, so that under ``torch.compile`` with a dynamic M the graph is guarded on
    the bucket's bounds instead of specialising on M."""
    bucket = 1
    while bucket < m:
        bucket *= 2
    return bucket


def shape_problem(recipe: Recipe, m: int, k: int, n: int) -> str | None:
    """Why the fp8 GEMMs cannot take ``[m, k] @ [n, k]ᵀ`` under ``recipe``, or None."""
    align = 128 if recipe.name == "mxfp8" else 16
    if k % align or n % align:
        return f"K={k} and N={n} must be multiples of {align} for {recipe.name}"
    if m % 16:
        return f"tokens M={m} must be a multiple of 16 for the fp8 GEMM"
    return None


def timing_allowed(x: torch.Tensor) -> bool:
    """Only in a plain forward on a GPU: not compiling, capturing a CUDA graph or in inference
    mode, not inside a backward (checkpoint recompute), no saved-tensor hooks (checkpointed
    forward, offloading), no dispatch mode (selective activation checkpointing)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if not x.is_cuda or torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return False
    if torch.cuda.is_current_stream_capturing():  # a timing would be captured, not run
        return False
    if torch._C._current_graph_task_id() != -1:
        return False
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top_hooks is None or top_hooks(False) is not None:
        return False
    return _get_current_dispatch_mode() is None


def time_fwd_bwd(fn, x: torch.Tensor, w: torch.Tensor, reps: int = 5) -> float:
    """Milliseconds per ``fn(x, w).sum().backward()`` on the current CUDA stream (after two
    warm-up calls)."""
    with torch.enable_grad():
        for _ in range(2):
            fn(x, w).sum().backward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn(x, w).sum().backward()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def measure_fp8_against_bf16(
    recipe: Recipe,
    m: int,
    k: int,
    n: int,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    out_dtype: torch.dtype,
    device,
    *,
    timer: Callable[..., float] = time_fwd_bwd,
) -> tuple[bool, str]:
    """Time the fp8 path against the linear it replaces, as the forward would run them, on
    random inputs ``[m, k]`` and ``[n, k]``: with ``out_dtype`` lower than the input's
    (autocast), the anchor casts x and W to it first. The two alternate for ``ROUNDS`` rounds;
    fp8 must beat BF16's median by ``recipe.fallback.min_speedup``.

    Returns:
        ``(keep_fp8, why)``: ``why`` names both medians (the reason given when BF16 is kept).
        ``timer(fn, x, w)`` returns the milliseconds of one fwd+bwd (tests pass their own).
    """
    xr = torch.randn(m, k, device=device, dtype=x_dtype, requires_grad=True)
    wr = torch.randn(n, k, device=device, dtype=w_dtype, requires_grad=True)
    ones = UnitScales()
    paths = {
        "bf16": lambda a, b: F.linear(a.to(out_dtype), b.to(out_dtype)),
        "fp8": lambda a, b: fp8_linear(a, b, recipe, out_dtype, ones),
    }
    times = {name: [] for name in paths}
    for _ in range(ROUNDS):
        for name, fn in paths.items():
            times[name].append(timer(fn, xr, wr))
    t_bf16, t_fp8 = (sorted(times[name])[ROUNDS // 2] for name in ("bf16", "fp8"))
    speedup = recipe.fallback.min_speedup
    keep = t_fp8 * speedup < t_bf16
    why = (
        f"measured fwd+bwd {recipe.name} {t_fp8:.3f} ms, bf16 {t_bf16:.3f} ms at M={m} "
        f"(median of {ROUNDS}): {'' if keep else 'not '}{speedup:g}x faster"
    )
    return keep, why


class Fp8Decisions:
    """The fp8-or-BF16 decisions of the linears that share it (see the module docstring).

    Args:
        measure: measured mode: ``measure(recipe, m, k, n, x_dtype, w_dtype, out_dtype, device)
            -> (keep_fp8, why)``; the default times both paths on the GPU
            (``measure_fp8_against_bf16``). Never called in table mode.
        timing_allowed: measured mode: ``timing_allowed(x) -> bool``, whether a call with input
            ``x`` may time now; the default is ``timing_allowed`` of this module.
        table: an ``Fp8Table`` switches to table mode (on every device, whatever
            ``FallbackConfig.measure_on_gpu`` says: that is the measured mode's switch).

    Attributes:
        table: the table consulted, or None (measured mode).
        used: table mode: ``{Fp8Key: Fp8Choice}`` for every key a call has decided, the
            ``why`` naming the rule (``"table: ..."``, ``"nearest M bucket 4096: ..."``,
            ``"shape rule: ..."``).
        measured: ``{(recipe, K, N, x dtype, out dtype, M bucket): (keep_fp8, why)}``.
        unmeasured: keys met only where timing was not allowed, with ``(M, device, weight
            dtype)`` to time them later.
        fallbacks: ``{(recipe name, M bucket, K, N, dtype): why}`` for every shape run in BF16.
    """

    def __init__(
        self,
        *,
        measure: Callable[..., tuple[bool, str]] = measure_fp8_against_bf16,
        timing_allowed: Callable[[torch.Tensor], bool] = timing_allowed,
        table: Fp8Table | None = None,
    ):
        if table is not None and not isinstance(table, Fp8Table):
            raise TypeError(f"table must be an Fp8Table or None, got {type(table).__name__}")
        self.measure = measure
        self.timing_allowed = timing_allowed
        self.table = table
        self.used: dict[Fp8Key, Fp8Choice] = {}
        # (recipe, K, N, x dtype, out dtype, M bucket) -> its Fp8Key: the per-call lookup
        # without building the key's strings again
        self._table_keys: dict[tuple, Fp8Key] = {}
        self.measured: dict[tuple, tuple[bool, str]] = {}
        self.unmeasured: dict[tuple, tuple[int, torch.device, torch.dtype]] = {}
        self.fallbacks: dict[tuple, str] = {}

    @classmethod
    def from_state_dict(cls, state) -> "Fp8Decisions":
        """Table-mode decisions from ``state_dict()`` (a checkpoint's), holding its table and
        its record of the choices made: a resumed run chooses what the saved one did.

        Raises:
            ValueError: not a ``{"table": ..., "used": ...}`` dict of ``Fp8Table`` dicts (the
                message names the field).
        """
        if not isinstance(state, dict) or set(state) != {"table", "used"}:
            got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"an Fp8Decisions state must be a dict with the fields 'table' and 'used', "
                f"got {got}"
            )
        tables = {}
        for name in ("table", "used"):
            try:
                tables[name] = Fp8Table.from_dict(state[name])
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from exc
        decisions = cls(table=tables["table"])
        decisions.used = dict(tables["used"].entries)
        return decisions

    def state_dict(self) -> dict:
        """JSON-serialisable ``{"table": ..., "used": ...}`` (``Fp8Table.to_dict`` form) for a
        checkpoint and a run summary: the table consulted (in measured mode, the measurements
        so far) and the choices made from it."""
        table = self.table if self.table is not None else self.measured_table()
        return {"table": table.to_dict(), "used": self.used_table().to_dict()}

    def used_table(self) -> Fp8Table:
        """The choices calls have made in table mode (empty in measured mode)."""
        return Fp8Table(self.used)

    def measured_table(self) -> Fp8Table:
        """The measured mode's measurements as an ``Fp8Table`` (to reuse them in table mode)."""
        return Fp8Table(
            {
                Fp8Key(recipe_id(recipe), k, n, dtype_name(x_dtype), dtype_name(out_dtype), m):
                Fp8Choice(keep, why)
                for (recipe, k, n, x_dtype, out_dtype, m), (keep, why) in self.measured.items()
            }
        )  # fmt: skip

    def _table_choice(self, key: tuple) -> Fp8Choice:
        """Table mode: the choice for ``(recipe, K, N, x dtype, out dtype, M bucket)``, looked up
        once per key and recorded in ``used``."""
        table_key = self._table_keys.get(key)
        if table_key is None:
            recipe, k, n, x_dtype, out_dtype, bucket = key
            table_key = Fp8Key(
                recipe_id(recipe), k, n, dtype_name(x_dtype), dtype_name(out_dtype), bucket
            )
            self._table_keys[key] = table_key
        if table_key not in self.used:
            found = self.table.lookup(table_key)
            if found is None:
                choice = Fp8Choice(True, "shape rule: no table entry for this shape; fp8 runs")
            else:
                entry_key, entry = found
                rule = (
                    "table" if entry_key == table_key else f"nearest M bucket {entry_key.m_bucket}"
                )
                choice = Fp8Choice(entry.keep_fp8, f"{rule}: {entry.why}")
            self.used[table_key] = choice
        return self.used[table_key]

    def use_fp8(
        self,
        recipe: Recipe,
        m: int,
        k: int,
        n: int,
        x: torch.Tensor,
        w: torch.Tensor,
        out_dtype: torch.dtype | None = None,
    ) -> bool:
        """Whether a call with ``m`` tokens of ``x`` (for ``w [n, k]``) and output dtype
        ``out_dtype`` (default: x's) takes the fp8 path. Table mode: from the table. Measured
        mode: times the shape first if it is new, on a GPU, and timing is allowed here."""
        why = shape_problem(recipe, m, k, n)
        if why is None and self.table is not None:
            key = (recipe, k, n, x.dtype, out_dtype or x.dtype, m_bucket(m))
            choice = self._table_choice(key)
            why = None if choice.keep_fp8 else choice.why
        elif why is None and x.is_cuda and recipe.fallback.measure_on_gpu:
            out_dtype = out_dtype or x.dtype
            key = (recipe, k, n, x.dtype, out_dtype, m_bucket(m))
            if key not in self.measured:
                if not self.timing_allowed(x):
                    self.unmeasured.setdefault(key, (m, x.device, w.dtype))
                    return True
                self.unmeasured.pop(key, None)
                self.measured[key] = self.measure(
                    recipe, m, k, n, x.dtype, w.dtype, out_dtype, x.device
                )
            use, measured_why = self.measured[key]
            why = None if use else measured_why
        if why is not None:
            self._note_fallback(recipe, m, k, n, x.dtype, why)
        return why is None

    def measure_pending(self) -> int:
        """Time every decision that so far was met only where timing is not allowed (inside
        checkpointed, hooked or recomputed calls, which meanwhile run fp8 unmeasured), on
        random inputs of the shape met, so that those calls follow the measurement from then
        on. Call it in a plain context, e.g. between training steps; returns how many keys it
        measured (0, at no cost, when none is pending or timing is not allowed here)."""
        measured = 0
        for key, (m, device, w_dtype) in list(self.unmeasured.items()):
            recipe, k, n, x_dtype, out_dtype, _ = key
            if not self.timing_allowed(torch.empty(0, device=device)):
                break
            self.measured[key] = self.measure(recipe, m, k, n, x_dtype, w_dtype, out_dtype, device)
            del self.unmeasured[key]
            measured += 1
        return measured

    def fallback_report(self) -> dict[tuple, str]:
        """``{(recipe, M bucket, K, N, dtype): reason}`` for every shape that ran in BF16."""
        return dict(self.fallbacks)

    def unmeasured_keys(self) -> list[tuple]:
        """Keys seen so far only where timing is not allowed (they run fp8 unmeasured)."""
        return sorted(self.unmeasured, key=str)

    def _note_fallback(self, recipe: Recipe, m: int, k: int, n: int, dtype, why: str) -> None:
        report_key = (recipe.name, m_bucket(m), k, n, dtype)
        if report_key in self.fallbacks:
            return
        self.fallbacks[report_key] = why
        # a warning would break a compiled graph; fallback_report() has it either way
        if recipe.fallback.warn and not torch.compiler.is_compiling():
            warnings.warn(
                f"gem_lowprec: linear [{m}x{k}] @ [{n}x{k}]ᵀ falls back to bf16: {why}",
                stacklevel=4,
            )

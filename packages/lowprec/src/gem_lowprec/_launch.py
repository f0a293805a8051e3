"""Kernel launches that skip Triton's per-call argument binding once a specialization is known.

``kernel[grid](*args, **kwargs)`` binds every argument by name, specializes each runtime one
(a tensor's dtype and 16-byte alignment, an integer's width and whether it equals 1 or divides
by 16), builds a cache key from those and from every constexpr and option, and only then
launches. For these kernels, with their long lists of format constexprs, that took 40–65 µs of
host time per launch on the H200 machine's host, against 13 µs through the ``CompiledKernel``
the launch returns (docs/performance.md, 2026-11-30): seven launches of an fp8_rowwise linear's
forward + backward spent about 0.3 ms of its 1.3 ms of host time there.

``CachedLaunch`` wraps a kernel. Its key is computed directly from the same facts: per runtime
argument the dtype and ``data_ptr() % 16 == 0`` of a tensor, or ``== 1``, ``% 16 == 0`` and the
width class of an integer; the keyword arguments (constexprs and launch options) by value; the
current device. A call with a new key goes through ``kernel[grid]``, which compiles or finds the
binary Triton itself would pick, and remembers the ``CompiledKernel`` it returns; a call with a
known key launches that binary directly. The key is at least as fine as Triton's specialization
(two calls with one key would be specialized alike by Triton), so a reused binary is always the
one ``kernel[grid]`` would have run. Anything the key does not model (an argument of another
type, a kernel whose constexprs are not all after its runtime arguments, a constexpr left at its
default, the interpreter, which returns no binary) takes ``kernel[grid]`` every time.
"""

import functools
import os

import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


class _Unmodelled(Exception):
    """An argument whose specialization the key does not model."""


def argument_key(arg) -> tuple:
    """What Triton specializes a runtime argument on (or finer)."""
    if isinstance(arg, torch.Tensor):
        return ("t", arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return ("i", arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, -(2**63) <= arg < 2**63)
    if isinstance(arg, float):
        return ("f",)
    raise _Unmodelled(type(arg).__name__)


class CachedLaunch:
    """``CachedLaunch(kernel)[grid](*runtime_args, **constexprs_and_options)``: the runtime
    arguments positionally, in signature order, every constexpr by keyword."""

    def __init__(self, kernel):
        self.kernel = kernel
        params = getattr(kernel, "params", None) or []
        runtime = [p for p in params if not p.is_constexpr]
        self._num_runtime = len(runtime)
        self._constexpr_names = tuple(p.name for p in params if p.is_constexpr)
        # the compiled kernel takes every argument positionally, in signature order
        self._runtime_first = bool(params) and all(
            not p.is_constexpr for p in params[: self._num_runtime]
        )
        self._binaries: dict[tuple, tuple] = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, tuple(grid))

    def _launch(self, grid, *args, **kwargs):
        if INTERPRETING or not self._runtime_first or len(args) != self._num_runtime:
            return self.kernel[grid](*args, **kwargs)
        try:
            key = (
                torch.cuda.current_device(),
                tuple(map(argument_key, args)),
                tuple(kwargs.items()),
            )
            known = self._binaries.get(key)
        except (_Unmodelled, TypeError, RuntimeError):  # unhashable keyword value; no CUDA
            return self.kernel[grid](*args, **kwargs)
        if known is None:
            binary = self.kernel[grid](*args, **kwargs)
            if hasattr(binary, "packed_metadata") and all(
                name in kwargs for name in self._constexpr_names
            ):
                self._binaries[key] = (binary, tuple(kwargs[n] for n in self._constexpr_names))
            return binary
        binary, constexprs = known
        binary[(*grid, 1, 1)[:3]](*args, *constexprs)
        return binary

    def binaries(self) -> int:
        """How many specializations are remembered (tests)."""
        return len(self._binaries)


_LAUNCHERS: dict[int, CachedLaunch] = {}


def launcher(kernel) -> CachedLaunch:
    """The one ``CachedLaunch`` of a kernel: ``launcher(kernel)[grid](...)``."""
    found = _LAUNCHERS.get(id(kernel))
    if found is None:
        found = _LAUNCHERS[id(kernel)] = CachedLaunch(kernel)
    return found

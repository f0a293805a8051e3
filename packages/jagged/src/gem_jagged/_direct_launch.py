"""``DirectLaunch``: launch an already compiled Triton kernel again without Triton's per-call work.

Each ``kernel[grid](...)`` call binds every argument to the signature, computes each one's
specialisation (dtype, 16-byte alignment, integer class), builds a cache key from them and the
options, finds the compiled kernel, and only then calls its C launcher, which for every tensor
asks the driver whether the pointer is a device pointer. For the 28 arguments of the jagged
attention forward that is 24 µs of host time on an H200 host, against 6 µs for the C launcher
given integers as pointers (docs/performance.md, 2026-12-01, sixteenth session). An eager call
of a small batch issues kernels that run for less than the host takes to issue them, so that is
the time of the call.

A ``DirectLaunch`` keeps what one ``kernel[grid](...)`` call resolved: the compiled kernel, the
grid and the arguments, pointers as integers. A later call passes new pointers (or TMA
descriptors, as ``DescriptorArg``) for the named arguments only and goes straight to the C
launcher, which still encodes each descriptor on the host. The caller vouches that everything
else is as it was (same device and stream, the same integers, the same dtypes, pointers at
least as aligned as at the recording, 16 bytes): ``gem_jagged.ops.jagged_flash_attention._plan``
keys its launches on all of that. Launch hooks (a profiler watching launches) and Triton
versions whose launcher this module does not know get ``None`` from ``record``: those callers
keep the ordinary launch.
"""

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
from triton import knobs

__all__ = ["DescriptorArg", "DirectLaunch", "Launch"]

# The Triton releases whose CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata,
# launch_metadata, enter_hook, exit_hook, *args) call this module makes (and tests on a GPU).
KNOWN_TRITON = ("3.6.",)


def _no_launch_hooks() -> bool:
    """True when no launch hook is installed (a direct launch would not call one)."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


@dataclass(frozen=True)
class Launch:
    """One ``kernel[grid](*args, **constexprs)`` call; ``compiled`` is what it returned (the
    compiled kernel, or None under the interpreter)."""

    kernel: Any
    compiled: Any
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict

    def named_args(self) -> dict[str, Any]:
        """Every argument by its name in the kernel's signature."""
        names = self.kernel.arg_names
        values = dict(zip(names[: len(self.args)], self.args, strict=True)) | self.constexprs
        if set(values) != set(names):
            raise ValueError(f"arguments {sorted(values)} do not match {self.kernel} ({names})")
        return values


class DescriptorArg(NamedTuple):
    """A TMA descriptor argument of a direct launch: what the launcher reads of a
    ``TensorDescriptor`` (base pointer, shape, strides, padding) without the constructor's
    checks, which the recorded launch's descriptor passed for the same shape and strides."""

    base: torch.Tensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    padding: str = "zero"


class DirectLaunch:
    """One compiled kernel, its grid and its arguments, relaunched with new values for the
    ``per_call`` arguments (in that order): ``launch(stream, *values)``, a pointer as an int or
    a descriptor as a ``DescriptorArg``. The fixed tensor arguments are kept alive with it."""

    def __init__(self, launch: Launch, per_call):
        values = launch.named_args()
        names = launch.kernel.arg_names
        self._args = [
            values[n].data_ptr() if isinstance(values[n], torch.Tensor) else values[n]
            for n in names
        ]
        self._keep = tuple(
            values[n] for n in names if n not in per_call and isinstance(values[n], torch.Tensor)
        )
        self._slots = tuple(names.index(n) for n in per_call)
        self._grid = (*launch.grid, 1, 1)[:3]
        self._run = launch.compiled.run
        self._function = launch.compiled.function
        self._metadata = launch.compiled.packed_metadata

    @classmethod
    def record(cls, launch: Launch, *, per_call):
        """A direct launch of what ``launch`` made, or None where direct launches are not
        available."""
        if not triton.__version__.startswith(KNOWN_TRITON) or not _no_launch_hooks():
            return None
        compiled = launch.compiled
        if compiled is None or not hasattr(compiled, "packed_metadata"):  # the interpreter
            return None
        return cls(launch, per_call)

    @staticmethod
    def available() -> bool:
        """Whether a recorded launch may be used now (no launch hook has been installed)."""
        return _no_launch_hooks()

    def __call__(self, stream: int, *values) -> None:
        args = self._args.copy()
        for slot, value in zip(self._slots, values, strict=True):
            args[slot] = value
        grid_x, grid_y, grid_z = self._grid
        self._run(
            grid_x, grid_y, grid_z, stream, self._function, self._metadata, None, None, None, *args
        )

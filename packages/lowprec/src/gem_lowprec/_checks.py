"""The input checks and option choices every public op shares, and the backend and eager-path
rules: ``backend="auto"`` takes Triton on CUDA tensors and the reference on CPU tensors; a plain
eager call skips the ``torch.library`` dispatcher when nothing could observe the difference."""

import functools
import os
from typing import Literal

import torch

ScaleMode = Literal["rceil", "floor"]
Rounding = Literal["nearest", "stochastic"]
Backend = Literal["auto", "triton", "reference"]

SCALE_MODES = ("rceil", "floor")
ROUNDINGS = ("nearest", "stochastic")
BACKENDS = ("auto", "triton", "reference")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_input(x, *, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{name} must be bfloat16, float16 or float32 to be quantized, got {x.dtype}"
        )
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")


def check_options(*, scale_mode: str, rounding: str = "nearest", backend: str = "auto") -> None:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    check_backend(backend)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_block_size(block_size: int) -> None:
    if block_size != 32:
        raise ValueError(
            f"block_size must be 32 (the MX block; E8M0 scales serve 32 elements), got {block_size}"
        )


def check_divisible(x: torch.Tensor, dim: int, block: int, *, what: str) -> None:
    if x.shape[dim] % block != 0:
        raise ValueError(
            f"x has size {x.shape[dim]} along dim {dim}, which must be a multiple of the {what} "
            f"{block}; pad x (zeros leave every other block unchanged) or pick another axis"
        )


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` takes Triton on CUDA tensors and the reference on CPU tensors; a Triton choice
    is checked to be runnable (``check_triton_runs``)."""
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "reference"
    if backend == "triton":
        check_triton_runs(device)
    return backend


def triton_interpreting() -> bool:
    """Whether Triton's interpreter is on: ``TRITON_INTERPRET`` read as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


@functools.cache
def _triton_import_error() -> str | None:
    """Why triton cannot be imported, or None; asked once, on the first Triton-backend call."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return str(err)
    return None


def check_triton_runs(device: torch.device) -> None:
    """The Triton backend needs triton, and a CUDA device or Triton's interpreter (without it
    Triton finds no driver for CPU tensors and fails deep inside the launch)."""
    if (reason := _triton_import_error()) is not None:
        raise RuntimeError(
            f"backend 'triton' (chosen by backend='auto' for CUDA tensors, or passed) needs the "
            f"triton package, which cannot be imported ({reason}); triton ships for Linux: "
            "install it there, or pass backend='reference'"
        )
    if device.type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"backend='triton' got tensors on {device}, but Triton runs tensors off CUDA only "
            "through its interpreter, which is off: move the tensors to a CUDA device, set "
            "TRITON_INTERPRET=1 in the environment before triton is first imported, or pass "
            "backend='reference' (or 'auto', which takes the reference on CPU tensors)"
        )


def eager_path_allowed(*tensors: torch.Tensor) -> bool:
    """True when calling an op's implementation directly is unobservable: not compiling or
    tracing, no dispatch mode on the stack (fake tensors, functionalization, proxies), no functorch
    transform, and plain tensors only (``nn.Parameter``, a subclass in name only, counts as one:
    a norm's weight is one).

    The dispatcher's Python layers cost tens of microseconds a call, more than a quantize kernel
    of a few MB takes, and the results are the same bytes."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)

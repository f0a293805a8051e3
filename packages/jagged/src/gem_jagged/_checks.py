"""Input validation shared by the jagged ops.

Every public op calls these before choosing a backend, so a bad argument fails the same way on
every backend, with a message that names the argument and says what was expected. Offsets values
can only be read on the host (a synchronisation on CUDA); ``gem_jagged.batch.JaggedBatch`` reads
them once per batch, and the ops compare what it read with their tensors' token counts.
"""

import functools
import os
from typing import NamedTuple

import torch

SUPPORTED_HEAD_DIMS = (32, 64, 128)
BACKENDS = ("auto", "triton", "reference")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` takes Triton on CUDA tensors and the reference on CPU tensors; a Triton choice
    is checked to be runnable (``check_triton_runs``)."""
    check_backend(backend)
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


def check_values(name: str, x: torch.Tensor, *, ndim: int = 3) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(
            f"{name} must have {ndim} dimensions [tokens, heads, head_dim], got shape {tuple(x.shape)}"
        )
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_same(names_and_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """All tensors share one dtype and one device; the message names the odd one out."""
    first_name, first = names_and_tensors[0]
    for name, t in names_and_tensors[1:]:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; they must match"
            )
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; they must match"
            )


def check_head_dim(name: str, head_dim: int, supported=SUPPORTED_HEAD_DIMS) -> None:
    if head_dim not in supported:
        raise ValueError(f"{name} has head dim {head_dim}; supported head dims are {supported}")


@functools.cache
def _has_cuda() -> bool:
    # ``torch.cuda.is_available`` reads the environment on every call: several microseconds of
    # host time, paid a few times per eager attention call.
    return torch.cuda.is_available()


def capturing_cuda_graph() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return _has_cuda() and torch.cuda.is_current_stream_capturing()


def building_a_graph() -> bool:
    """True under ``torch.compile`` tracing or while the current CUDA stream is captured: no
    host read of device values, and nothing remembered from one batch may shape the launch."""
    return torch.compiler.is_compiling() or capturing_cuda_graph()


class LengthRange(NamedTuple):
    """What a host read of valid offsets shows: the shortest and longest sequence and the
    token count (``offsets[-1]``)."""

    shortest: int
    longest: int
    total: int


def check_offsets(name: str, offsets: torch.Tensor, *, validate_values: bool) -> LengthRange | None:
    """Check a jagged ``offsets [B+1]`` tensor.

    Structure (a 1-D int32/int64 tensor with at least one entry) is always checked. With
    ``validate_values`` the values are read on the host (a synchronisation on CUDA) and checked
    to start at 0 and never decrease; the returned ``LengthRange`` says what they hold. Without,
    None. Strided offsets are accepted here: ``JaggedBatch`` keeps a contiguous copy, which is
    what the kernels read.
    """
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B+1], got shape {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if offsets.numel() < 1:
        raise ValueError(f"{name} must hold at least one entry (offsets[0] = 0), got none")
    if not validate_values:
        return None
    host = offsets.detach().to("cpu", torch.int64)
    if host[0].item() != 0:
        raise ValueError(f"{name}[0] must be 0, got {host[0].item()}")
    steps = host[1:] - host[:-1]
    if bool((steps < 0).any()):
        i = int(torch.nonzero(steps < 0)[0].item())
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{i + 1}] = {host[i + 1].item()} "
            f"< {name}[{i}] = {host[i].item()}"
        )
    if steps.numel() == 0:
        return LengthRange(0, 0, 0)
    return LengthRange(int(steps.min()), int(steps.max()), int(host[-1]))


def check_tokens(name: str, known: LengthRange | None, tokens: int, *, values: str) -> None:
    """The offsets must end at the token count of the values they describe (where known)."""
    if known is not None and known.total != tokens:
        raise ValueError(
            f"{name}[-1] = {known.total} must equal the number of tokens of {values} ({tokens})"
        )


def check_rel_bias(rel_bias: torch.Tensor | None, *, num_heads: int, like: torch.Tensor) -> None:
    if rel_bias is None:
        return
    if not isinstance(rel_bias, torch.Tensor):
        raise TypeError(f"rel_bias must be a torch.Tensor, got {type(rel_bias).__name__}")
    if rel_bias.dim() != 2 or rel_bias.shape[0] != num_heads or rel_bias.shape[1] % 2 != 1:
        raise ValueError(
            f"rel_bias must have shape [N={num_heads}, 2R+1] (an odd number of buckets), "
            f"got {tuple(rel_bias.shape)}"
        )
    if rel_bias.device != like.device:
        raise ValueError(f"rel_bias is on {rel_bias.device} but q is on {like.device}")
    if not rel_bias.is_floating_point():
        raise TypeError(f"rel_bias must be floating point, got {rel_bias.dtype}")

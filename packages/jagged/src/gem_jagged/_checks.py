"""Input validation shared by the jagged ops.

Every public op calls these before choosing a backend, so a bad argument fails the same way on
every backend, with a message that names the argument and says what was expected.

Offsets values (start at 0, never decrease, end at the token count) can only be read on the host.
On CUDA that costs one device-to-host copy and a synchronisation, so it is paid once per offsets
tensor: a tensor that passed is remembered (by identity and version counter, so an in-place
change is checked again) and the layers of a model that share one batch's offsets sync once, not
once per call. The value checks are skipped inside CUDA-graph capture and under
``torch.compile`` tracing; the shape, dtype and device checks always run. A pipeline that builds
offsets on the host can check them there for free and move them with ``offsets_to_device``,
which remembers the copy as checked: no synchronisation at all.
"""

import functools
import weakref

import torch

SUPPORTED_HEAD_DIMS = (32, 64, 128)
BACKENDS = ("auto", "triton", "reference")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` takes Triton on CUDA tensors and the reference on CPU tensors."""
    check_backend(backend)
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return backend


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


def check_offsets(
    name: str,
    offsets: torch.Tensor,
    *,
    total: int,
    device: torch.device,
    validate_values: bool | None = None,
) -> None:
    """Check a jagged ``offsets [B+1]`` tensor against ``total`` tokens.

    Structure (1-D, integer dtype, at least one entry, right device) is always checked. Values
    (starts at 0, never decreases, ends at ``total``) are checked on CPU tensors always and on CUDA
    tensors unless ``validate_values=False`` or a graph is being captured or traced. CUDA offsets
    that passed both and have not changed since return at once (only their device is compared).
    """
    # Passed every check below before, and unchanged since: return at once (cheap, per call).
    # Not while tracing: a graph cannot guard on the version counter.
    if not torch.compiler.is_compiling() and _already_checked(offsets, total):
        if offsets.device == device:
            return
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B+1], got shape {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if offsets.numel() < 1:
        raise ValueError(f"{name} must hold at least one entry (offsets[0] = 0), got none")
    if offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but the values are on {device}")
    if validate_values is None:
        validate_values = not building_a_graph()
    if not validate_values:
        return
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
    if host[-1].item() != total:
        raise ValueError(f"{name}[-1] = {host[-1].item()} must equal the number of tokens {total}")
    if offsets.device.type == "cuda" and not offsets.is_inference():
        # (inference tensors track no version: they are checked each call)
        _remember_checked(offsets, total, _length_range(steps))


def offsets_to_device(
    offsets: torch.Tensor, device: torch.device | str, *, non_blocking: bool = False
) -> torch.Tensor:
    """Check host ``offsets [B+1]`` on the host and copy them to ``device``, remembered as
    checked: the jagged ops then skip their own value check of the copy, which on CUDA costs a
    device-to-host copy and a synchronisation. For data pipelines that build offsets on the
    host, as most do. The values must end at the token count the ops are given
    (``offsets[-1]``); anything else is checked again, and fails, at the op.
    """
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.device.type != "cpu":
        raise ValueError(
            f"offsets must be on the CPU (the check is free there), got {offsets.device}"
        )
    # the ops' own check, on the host: the total is whatever the offsets end at (the op
    # compares it with its token count when it meets the copy)
    total = int(offsets[-1]) if offsets.dim() == 1 and offsets.numel() > 0 else 0
    check_offsets("offsets", offsets, total=total, device=offsets.device)
    moved = offsets.to(device, non_blocking=non_blocking)
    if moved.device.type == "cuda" and not moved.is_inference():
        _remember_checked(moved, total, _length_range(offsets.to(torch.int64).diff()))
    return moved


# id(offsets) -> (weak reference, version counter, token total, (shortest, longest) sequence)
# of CUDA offsets that passed.
_CHECKED: dict[int, tuple[weakref.ref, int, int, tuple[int, int]]] = {}


def _length_range(lengths: torch.Tensor) -> tuple[int, int]:
    if lengths.numel() == 0:
        return (0, 0)
    return (int(lengths.min()), int(lengths.max()))


def _live_entry(offsets: torch.Tensor):
    entry = _CHECKED.get(id(offsets))
    if entry is None or entry[0]() is not offsets or entry[1] != offsets._version:
        return None
    return entry


def _already_checked(offsets: torch.Tensor, total: int) -> bool:
    entry = _live_entry(offsets)
    return entry is not None and entry[2] == total


def checked_length_range(offsets: torch.Tensor) -> tuple[int, int] | None:
    """``(shortest, longest)`` sequence of CUDA offsets whose values were checked on the host
    and not changed since; None when unknown (never checked, changed in place, or checked
    inside a graph capture or trace, where nothing is read). Launchers use it to skip work
    that no sequence needs, with no synchronisation of their own."""
    if building_a_graph():
        return None
    entry = _live_entry(offsets)
    return None if entry is None else entry[3]


def keys_fit_one_tile(kv_offsets: torch.Tensor, block_n: int) -> bool:
    """True when every sequence is known to have 1 to ``block_n`` keys: a dK/dV kernel whose
    one key tile then holds all of a sequence's keys can write every dQ row, and the dQ kernel
    would launch only to exit. Known from the host check of the offsets; unknown (inside a
    graph capture, say) is False."""
    lengths = checked_length_range(kv_offsets)
    return lengths is not None and 1 <= lengths[0] and lengths[1] <= block_n


def _remember_checked(offsets: torch.Tensor, total: int, length_range: tuple[int, int]) -> None:
    key = id(offsets)
    _CHECKED[key] = (
        weakref.ref(offsets, lambda _: _CHECKED.pop(key, None)),
        offsets._version,
        total,
        length_range,
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

"""Saved activations kept in FP8 or MX: ``quantized_activations``.

Autograd keeps, between forward and backward, every tensor an op saves for its gradient. Inside
``quantized_activations(fmt)`` a pack hook (``torch.autograd.graph.saved_tensors_hooks``) replaces
each large floating tensor by a packed copy and the unpack hook restores it when the backward asks
for it, with its exact shape and dtype (values rounded to the format, contiguous layout).

Formats:

- ``"fp8_e4m3"``: rows along the last dimension, one fp32 scale per row
  (``scale = amax / 448``), elements ``x / scale`` rounded to nearest-even into
  ``float8_e4m3fn``. This is the project's own packing; it needs nothing beyond torch.
- ``"mxfp8"``: OCP microscaling, E4M3 elements in blocks of 32 along the last dimension with
  E8M0 scales, through ``gem_lowprec.to_mx`` (the optional ``lowprec`` extra; asking for it
  without gem_lowprec installed is an error that says so).
- ``"mxfp4"``: the same blocks with E2M1 elements, two per byte (``gem_memory.mxfp4``; gem_lowprec
  has FP8 elements only).

What is never packed: integer and boolean tensors, tensors under ``min_bytes``, and parameters
(and views of them): a parameter stays alive anyway, so a packed copy would add memory. A tensor
saved several times in one forward (the same storage, offset, shape, strides and version) is
packed once. A row (or MX block) holding Inf or NaN unpacks as NaN.

The quantization error is that of the format: per-row FP8 keeps a relative error of at most
2^-4 per element (3 mantissa bits, round to nearest) where ``|x| >= 2^-6 * scale`` (the normal
range of E4M3), and an absolute error of at most ``2^-10 * scale`` below it.
"""

import importlib
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .mxfp4 import to_mxfp4

__all__ = [
    "FORMATS",
    "PackingStats",
    "QuantizedConfig",
    "quantized_activations",
    "pack",
    "unpack",
]

FORMATS = ("fp8_e4m3", "mxfp8", "mxfp4")
_FP8_MAX = 448.0
_FLOATING = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class QuantizedConfig:
    """What ``quantized_activations`` packs and how."""

    fmt: str = "fp8_e4m3"
    min_bytes: int = 64 * 1024

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt: expected one of {FORMATS}, got {self.fmt!r}")
        if self.min_bytes < 0:
            raise ValueError(f"min_bytes: expected a non-negative byte count, got {self.min_bytes}")


@dataclass
class PackingStats:
    """What one ``quantized_activations`` block did with the tensors autograd saved.

    ``packed_shapes``: the shape of each tensor packed, in save order; ``reused``: saves that got
    an earlier packed copy of the same tensor; ``kept``: saves left as they are (integer, small,
    parameter-like or, for MX, a last dimension not a multiple of 32).
    """

    packed_shapes: list[tuple[int, ...]] = field(default_factory=list)
    reused: int = 0
    kept: int = 0


def _lowprec():
    try:
        return importlib.import_module("gem_lowprec")
    except ImportError as exc:
        raise ImportError(
            "fmt='mxfp8' needs gem_lowprec (install gem-memory[lowprec]); "
            "fmt='fp8_e4m3' and 'mxfp4' work without it"
        ) from exc


# -- the packed forms --------------------------------------------------------------------------
@dataclass
class _RowFP8:
    data: torch.Tensor  # float8_e4m3fn, [rows, cols]
    scale: torch.Tensor  # float32, [rows, 1]
    shape: torch.Size
    dtype: torch.dtype

    def restore(self) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale).to(self.dtype).reshape(self.shape)


@dataclass
class _MX:
    mx: object  # gem_lowprec.MXTensor or gem_memory.mxfp4.MXFP4
    shape: torch.Size
    dtype: torch.dtype

    def restore(self) -> torch.Tensor:
        return self.mx.dequantize(self.dtype).reshape(self.shape)


def _pack_fp8_rows(x: torch.Tensor) -> _RowFP8:
    cols = x.shape[-1] if x.dim() > 0 else 1
    rows_RC = x.detach().reshape(-1, max(cols, 1)).to(torch.float32)
    amax_R1 = rows_RC.abs().amax(dim=1, keepdim=True)
    # An all-zero row keeps scale 1; a row holding Inf/NaN gets a NaN scale and unpacks as NaN.
    scale_R1 = torch.where(amax_R1 > 0, amax_R1 / _FP8_MAX, torch.ones_like(amax_R1))
    scale_R1 = torch.where(torch.isfinite(amax_R1), scale_R1, torch.full_like(amax_R1, torch.nan))
    data_RC = (rows_RC / scale_R1).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return _RowFP8(data_RC, scale_R1, x.shape, x.dtype)


def pack(x: torch.Tensor, fmt: str):
    """Packed copy of ``x`` (a floating tensor of any shape) in ``fmt``; ``unpack`` restores its
    shape and dtype with the values rounded to the format. ``ValueError`` for an unknown
    ``fmt``; ``ImportError`` for ``"mxfp8"`` without gem_lowprec."""
    if fmt == "fp8_e4m3":
        return _pack_fp8_rows(x)
    if fmt == "mxfp8":
        mx = _lowprec().to_mx(x.detach(), elem_dtype=torch.float8_e4m3fn, block_size=32)
        return _MX(mx, x.shape, x.dtype)
    if fmt == "mxfp4":
        return _MX(to_mxfp4(x), x.shape, x.dtype)
    raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")


def unpack(packed) -> torch.Tensor:
    """The tensor ``pack`` packed: its shape and dtype, contiguous, values rounded."""
    return packed.restore()


def _is_parameter_like(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def _packable(t: torch.Tensor, config: QuantizedConfig) -> bool:
    if t.dtype not in _FLOATING or t.numel() * t.element_size() < config.min_bytes:
        return False
    if _is_parameter_like(t):
        return False
    if config.fmt != "fp8_e4m3" and (
        t.dim() == 0 or t.shape[-1] % 32 != 0 or t.dtype == torch.float64
    ):
        return False  # MX blocks run along the last dimension; ragged rows stay exact
    return True


@contextmanager
def quantized_activations(fmt: str = "fp8_e4m3", *, min_bytes: int = 64 * 1024):
    """Keep the tensors autograd saves in this block quantized until the backward needs them.

    ``fmt``: ``"fp8_e4m3"`` (per-row scales), ``"mxfp8"`` (MX blocks of 32, via gem_lowprec) or
    ``"mxfp4"`` (MX blocks of 32, E2M1 elements). ``min_bytes``: tensors smaller than this are
    saved as they are. For MX formats a tensor whose last dimension is not a multiple of 32 is
    also saved as it is. Yields a ``PackingStats`` that fills as the block's forward saves
    tensors.

    Raises:
        ValueError: an unknown ``fmt`` or a negative ``min_bytes``.
        ImportError: ``fmt="mxfp8"`` without gem_lowprec installed (the ``lowprec`` extra).
    """
    config = QuantizedConfig(fmt, min_bytes)
    if fmt == "mxfp8":
        _lowprec()  # fail at the door, not in the middle of a forward
    with saved_tensor_packing(config) as stats:
        yield stats


@contextmanager
def saved_tensor_packing(config: QuantizedConfig):
    """The hooks behind ``quantized_activations``, driven by a ``QuantizedConfig``; yields the
    block's ``PackingStats``."""
    # key -> (weak reference to the storage, packed copy); the weak reference tells a storage
    # that is still alive from a new one that happens to reuse the address.
    packed_once: dict[tuple, tuple] = {}
    stats = PackingStats()

    def pack_hook(t: torch.Tensor):
        if not _packable(t, config):
            stats.kept += 1
            return t
        storage = t.untyped_storage()
        key = (storage._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t._version, t.dtype)
        hit = packed_once.get(key)
        if hit is not None and hit[0]() is storage:
            stats.reused += 1
            return hit[1]
        packed = pack(t, config.fmt)
        packed_once[key] = (weakref.ref(storage), packed)
        stats.packed_shapes.append(tuple(t.shape))
        return packed

    def unpack_hook(packed):
        return packed if isinstance(packed, torch.Tensor) else unpack(packed)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook):
            yield stats
    finally:
        packed_once.clear()

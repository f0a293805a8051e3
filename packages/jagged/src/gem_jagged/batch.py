"""``JaggedBatch``: what is known about one batch's jagged layout, built once, passed to every op.

A jagged kernel needs more than the offsets tensor: the offsets must be valid (which can only be
read on the host: a device-to-host copy and a synchronisation on CUDA), the launchers want the
range of lengths (to size the split of long sequences, to skip a kernel no sequence needs), and
each op builds tile work lists from the offsets with a few small launches. All of it depends on
the batch alone, and every attention layer of a model sees the same batch. So a model builds one
``JaggedBatch`` per batch and passes it to each call in place of the offsets tensor; the checks
run once, the host facts are read once, and each work list is built at the first call that needs
it and kept *in the batch object*, where the caller can see it and drops it with the batch.

One invalidation rule: a batch never changes. It holds its own copy of the offsets, made when it
is built, so writing into the caller's tensor afterwards (in place, through a view, through
``.data``, through a numpy array sharing its memory) cannot reach what the batch's work lists
were built from, nor what a backward pass reads: a backward always uses exactly the offsets its
forward saw. New offsets mean a new batch.

Plain offsets tensors keep working: the ops build a batch for the call (checks included, so on
CUDA each such call synchronises once; build the batch yourself to pay that once per batch, or
use ``from_host`` to pay nothing).

Graphs. Under ``torch.compile`` tracing and during CUDA-graph capture nothing is read back to the
host: the value checks and the length range are skipped (the structure checks still run) and no
work list is kept, so a captured graph rebuilds its lists from the offsets at every replay. A
batch built inside the captured region copies the static offsets at each replay, which is the
pattern to use: copy the next batch's offsets into the static tensor, replay. A batch built
before capture is one fixed batch for the graph's lifetime.
"""

from collections.abc import Callable
from typing import TypeVar

import torch

from gem_jagged._checks import LengthRange, building_a_graph, check_offsets

__all__ = ["JaggedBatch", "as_batch"]

T = TypeVar("T")


BATCH_ARGUMENTS = ("offsets", "kv_offsets", "max_len", "max_kv_len")


class JaggedBatch:
    """The layout of one batch of jagged sequences: offsets, what was checked, work lists.

    Args:
        offsets: ``[B+1]`` int32 or int64 offsets of the (query) sequences, ``offsets[0] = 0``,
            non-decreasing; ``offsets[-1]`` is the token count. Copied: later writes into the
            caller's tensor do not reach the batch.
        kv_offsets: ``[B+1]`` offsets of the key/value sequences for cross-attention, on the
            same device; ``None`` (self-attention) means the keys are the queries.
        max_len: launch hint, the longest (query) sequence, or ``None``. Never truncates. When
            the values are checked on the host, the checked longest length is used instead.
        max_kv_len: the same hint for the key/value sequences.
        validate: check the offsets' values (a host synchronisation on CUDA). ``False`` skips
            the check and leaves the length range unknown; the ops then take conservative
            launch paths.

    Raises:
        TypeError: offsets that are not an int32/int64 tensor.
        ValueError: offsets that are not 1-D, empty, do not start at 0, decrease, or whose
            query and key/value sides disagree in batch size or device.
    """

    __slots__ = (
        "offsets", "kv_offsets", "num_seqs", "length_range", "kv_length_range", "max_len",
        "max_kv_len", "_memo",
    )  # fmt: skip

    def __init__(
        self,
        offsets: torch.Tensor,
        kv_offsets: torch.Tensor | None = None,
        *,
        max_len: int | None = None,
        max_kv_len: int | None = None,
        validate: bool = True,
    ):
        self._build(offsets, kv_offsets, max_len, max_kv_len, validate, BATCH_ARGUMENTS)

    def _build(self, offsets, kv_offsets, max_len, max_kv_len, validate, names) -> None:
        """``__init__``'s work; ``names`` are the caller's argument names for offsets,
        kv_offsets, max_len and max_kv_len, so an op's errors name the op's own arguments."""
        off_name, kv_name, len_name, kv_len_name = names
        _check_hint(len_name, max_len)
        _check_hint(kv_len_name, max_kv_len)
        self.offsets, self.length_range = _own_copy(off_name, offsets, validate=validate)
        if kv_offsets is None:
            self.kv_offsets, self.kv_length_range = self.offsets, self.length_range
        else:
            self.kv_offsets, self.kv_length_range = _own_copy(
                kv_name, kv_offsets, validate=validate
            )
            if self.kv_offsets.shape != self.offsets.shape:
                raise ValueError(
                    f"{kv_name} has {self.kv_offsets.shape[0] - 1} sequences but {off_name} has "
                    f"{self.offsets.shape[0] - 1}; they must match"
                )
            if self.kv_offsets.device != self.offsets.device:
                raise ValueError(
                    f"{kv_name} is on {self.kv_offsets.device} but {off_name} is on "
                    f"{self.offsets.device}; they must match"
                )
        self.num_seqs = self.offsets.shape[0] - 1
        self.max_len = self.length_range.longest if self.length_range is not None else max_len
        self.max_kv_len = (
            self.kv_length_range.longest if self.kv_length_range is not None else max_kv_len
        )
        self._memo: dict[tuple, object] = {}

    @classmethod
    def from_host(
        cls,
        offsets: torch.Tensor,
        kv_offsets: torch.Tensor | None = None,
        *,
        device: torch.device | str,
        non_blocking: bool = False,
        device_copy: torch.Tensor | None = None,
    ) -> "JaggedBatch":
        """A batch on ``device`` from CPU offsets, checked on the host where the check is free:
        no device-to-host synchronisation at all. For data pipelines that build offsets on the
        host, as most do. The length range is known, as after a checked build. With
        ``non_blocking`` the host does not wait for the device either: the copy to CUDA goes
        through pinned memory.

        ``device_copy``: the (query) offsets already on ``device``, copied from ``offsets`` by
        the caller (a pipeline that moves a whole batch in one copy), taken as the batch's own
        instead of a second copy. The caller hands it over: nothing may write to it afterwards.
        Self-attention only (``kv_offsets`` None); its dtype, shape and device are checked, its
        values are not read (that would synchronise)."""
        host = _require_cpu("offsets", offsets)
        host_kv = None if kv_offsets is None else _require_cpu("kv_offsets", kv_offsets)
        checked = cls(host, host_kv)
        batch = cls.__new__(cls)
        if device_copy is None:
            batch.offsets = _move_private(checked.offsets, device, non_blocking=non_blocking)
        else:
            batch.offsets = _adopt(device_copy, checked.offsets, device, has_kv=host_kv is not None)
        batch.kv_offsets = (
            batch.offsets
            if kv_offsets is None
            else _move_private(checked.kv_offsets, device, non_blocking=non_blocking)
        )
        for name in ("num_seqs", "length_range", "kv_length_range", "max_len", "max_kv_len"):
            setattr(batch, name, getattr(checked, name))
        batch._memo = {}
        return batch

    @classmethod
    def of_owned(
        cls,
        offsets: torch.Tensor,
        kv_offsets: torch.Tensor,
        *,
        max_len: int | None,
        max_kv_len: int | None = None,
    ) -> "JaggedBatch":
        """A batch over tensors that a ``JaggedBatch`` already owns and checked, without a copy
        or a check: what the custom ops' implementations rebuild from the tensors and hints
        they are called with. The length range is unknown."""
        batch = cls.__new__(cls)
        batch.offsets = offsets
        batch.kv_offsets = offsets if kv_offsets is offsets else kv_offsets
        batch.num_seqs = offsets.shape[0] - 1
        batch.length_range = batch.kv_length_range = None
        batch.max_len, batch.max_kv_len = max_len, max_kv_len
        batch._memo = {}
        return batch

    def with_queries(self, q_offsets: torch.Tensor) -> "JaggedBatch":
        """A cross-attention batch: queries described by ``q_offsets`` (checked where they lie:
        free on the CPU, from where they move to this batch's device without waiting for it),
        keys and values by this batch's (query-side) sequences, whose check is not repeated.
        For candidates attending over a history, say."""
        if isinstance(q_offsets, torch.Tensor) and q_offsets.device.type == "cpu":
            checked = JaggedBatch(q_offsets)
            q_copy = _move_private(checked.offsets, self.device, non_blocking=True)
            q_range = checked.length_range
        else:
            q_copy, q_range = _own_copy("q_offsets", q_offsets, validate=True)
        if q_copy.shape != self.offsets.shape:
            raise ValueError(
                f"q_offsets has {q_copy.shape[0] - 1} sequences but the batch has "
                f"{self.num_seqs}; they must match"
            )
        batch = JaggedBatch.__new__(JaggedBatch)
        batch.offsets, batch.length_range = q_copy, q_range
        batch.kv_offsets, batch.kv_length_range = self.offsets, self.length_range
        batch.num_seqs = self.num_seqs
        batch.max_len = q_range.longest if q_range is not None else None
        batch.max_kv_len = self.max_len
        batch._memo = {}
        return batch

    @property
    def total(self) -> int | None:
        """Query tokens (``offsets[-1]``) where the values were read, else None."""
        return None if self.length_range is None else self.length_range.total

    @property
    def total_kv(self) -> int | None:
        """Key/value tokens where the values were read, else None."""
        return None if self.kv_length_range is None else self.kv_length_range.total

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    @property
    def is_self_attention(self) -> bool:
        return self.kv_offsets is self.offsets

    def kv_lengths_known_within(self, shortest: int, longest: int) -> bool:
        """True when every key/value sequence is known (from the host check) to hold between
        ``shortest`` and ``longest`` tokens; False when it does not or is unknown. Launchers
        use it to skip a kernel that no sequence needs."""
        known = self.kv_length_range
        return known is not None and shortest <= known.shortest and known.longest <= longest

    def memo(self, key: tuple, build: Callable[[], T]) -> T:
        """``build()`` once per ``key`` for this batch (work lists, block tables): the ops'
        derived device tensors, kept while the batch lives. Nothing is kept while a graph is
        captured or traced, or under inference mode (an inference tensor could not be saved
        for a later backward pass)."""
        if building_a_graph() or torch.is_inference_mode_enabled():
            return build()
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def __repr__(self) -> str:
        kind = "self" if self.is_self_attention else "cross"
        return (
            f"JaggedBatch({kind}, sequences={self.num_seqs}, lengths={self.length_range}, "
            f"kv_lengths={self.kv_length_range}, device={self.device})"
        )


def as_batch(
    offsets: "torch.Tensor | JaggedBatch",
    kv_offsets: torch.Tensor | None = None,
    *,
    max_len: int | None = None,
    max_kv_len: int | None = None,
    names: tuple[str, str, str, str] = ("q_offsets", "kv_offsets", "max_q_len", "max_kv_len"),
) -> JaggedBatch:
    """The ops' entry: a ``JaggedBatch`` passed in is used as it is (``kv_offsets`` must then be
    None: the batch holds both sides); plain tensors get a batch built for the call, and its
    errors use ``names``, the op's names for offsets, kv_offsets, max_len and max_kv_len."""
    off_name, kv_name = names[:2]
    if isinstance(offsets, JaggedBatch):
        if kv_offsets is not None:
            raise ValueError(
                f"a JaggedBatch holds both sides: pass kv_offsets to JaggedBatch(...), not "
                f"{kv_name} to the op, when {off_name} is a JaggedBatch"
            )
        return offsets
    if isinstance(kv_offsets, JaggedBatch):
        raise TypeError(f"{kv_name} must be a tensor or None; pass a JaggedBatch as {off_name}")
    batch = JaggedBatch.__new__(JaggedBatch)
    batch._build(offsets, kv_offsets, max_len, max_kv_len, True, names)
    return batch


def _check_hint(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{name} must be None or a non-negative int (a launch hint), got {value!r}"
        )


def _require_cpu(name: str, offsets) -> torch.Tensor:
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.device.type != "cpu":
        raise ValueError(
            f"{name} must be on the CPU (the check is free there), got {offsets.device}"
        )
    return offsets


def _move_private(host: torch.Tensor, device, *, non_blocking: bool) -> torch.Tensor:
    """A batch's private CPU copy ``host`` on ``device``. An asynchronous copy to CUDA is staged
    in pinned memory: from pageable memory CUDA first waits for every kernel queued before it,
    a host synchronisation that ``torch.cuda.set_sync_debug_mode`` does not report. PyTorch's
    pinned allocator keeps the staging block until the copy has run."""
    if non_blocking and torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=non_blocking)


def _adopt(device_copy, host: torch.Tensor, device, *, has_kv: bool) -> torch.Tensor:
    """``from_host``'s ``device_copy`` checked against the host offsets it was copied from."""
    if has_kv:
        raise ValueError("device_copy is for self-attention batches: pass kv_offsets=None")
    if not isinstance(device_copy, torch.Tensor):
        raise TypeError(f"device_copy must be a torch.Tensor, got {type(device_copy).__name__}")
    if (device_copy.dtype, device_copy.shape) != (host.dtype, host.shape):
        raise ValueError(
            f"device_copy must have the offsets' dtype and shape {host.dtype} "
            f"{tuple(host.shape)}, got {device_copy.dtype} {tuple(device_copy.shape)}"
        )
    want = torch.device(device)
    if device_copy.device.type != want.type or want.index not in (None, device_copy.device.index):
        raise ValueError(f"device_copy must be on {device}, got {device_copy.device}")
    if not device_copy.is_contiguous():
        raise ValueError("device_copy must be contiguous")
    return device_copy


def _own_copy(name: str, offsets, *, validate: bool) -> tuple[torch.Tensor, LengthRange | None]:
    """The batch's private, contiguous copy of ``offsets`` and its ``LengthRange`` (None when
    the values were not read)."""
    check_offsets(name, offsets, validate_values=False)
    copy = offsets.detach().clone(memory_format=torch.contiguous_format)
    if not validate or building_a_graph():
        return copy, None
    return copy, check_offsets(name, copy, validate_values=True)

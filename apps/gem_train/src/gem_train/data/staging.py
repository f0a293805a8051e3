"""Pinned host buffers that batches bound for a CUDA device are packed into, reused step after step.

A copy to CUDA is asynchronous only from pinned memory, and allocating pinned memory
(``cudaHostAlloc``, behind ``Tensor.pin_memory()`` whenever PyTorch's pinned cache has no free
block of the size) waits until the GPU has drained its queue and holds up every other thread's
CUDA calls meanwhile: one such allocation while the host runs ahead stalls the whole step. Pinning
each new batch allocates whenever the cache's blocks are still owed to copies the GPU has not run.

``PinnedStaging`` owns a ring of pinned buffers instead. The loader packs each batch's tensors
into one buffer (``stage``); the trainer moves the whole buffer with one copy and records an event
after it (``StagedBatch.to``); a buffer is packed again only once the copy that read it has run
(its event, waited on by the thread that packs: the loader's, not the training loop's). A buffer
grows, with headroom, only for a batch larger than any it held. A batch taken but never moved
keeps its buffer; when every buffer is so held the ring adds one, so holding batches cannot
deadlock the loader.
"""

import threading
from dataclasses import fields

import torch
from gem_jagged import JaggedBatch

from gem_train.data.batch import Batch

_ALIGN = 8  # bytes: every field starts where an int64 may
_HEADROOM = 1.25  # a buffer grows to this times the batch that outgrew it


class _Slot:
    """One pinned buffer and what it is waiting for before it can be packed again."""

    def __init__(self):
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.moved = threading.Event()  # set once the copy out of it is issued
        self.moved.set()
        self.copied: torch.cuda.Event | None = None  # recorded after that copy


class PinnedStaging:
    """A ring of at least ``slots`` pinned buffers for batches bound for ``device``.

    On a CUDA device the buffers are pinned and each copy out of one is tracked by an event; on
    the CPU (where a move is a copy, and what the CPU tests exercise) they are plain memory.
    ``grown`` counts the allocations made after the first use of each buffer (on CUDA each one
    may stall the process as described above); the trainer reports it.
    """

    def __init__(self, device: torch.device | str, *, slots: int):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int of at least 1, got {slots!r}")
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0
        self.grown = 0

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def stage(self, batch: Batch) -> "StagedBatch":
        """``batch`` packed into a free pinned buffer (waiting, in this thread, for the GPU to
        finish the copy that last read it)."""
        layout, nbytes = _layout(batch)
        slot = self._free_slot()
        slot.moved.clear()
        if slot.copied is not None:
            slot.copied.synchronize()
            slot.copied = None
        if slot.buffer.numel() < nbytes:
            if slot.buffer.numel():
                self.grown += 1
            slot.buffer = torch.empty(
                int(nbytes * _HEADROOM), dtype=torch.uint8, pin_memory=self.pinned
            )
        views = {}
        for name, (start, dtype, shape) in layout.items():
            view = _view(slot.buffer, start, dtype, shape)
            view.copy_(getattr(batch, name))
            views[name] = view
        return StagedBatch(Batch(**views), slot, layout, nbytes, self.device)

    def _free_slot(self) -> _Slot:
        """The next buffer whose batch was moved; a new one when every buffer holds a batch
        that was not."""
        for _ in range(len(self._slots)):
            slot = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            if slot.moved.is_set():
                return slot
        slot = _Slot()
        self._slots.insert(self._next, slot)
        self._next = (self._next + 1) % len(self._slots)
        return slot


class StagedBatch:
    """A ``Batch`` whose tensors are views of one pinned buffer, moved to the device in one copy."""

    def __init__(self, batch: Batch, slot: _Slot, layout: dict, nbytes: int, device):
        self.batch, self._slot, self._layout, self._nbytes = batch, slot, layout, nbytes
        self.device = device

    def to(self, device: torch.device | str) -> Batch:
        """The batch on ``device`` (asynchronous), with its ``layout`` checked on the host. Once
        moved, the host buffer belongs to the staging ring again: moving twice is an error."""
        if torch.device(device).type != self.device.type:
            raise ValueError(f"this batch was staged for {self.device}, not {device}")
        if self._slot is None:
            raise RuntimeError("this staged batch was moved already; its buffer is reused")
        slot, self._slot = self._slot, None
        if self.device.type == "cuda":
            moved = slot.buffer[: self._nbytes].to(device, non_blocking=True)
            # blocking: the loader thread that waits on it sleeps instead of spinning a core
            slot.copied = torch.cuda.Event(blocking=True)
            slot.copied.record()
        else:
            moved = slot.buffer[: self._nbytes].clone()
        tensors = {
            name: _view(moved, start, dtype, shape)
            for name, (start, dtype, shape) in self._layout.items()
        }
        # The host offsets are a view of the buffer: checked (and copied by the layout) before
        # the buffer goes back to the ring, where the loader may pack the next batch into it.
        layout = JaggedBatch.from_host(
            self.batch.offsets, device=device, device_copy=tensors["offsets"]
        )
        slot.moved.set()
        return Batch(**tensors, layout=layout)


def _layout(batch: Batch) -> tuple[dict[str, tuple[int, torch.dtype, tuple[int, ...]]], int]:
    """Each field's byte offset, dtype and shape in a packed buffer, and the buffer's size."""
    layout, nbytes = {}, 0
    for f in fields(Batch):
        if f.name == "layout":
            continue
        t = getattr(batch, f.name)
        layout[f.name] = (nbytes, t.dtype, tuple(t.shape))
        nbytes += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return layout, nbytes


def _view(buffer: torch.Tensor, start: int, dtype: torch.dtype, shape: tuple[int, ...]):
    count = 1
    for n in shape:
        count *= n
    size = count * torch.empty(0, dtype=dtype).element_size()
    return buffer[start : start + size].view(dtype).view(shape)

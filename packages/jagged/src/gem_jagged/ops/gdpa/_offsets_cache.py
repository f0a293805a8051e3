"""Device tensors derived from offsets tensors, built once per offsets tensor and reused.

A jagged kernel's launch plan (a tile work list, a per-block table) depends only on the offsets.
Building it costs a few small launches, and on a GPU host each launch costs ~10–25 us of CPU
time, more than the attention of a short problem takes on the device. The layers of a model
share one batch's offsets tensor, and a training step calls each op forward and backward, so a
plan is looked up by the identity and version counter of its offsets tensors (an in-place
change bumps the version and misses) and the options that shaped it.

Nothing is cached while a CUDA graph is being captured or ``torch.compile`` traces: a captured
graph must contain the build, so that replays with new offsets values copied into the same
tensor rebuild the plan on the device. Inference tensors, which carry no version counter, are
never cached either.
"""

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch

from gem_jagged._checks import building_a_graph

T = TypeVar("T")


class OffsetsCache:
    """``get((offsets, ...), options, build)``: ``build()`` once per live, unchanged offsets."""

    def __init__(self, max_entries: int = 64):
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple[tuple[weakref.ref, ...], object]] = OrderedDict()

    def get(self, offsets: tuple[torch.Tensor, ...], options: tuple, build: Callable[[], T]) -> T:
        if building_a_graph() or any(t.is_inference() for t in offsets):
            return build()
        key = (*((id(t), t._version) for t in offsets), *options)
        entry = self._entries.get(key)
        if entry is not None and all(ref() is t for ref, t in zip(entry[0], offsets, strict=True)):
            return entry[1]
        value = build()
        refs = tuple(
            weakref.ref(t, lambda _, key=key: self._entries.pop(key, None)) for t in offsets
        )
        self._entries[key] = (refs, value)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()

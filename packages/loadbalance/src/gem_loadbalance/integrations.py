"""Plugging the shuffler into PyTorch data pipelines and torchrec batches.

``SubBatches``
    A re-iterable view of a flat sample iterable as lists of ``size`` samples (the last may be
    shorter): the shape the shuffler reads. ``BaseBatchShuffler`` also takes a ``DataLoader``
    directly when its ``collate_fn`` returns one list of samples per batch.
``ShufflingIterableDataset``
    An ``IterableDataset`` that runs one shuffler per ``DataLoader`` worker over that worker's
    shard (the wrapped dataset shards itself with ``get_worker_info``, as PyTorch expects) and
    yields balanced local batches; use ``DataLoader(ds, batch_size=None, num_workers=W)``. Worker
    ``w`` uses seed ``seed + w``. For exact resume keep the shuffler in the main process
    (``BaseBatchShuffler(DataLoader(...))``): worker processes do not hand their state back.
``kjt_rows`` / ``KJTSubBatches`` / ``kjt_sub_batch_cost`` / ``collate_kjt_rows``
    torchrec ``KeyedJaggedTensor`` batches, handled by duck typing (``keys()``, ``values()``,
    ``lengths()``, ``offsets()``, ``stride()``, ``weights_or_none()``), so torchrec is never
    imported here. A KJT batch becomes a list of ``KJTRow(kjt, row)`` samples, priced from the
    lengths of one named sequence feature; ``collate_kjt_rows`` gathers the rows of a local
    batch (from any number of source KJTs) back into one KJT of the same class, every key's
    values and weights copied in row order.
"""

from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np
import torch

from .cost import sample_cost
from .shuffler import BaseBatchShuffler

__all__ = [
    "KJTRow",
    "KJTSubBatches",
    "ShufflingIterableDataset",
    "SubBatches",
    "collate_kjt_rows",
    "kjt_rows",
    "kjt_sub_batch_cost",
]


class SubBatches:
    """Re-iterable: ``iter(samples)`` cut into lists of ``size`` samples."""

    def __init__(self, samples: Iterable, size: int):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.samples, self.size = samples, size

    def __iter__(self):
        chunk = []
        for sample in self.samples:
            chunk.append(sample)
            if len(chunk) == self.size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


class ShufflingIterableDataset(torch.utils.data.IterableDataset):
    """Balanced local batches from a (worker-sharded) ``IterableDataset`` of samples.

    Each ``DataLoader`` worker cuts its shard of ``dataset`` into sub-batches of
    ``sub_batch_size`` and runs its own ``BaseBatchShuffler`` (``seed + worker``); the other
    arguments are the shuffler's. Use it with ``batch_size=None``: every item is a local batch.
    Bad options raise at construction, as ``BaseBatchShuffler`` does.
    """

    def __init__(
        self,
        dataset: Iterable,
        *,
        sub_batch_size: int,
        local_batch_size: int,
        cost: Callable | None = None,
        sub_batch_cost: Callable | None = None,
        seed: int = 0,
        **shuffler_options,
    ):
        super().__init__()
        self.dataset = dataset
        self.sub_batch_size = sub_batch_size
        self.options = dict(
            cost=cost, sub_batch_cost=sub_batch_cost, local_batch_size=local_batch_size
        )
        self.options.update(shuffler_options)
        self.seed = seed
        # Built once here so that a bad option fails at construction, not inside a worker.
        BaseBatchShuffler([], seed=seed, **self.options)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        shuffler = BaseBatchShuffler(
            SubBatches(self.dataset, self.sub_batch_size), seed=self.seed + worker, **self.options
        )
        return iter(shuffler)


class KJTRow(NamedTuple):
    """One sample of a ``KeyedJaggedTensor`` batch: the batch and the row index in it."""

    kjt: object
    row: int


def _check_kjt(kjt) -> None:
    for method in ("keys", "values", "lengths", "offsets", "stride", "weights_or_none"):
        if not callable(getattr(kjt, method, None)):
            raise TypeError(
                f"expected a KeyedJaggedTensor (with .{method}()), got {type(kjt).__name__}"
            )
    variable = getattr(kjt, "variable_stride_per_key", None)
    if callable(variable) and variable():
        raise ValueError("KeyedJaggedTensors with a variable stride per key are not supported")


def kjt_rows(kjt) -> list[KJTRow]:
    """The samples of one KJT batch."""
    _check_kjt(kjt)
    return [KJTRow(kjt, row) for row in range(kjt.stride())]


class KJTSubBatches:
    """Re-iterable: each KJT batch of ``batches`` as a list of ``KJTRow`` samples."""

    def __init__(self, batches: Iterable):
        self.batches = batches

    def __iter__(self):
        for kjt in self.batches:
            yield kjt_rows(kjt)


def _feature_lengths(kjt, feature: str) -> torch.Tensor:
    keys = list(kjt.keys())
    if feature not in keys:
        raise KeyError(f"feature {feature!r} is not among the KJT's keys {keys}")
    lengths_KB = kjt.lengths().reshape(len(keys), kjt.stride())
    return lengths_KB[keys.index(feature)]


def kjt_sub_batch_cost(feature: str, *, a: float, b: float) -> Callable[[list], np.ndarray]:
    """A ``sub_batch_cost`` pricing ``KJTRow`` samples by ``feature``'s sequence lengths."""

    def price(rows: list) -> np.ndarray:
        costs = np.empty(len(rows), dtype=np.float64)
        by_source: dict[int, tuple[object, list[int], list[int]]] = {}
        for i, (kjt, row) in enumerate(rows):
            entry = by_source.setdefault(id(kjt), (kjt, [], []))
            entry[1].append(i)
            entry[2].append(row)
        for kjt, positions, source_rows in by_source.values():
            lengths = _feature_lengths(kjt, feature).cpu().numpy()[source_rows]
            costs[positions] = sample_cost(lengths.astype(np.int64), a=a, b=b)
        return costs

    return price


def collate_kjt_rows(rows: list):
    """One KJT holding ``rows`` (``KJTRow`` samples, from any source KJTs) in order."""
    if not rows:
        raise ValueError("rows must hold at least one KJTRow")
    first = rows[0].kjt
    _check_kjt(first)
    keys = list(first.keys())
    sources: dict[int, int] = {}
    kjts = []
    for kjt, _ in rows:
        if id(kjt) not in sources:
            _check_kjt(kjt)
            if list(kjt.keys()) != keys:
                raise ValueError(f"rows mix KJTs with keys {keys} and {list(kjt.keys())}")
            sources[id(kjt)] = len(kjts)
            kjts.append(kjt)
    with_weights = first.weights_or_none() is not None
    if any((k.weights_or_none() is not None) != with_weights for k in kjts):
        raise ValueError("rows mix weighted and unweighted KJTs")
    # Every source's values (and weights) concatenated, and every source's offsets shifted to
    # point into that concatenation, then concatenated too (`offset_base`: where each starts).
    sizes = [int(k.values().numel()) for k in kjts]
    value_base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    shifted = [
        k.offsets().cpu().numpy().astype(np.int64) + b
        for k, b in zip(kjts, value_base, strict=True)
    ]
    offset_base = np.concatenate([[0], np.cumsum([o.size for o in shifted])[:-1]]).astype(np.int64)
    all_offsets = np.concatenate(shifted)
    strides = np.array([k.stride() for k in kjts], dtype=np.int64)
    source_of = np.array([sources[id(kjt)] for kjt, _ in rows], dtype=np.int64)
    row_of = np.array([row for _, row in rows], dtype=np.int64)
    key_of = np.repeat(np.arange(len(keys), dtype=np.int64), len(rows))
    at = np.tile(offset_base[source_of] + row_of, len(keys)) + key_of * np.tile(
        strides[source_of], len(keys)
    )
    starts = all_offsets[at]
    lengths = all_offsets[at + 1] - starts
    total = int(lengths.sum())
    # Token i of the output comes from starts[segment] + (i - segment's first output position).
    segment = np.repeat(np.arange(lengths.size), lengths)
    first_out = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    gather = torch.as_tensor(starts[segment] + (np.arange(total) - first_out[segment]))
    device = first.values().device
    values = torch.cat([k.values() for k in kjts])[gather.to(device)]
    weights = None
    if with_weights:
        weights = torch.cat([k.weights_or_none() for k in kjts])[gather.to(device)]
    return type(first)(
        keys=keys,
        values=values,
        weights=weights,
        lengths=torch.as_tensor(lengths, dtype=first.lengths().dtype, device=device),
    )

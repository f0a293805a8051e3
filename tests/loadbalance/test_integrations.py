"""Integration: DataLoader-fed shufflers, per-worker shuffling, KeyedJaggedTensor rows."""

import pytest
import torch
from gem_loadbalance import (
    BaseBatchShuffler,
    ShufflingIterableDataset,
    SubBatches,
    collate_kjt_rows,
    kjt_rows,
    kjt_sub_batch_cost,
)


class ShardedRange(torch.utils.data.IterableDataset):
    """Samples 0..n-1, each DataLoader worker taking every num_workers-th one."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(worker, self.n, workers))


def price(sample):
    return float((sample * 7919) % 97 + 1) ** 2


def test_shuffler_over_a_dataloader_resumes_exactly():
    loader = torch.utils.data.DataLoader(ShardedRange(300), batch_size=16, collate_fn=list)
    make = lambda: BaseBatchShuffler(loader, cost=price, local_batch_size=32, seed=3)
    full = list(make())
    assert sorted(s for b in full for s in b) == list(range(300))
    first = make()
    iterator = iter(first)
    head = [next(iterator) for _ in range(4)]
    second = make()
    second.load_state_dict(first.state_dict())
    assert head + list(second) == full


def test_sub_batches_cut_a_flat_stream():
    assert list(SubBatches(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="size"):
        SubBatches(range(3), 0)


def test_one_shuffler_per_worker_covers_every_sample_once():
    dataset = ShufflingIterableDataset(
        ShardedRange(200), sub_batch_size=8, local_batch_size=16, cost=price
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    batches = list(loader)
    assert sorted(s for b in batches for s in b) == list(range(200))
    assert sum(len(b) < 16 for b in batches) <= 2  # at most one short tail per worker
    with pytest.raises(ValueError, match="local_batch_size"):
        ShufflingIterableDataset(ShardedRange(1), sub_batch_size=8, local_batch_size=0, cost=price)


class FakeKJT:
    """Just the KeyedJaggedTensor surface the helpers use (torchrec's class is tested below)."""

    def __init__(self, keys, values, lengths, weights=None):
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def weights_or_none(self):
        return self._weights

    def stride(self):
        return self._lengths.numel() // len(self._keys)

    def offsets(self):
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self._lengths, 0)])


def _rows_of(kjt, key):
    """Per-row value lists of one key."""
    keys = list(kjt.keys())
    stride = kjt.lengths().numel() // len(keys)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(kjt.lengths(), 0)])
    k = keys.index(key)
    return [
        kjt.values()[offsets[k * stride + r] : offsets[k * stride + r + 1]].tolist()
        for r in range(stride)
    ]


def _check_round_trip(kjt_class):
    a = kjt_class(
        keys=["seq", "cat"],
        values=torch.arange(20),
        lengths=torch.tensor([3, 0, 5, 4, 2, 6]),
        weights=torch.arange(20, dtype=torch.float32) / 2,
    )
    b = kjt_class(
        keys=["seq", "cat"],
        values=torch.arange(100, 104),
        lengths=torch.tensor([1, 2, 0, 1]),
        weights=torch.ones(4),
    )
    rows = kjt_rows(a) + kjt_rows(b)
    costs = kjt_sub_batch_cost("seq", a=1.0, b=0.5)(rows)
    assert costs.tolist() == [7.5, 0.0, 17.5, 1.5, 4.0]
    picked = [rows[2], rows[4], rows[0]]
    out = collate_kjt_rows(picked)
    assert type(out) is kjt_class and list(out.keys()) == ["seq", "cat"]
    for key in ("seq", "cat"):
        expected = [_rows_of(kjt, key)[row] for kjt, row in picked]
        assert _rows_of(out, key) == expected
    # Weights travel with their values: a's weight is value / 2, b's is 1.
    expected_weights = [v / 2 if v < 100 else 1.0 for v in out.values().tolist()]
    assert out.weights_or_none().tolist() == expected_weights
    shuffler = BaseBatchShuffler(
        [rows[:3], rows[3:]], sub_batch_cost=kjt_sub_batch_cost("seq", a=1, b=1), local_batch_size=2
    )
    batches = [collate_kjt_rows(batch) for batch in shuffler]
    assert sum(out.lengths().numel() // 2 for out in batches) == 5
    with pytest.raises(KeyError, match="feature 'nope'"):
        kjt_sub_batch_cost("nope", a=1.0, b=1.0)(rows)


def test_kjt_rows_round_trip_duck_typed():
    _check_round_trip(FakeKJT)
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        kjt_rows(object())


def test_kjt_rows_round_trip_torchrec():
    torchrec = pytest.importorskip("torchrec")
    _check_round_trip(torchrec.KeyedJaggedTensor)

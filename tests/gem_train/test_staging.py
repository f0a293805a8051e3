"""PinnedStaging: batches packed into reused buffers, moved in one copy, never overwritten before
their copy is issued. On the CPU the buffers are plain memory and the ring's rules are the same;
on CUDA (test_gpu.py) a training step queued behind a busy GPU never waits for it."""

import pytest
import torch
from gem_train.data.batch import Batch
from gem_train.data.staging import PinnedStaging
from gem_train.data.synthetic import SyntheticStream

from .conftest import small_config


def _batches(n: int, **overrides) -> list[Batch]:
    cfg = small_config(**overrides)
    stream = SyntheticStream(cfg.data, cfg.model)
    return [stream.sub_batch(k) for k in range(n)]


def _assert_same(moved: Batch, batch: Batch) -> None:
    for name, t in batch.tensors().items():
        got = getattr(moved, name)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
    assert moved.layout is not None and moved.layout.offsets is moved.offsets
    assert moved.layout.max_len == int(batch.lengths.max())


def test_a_staged_batch_moves_whole_with_its_layout():
    staging = PinnedStaging("cpu", slots=2)
    for batch in _batches(3):
        _assert_same(staging.stage(batch).to("cpu"), batch)


def test_buffers_are_reused_once_moved():
    staging = PinnedStaging("cpu", slots=2)
    small, *_ = _batches(1)
    pointers = []
    for _ in range(4):
        staged = staging.stage(small)
        pointers.append(staged.batch.offsets.data_ptr())
        staged.to("cpu")
    assert staging.num_slots == 2 and staging.grown == 0
    assert pointers[0] == pointers[2] and pointers[1] == pointers[3] != pointers[0]


def test_a_batch_held_unmoved_keeps_its_buffer_and_the_ring_grows():
    staging = PinnedStaging("cpu", slots=1)
    batches = _batches(3)
    held = [staging.stage(b) for b in batches]  # none moved: each needs its own buffer
    assert staging.num_slots == 3
    for staged, batch in zip(held, batches, strict=True):
        _assert_same(staged.to("cpu"), batch)  # no later stage wrote into an earlier buffer


def test_a_larger_batch_grows_its_buffer_once_with_headroom():
    staging = PinnedStaging("cpu", slots=1)
    small = _batches(1)[0]
    large = Batch.cat(_batches(8))
    staging.stage(small).to("cpu")
    staging.stage(large).to("cpu")
    assert staging.grown == 1
    _assert_same(staging.stage(large).to("cpu"), large)
    _assert_same(staging.stage(small).to("cpu"), small)
    assert staging.grown == 1


def test_moving_twice_or_elsewhere_is_an_error():
    staging = PinnedStaging("cpu", slots=1)
    staged = staging.stage(_batches(1)[0])
    with pytest.raises(ValueError, match="staged for cpu, not meta"):
        staged.to("meta")
    staged.to("cpu")
    with pytest.raises(RuntimeError, match="moved already"):
        staged.to("cpu")


@pytest.mark.parametrize("slots", [0, -1, 1.5, True])
def test_slots_must_be_a_positive_int(slots):
    with pytest.raises(ValueError, match="slots must be an int of at least 1"):
        PinnedStaging("cpu", slots=slots)


def test_the_loader_stages_each_batch_and_the_step_moves_it():
    from gem_train.data.loader import TrainBatches

    cfg = small_config(data__prefetch=2)
    plain = TrainBatches(SyntheticStream(cfg.data, cfg.model), cfg.data, cfg.model)
    staged = TrainBatches(
        SyntheticStream(cfg.data, cfg.model), cfg.data, cfg.model,
        staging=PinnedStaging("cpu", slots=cfg.data.prefetch + 3),
    )  # fmt: skip
    try:
        for _ in range(6):
            want, got = next(plain), next(staged)
            assert got.staged is not None and want.staged is None
            _assert_same(got.to("cpu"), want.batch)
    finally:
        plain.close()
        staged.close()


def test_the_loader_never_deadlocks_on_batches_taken_and_held():
    """Batches taken from the loader but not moved keep their buffers: the ring grows and the
    loader thread goes on, and every held batch still moves intact."""
    from gem_train.data.loader import TrainBatches

    cfg = small_config(data__prefetch=2)
    plain = TrainBatches(SyntheticStream(cfg.data, cfg.model), cfg.data, cfg.model)
    staging = PinnedStaging("cpu", slots=cfg.data.prefetch + 3)
    staged = TrainBatches(
        SyntheticStream(cfg.data, cfg.model), cfg.data, cfg.model, staging=staging
    )  # fmt: skip
    try:
        held = [next(staged) for _ in range(9)]
        assert staging.num_slots > cfg.data.prefetch + 3
        for got in held:
            _assert_same(got.to("cpu"), next(plain).batch)
    finally:
        plain.close()
        staged.close()

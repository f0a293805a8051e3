"""The synthetic stream, the batch format, the resumable loader and the Parquet reader."""

import numpy as np
import pytest
import torch
from gem_train.config import DataConfig
from gem_train.data.batch import Batch, time_bucket_of
from gem_train.data.loader import TrainBatches
from gem_train.data.synthetic import EVAL_STREAM, SyntheticStream
from gem_train.metrics import auc
from hypothesis import given
from hypothesis import strategies as st

# The Parquet reader needs pyarrow, which the GPU image lacks.
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
parquet = pytest.importorskip("gem_train.data.parquet")
ParquetSource, write_example = parquet.ParquetSource, parquet.write_example


def _equal(a: Batch, b: Batch) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return ta.keys() == tb.keys() and all(torch.equal(ta[f], tb[f]) for f in ta)


def test_defaults_are_workload_j1():
    d = DataConfig()
    assert (d.median_len, d.sigma, d.min_len, d.max_len) == (512, 1.0, 32, 16384)


def test_stream_is_deterministic_and_seeded(small):
    cfg = small()
    one, two = SyntheticStream(cfg.data, cfg.model), SyntheticStream(cfg.data, cfg.model)
    assert _equal(one.batch(3), two.batch(3))
    assert not _equal(one.batch(3), one.batch(4))
    held_out = SyntheticStream(cfg.data, cfg.model, stream=EVAL_STREAM)
    assert not _equal(one.batch(3), held_out.batch(3))


def test_lengths_stay_in_bounds_and_are_heavy_tailed(small):
    cfg = small(data__median_len=16, data__min_len=2, data__max_len=200, data__batch_size=512)
    lengths = SyntheticStream(cfg.data, cfg.model).batch(0).lengths.numpy()
    assert lengths.min() >= 2 and lengths.max() <= 200
    assert 10 <= np.median(lengths) <= 25 and lengths.max() > 4 * np.median(lengths)


def test_teacher_plants_a_learnable_signal(small):
    """The teacher's own logits rank clicks well: the signal is there to learn."""
    cfg = small(data__batch_size=2048)
    stream = SyntheticStream(cfg.data, cfg.model)
    batch = stream.batch(0)
    click_logit, _ = stream.teacher.logits(
        offsets=batch.offsets.numpy(), category=batch.category.numpy(), action=batch.action.numpy(),
        time_bucket=batch.time_bucket.numpy(), ad_category=batch.ad_category.numpy(),
        advertiser=batch.advertiser.numpy(), segments=batch.segments.numpy(),
        segment_counts=np.diff(batch.segment_offsets.numpy()),
    )  # fmt: skip
    assert auc(torch.as_tensor(click_logit), batch.click) > 0.72
    assert 0.05 < batch.click.mean().item() < 0.5


@given(st.lists(st.integers(0, 7), min_size=1, max_size=8))
def test_select_then_cat_restores_the_batch(index):
    cfg_data = DataConfig(batch_size=8, sub_batch_size=8, median_len=4, min_len=0, max_len=12)
    from gem_train.config import ModelConfig

    batch = SyntheticStream(cfg_data, ModelConfig()).batch(0)
    picked = batch.select(index)
    assert picked.num_samples == len(index)
    for j, i in enumerate(index):
        one, ref = picked.select([j]), batch.select([i])
        assert _equal(one, ref)
    halves = Batch.cat([batch.select(range(4)), batch.select(range(4, 8))])
    assert _equal(halves, batch)


def test_time_buckets():
    assert time_bucket_of(np.array([0, 1, 2, 3, 1000, 10**12]), 16).tolist() == [0, 1, 1, 2, 9, 15]


@pytest.mark.parametrize("shuffle", [True, False])
def test_loader_resumes_exactly(small, shuffle):
    cfg = small(data__shuffle=shuffle)

    def stream():
        return TrainBatches(SyntheticStream(cfg.data, cfg.model), cfg.data, cfg.model)

    straight = stream()
    expected = [next(straight).batch for _ in range(6)]
    first = stream()
    for _ in range(3):
        next(first)
    resumed = stream()
    resumed.load_state_dict(first.state_dict())
    for want in expected[3:]:
        assert _equal(next(resumed).batch, want)


def test_shuffler_keeps_every_sample_once(small):
    cfg = small(data__shuffle=True)
    source = SyntheticStream(cfg.data, cfg.model)
    batches = TrainBatches(source, cfg.data, cfg.model)
    seen = Batch.cat([next(batches).batch for _ in range(8)])
    read = Batch.cat([source.sub_batch(k) for k in range(16 + 8)])  # look-ahead: 2 batches
    key = lambda b: sorted(zip(b.user.tolist(), b.ad.tolist(), b.lengths.tolist(), strict=True))  # noqa: E731
    # Everything emitted was read, nothing twice (a few read-ahead samples may still wait).
    emitted, available = key(seen), key(read)
    assert len(set(emitted)) == len(emitted) == 64
    assert set(emitted) <= set(available)


def test_ranks_read_disjoint_sub_batches(small):
    cfg = small(data__shuffle=False)
    source = SyntheticStream(cfg.data, cfg.model)
    r0 = next(TrainBatches(source, cfg.data, cfg.model, rank=0, world=2)).batch
    r1 = next(TrainBatches(source, cfg.data, cfg.model, rank=1, world=2)).batch
    assert _equal(r0, Batch.cat([source.sub_batch(0), source.sub_batch(2)]))
    assert _equal(r1, Batch.cat([source.sub_batch(1), source.sub_batch(3)]))


def test_parquet_round_trip(small, tmp_path):
    cfg = small()
    path = tmp_path / "example.parquet"
    write_example(str(path), cfg.data, cfg.model, rows=10, row_group_rows=3)
    cfg = small(data__source="parquet", data__path=str(path))
    source = ParquetSource(cfg.data, cfg.model)
    assert source.num_rows == 10
    rows = SyntheticStream(cfg.data, cfg.model).batch(0, batch_size=10)
    assert _equal(source.sub_batch(0), rows.select(range(4)))
    assert _equal(source.sub_batch(2), rows.select([8, 9, 0, 1]))  # wraps into the next epoch


def _rewrite(path, column, values):
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index(column), column, values)
    pq.write_table(table, path)


def test_parquet_errors_name_the_problem(small, tmp_path):
    cfg = small()
    path = tmp_path / "bad.parquet"
    write_example(str(path), cfg.data, cfg.model, rows=4)
    parquet = small(data__source="parquet", data__path=str(path))

    pq.write_table(pq.read_table(path).drop(["click"]), path)
    with pytest.raises(ValueError, match="column 'click'"):
        ParquetSource(parquet.data, parquet.model)

    write_example(str(path), cfg.data, cfg.model, rows=4)
    _rewrite(path, "action_ids", pa.array([[0]] * 4, pa.list_(pa.int64())))
    with pytest.raises(ValueError, match="action_ids has 1 entries but item_ids has"):
        ParquetSource(parquet.data, parquet.model).sub_batch(0)

    write_example(str(path), cfg.data, cfg.model, rows=4)
    _rewrite(path, "ad_id", pa.array([10**9] * 4, pa.int64()))
    with pytest.raises(ValueError, match=r"ad_id holds ids outside \[0, 200\)"):
        ParquetSource(parquet.data, parquet.model).sub_batch(0)

    with pytest.raises(FileNotFoundError, match="data.path"):
        ParquetSource(
            small(data__source="parquet", data__path=str(tmp_path / "nope")).data, cfg.model
        )


@pytest.mark.parametrize("multiple", [1, 64, 128])
def test_padding_aligns_tokens_and_samples_and_keeps_the_real_ones_first(small, multiple):
    cfg = small(data__batch_size=12, data__sub_batch_size=4)
    batch = SyntheticStream(cfg.data, cfg.model).batch(0, batch_size=12)
    padded = batch.padded(token_multiple=multiple)
    assert padded.num_tokens % multiple == 0 and padded.num_samples % 16 == 0
    assert _equal(padded.select(range(12)), batch)
    tail = padded.select(range(12, padded.num_samples))
    assert tail.click.sum() == 0 and tail.segments.numel() == 0 and tail.item.sum() == 0

"""The Parquet reader refuses what it cannot read faithfully, naming the column and the row.

Nulls (a whole history, one event, a scalar), events after their request and ages that overflow
int64 would otherwise become an empty history, another row's values, time bucket 0 or the top
bucket, or pyarrow's raw "zero_copy_only" error.
"""

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
parquet = pytest.importorskip("gem_train.data.parquet")
ParquetSource, write_example = parquet.ParquetSource, parquet.write_example

HISTORY = ("item_ids", "action_ids", "category_ids", "event_timestamps")


def _source(small, tmp_path, edit):
    """A 6-row example file (sub-batches of 4) with ``edit(table) -> table`` applied."""
    cfg = small()
    path = tmp_path / "rows.parquet"
    write_example(str(path), cfg.data, cfg.model, rows=6, row_group_rows=4)
    pq.write_table(edit(pq.read_table(path)), path, row_group_size=4)
    cfg = small(data__source="parquet", data__path=str(path))
    return ParquetSource(cfg.data, cfg.model)


def _set_row(table, column, row, value):
    values = table.column(column).to_pylist()
    values[row] = value
    index = table.schema.get_field_index(column)
    return table.set_column(index, column, pa.array(values, table.schema.field(column).type))


def test_a_null_history_is_an_error_naming_the_column_and_row(small, tmp_path):
    def edit(table):
        for column in HISTORY:
            table = _set_row(table, column, 5, None)
        return table

    source = _source(small, tmp_path, edit)
    source.sub_batch(0)  # rows 0-3 are intact
    with pytest.raises(ValueError, match=r"item_ids is null at row 5"):
        source.sub_batch(1)  # rows 4, 5, 0, 1


def test_a_null_event_inside_a_history_names_the_column_and_row(small, tmp_path):
    def edit(table):
        history = table.column("category_ids").to_pylist()[2]
        assert history, "the example's row 2 has a history"
        return _set_row(table, "category_ids", 2, [None] + history[1:])

    with pytest.raises(ValueError, match=r"category_ids holds a null value at row 2"):
        _source(small, tmp_path, edit).sub_batch(0)


@pytest.mark.parametrize("column", ["user_id", "request_timestamp", "ad_id", "click"])
def test_a_null_scalar_names_the_column_and_row(small, tmp_path, column):
    source = _source(small, tmp_path, lambda t: _set_row(t, column, 3, None))
    with pytest.raises(ValueError, match=rf"{column} is null at row 3"):
        source.sub_batch(0)


def test_an_event_after_its_request_is_an_error(small, tmp_path):
    def edit(table):
        request = table.column("request_timestamp").to_pylist()[1]
        events = table.column("event_timestamps").to_pylist()[1]
        return _set_row(table, "event_timestamps", 1, events[:-1] + [request + 60])

    with pytest.raises(ValueError, match=r"event_timestamps: row 1 has an event 60 s after"):
        _source(small, tmp_path, edit).sub_batch(0)


def test_an_age_overflowing_int64_is_an_error(small, tmp_path):
    def edit(table):
        events = table.column("event_timestamps").to_pylist()[0]
        return _set_row(table, "event_timestamps", 0, [-(2**63)] + events[1:])

    with pytest.raises(ValueError, match=r"event_timestamps: row 0 .* overflows int64"):
        _source(small, tmp_path, edit).sub_batch(0)


def test_errors_name_the_row_of_the_file_when_a_sub_batch_wraps(small, tmp_path):
    """Sub-batch 1 holds rows 4, 5, 0, 1: a bad id in row 1 is reported as row 1."""
    source = _source(small, tmp_path, lambda t: _set_row(t, "ad_id", 1, 10**9))
    with pytest.raises(ValueError, match=r"ad_id holds ids outside \[0, 200\) at row 1"):
        source.sub_batch(1)


def _example(small, tmp_path, rows, name="rows.parquet"):
    cfg = small()
    path = tmp_path / name
    write_example(str(path), cfg.data, cfg.model, rows=rows, row_group_rows=16)
    return path


def test_the_evaluation_reads_only_rows_that_training_never_reads(small, tmp_path):
    """Without data.eval_path the last data.eval_fraction of the rows are held out: over two
    epochs the training sub-batches never hold one, the evaluation holds only them, and the two
    cover every row."""
    from gem_train.components import make_source
    from gem_train.data.synthetic import EVAL_STREAM

    path = _example(small, tmp_path, rows=100)
    cfg = small(data__source="parquet", data__path=str(path), data__eval_fraction=0.25)
    train, evaluation = make_source(cfg), make_source(cfg, stream=EVAL_STREAM)
    per_epoch = -(-train.num_rows // cfg.data.sub_batch_size)
    trained = {int(r) for k in range(2 * per_epoch) for r in train.rows_of(k)}
    evaluated = {int(r) for k in range(8) for r in evaluation.rows_of(k)}
    assert trained == set(range(75)) and evaluated == set(range(75, 100))
    users = pq.read_table(path).column("user_id").to_pylist()  # the rows themselves
    size = cfg.data.sub_batch_size
    assert evaluation.sub_batch(0).user.tolist() == users[75 : 75 + size]


def test_an_eval_path_is_the_evaluation_and_training_reads_all_of_data_path(small, tmp_path):
    from gem_train.components import make_source
    from gem_train.data.synthetic import EVAL_STREAM

    train_path = _example(small, tmp_path, rows=40)
    eval_path = _example(small, tmp_path, rows=24, name="eval.parquet")
    cfg = small(data__source="parquet", data__path=str(train_path), data__eval_path=str(eval_path))
    train, evaluation = make_source(cfg), make_source(cfg, stream=EVAL_STREAM)
    assert (train.num_rows, evaluation.num_rows, evaluation.path) == (40, 24, str(eval_path))


def test_a_hold_out_that_leaves_nothing_is_refused_naming_the_field(small, tmp_path):
    from gem_train.components import make_source

    path = _example(small, tmp_path, rows=4)
    cfg = small(data__source="parquet", data__path=str(path), data__eval_fraction=0.0)
    with pytest.raises(ValueError, match="data.eval_fraction=0.0 of the 4 rows"):
        make_source(cfg)
    with pytest.raises(FileNotFoundError, match="data.eval_path"):
        make_source(small(data__source="parquet", data__path=str(path), data__eval_path="nope"))

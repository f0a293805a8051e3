"""A Parquet source of training samples, one row per (user history, candidate ad) impression.

Schema (every column required; ids are non-negative and below the model's vocabulary sizes):

| column | Arrow type | meaning |
|---|---|---|
| ``user_id`` | int64 | the user |
| ``item_ids`` | list<int64> | history items, oldest first |
| ``action_ids`` | list<int64> | action type of each history event |
| ``category_ids`` | list<int64> | category of each history item |
| ``event_timestamps`` | list<int64> | seconds since the epoch of each history event |
| ``request_timestamp`` | int64 | when the candidate was shown; event age = request − event |
| ``user_segments`` | list<int64> | the user's segments (may be empty) |
| ``ad_id``, ``ad_category``, ``advertiser_id`` | int64 | the candidate ad |
| ``click``, ``conversion`` | int8 | labels, 0 or 1 |

The four history lists of a row must have equal lengths (zero is allowed). Event ages become time
buckets with ``data.batch.time_bucket_of``.

Nothing is guessed: a null anywhere (a whole list, one element of a list, a scalar), an event
timestamp after its row's ``request_timestamp``, or an age that does not fit in int64 raises a
``ValueError`` naming the column and the row (counted from 0 over the files in order). An empty
history is written as an empty list, never as a null: a null list has no defined length in Arrow
(its offsets may span another row's values), and a reader that took its offsets at face value
would hand out data that is not this row's. The source is a file or a folder of ``*.parquet``
files (sorted by name); rows are served in order, sub-batch ``k`` holding rows ``k·s ... k·s + s −
1`` counted modulo the row count, so epochs follow each other without dropping a row. A source
serves a range of the rows where a run holds some out for its evaluation (``held_out_split``). Row groups
are read on demand (the last one read stays cached). ``write_example`` writes synthetic rows in
this schema: the small generated example the tests read.
"""

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gem_train.config import DataConfig, ModelConfig
from gem_train.data.batch import Batch, offsets_of, time_bucket_of
from gem_train.data.synthetic import SyntheticStream, _to_batch

LIST_COLUMNS = ("item_ids", "action_ids", "category_ids", "event_timestamps", "user_segments")
SCALAR_COLUMNS = ("user_id", "request_timestamp", "ad_id", "ad_category", "advertiser_id")
LABEL_COLUMNS = ("click", "conversion")
SCHEMA = pa.schema(
    [(c, pa.int64()) for c in ("user_id",)]
    + [(c, pa.list_(pa.int64())) for c in LIST_COLUMNS]
    + [(c, pa.int64()) for c in SCALAR_COLUMNS[1:]]
    + [(c, pa.int8()) for c in LABEL_COLUMNS]
)


def _files(path: str, *, name: str) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"{name} {path!r} is a folder without *.parquet files")
        return files
    if not p.exists():
        raise FileNotFoundError(f"{name} {path!r} does not exist")
    return [p]


def held_out_split(data: DataConfig, model: ModelConfig) -> tuple["ParquetSource", "ParquetSource"]:
    """``(training, evaluation)`` sources of a Parquet run. With ``data.eval_path`` the
    evaluation reads those files and training all of ``data.path``; without it the last
    ``data.eval_fraction`` of ``data.path``'s rows are held out: training never reads them
    (its sub-batches wrap within the rows before them) and the evaluation reads only them.

    Raises:
        ValueError: the hold-out would leave no rows to train on or none to evaluate on.
    """
    if data.eval_path:
        return ParquetSource(data, model), ParquetSource(
            data, model, path=data.eval_path, name="data.eval_path"
        )
    everything = ParquetSource(data, model)
    total = everything.total_rows
    held = math.ceil(total * data.eval_fraction)
    if held >= total or (held == 0 and data.eval_batches):
        raise ValueError(
            f"data.eval_fraction={data.eval_fraction} of the {total} rows of data.path holds "
            f"out {held}: it must leave rows to train on and, with data.eval_batches="
            f"{data.eval_batches}, rows to evaluate; or give the evaluation its own data.eval_path"
        )
    train = ParquetSource(data, model, row_range=(0, total - held))
    evaluation = ParquetSource(data, model, row_range=(total - held, total)) if held else None
    return train, evaluation


def _check_schema(file: Path, schema: pa.Schema) -> None:
    for expected in SCHEMA:
        if expected.name not in schema.names:
            raise ValueError(f"{file}: column {expected.name!r} ({expected.type}) is missing")
        got = schema.field(expected.name).type
        if got != expected.type:
            raise ValueError(f"{file}: column {expected.name!r} must be {expected.type}, got {got}")


class ParquetSource:
    """Sub-batches of the rows ``row_range`` of the Parquet files at ``path``.

    Args:
        data, model: the run's configs (sub-batch size, vocabulary sizes for the id checks).
        path: a file or folder of ``*.parquet`` files; default ``data.path``.
        row_range: ``(first, end)``, the rows of the files (counted from 0 over the files in
            order) this source serves, wrapping from ``end`` back to ``first``; default all.
        name: the config field the path came from, for errors.
    """

    def __init__(
        self, data: DataConfig, model: ModelConfig, *, path: str | None = None,
        row_range: tuple[int, int] | None = None, name: str = "data.path",
    ):  # fmt: skip
        self.data, self.model = data, model
        self.path = data.path if path is None else path
        self.groups = []  # (file, row group, first row, rows)
        first = 0
        for file in _files(self.path, name=name):
            meta = pq.ParquetFile(file)
            _check_schema(file, meta.schema_arrow)
            for g in range(meta.num_row_groups):
                rows = meta.metadata.row_group(g).num_rows
                self.groups.append((file, g, first, rows))
                first += rows
        self.total_rows = first
        if self.total_rows == 0:
            raise ValueError(f"{name} {self.path!r} holds no rows")
        self.row_range = (0, first) if row_range is None else row_range
        lo, hi = self.row_range
        if not 0 <= lo < hi <= first:
            raise ValueError(
                f"row_range must be (first, end) with 0 ≤ first < end ≤ {first} (the rows of "
                f"{name} {self.path!r}), got {row_range}"
            )
        self.num_rows = hi - lo
        self._cached = (None, None)

    def _group(self, index: int) -> pa.Table:
        if self._cached[0] != index:
            file, g, _, _ = self.groups[index]
            self._cached = (index, pq.ParquetFile(file).read_row_group(g, columns=SCHEMA.names))
        return self._cached[1]

    def _rows(self, rows: np.ndarray) -> pa.Table:
        starts = np.array([g[2] for g in self.groups])
        which = np.searchsorted(starts, rows, side="right") - 1
        pieces = []
        for gi in np.unique(which):
            take = rows[which == gi] - starts[gi]
            pieces.append(self._group(int(gi)).take(pa.array(take)))
        return pa.concat_tables(pieces)

    def rows_of(self, index: int) -> np.ndarray:
        """The rows of the files that sub-batch ``index`` holds, in order."""
        size = self.data.sub_batch_size
        positions = np.arange(index * size, (index + 1) * size) % self.num_rows
        return (self.row_range[0] + positions).astype(np.int64)

    def sub_batch(self, index: int) -> Batch:
        rows = self.rows_of(index)
        # Keep the order of ``rows`` when they span row groups (``_rows`` groups them).
        table = self._rows(np.sort(rows))
        order = np.argsort(np.argsort(rows, kind="stable"), kind="stable")
        return self._to_batch(table.take(pa.array(order)), rows=rows)

    def _to_batch(self, table: pa.Table, *, rows: np.ndarray) -> Batch:
        """``table``'s rows (row ``i`` is row ``rows[i]`` of the files) as a checked ``Batch``."""
        m = self.model
        col = {c: table.column(c).combine_chunks() for c in SCHEMA.names}
        _check_no_nulls(col, rows)
        lists = {c: col[c].flatten().to_numpy() for c in LIST_COLUMNS}
        lengths = {c: pc.list_value_length(col[c]).to_numpy() for c in LIST_COLUMNS}
        for c in ("action_ids", "category_ids", "event_timestamps"):
            bad = np.flatnonzero(lengths[c] != lengths["item_ids"])
            if bad.size:
                raise ValueError(
                    f"row {rows[bad[0]]}: {c} has {lengths[c][bad[0]]} entries but "
                    f"item_ids has {lengths['item_ids'][bad[0]]}; the history lists must match"
                )
        scalars = {c: col[c].to_numpy() for c in SCALAR_COLUMNS + LABEL_COLUMNS}
        owner = np.repeat(np.arange(table.num_rows), lengths["item_ids"])
        age = _event_ages(scalars["request_timestamp"][owner], lists["event_timestamps"],
                          rows[owner])  # fmt: skip
        limits = {
            "item_ids": m.item_vocab, "action_ids": m.action_vocab, "category_ids": m.category_vocab,
            "user_segments": m.segment_vocab, "user_id": m.user_vocab, "ad_id": m.item_vocab,
            "ad_category": m.category_vocab, "advertiser_id": m.advertiser_vocab,
        }  # fmt: skip
        segment_owner = np.repeat(np.arange(table.num_rows), lengths["user_segments"])
        for c, limit in limits.items():
            values = lists[c] if c in lists else scalars[c]
            bad = np.flatnonzero((values < 0) | (values >= limit))
            if bad.size:
                where = segment_owner if c == "user_segments" else owner if c in lists else None
                row = rows[bad[0]] if where is None else rows[where[bad[0]]]
                raise ValueError(f"{c} holds ids outside [0, {limit}) at row {row}: "
                                 f"min {values.min()}, max {values.max()}")  # fmt: skip
        for c in LABEL_COLUMNS:
            bad = np.flatnonzero(~np.isin(scalars[c], (0, 1)))
            if bad.size:
                raise ValueError(
                    f"{c} must be 0 or 1, got {scalars[c][bad[0]]} at row {rows[bad[0]]}"
                )
        return _to_batch(
            offsets=offsets_of(lengths["item_ids"]), item=lists["item_ids"], action=lists["action_ids"],
            category=lists["category_ids"], time_bucket=time_bucket_of(age, m.time_buckets),
            user=scalars["user_id"], segments=lists["user_segments"],
            segment_offsets=offsets_of(lengths["user_segments"]), ad=scalars["ad_id"],
            ad_category=scalars["ad_category"], advertiser=scalars["advertiser_id"],
            click=scalars["click"], conversion=scalars["conversion"],
        )  # fmt: skip


def _check_no_nulls(col: dict[str, pa.Array], rows: np.ndarray) -> None:
    """``ValueError`` naming the column and the row of the first null list, element or scalar."""
    for c in SCHEMA.names:
        array = col[c]
        if array.null_count:
            row = rows[np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0]]
            raise ValueError(f"{c} is null at row {row}; every column is required "
                             "(write an empty history as an empty list)")  # fmt: skip
        if c in LIST_COLUMNS and array.flatten().null_count:
            owner = pc.list_parent_indices(array).to_numpy()
            element = np.flatnonzero(array.flatten().is_null().to_numpy(zero_copy_only=False))[0]
            raise ValueError(f"{c} holds a null value at row {rows[owner[element]]}")


def _event_ages(request: np.ndarray, events: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``request − event`` per event (int64 seconds), refusing future events and overflow.

    An event after its request would become age 0 (the newest bucket) and an age past int64
    would wrap negative, both silently; they are data errors and are named instead.
    """
    future = np.flatnonzero(events > request)
    if future.size:
        i = future[0]
        raise ValueError(
            f"event_timestamps: row {rows[i]} has an event {events[i] - request[i]} s after its "
            f"request_timestamp {request[i]} (event {events[i]}); events must precede the request"
        )
    with np.errstate(over="ignore"):
        age = request - events
    wrapped = np.flatnonzero(age < 0)  # request ≥ event, so a negative age has wrapped
    if wrapped.size:
        i = wrapped[0]
        raise ValueError(
            f"event_timestamps: row {rows[i]} request_timestamp {request[i]} − event "
            f"{events[i]} overflows int64"
        )
    return age


def write_example(
    path: str, data: DataConfig, model: ModelConfig, *, rows: int, row_group_rows: int = 64
) -> None:
    """Write ``rows`` synthetic impressions in the schema above (ages ``2^bucket − 1`` seconds)."""
    batch = SyntheticStream(data, model).batch(0, batch_size=rows)
    request = 1_764_000_000 + np.arange(rows, dtype=np.int64) * 60
    owner = np.repeat(np.arange(rows), batch.lengths.numpy())
    events = request[owner] - (2 ** batch.time_bucket.numpy() - 1)

    def split(values, offsets):
        offsets = offsets.numpy() if hasattr(offsets, "numpy") else offsets
        return pa.ListArray.from_arrays(
            pa.array(offsets, pa.int32()), pa.array(np.asarray(values), pa.int64())
        )

    table = pa.table(
        {
            "user_id": batch.user.numpy(),
            "item_ids": split(batch.item.numpy(), batch.offsets),
            "action_ids": split(batch.action.numpy(), batch.offsets),
            "category_ids": split(batch.category.numpy(), batch.offsets),
            "event_timestamps": split(events, batch.offsets),
            "user_segments": split(batch.segments.numpy(), batch.segment_offsets),
            "request_timestamp": request,
            "ad_id": batch.ad.numpy(),
            "ad_category": batch.ad_category.numpy(),
            "advertiser_id": batch.advertiser.numpy(),
            "click": batch.click.numpy().astype(np.int8),
            "conversion": batch.conversion.numpy().astype(np.int8),
        },
        schema=SCHEMA,
    )
    pq.write_table(table, path, row_group_size=row_group_rows)

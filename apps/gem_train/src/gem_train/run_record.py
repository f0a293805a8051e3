"""What a run is, field by field: recorded in its checkpoints, compared across its ranks.

``flat_config`` is the one serialization of a resolved config (``{"model.d_model": 64, ...}``,
every field): checkpoints, the run's summary JSON, TensorBoard's hparams and the TOML dump
(``gem_train.config_file``) all write it.

Two checks share this record. Resuming: a checkpoint fits a run only if it was trained with the
same model, data and optimisation, or the loaded state silently trains something else (DCP loads a
3-block checkpoint into a 2-block model, dropping the third block; a synthetic run's data position
resumes on Parquet files). So every checkpoint records the resolved config (every field) and the
data files it read, and a resume compares them with the run's own, naming the first field that
differs. A few fields may change on resume because the saved state does not depend on them
(``MAY_CHANGE_ON_RESUME``: the step count, where and how fast the run executes, checkpointing,
logging, activation checkpointing, the data folder's location when its files are the same); the
comparison skips them.

Starting under ``torchrun``: ranks that resolved different configs fail late and badly (a
different ``--steps`` deadlocks in the last collective, a different ``d_model`` aborts inside
gloo, a different ``--seed`` trains apart in silence). So the ranks exchange their whole resolved
config once, before anything else collective, and all refuse together, naming the first field
that differs and the ranks.
"""

import math
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gem_train.config import ConfigError, TrainConfig, fields_of

# Fields a resume may change (a trailing "." covers a section): the saved model, optimizer and
# data state do not depend on them.
MAY_CHANGE_ON_RESUME = (
    "name", "steps", "device", "compile", "cpu_threads", "data.path", "data.eval_batches",
    "data.eval_path", "data.prefetch", "optim.skip_nonfinite", "parallel.backend", "lowprec.fp8_plan", "checkpoint.", "metrics.",
    "memory.",
)  # fmt: skip


def flat_config(cfg: TrainConfig) -> dict[str, Any]:
    """``{"model.d_model": 64, "steps": 300, ...}``: every field of the resolved config."""
    return {
        name: getattr(owner, name.split(".")[-1]) for name, (owner, _, _) in fields_of(cfg).items()
    }


def may_change_on_resume(name: str) -> bool:
    return any(name.startswith(f) if f.endswith(".") else name == f for f in MAY_CHANGE_ON_RESUME)


def data_files(source) -> list[list] | None:
    """``[[file name relative to data.path, rows], ...]`` of a Parquet source, None for a
    synthetic one (its config fields define it)."""
    groups = getattr(source, "groups", None)
    if groups is None:
        return None
    root = Path(source.data.path)
    rows: dict[str, int] = {}
    for file, _, _, count in groups:
        name = Path(file).name if root.is_file() else Path(file).relative_to(root).as_posix()
        rows[name] = rows.get(name, 0) + count
    return [[name, count] for name, count in rows.items()]


def resume_record(cfg: TrainConfig, source) -> dict:
    """What a checkpoint records of its run: every field of the resolved config, and the data."""
    return {"config": flat_config(cfg), "data_files": data_files(source)}


def first_difference(saved: dict, current: dict) -> str | None:
    """The first difference between two records in a field a resume must keep (not
    ``MAY_CHANGE_ON_RESUME``) or in the data files, said as "field: checkpoint X, this run Y";
    None when they match."""
    saved_cfg, current_cfg = (
        {k: v for k, v in record.get("config", {}).items() if not may_change_on_resume(k)}
        for record in (saved, current)
    )
    for name in sorted(set(saved_cfg) | set(current_cfg)):
        if name not in saved_cfg:
            return f"{name}: not in the checkpoint's record, this run {current_cfg[name]!r}"
        if name not in current_cfg:
            return f"{name}: the checkpoint has {saved_cfg[name]!r}, this run has no such field"
        if not _same(saved_cfg[name], current_cfg[name]):
            return f"{name}: the checkpoint has {saved_cfg[name]!r}, this run {current_cfg[name]!r}"
    if saved.get("data_files") != current.get("data_files"):
        return _files_difference(saved.get("data_files"), current.get("data_files"))
    return None


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _files_difference(saved, current) -> str:
    if saved is None or current is None:  # data.source differs too, and is named first
        return f"data files: the checkpoint recorded {saved!r}, this run {current!r}"
    saved_d, current_d = dict(map(tuple, saved)), dict(map(tuple, current))
    for name in sorted(set(saved_d) | set(current_d)):
        if saved_d.get(name) != current_d.get(name):
            return (
                f"data file {name}: the checkpoint read {_rows(saved_d.get(name))}, this run "
                f"finds {_rows(current_d.get(name))}"
            )
    return "data files: the same files in another order"


def _rows(count) -> str:
    return "no such file" if count is None else f"{count} rows"


def check_ranks_agree(cfg: TrainConfig, *, world: int) -> None:
    """Exchange every rank's resolved config over the default group (one ``all_gather_object``)
    and raise on every rank alike if any differs from rank 0's.

    Raises:
        ConfigError: naming the first field that differs, its value on rank 0 and on the
            first rank that differs.
    """
    if world == 1:
        return
    mine = flat_config(cfg)
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    reference = gathered[0]
    for rank, other in enumerate(gathered[1:], start=1):
        for name in reference:
            if not _same(reference[name], other.get(name)):
                raise ConfigError(
                    f"the ranks resolved different configs: {name} is {reference[name]!r} on "
                    f"rank 0 but {other.get(name)!r} on rank {rank}; every rank must be started "
                    "with the same flags"
                )

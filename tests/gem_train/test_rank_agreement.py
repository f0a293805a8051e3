"""Ranks started with different flags refuse together at the start, naming the first field that
differs, instead of deadlocking (a different ``--steps``), aborting inside gloo (a different
``d_model``) or training apart (a different ``--seed``). Two gloo processes, spawned as in
``test_checkpoint_distributed``."""

import os
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parents[2]))
from tests.gem_train.conftest import small_config  # noqa: E402
from tests.parallel.parallel_launch import free_port  # noqa: E402


def _worker(rank, world, port, per_rank, result_dir):
    import torch
    from gem_train.config import ConfigError
    from gem_train.train import train

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
        LOCAL_RANK=str(rank),
    )  # fmt: skip
    try:
        train(small_config(**per_rank[rank]))
        outcome = "trained"
    except ConfigError as exc:
        outcome = f"ConfigError: {exc}"
    Path(result_dir, f"rank{rank}.txt").write_text(outcome)
    sys.stdout.flush()
    os._exit(0)  # gloo's threads, joined while Python finalizes, can abort the process


@pytest.mark.parametrize(
    "per_rank, field, values",
    [
        ([{"steps": 3}, {"steps": 5}], "steps", ("3", "5")),
        ([{"model__d_model": 64}, {"model__d_model": 32}], "model.d_model", ("64", "32")),
        ([{"seed": 0}, {"seed": 1}], "seed", ("0", "1")),
    ],
    ids=["steps", "d_model", "seed"],
)
def test_ranks_with_different_flags_refuse_together_naming_the_field(
    tmp_path, per_rank, field, values
):
    t0 = time.perf_counter()
    mp.start_processes(
        _worker, args=(2, free_port(), per_rank, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    assert time.perf_counter() - t0 < 120  # no deadlock: both refuse at the start
    expected = (
        f"ConfigError: the ranks resolved different configs: {field} is {values[0]} on rank 0 "
        f"but {values[1]} on rank 1"
    )
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text().startswith(expected)

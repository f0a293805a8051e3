"""Checkpoints under two gloo processes: saving mid-run leaves training able to continue, and a
resumed run reproduces the straight run's losses.

FSDP2 shards the dense tower and gem_parallel row-shards the native tables over the two ranks;
the save views each rank's table rows as a row-sharded DTensor. The workers are spawned from this
module (found by its import name, ``tests.gem_train.<file>``: the repository root must be
importable in the children, which inherit ``sys.path``) and each run ``gem_train.train.train``
as torchrun would, through the environment.
"""

import json
import os
import sys
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parents[2]))
from tests.gem_train.conftest import small_config  # noqa: E402
from tests.parallel.parallel_launch import free_port  # noqa: E402


def _worker(rank, world, phases, result_dir):
    import torch
    from gem_train.train import train

    torch.set_num_threads(1)
    for i, (port, overrides) in enumerate(phases):
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
            RANK=str(rank), LOCAL_RANK=str(rank),
        )  # fmt: skip
        summary = train(small_config(**overrides))  # tears its process group down at the end
        if rank == 0:
            Path(result_dir, f"{i}.json").write_text(json.dumps(summary["losses"]))
    sys.stdout.flush()
    os._exit(0)  # gloo's threads, joined while Python finalizes, can abort the process


def test_two_ranks_save_mid_run_continue_and_resume_exactly(tmp_path):
    """Saving at step 2 must leave the optimizer's live state as it was (the save once wrote
    row-sharded DTensors into it, and the next AdamW step died on mixed Tensor and DTensor)."""
    folder = str(tmp_path / "ckpt")
    every = {"checkpoint__folder": folder, "checkpoint__every": 2}
    phases = [
        (free_port(), {"steps": 6}),  # straight, no checkpoints
        (free_port(), {"steps": 4, **every}),  # saves at 2 and 4, trains on after the first
        (free_port(), {"steps": 6, **every}),  # resumes at 4
    ]
    mp.start_processes(_worker, args=(2, phases, str(tmp_path)), nprocs=2, start_method="spawn")
    straight, first, resumed = (json.loads((tmp_path / f"{i}.json").read_text()) for i in range(3))
    assert len(first) == 4 and len(resumed) == 2
    assert first + resumed == straight  # bit for bit
    names = sorted(p.name for p in Path(folder).iterdir())
    assert names == ["step_00000002", "step_00000004", "step_00000006"]  # 4 saved once, keep 3

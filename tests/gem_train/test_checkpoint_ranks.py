"""Checkpoints that scale, under two gloo processes: each rank hashes only the shards it wrote
(saving and loading), a corrupted shard of rank 1 is refused on both ranks naming the file, and
asynchronous saves resume bit for bit.

The workers are spawned as in ``test_checkpoint_distributed``; each records every file its
digest function (``gem_train.checkpoint_checks.sha256_of``) opened, per phase.
"""

import json
import os
import sys
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parents[2]))
from tests.gem_train.conftest import small_config  # noqa: E402
from tests.parallel.parallel_launch import free_port  # noqa: E402


def _corrupt_own_shard(folder: Path, rank: int) -> str:
    """Flip a byte in the middle of a data file the manifest gives to ``rank``; its name."""
    manifest = json.loads((folder / "manifest.json").read_text())
    name = next(
        n for n, e in manifest["files"].items() if e["rank"] == rank and n.endswith(".distcp")
    )
    blob = bytearray((folder / name).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (folder / name).write_bytes(bytes(blob))
    return name


def _worker(rank, world, phases, result_dir):
    import torch
    from gem_train import checkpoint_checks
    from gem_train.checkpoint import CheckpointError
    from gem_train.train import train

    torch.set_num_threads(1)
    real, opened = checkpoint_checks.sha256_of, []

    def recording(path):
        opened.append(f"{Path(path).parent.name}/{Path(path).name}")
        return real(path)

    checkpoint_checks.sha256_of = recording
    out = {}
    for i, (port, overrides, corrupt) in enumerate(phases):
        if corrupt and rank == 1:  # before the rendezvous: rank 0 cannot load earlier
            out["corrupted"] = _corrupt_own_shard(Path(corrupt), rank)
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
            RANK=str(rank), LOCAL_RANK=str(rank),
        )  # fmt: skip
        opened.clear()
        try:
            out[i] = {"losses": train(small_config(**overrides))["losses"]}
        except CheckpointError as exc:
            out[i] = {"error": str(exc)}
        out[i]["opened"] = list(opened)
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # gloo's threads, joined while Python finalizes, can abort the process


def test_each_rank_hashes_its_own_shards_and_async_saves_resume_exactly(tmp_path):
    folder = tmp_path / "ckpt"
    every = {"checkpoint__folder": str(folder), "checkpoint__every": 2}
    async_every = {**every, "checkpoint__async_save": "true"}
    phases = [
        (free_port(), {"steps": 4}, None),  # straight, no checkpoints
        (free_port(), {"steps": 2, **async_every}, None),  # saves step 2 in the background
        (free_port(), {"steps": 4, **async_every}, None),  # resumes at 2, saves 4
        (free_port(), {"steps": 6, **every}, str(folder / "step_00000004")),  # rank 1's shard
    ]
    mp.start_processes(_worker, args=(2, phases, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    straight, first, resumed, refused = (ranks[0][str(i)] for i in range(4))
    assert first["losses"] + resumed["losses"] == straight["losses"]  # bit for bit

    # Saving step 2: each rank hashed exactly the files the manifest gives it, DCP's shards
    # named for their writer (``__<rank>_<i>.distcp``), rank 0 also the metadata.
    manifest = json.loads((folder / "step_00000002" / "manifest.json").read_text())
    for rank in (0, 1):
        own = {n for n, e in manifest["files"].items() if e["rank"] == rank}
        assert own and all(n.startswith(f"__{rank}_") for n in own - {".metadata"})
        assert sorted(ranks[rank]["1"]["opened"]) == sorted(
            f"step_00000002.partial/{n}" for n in own
        )
    assert {n for n, e in manifest["files"].items() if e["rank"] == 0} >= {".metadata"}

    # Resuming from step 2 and saving step 4: still only its own files, on each rank.
    for rank in (0, 1):
        names = {p.split("/")[1] for p in ranks[rank]["2"]["opened"]}
        other = f"__{1 - rank}_"
        assert names and not any(n.startswith(other) for n in names), names
        assert {p.split("/")[0] for p in ranks[rank]["2"]["opened"]} == {
            "step_00000002",  # verified before loading
            "step_00000004.partial",  # hashed after saving
        }

    # Rank 1's corrupted shard: found by rank 1 alone, refused by both, naming the file.
    corrupted = ranks[1]["corrupted"]
    assert not any(p.endswith(corrupted) for p in ranks[0]["3"]["opened"])
    for rank in (0, 1):
        message = ranks[rank]["3"]["error"]
        assert f"step_00000004 is corrupted: file {corrupted} does not match its SHA-256" in message
        assert "(rank 1's file)" in message
    assert refused.get("losses") is None

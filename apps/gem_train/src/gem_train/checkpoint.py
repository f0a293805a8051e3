"""Checkpoints: everything a run needs to continue exactly, verified before it is trusted.

A checkpoint is a folder ``step_<8 digits>`` written by ``torch.distributed.checkpoint`` (each rank
writes its shards in parallel; FSDP-sharded parameters and optimizer state are saved as shards and
resharded on load) holding

- ``model`` and ``optim``: from ``torch.distributed.checkpoint.state_dict.get_state_dict``
  (gem_parallel's row-sharded embedding tables are viewed as row-sharded DTensors so that every
  rank's rows are saved);
- ``train.rank<r>``: per rank, the step, the data stream's position (including the shuffler's
  state) and the RNG states (torch CPU, CUDA), serialized with ``torch.save`` and loaded with
  ``weights_only=True``.

Saving goes to ``step_<n>.partial``; when every rank has finished, rank 0 hashes every file into
``manifest.json`` (size and SHA-256) and renames the folder. So a folder named ``step_<n>`` without a
manifest, with a file missing or with a file whose size or hash differs, is partial or corrupted:
``load`` refuses it with a message naming the folder and the file, and never falls back silently
to something else. ``*.partial`` folders (a save interrupted by a crash) are never considered.
After each save the newest ``checkpoint.keep`` checkpoints are kept and older ones deleted.
"""

import io
import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from gem_train.checkpoint_checks import (
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    MetadataReader,
    load_metadata,
    sha256_of,
    verify,
)

__all__ = ["MANIFEST", "CheckpointError", "Checkpointer", "list_checkpoints", "verify"]


def _row_sharded(model) -> dict[str, DeviceMesh]:
    """Parameters that are this rank's block of rows of a table (gem_parallel's native sharded
    embeddings: plain tensors, different on every rank), with the mesh of their group."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "shards") and hasattr(module, "mp_group"):
            if getattr(module, "R", 1) != 1:
                raise CheckpointError(
                    f"{name}: checkpoints of replicated embedding shards are not supported"
                )
            device = next(iter(module.shards.values())).device.type
            mesh = DeviceMesh.from_group(module.mp_group, device_type=device)
            out.update({f"{name}.shards.{table}": mesh for table in module.shards})
    return out


def _as_global(model_sd: dict, optim_sd: dict, sharded: dict) -> None:
    """View each rank's row block as a row-sharded DTensor, so DCP saves every rank's rows (a
    plain tensor would be taken for a replica and saved once).

    The per-parameter optimizer state dicts that ``get_state_dict`` returns can be the
    optimizer's own live dicts, so each is replaced by a new dict rather than edited: writing
    DTensors into the live state would make the next optimizer step mix Tensor and DTensor."""
    for fqn, mesh in sharded.items():
        model_sd[fqn] = DTensor.from_local(model_sd[fqn], mesh, [Shard(0)], run_check=False)
        if fqn in optim_sd["state"]:
            optim_sd["state"][fqn] = {
                key: DTensor.from_local(value, mesh, [Shard(0)], run_check=False)
                if isinstance(value, torch.Tensor) and value.dim() > 0
                else value
                for key, value in optim_sd["state"][fqn].items()
            }


def _as_local(model_sd: dict, optim_sd: dict, sharded: dict) -> None:
    for fqn in sharded:
        model_sd[fqn] = model_sd[fqn].to_local()
        if fqn in optim_sd["state"]:
            optim_sd["state"][fqn] = {
                key: value.to_local() if isinstance(value, DTensor) else value
                for key, value in optim_sd["state"][fqn].items()
            }


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoint folders (``step_<n>``, not ``.partial``), oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


class Checkpointer:
    def __init__(self, folder: str, *, keep: int):
        self.folder, self.keep = Path(folder), keep

    def save(self, step: int, model, optimizer, train_state: dict) -> Path:
        final = self.folder / f"step_{step:08d}"
        partial = final.with_name(final.name + ".partial")
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        _as_global(model_sd, optim_sd, _row_sharded(model))
        buffer = io.BytesIO()
        torch.save({**train_state, "rng": rng_state()}, buffer)
        state = {"model": model_sd, "optim": optim_sd, f"train.rank{_rank()}": buffer}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(state, checkpoint_id=str(partial))
        _barrier()
        if _rank() == 0:
            files = {
                p.name: {"size": p.stat().st_size, "sha256": sha256_of(p)}
                for p in sorted(partial.iterdir())
                if p.is_file()
            }
            world = dist.get_world_size() if dist.is_initialized() else 1
            manifest = {"step": step, "world_size": world, "files": files}
            (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            for old in list_checkpoints(self.folder)[: -self.keep]:
                shutil.rmtree(old)
        _barrier()
        return final

    def latest(self) -> Path | None:
        found = list_checkpoints(self.folder)
        return found[-1] if found else None

    def load(self, path: str | Path, model, optimizer) -> dict:
        """Verify, then restore model, optimizer and RNG; returns this rank's train state."""
        path = Path(path)
        manifest = verify(path)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if manifest.get("world_size") != world:
            raise CheckpointError(
                f"checkpoint {path} was saved by {manifest.get('world_size')} processes; this run "
                f"has {world} (the data position is per rank)"
            )
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sharded = _row_sharded(model)
        _as_global(model_sd, optim_sd, sharded)
        load_metadata(path / ".metadata")  # refuses a tampered pickle before DCP reads it
        buffer = io.BytesIO()
        state = {"model": model_sd, "optim": optim_sd, f"train.rank{_rank()}": buffer}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(state, storage_reader=MetadataReader(str(path)))
        _as_local(state["model"], state["optim"], sharded)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        buffer = state[f"train.rank{_rank()}"]
        buffer.seek(0)
        train_state = torch.load(buffer, weights_only=True)
        set_rng_state(train_state.pop("rng"))
        return train_state

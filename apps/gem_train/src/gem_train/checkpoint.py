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

Saving goes to ``step_<n>.partial``. When DCP has written it, each rank hashes the files it wrote
itself (its writer records them), the ranks' entries are gathered, and rank 0 writes them into
``manifest.json`` (size, SHA-256 and rank of every file, and the run's ``record``: every field of
its resolved config and its data files, ``gem_train.run_record``) and renames the folder. No rank
reads another's shards, so a save hashes its bytes once, spread over the ranks; a file in the
folder that no rank wrote fails the save rather than go unvouched for. So a folder named
``step_<n>`` without a manifest, with a file missing or with a file whose size or hash differs, is
partial or corrupted: ``load`` (each rank checking its own files, then all agreeing) refuses it on
every rank with a message naming the folder and the file, and never falls back silently to
something else. ``*.partial`` folders (a save interrupted by a crash) are never considered. After
each save the newest ``checkpoint.keep`` checkpoints are kept and older ones deleted.

With ``async_save`` (``checkpoint.async_save``) a save copies the state to host memory and returns;
DCP's ``async_save`` writes it in a background thread, and the hashing and the manifest follow in
another, so the manifest is written only once the files are complete. Their collectives go over a
gloo group of their own, apart from the training's. ``wait`` blocks until the save in flight is a
checkpoint (or raises its failure); the next save and a load wait first, and the trainer waits at
the end of a run. The copy holds a second image of the model and optimizer state in host memory.

``load`` also refuses a checkpoint that does not fit the run: saved by another number of
processes, recording another config or other data (naming the first field that differs), or
holding other model parameters than the model's (DCP alone would load the common ones and drop
the rest). ``check_folder`` finds, before any training, a folder that cannot take a checkpoint
(a file, not writable, too little free space), and a save that runs out of space says so.
"""

import errno
import io
import json
import os
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from gem_train.checkpoint_checks import (
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    MetadataReader,
    digest_files,
    load_metadata,
    read_manifest,
    verify,
)
from gem_train.run_record import first_difference

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


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# What DCP says when it saves without a process group: one process is the intent here. An
# asynchronous save says it from DCP's own thread, beyond a ``catch_warnings`` around the call.
_SINGLE_PROCESS = ".*assuming the intent is to save in a single process"


class _RecordingFileSystem(FileSystem):
    """DCP's file system, remembering the files this process creates under ``root`` (its shards;
    on the coordinator also ``.metadata``, written under a temporary name and renamed)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root, self.created = root, set()

    @contextmanager
    def create_stream(self, path, mode: str):
        if any(c in mode for c in "wax"):
            self.created.add(Path(path).relative_to(self.root).as_posix())
        with super().create_stream(path, mode) as stream:
            yield stream

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        self.created.discard(Path(path).relative_to(self.root).as_posix())
        self.created.add(Path(new_path).relative_to(self.root).as_posix())


class _Writer(FileSystemWriter):
    """DCP's file-system writer of one checkpoint folder; ``written`` lists the files this
    rank wrote into it, the ones it hashes for the manifest."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.fs = _RecordingFileSystem(path)

    @property
    def written(self) -> set[str]:
        return self.fs.created


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


def _free_bytes(folder: Path) -> int:
    """Free bytes on the file system that holds ``folder`` (or would: its nearest existing
    ancestor)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


class Checkpointer:
    """Saves and loads the checkpoints of one run in ``folder``.

    Args:
        folder: where the ``step_<n>`` folders live (created if missing).
        keep: how many of the newest checkpoints to keep.
        record: what the run is (``gem_train.run_record.resume_record``), written into each
            manifest and compared on ``load``; None records and checks nothing.
        async_save: save with DCP's ``async_save`` and finish the save in the background (see
            the module docstring); ``wait`` for it.
    """

    def __init__(
        self, folder: str, *, keep: int, record: dict | None = None, async_save: bool = False
    ):
        self.folder, self.keep, self.record, self.async_save = (
            Path(folder),
            keep,
            record,
            async_save,
        )
        self._pending: Future | None = None
        self._background: ThreadPoolExecutor | None = None
        self._group = None  # the default group
        if async_save and _world() > 1:
            # DCP's background collectives on a gloo group of their own: they never interleave
            # with the training's on the default group, and NCCL runs get the CPU group that
            # async_save needs
            self._group = dist.new_group(backend="gloo")
        if async_save:
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)

    def check_folder(self, *, needed_bytes: int) -> None:
        """Before training: the folder exists or can be made, takes a file, and has room for a
        checkpoint of about ``needed_bytes``.

        Raises:
            CheckpointError: naming the folder and the cause (a file, not writable, no space).
        """
        where = f"checkpoint.folder {str(self.folder)!r}"
        if self.folder.exists() and not self.folder.is_dir():
            raise CheckpointError(f"{where} is a file, not a folder")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".write_probe.rank{_rank()}"
            os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
            probe.unlink()
        except OSError as exc:
            raise CheckpointError(
                f"{where} is not writable: {exc.strerror or exc} (checked before training, "
                "not at the first save)"
            ) from None
        self._check_space(needed_bytes, when="before training")

    def _check_space(self, needed_bytes: int, *, when: str) -> None:
        free = _free_bytes(self.folder)
        if free < needed_bytes:
            raise CheckpointError(
                f"no space for a checkpoint in checkpoint.folder {str(self.folder)!r} ({when}): "
                f"{_size(free)} free, a checkpoint of this run takes about {_size(needed_bytes)}"
            )

    def save(self, step: int, model, optimizer, train_state: dict) -> Path:
        """Save ``model``, ``optimizer``, ``train_state`` (this rank's) and the RNG states as
        checkpoint ``step``; returns its folder, complete on return unless ``async_save`` (then
        once ``wait`` returns). A save in flight is waited for first.

        Raises:
            CheckpointError: no space for the checkpoint, or a save that could not be verified
                (on every rank alike); with ``async_save``, a failure of the previous save.
        """
        self.wait()
        final = self.folder / f"step_{step:08d}"
        partial = final.with_name(final.name + ".partial")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        self._check_space(state_bytes(model_sd, optim_sd), when=f"saving step {step}")
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        _barrier()
        _as_global(model_sd, optim_sd, _row_sharded(model))
        buffer = io.BytesIO()
        torch.save({**train_state, "rng": rng_state()}, buffer)
        state = {"model": model_sd, "optim": optim_sd, f"train.rank{_rank()}": buffer}
        writer = _Writer(partial)
        if not self.async_save:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
                self._written(lambda: dcp.save(state, storage_writer=writer), step, partial)
            self._finish(step, partial, writer.written)
            return final
        # staged (copied to host memory) before it returns: training may change the state next
        upload = dcp.async_save(state, storage_writer=writer, process_group=self._group)
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="gem-train-checkpoint")
        self._pending = self._background.submit(self._complete, upload, step, partial, writer)
        return final

    def wait(self) -> None:
        """Return once the save in flight (``async_save``), if any, is a checkpoint.

        Raises:
            CheckpointError: or DCP's error: that save failed (every rank alike).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _complete(self, upload: Future, step: int, partial: Path, writer: "_Writer") -> None:
        self._written(upload.result, step, partial)
        self._finish(step, partial, writer.written)

    def _written(self, write, step: int, partial: Path) -> None:
        """Run ``write`` (DCP's save, or the wait for it); a full disk says so."""
        try:
            write()
        except (OSError, RuntimeError) as exc:
            # a full disk surfaces from DCP's writer as "unexpected pos" or a bare OSError
            out_of_space = getattr(exc, "errno", None) == errno.ENOSPC or (
                _free_bytes(self.folder) < (1 << 20)
            )
            if out_of_space:
                raise CheckpointError(
                    f"no space left in checkpoint.folder {str(self.folder)!r} while saving step "
                    f"{step} ({_size(_free_bytes(self.folder))} free); the partial "
                    f"save {partial.name} is not a checkpoint"
                ) from exc
            raise

    def _finish(self, step: int, partial: Path, written: set[str]) -> None:
        """Each rank hashes the files it wrote; rank 0 writes the manifest of all of them and
        renames the folder; every rank learns the outcome and raises alike on a failure."""
        rank = _rank()
        try:
            mine: dict = {"files": digest_files(partial, written, rank=rank)}
        except OSError as exc:
            mine = {"error": f"rank {rank} could not read back a file it wrote: {exc}"}
        parts = self._collect(mine)
        failure = None
        if rank == 0:
            try:
                failure = self._commit(step, partial, parts)
            except OSError as exc:
                failure = f"rank 0 could not write the manifest or rename the folder: {exc}"
        failure = self._from_rank0(failure)
        if failure is not None:
            raise CheckpointError(
                f"saving step {step}: {failure}; the partial save {partial.name} is not a checkpoint"
            )

    def _commit(self, step: int, partial: Path, parts: list[dict]) -> str | None:
        """Rank 0: the manifest from every rank's entries, then the rename and the pruning;
        returns what went wrong instead, or None."""
        files: dict[str, dict] = {}
        for part in parts:
            if "error" in part:
                return part["error"]
            for name, entry in part["files"].items():
                if name in files:
                    return f"ranks {files[name]['rank']} and {entry['rank']} both wrote {name}"
                files[name] = entry
        unclaimed = sorted({p.name for p in partial.iterdir() if p.is_file()} - files.keys())
        if unclaimed:
            return f"no rank wrote {unclaimed[0]}, so none can vouch for it"
        manifest = {"step": step, "world_size": len(parts), "files": dict(sorted(files.items()))}
        if self.record is not None:
            manifest["record"] = self.record
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
        final = partial.with_name(partial.name.removesuffix(".partial"))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in list_checkpoints(self.folder)[: -self.keep]:
            shutil.rmtree(old)
        return None

    def _collect(self, mine: dict) -> list[dict]:
        """Every rank's ``mine``, in rank order (over the save's group)."""
        if _world() == 1:
            return [mine]
        parts: list = [None] * _world()
        dist.all_gather_object(parts, mine, group=self._group)
        return parts

    def _from_rank0(self, value):
        """Rank 0's ``value`` on every rank (over the save's group)."""
        if _world() == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def latest(self) -> Path | None:
        found = list_checkpoints(self.folder)
        return found[-1] if found else None

    def load(self, path: str | Path, model, optimizer) -> dict:
        """Verify, then restore model, optimizer and RNG; returns this rank's train state."""
        self.wait()
        path = Path(path)
        manifest, _ = read_manifest(path)
        world = _world()
        if manifest.get("world_size") != world:
            raise CheckpointError(
                f"checkpoint {path} was saved by {manifest.get('world_size')} processes; this run "
                f"has {world} (the data position is per rank)"
            )
        self._check_record(path, manifest)
        _verify_together(path)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sharded = _row_sharded(model)
        _as_global(model_sd, optim_sd, sharded)
        metadata = load_metadata(path / ".metadata")  # refuses a tampered pickle before DCP
        _check_parameters(path, metadata, model_sd)
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

    def _check_record(self, path: Path, manifest: dict) -> None:
        if self.record is None:
            return
        saved = manifest.get("record")
        if not isinstance(saved, dict):
            raise CheckpointError(
                f"checkpoint {path} records no config and data of its run, so it cannot be "
                "checked to fit this one; resume only from checkpoints that record them"
            )
        difference = first_difference(saved, self.record)
        if difference is not None:
            raise CheckpointError(
                f"checkpoint {path} does not fit this run: {difference}. Resume with the "
                "checkpoint's settings, or start in another checkpoint.folder"
            )


def _verify_together(path: Path) -> None:
    """Each rank checks the files it wrote (``verify(path, rank=r)``), then every rank raises the
    lowest rank's finding, so that all refuse the checkpoint together."""
    try:
        verify(path, rank=_rank())
        finding = None
    except CheckpointError as exc:
        finding = str(exc)
    findings = [finding]
    if _world() > 1:
        findings = [None] * _world()
        dist.all_gather_object(findings, finding)
    first = next((f for f in findings if f is not None), None)
    if first is not None:
        raise CheckpointError(first)


def state_bytes(*state_dicts: dict) -> int:
    """Bytes of the tensors in (nested) state dicts: about what a checkpoint of them takes."""

    def walk(value) -> int:
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        if isinstance(value, list | tuple):
            return sum(walk(v) for v in value)
        return 0

    return sum(walk(sd) for sd in state_dicts)


def _check_parameters(path: Path, metadata, model_sd: dict) -> None:
    """The checkpoint's model entries are exactly the model's: DCP loads the common ones and
    leaves the rest, so a checkpoint of a deeper model would load into a shallower one."""
    saved = {k[len("model.") :] for k in metadata.state_dict_metadata if k.startswith("model.")}
    expected = set(model_sd)
    if saved != expected:
        extra, missing = sorted(saved - expected), sorted(expected - saved)
        what = []
        if extra:
            what.append(f"{len(extra)} the model does not have (first: {extra[0]})")
        if missing:
            what.append(f"{len(missing)} the checkpoint lacks (first: {missing[0]})")
        raise CheckpointError(
            f"checkpoint {path} holds other model parameters than this model: {'; '.join(what)}"
        )

"""What makes a checkpoint trustworthy: an intact manifest, metadata that is data and not code.

``verify`` checks a checkpoint folder against its ``manifest.json``: every file's size and SHA-256,
and the rank that wrote it and vouches for it. Saving, each rank hashes only the files it wrote
(``digest_files``) and rank 0 combines the ranks' entries into the manifest; loading, each rank
re-hashes only its own (``verify(path, rank=r)``) and the ranks then agree on the verdict, so no
rank reads another's shards to check them, and the whole checkpoint is read once, in parallel.
A manifest without ranks (an older save, hashed by rank 0) is rank 0's to check. ``verify`` with
no rank checks every file (a checkpoint checked by hand). A manifest only proves that the files are
the ones that were saved; it does not make them safe to unpickle, because whoever can write the
folder can re-hash the manifest. DCP keeps its metadata (``.metadata``: which tensor lives in which
file at which offset) as a pickle, and unpickling runs whatever callable the pickle names.
``MetadataReader`` therefore reads that file with an unpickler that admits only the types DCP's
metadata is made of (its metadata dataclasses, ``torch.Size``, dtypes, layouts, paths) and
refuses anything else, naming the file and the callable it asked for, before any of it runs. The
tensor data itself is read by DCP with ``torch.load(weights_only=True)``, which is already
restricted.
"""

import hashlib
import io
import json
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")

# Every global a DCP metadata pickle refers to: its own dataclasses and enum, the tensor
# properties' dtypes, layouts and sizes, and the checkpoint id (a path).
_METADATA_TYPES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class CheckpointError(RuntimeError):
    """A checkpoint is partial, corrupted, unsafe or does not fit this run."""


def sha256_of(path: Path) -> str:
    """The hex SHA-256 of the file at ``path``, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def digest_files(folder: Path, names, *, rank: int) -> dict[str, dict]:
    """The manifest entries of the files ``names`` (relative to ``folder``) that ``rank`` wrote:
    ``{name: {"size", "sha256", "rank"}}``, read by this process only."""
    return {
        name: {
            "size": (folder / name).stat().st_size,
            "sha256": sha256_of(folder / name),
            "rank": rank,
        }
        for name in sorted(names)
    }


def verify(path: str | Path, *, rank: int | None = None) -> dict:
    """Check a checkpoint folder against its manifest: every file, or ``rank``'s only.

    Args:
        path: a ``step_<n>`` checkpoint folder.
        rank: check only the files this rank wrote (a resume under ``torchrun``, where every
            rank checks its own); None: every file.

    Returns:
        The manifest (``{"step", "world_size", "files", ...}``).

    Raises:
        CheckpointError: the folder has no manifest (its save never finished), the manifest is
            unreadable or lists no files, its step is not the one in the folder's name
            (``step_<n>``), a file's rank is not one of the saving run's, or a checked file is
            missing or differs in size or SHA-256 (naming the file and its rank).
    """
    path = Path(path)
    manifest, entries = read_manifest(path)
    for name, (expected_size, expected_sha, owner) in entries.items():
        if rank is not None and owner != rank:
            continue
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is partial: file {name} is missing")
        size = file.stat().st_size
        if size != expected_size:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: file {name} has {size} bytes, "
                f"the manifest says {expected_size} (rank {owner}'s file)"
            )
        if sha256_of(file) != expected_sha:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: file {name} does not match its SHA-256 in "
                f"{MANIFEST} (rank {owner}'s file)"
            )
    return manifest


def read_manifest(path: Path) -> tuple[dict, dict[str, tuple[int, str, int]]]:
    """The manifest of the checkpoint folder ``path`` and its entries, ``{name: (size, sha256,
    rank)}``, checked for form (``verify``'s errors but those of the files themselves)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint {path} is partial: it has no {MANIFEST}, so its save never finished; "
            "refusing to load it (delete the folder or resume from another checkpoint)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        entries = {
            name: (entry["size"], entry["sha256"], entry.get("rank", 0))
            for name, entry in manifest["files"].items()
        }
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is corrupted: unreadable {MANIFEST} ({exc!r})"
        ) from None
    if not entries:
        raise CheckpointError(
            f"checkpoint {path} is corrupted: its {MANIFEST} lists no files, so it vouches for "
            "nothing; refusing to load it"
        )
    named = STEP_DIR.match(path.name)
    if named and manifest.get("step") != int(named.group(1)):
        raise CheckpointError(
            f"checkpoint {path} is corrupted: the folder is named for step {int(named.group(1))} "
            f"but its {MANIFEST} says step {manifest.get('step')}"
        )
    world = manifest.get("world_size")
    for name, (_, _, owner) in entries.items():
        if not (type(owner) is int and type(world) is int and 0 <= owner < world):
            raise CheckpointError(
                f"checkpoint {path} is corrupted: {MANIFEST} gives file {name} to rank {owner!r} "
                f"of a run of {world!r} processes"
            )
    return manifest, entries


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the globals of ``_METADATA_TYPES`` (and torch dtypes)."""

    def __init__(self, file, *, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if name in _METADATA_TYPES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"checkpoint file {self.source} is not DCP metadata: it asks for {module}.{name}, "
            "which DCP metadata never holds; refusing to unpickle it (the file may have been "
            "tampered with: do not load this checkpoint)"
        )


def load_metadata(path: Path) -> Metadata:
    """Unpickle the DCP metadata file at ``path`` admitting only DCP's metadata types.

    Raises:
        CheckpointError: the pickle names any other callable (nothing of it has run), or it
            holds something other than a ``Metadata``, or it is not a readable pickle.
        FileNotFoundError: there is no file at ``path``.
    """
    data = Path(path).read_bytes()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), source=Path(path)).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or garbled pickle raises many kinds
        raise CheckpointError(
            f"checkpoint file {path} is not DCP metadata: unreadable pickle ({exc!r})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint file {path} is not DCP metadata: it holds a {type(metadata).__name__}"
        )
    return metadata


class MetadataReader(FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` through ``load_metadata``.

    Args:
        path: the checkpoint folder.
    """

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = load_metadata(path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

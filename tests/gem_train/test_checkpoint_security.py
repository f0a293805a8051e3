"""Checkpoints are data, never code: a pickle planted in DCP's ``.metadata`` does not run on
resume, and no code in the repository unpickles, ``torch.load``-s with full pickling, evaluates
data or runs a shell."""

import hashlib
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from gem_train.checkpoint import MANIFEST, Checkpointer, CheckpointError

ROOT = Path(__file__).parents[2]


class _Payload:
    """Unpickling this runs a shell command that writes ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(path: Path, payload) -> None:
    """Replace ``.metadata`` and re-hash the manifest, as an attacker with write access would."""
    metadata = path / ".metadata"
    metadata.write_bytes(pickle.dumps(payload))
    doc = json.loads((path / MANIFEST).read_text())
    digest = hashlib.sha256(metadata.read_bytes()).hexdigest()
    doc["files"][".metadata"] = {"size": metadata.stat().st_size, "sha256": digest}
    (path / MANIFEST).write_text(json.dumps(doc))


def _tiny():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_a_payload_planted_in_the_metadata_does_not_run(tmp_path):
    model, optimizer = _tiny()
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    path = ckpt.save(1, model, optimizer, {"step": 1})
    marker = tmp_path / "pwned"
    _plant(path, _Payload(marker))
    with pytest.raises(
        CheckpointError, match=r"\.metadata is not DCP metadata: it asks for posix\.system"
    ):
        ckpt.load(path, model, optimizer)
    assert not marker.exists()


def test_metadata_of_unexpected_types_is_refused_naming_the_file(tmp_path):
    model, optimizer = _tiny()
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    path = ckpt.save(1, model, optimizer, {"step": 1})
    _plant(path, {"not": "metadata"})
    with pytest.raises(CheckpointError, match=r"\.metadata is not DCP metadata"):
        ckpt.load(path, model, optimizer)


UNSAFE = {
    r"\bpickle\.loads?\(": "pickle.load",
    r"\bUnpickler\(": "an unrestricted Unpickler",
    r"torch\.load\((?![^)]*weights_only=True)": "torch.load without weights_only=True",
    r"(?<![.\w])(eval|exec)\(": "eval/exec",
    r"shell=True": "a shell",
    r"\bos\.(system|popen)\(": "a shell",
    r"yaml\.load\(|marshal\.loads?\(|read_pickle\(|allow_pickle=True": "a code-running loader",
}


def test_no_code_runs_data():
    """Grep every Python file under packages/, apps/, benchmarks/ and scripts/. The one
    ``Unpickler`` allowed is the restricted one the checkpoint reader defines."""
    found = []
    for top in ("packages", "apps", "benchmarks", "scripts"):
        for file in sorted((ROOT / top).rglob("*.py")):
            for number, line in enumerate(file.read_text().splitlines(), 1):
                code = line.split("#")[0]
                for pattern, what in UNSAFE.items():
                    if re.search(pattern, code) and "pickle.Unpickler):" not in code:
                        found.append(f"{file.relative_to(ROOT)}:{number}: {what}")
    assert not found, "\n".join(found)

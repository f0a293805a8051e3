"""Resume refuses checkpoints that do not fit: a manifest that lists no files, a folder whose
step is not the manifest's."""

import json

import pytest
import torch
from gem_train.checkpoint import MANIFEST, Checkpointer, CheckpointError, verify


def _saved(tmp_path, step=3):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return Checkpointer(str(tmp_path), keep=2).save(step, model, optimizer, {"step": step})


def _edit_manifest(path, **changes):
    doc = json.loads((path / MANIFEST).read_text())
    doc.update(changes)
    (path / MANIFEST).write_text(json.dumps(doc))


def test_a_manifest_listing_no_files_is_refused(tmp_path):
    path = _saved(tmp_path)
    _edit_manifest(path, files={})
    with pytest.raises(CheckpointError, match="manifest.json lists no files"):
        verify(path)


def test_the_folder_step_and_the_manifest_step_must_agree(tmp_path):
    path = _saved(tmp_path)
    _edit_manifest(path, step=5)
    with pytest.raises(CheckpointError, match="named for step 3 but its manifest.json says step 5"):
        verify(path)

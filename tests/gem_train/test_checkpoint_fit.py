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


# --- the run a checkpoint records, and the folder it goes to --------------------------------

pq = pytest.importorskip("pyarrow.parquet")


def _train(small, folder, **overrides):
    from gem_train.train import train

    return train(small(**{"steps": 2, "checkpoint__folder": str(folder), **overrides}))


def test_a_checkpoint_of_a_deeper_model_is_refused_naming_the_field(small, tmp_path):
    _train(small, tmp_path, model__n_layers=3)
    with pytest.raises(CheckpointError, match="model.n_layers: the checkpoint has 3, this run 2"):
        _train(small, tmp_path, model__n_layers=2, steps=4)


def test_the_parameter_check_holds_without_a_record(tmp_path):
    """Without a config record (a user's own Checkpointer) the parameters must still match:
    DCP alone loads the common ones and drops the rest."""
    deep = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    path = Checkpointer(str(tmp_path), keep=1).save(
        1, deep, torch.optim.AdamW(deep.parameters()), {"step": 1}
    )
    shallow = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with pytest.raises(CheckpointError, match=r"1\.bias"):
        Checkpointer(str(tmp_path), keep=1).load(
            path, shallow, torch.optim.AdamW(shallow.parameters())
        )


def test_a_synthetic_checkpoint_does_not_resume_on_parquet_data(small, tmp_path):
    from gem_train.data.parquet import write_example

    _train(small, tmp_path / "ckpt")
    data = tmp_path / "rows.parquet"
    cfg = small()
    write_example(str(data), cfg.data, cfg.model, rows=64)
    with pytest.raises(
        CheckpointError, match="data.source: the checkpoint has 'synthetic', this run 'parquet'"
    ):
        _train(small, tmp_path / "ckpt", steps=4, data__source="parquet", data__path=str(data))


def test_parquet_files_that_changed_are_named(small, tmp_path):
    from gem_train.data.parquet import write_example

    folder = tmp_path / "data"
    folder.mkdir()
    cfg = small()
    write_example(str(folder / "a.parquet"), cfg.data, cfg.model, rows=64)
    parquet = {"data__source": "parquet", "data__path": str(folder)}
    _train(small, tmp_path / "ckpt", **parquet)
    write_example(str(folder / "a.parquet"), cfg.data, cfg.model, rows=96)
    with pytest.raises(
        CheckpointError, match="data file a.parquet: the checkpoint read 64 rows, this run finds 96"
    ):
        _train(small, tmp_path / "ckpt", steps=4, **parquet)


def test_what_may_change_on_resume_does(small, tmp_path):
    """More steps, another log interval or device setting: the saved state does not depend on
    them, and the run resumes."""
    _train(small, tmp_path)
    summary = _train(small, tmp_path, steps=3, metrics__log_every=1, cpu_threads=2)
    assert len(summary["losses"]) == 1


def test_a_checkpoint_recording_no_run_is_refused(small, tmp_path):
    _train(small, tmp_path)
    (path,) = sorted(tmp_path.glob("step_*"))
    doc = json.loads((path / MANIFEST).read_text())
    del doc["record"]
    (path / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="records no config and data of its run"):
        _train(small, tmp_path, steps=4)


def test_a_checkpoint_folder_that_is_a_file_is_found_before_training(small, tmp_path):
    target = tmp_path / "ckpt"
    target.write_text("not a folder")
    with pytest.raises(CheckpointError, match="ckpt' is a file, not a folder"):
        _train(small, target)
    with pytest.raises(CheckpointError, match="is not writable"):  # a folder inside a file
        _train(small, target / "inner")


def test_an_unwritable_checkpoint_folder_is_found_before_training(small, tmp_path, monkeypatch):
    import gem_train.checkpoint as checkpoint

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint.os, "open", refuse)  # root ignores chmod: refuse the probe
    with pytest.raises(CheckpointError, match="is not writable: Permission denied"):
        _train(small, tmp_path)


def test_too_little_space_is_found_before_training_and_at_a_save(small, tmp_path, monkeypatch):
    import shutil

    import gem_train.checkpoint as checkpoint

    real = shutil.disk_usage
    free = {"bytes": 0}
    monkeypatch.setattr(
        checkpoint.shutil, "disk_usage", lambda p: real(p)._replace(free=free["bytes"])
    )
    with pytest.raises(
        CheckpointError,
        match=r"no space .* \(before training\): 0 B free, a checkpoint .* takes about",
    ):
        _train(small, tmp_path)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match=r"no space .*\(saving step 7\): 0 B free"):
        Checkpointer(str(tmp_path), keep=1).save(7, model, optimizer, {"step": 7})


def test_a_disk_that_fills_during_a_save_says_so(tmp_path, monkeypatch):
    import errno

    import gem_train.checkpoint as checkpoint

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.dcp, "save", full)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match="no space left .* while saving step 2"):
        Checkpointer(str(tmp_path), keep=1).save(
            2, model, torch.optim.AdamW(model.parameters()), {"step": 2}
        )

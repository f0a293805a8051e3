"""Checkpoints: exact resume, refusal of partial or corrupted ones, keeping the newest k."""

import json

import pytest
import torch
from gem_train.checkpoint import MANIFEST, Checkpointer, CheckpointError, list_checkpoints, verify
from gem_train.train import train


def _tiny_state():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_round_trip_restores_model_optimizer_rng_and_state(tmp_path):
    model, optimizer = _tiny_state()
    ckpt = Checkpointer(str(tmp_path), keep=2)
    torch.manual_seed(5)
    path = ckpt.save(
        7, model, optimizer, {"step": 7, "data": {"produced": 7, "shuffler": {"a": [1, 2]}}}
    )
    after_save = torch.rand(3)
    fresh, fresh_opt = torch.nn.Linear(3, 2), None
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = ckpt.load(path, fresh, fresh_opt)
    assert state == {"step": 7, "data": {"produced": 7, "shuffler": {"a": [1, 2]}}}
    assert torch.equal(torch.rand(3), after_save)  # the RNG continues where the save left it
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    exp_avg = [s["exp_avg"] for s in optimizer.state.values()]
    assert all(
        torch.equal(x, s["exp_avg"]) for x, s in zip(exp_avg, fresh_opt.state.values(), strict=True)
    )


def test_keeps_the_newest_k(tmp_path):
    model, optimizer = _tiny_state()
    ckpt = Checkpointer(str(tmp_path), keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, model, optimizer, {"step": step})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert ckpt.latest().name == "step_00000003"


def test_corrupted_or_partial_checkpoints_are_refused(tmp_path):
    model, optimizer = _tiny_state()
    path = Checkpointer(str(tmp_path), keep=3).save(1, model, optimizer, {"step": 1})
    verify(path)
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    with pytest.raises(
        CheckpointError, match=f"corrupted: file {data.name} does not match its SHA-256"
    ):
        Checkpointer(str(tmp_path), keep=3).load(path, model, optimizer)

    data.write_bytes(bytes(blob[:-10]))
    with pytest.raises(CheckpointError, match="corrupted: .* bytes, the manifest says"):
        verify(path)

    data.unlink()
    with pytest.raises(CheckpointError, match=f"partial: file {data.name} is missing"):
        verify(path)

    (path / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="is partial: it has no manifest.json"):
        verify(path)

    (path / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable manifest.json"):
        verify(path)


FUSED_EMBEDDING_OPTIMIZER = dict(
    model__embeddings="native", optim__embedding_optimizer="rowwise_adagrad"
)


@pytest.mark.parametrize("options", [{}, FUSED_EMBEDDING_OPTIMIZER], ids=["adamw", "fused"])
def test_stop_and_resume_reproduces_the_losses_exactly(small, tmp_path, options):
    """The fused row-wise Adagrad's per-row state lives in the model's buffers: saved too."""
    straight = train(small(steps=6, **options))["losses"]
    folder = str(tmp_path / "ckpt")
    first = train(small(steps=3, checkpoint__folder=folder, **options))
    assert [p.name for p in list_checkpoints(folder)] == ["step_00000003"]
    second = train(small(steps=6, checkpoint__folder=folder, **options))
    assert second["steps_this_run"] == 3
    assert first["losses"] + second["losses"] == straight  # bit for bit


def test_training_refuses_a_corrupted_latest_checkpoint(small, tmp_path):
    folder = tmp_path / "ckpt"
    train(small(steps=2, checkpoint__folder=str(folder)))
    manifest = folder / "step_00000002" / MANIFEST
    doc = json.loads(manifest.read_text())
    name = next(iter(doc["files"]))
    doc["files"][name]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="step_00000002 is corrupted"):
        train(small(steps=4, checkpoint__folder=str(folder)))


def test_an_async_save_writes_the_sync_save_and_resumes_exactly(small, tmp_path):
    """The same shards byte for byte (the metadata differs only in the save's ids), complete
    with their manifest when the run returns, and a run resumed from it matches the straight
    run bit for bit."""
    from gem_train.checkpoint_checks import load_metadata

    straight = train(small(steps=6))["losses"]
    sync, background = tmp_path / "sync", tmp_path / "async"
    train(small(steps=3, checkpoint__folder=str(sync)))
    first = train(small(steps=3, checkpoint__folder=str(background), checkpoint__async_save=True))
    (path,) = list_checkpoints(background)  # the run waited for its last save
    files = {folder: verify(folder / path.name)["files"] for folder in (sync, background)}
    assert files[sync].keys() == files[background].keys()
    for name in files[sync].keys() - {".metadata"}:
        assert files[sync][name]["sha256"] == files[background][name]["sha256"], name
    metadata = [load_metadata(folder / path.name / ".metadata") for folder in (sync, background)]
    assert metadata[0].state_dict_metadata == metadata[1].state_dict_metadata
    second = train(small(steps=6, checkpoint__folder=str(background), checkpoint__async_save=True))
    assert first["losses"] + second["losses"] == straight


def test_an_async_save_is_a_checkpoint_only_once_complete_and_its_failure_is_raised(
    tmp_path, monkeypatch
):
    import errno
    from concurrent.futures import Future

    import gem_train.checkpoint as checkpoint

    model, optimizer = _tiny_state()
    ckpt = Checkpointer(str(tmp_path), keep=3, async_save=True)
    release, real = Future(), checkpoint.dcp.async_save

    def held(*args, **kwargs):
        done = real(*args, **kwargs)
        out = Future()
        release.add_done_callback(lambda _: out.set_result(done.result()))
        return out

    monkeypatch.setattr(checkpoint.dcp, "async_save", held)
    path = ckpt.save(1, model, optimizer, {"step": 1})
    assert list_checkpoints(tmp_path) == []  # written, not yet hashed: not a checkpoint
    release.set_result(None)
    ckpt.wait()
    assert list_checkpoints(tmp_path) == [path] and verify(path)["step"] == 1

    def full(*args, **kwargs):
        failed = Future()
        failed.set_exception(OSError(errno.ENOSPC, "No space left on device"))
        return failed

    monkeypatch.setattr(checkpoint.dcp, "async_save", full)
    ckpt.save(2, model, optimizer, {"step": 2})  # returns; the failure comes with the wait
    with pytest.raises(CheckpointError, match="no space left .* while saving step 2"):
        ckpt.wait()
    assert list_checkpoints(tmp_path) == [path]


def test_a_file_no_rank_wrote_fails_the_save(tmp_path, monkeypatch):
    """Each rank vouches for the files its writer wrote; a file nobody wrote is not silently
    left out of the manifest."""
    import gem_train.checkpoint as checkpoint

    real = checkpoint.dcp.save

    def with_a_stray_file(state, *, storage_writer):
        real(state, storage_writer=storage_writer)
        (storage_writer.path / "stray.bin").write_bytes(b"x")

    monkeypatch.setattr(checkpoint.dcp, "save", with_a_stray_file)
    model, optimizer = _tiny_state()
    with pytest.raises(CheckpointError, match="saving step 4: no rank wrote stray.bin"):
        Checkpointer(str(tmp_path), keep=1).save(4, model, optimizer, {"step": 4})
    assert list_checkpoints(tmp_path) == []


def test_a_manifest_without_ranks_is_rank_0s_and_a_foreign_rank_is_refused(tmp_path):
    """Manifests written before ranks hashed their own files name no rank: rank 0 checks them."""
    model, optimizer = _tiny_state()
    ckpt = Checkpointer(str(tmp_path), keep=1)
    path = ckpt.save(1, model, optimizer, {"step": 1})
    doc = json.loads((path / MANIFEST).read_text())
    assert {entry.pop("rank") for entry in doc["files"].values()} == {0}
    (path / MANIFEST).write_text(json.dumps(doc))
    assert ckpt.load(path, model, optimizer) == {"step": 1}
    next(iter(doc["files"].values()))["rank"] = 1
    (path / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="gives file .* to rank 1 of a run of 1 processes"):
        ckpt.load(path, model, optimizer)

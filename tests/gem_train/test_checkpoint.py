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

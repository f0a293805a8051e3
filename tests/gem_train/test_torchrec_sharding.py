"""The trainer's torchrec tables sharded by torchrec on the CPU: two gloo processes against one
process on the union of their batches.

Each rank builds the model as ``components.build_run`` does (one seed, the optimisations
applied from outside, the fused embedding optimizer collected, AdamW in groups) and trains two
steps on its own batch; the reference is the unsharded model on both ranks' samples at once.
Losses (the mean of the ranks' equals the union's), the first step's gradients and the tables
and dense weights after both steps agree within fp32 tolerance:

- ``optim.embedding_optimizer=adamw``: the pooled EmbeddingBagCollection is sharded by torchrec's
  DistributedModelParallel (table-wise, dense kernel) and trained by AdamW; the sequence
  EmbeddingCollection falls back to gem_parallel's native tables, and the notes say why.
- ``rowwise_adagrad``: both collections are sharded by DistributedModelParallel on the fused
  kernel, FBGEMM's row-wise Adagrad against gem_parallel's on the reference, the learning rate
  changed between the steps.

With ``checkpoint.folder`` ``parallel.embeddings=torchrec`` is refused and ``auto`` shards
natively. Workers are spawned as in ``test_checkpoint_distributed``.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parents[2]))
from tests.gem_train.conftest import small_config  # noqa: E402
from tests.parallel.parallel_launch import free_port  # noqa: E402

WORLD, STEPS, SUB_BATCHES = 2, 2, 2  # two sub-batches of 4 samples per rank and step
LEARNING_RATES = (0.1, 0.03)  # the fused row-wise Adagrad's, one per step
OPTIMIZERS = ("adamw", "rowwise_adagrad")


def _config(optimizer, **overrides):
    flags = {
        "model__embeddings": "torchrec", "parallel__embeddings": "torchrec",
        "optim__embedding_optimizer": optimizer, "optim__embedding_lr": LEARNING_RATES[0],
    }  # fmt: skip
    return small_config(**(flags | overrides))


def _batch(cfg, step, ranks):
    """The batch of ``ranks`` at ``step``: their sub-batches, rank by rank."""
    from gem_train.components import make_source

    source = make_source(cfg)
    first = [SUB_BATCHES * (WORLD * step + r) for r in ranks]
    parts = [source.sub_batch(i + k) for i in first for k in range(SUB_BATCHES)]
    return type(parts[0]).cat(parts).to(torch.device("cpu"))


def _smooth(adamw):
    """AdamW divides by the gradient's own size, so a gradient near zero summed in another order
    moves its weight by a different fraction of the rate; a larger epsilon (on both sides) makes
    the update continuous in the gradient, and the comparison of the weights tight."""
    for group in adamw.param_groups:
        group["eps"] = 1e-3
    return adamw


def _tables_of(model, *, grads=False):
    """``{table: whole weight (or gradient)}`` of both collections, on every rank."""
    import torch.distributed as dist

    out = {}
    for collection in (model.sequence_embeddings, model.pooled_embeddings):
        if hasattr(collection, "dmp"):  # torchrec's: each table whole on one rank
            params = dict(collection.dmp.named_parameters())
            for key, st in collection.dmp.state_dict().items():
                owner = st.metadata().shards_metadata[0].placement.rank()
                full = torch.empty(st.size())
                if dist.get_rank() == owner:
                    full = (params[key].grad if grads else st.local_shards()[0].tensor).clone()
                dist.broadcast(full, src=owner)
                out[key.split(".")[-2]] = full
        elif grads:  # gem_parallel's native row blocks
            blocks = [None] * dist.get_world_size()
            mine = {}
            for t in collection.tables:
                start, rows = collection.shard_range(t.name)
                mine[t.name] = (start, collection.shards[t.name].grad[:rows])
            dist.all_gather_object(blocks, mine)
            for t in collection.tables:
                full = torch.zeros(t.num_embeddings, t.embedding_dim)
                for block in blocks:
                    start, rows = block[t.name]
                    full[start : start + rows.shape[0]] = rows
                out[t.name] = full
        else:
            out.update(collection.full_weights())
    return out


def _dense_of(model, *, grads=False):
    return {
        name: (p.grad if grads else p.detach()).full_tensor()
        for name, p in model.dense.named_parameters()
    }


def _train_sharded(optimizer, rank):
    import torch.distributed as dist
    from gem_train.components import build_optimizer, fuse_embedding_optimizer, make_source
    from gem_train.model import GemModel, loss_of
    from gem_train.optimizations import apply_optimizations

    cfg = _config(optimizer)
    torch.manual_seed(cfg.seed)
    model, notes = apply_optimizations(
        GemModel(cfg.model), cfg, device=torch.device("cpu"), world=WORLD,
        sample_source=make_source(cfg),
    )  # fmt: skip
    fused = fuse_embedding_optimizer(cfg, model, WORLD)
    adamw = _smooth(build_optimizer(cfg, model))
    losses, grads = [], {}
    for step in range(STEPS):
        for f in fused:
            f.lr = LEARNING_RATES[step]
        batch = _batch(cfg, step, [rank])
        loss, _ = loss_of(model(batch), batch)
        adamw.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            grads = _dense_of(model, grads=True)
            if not fused:
                grads |= _tables_of(model, grads=True)
        adamw.step()
        every = [None] * WORLD
        dist.all_gather_object(every, loss.item())
        losses.append(every)
    return {
        "notes": notes, "fused": len(fused), "losses": losses, "grads": grads,
        "tables": _tables_of(model), "dense": _dense_of(model),
    }  # fmt: skip


def _check_checkpoint_rules(tmp_folder):
    from gem_train.config import ConfigError
    from gem_train.model import GemModel
    from gem_train.optimizations import shard_model_embeddings
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("sparse_replica", "sparse_mp"))
    cfg = _config("adamw", checkpoint__folder=tmp_folder)
    with pytest.raises(ConfigError, match="parallel.embeddings=torchrec cannot be checkpointed"):
        shard_model_embeddings(GemModel(cfg.model), cfg, torch.device("cpu"), mesh)
    cfg = _config("adamw", checkpoint__folder=tmp_folder, parallel__embeddings="auto")
    torch.manual_seed(cfg.seed)  # every rank passes the same tables
    model = GemModel(cfg.model)
    notes = shard_model_embeddings(model, cfg, torch.device("cpu"), mesh)
    assert any("auto shards torchrec's tables natively" in note for note in notes)
    assert model.embedding_backend == "native"


def _worker(rank, world, port, result_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = {optimizer: _train_sharded(optimizer, rank) for optimizer in OPTIMIZERS}
    _check_checkpoint_rules(str(Path(result_dir, "checkpoints")))
    if rank == 0:
        torch.save(results, Path(result_dir, "sharded.pt"))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads, joined while Python finalizes, can abort the process


def _train_reference(optimizer):
    """The unsharded model, one process, the union batch of every step."""
    from gem_parallel.embeddings import EmbeddingTables, RowwiseAdagrad
    from gem_train.components import build_optimizer
    from gem_train.model import GemModel, loss_of

    cfg = _config(optimizer)
    torch.manual_seed(cfg.seed)
    model = GemModel(cfg.model)
    fused = None
    if optimizer == "rowwise_adagrad":  # the same tables, trained in the backward
        fused = RowwiseAdagrad(lr=LEARNING_RATES[0])
        for name in ("sequence_embeddings", "pooled_embeddings"):
            tables = EmbeddingTables.from_torchrec(getattr(model, name))
            tables.fuse_optimizer(fused)
            setattr(model, name, tables)
        model.embedding_backend = "native"
    adamw = _smooth(build_optimizer(cfg, model))
    losses, grads = [], {}
    for step in range(STEPS):
        if fused is not None:
            fused.lr = LEARNING_RATES[step]
        batch = _batch(cfg, step, range(WORLD))
        loss, _ = loss_of(model(batch), batch)
        adamw.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            grads = {name: p.grad for name, p in model.dense.named_parameters()}
            if fused is None:
                grads |= _reference_tables(model, grads=True)
        adamw.step()
        losses.append(loss.item())
    dense = {name: p.detach() for name, p in model.dense.named_parameters()}
    return {"losses": losses, "grads": grads, "tables": _reference_tables(model), "dense": dense}


def _reference_tables(model, *, grads=False):
    out = {}
    for collection in (model.sequence_embeddings, model.pooled_embeddings):
        for key, p in collection.named_parameters():
            out[key.split(".")[-1 if key.startswith("weights.") else -2]] = (
                p.grad if grads else p.detach()
            )
    return out


def _close(actual, expected, msg, *, atol=1e-6):
    torch.testing.assert_close(
        actual, expected, rtol=1e-4, atol=atol, msg=lambda detail: f"{msg}: {detail}"
    )


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    pytest.importorskip("torchrec", reason="torchrec is not installed")
    folder = tmp_path_factory.mktemp("torchrec_sharding")
    mp.start_processes(
        _worker, args=(WORLD, free_port(), str(folder)), nprocs=WORLD, start_method="spawn"
    )
    return torch.load(folder / "sharded.pt", weights_only=False)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_sharded_training_matches_one_process_on_the_union_batch(sharded_runs, optimizer):
    sharded, reference = sharded_runs[optimizer], _train_reference(optimizer)
    for step, (per_rank, union) in enumerate(
        zip(sharded["losses"], reference["losses"], strict=True)
    ):
        _close(torch.tensor(sum(per_rank) / WORLD), torch.tensor(union), f"loss of step {step}")
    assert sharded["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        _close(sharded["grads"][name], grad, f"first step's gradient of {name}")
    for part in ("tables", "dense"):
        assert sharded[part].keys() == reference[part].keys()
        for name, value in reference[part].items():
            _close(sharded[part][name], value, f"{name} after {STEPS} steps", atol=1e-5)


def test_the_notes_say_which_sharding_each_collection_took(sharded_runs):
    adamw, rowwise = sharded_runs["adamw"], sharded_runs["rowwise_adagrad"]
    summary = next(n for n in adamw["notes"] if n.startswith("embeddings sharded"))
    assert summary == (
        "embeddings sharded: sequence by gem_parallel native tables (row-wise); pooled by "
        "torchrec DistributedModelParallel (table-wise, dense kernel)"
    )
    assert any("cannot shard the sequence EmbeddingCollection" in n for n in adamw["notes"])
    summary = next(n for n in rowwise["notes"] if n.startswith("embeddings sharded"))
    assert summary.count("DistributedModelParallel (table-wise, fused kernel") == 2
    assert (adamw["fused"], rowwise["fused"]) == (0, 1)  # one RowwiseAdagrad, both collections

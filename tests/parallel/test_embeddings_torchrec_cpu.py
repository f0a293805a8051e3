"""torchrec's DistributedModelParallel on the CPU: two gloo processes, tables sharded table-wise,
against one process holding the unsharded tables and the union of both ranks' batches.

- Pooled tables on the ``dense`` kernel (a torchrec EmbeddingBagCollection): each rank's forward
  is the unsharded module's on its own batch, the owner's gradient is that of the mean of the two
  ranks' losses, and two AdamW steps leave the tables equal.
- Pooled and unpooled tables (EmbeddingBagCollection, EmbeddingCollection) on the ``fused``
  kernel with a ``RowwiseAdagrad``: forward, and the tables after two steps (with a new learning
  rate for the second) equal to gem_parallel's fused row-wise Adagrad on the union batch.
- What cannot run is refused by name: replicas, and an unpooled collection without a fused
  optimizer (FBGEMM's CPU dense lookup pools).

The file is also the launcher: ``python test_embeddings_torchrec_cpu.py``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

if __name__ != "__main__":
    import torch

WORLD = 2


def test_dmp_table_wise_on_gloo_matches_one_process_on_the_union_batch():
    pytest.importorskip("torchrec", reason="torchrec is not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__))], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert f"all {WORLD} ranks passed" in proc.stdout, proc.stdout[-4000:]


# ---------------------------------------------------------------------------------------------
# the workers


def _tables():
    from gem_parallel.embeddings import TableConfig

    # "a" and "b" share t0; three tables over two ranks: one rank holds two of them
    return [
        TableConfig("t0", 40, 8, ("a", "b")),
        TableConfig("t1", 30, 8, ("c",)),
        TableConfig("t2", 20, 8, ("d",)),
    ]


def _batch(seed: int, *, batch: int = 3):
    """``{feature: (ids, lengths [batch])}``; ids repeat within and across ranks."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in _tables():
        for f in t.feature_names:
            lengths = torch.randint(0, 4, (batch,), generator=gen)
            out[f] = (torch.randint(0, 12, (int(lengths.sum()),), generator=gen), lengths)
    return out


def _kjt(features):
    from gem_parallel.embeddings import KeyedJagged

    return KeyedJagged.from_dict(features)


def _union(batches):
    """One batch holding every rank's samples, rank by rank."""
    return {
        f: (torch.cat([b[f][0] for b in batches]), torch.cat([b[f][1] for b in batches]))
        for f in batches[0]
    }


def _flat(out, samples=slice(None)):
    """Every output element in one vector, features in a fixed order; ``samples`` picks a
    rank's rows out of a pooled union output."""
    if hasattr(out, "to_dict"):
        parts = out.to_dict()
        return torch.cat([parts[f][samples].reshape(-1) for f in sorted(parts)])
    return torch.cat([out[f].values.reshape(-1) for f in sorted(out)])


def _flat_tokens(union, batches, rank):
    """Rank ``rank``'s tokens of an unpooled union output, in ``_flat``'s order."""
    flat = []
    for f in sorted(union):
        before = sum(int(b[f][1].sum()) for b in batches[:rank])
        mine = int(batches[rank][f][1].sum())
        flat.append(union[f].values[before : before + mine].reshape(-1))
    return torch.cat(flat)


def _loss(flat, step: int):
    """A fixed linear function of the output (every element gets a gradient)."""
    gen = torch.Generator().manual_seed(100 + step)
    return (flat * torch.randn(flat.numel(), generator=gen, dtype=flat.dtype)).sum()


def _full_tables(sharded):
    """The sharded module's tables, whole, on every rank (each lives on one rank)."""
    import torch.distributed as dist

    tables = {}
    for key, st in sharded.dmp.state_dict().items():
        owner = st.metadata().shards_metadata[0].placement.rank()
        full = st.local_shards()[0].tensor.clone() if st.local_shards() else torch.empty(st.size())
        dist.broadcast(full, src=owner)
        tables[key.split(".")[-2]] = full
    return tables


def _assert_close(actual, expected, msg):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=msg)


def _check_dense_pooled(rank):
    """A torchrec EmbeddingBagCollection, ``dense`` kernel, trained by AdamW on both sides."""
    from gem_parallel.embeddings import EmbeddingTables, shard_embeddings
    from gem_parallel.embeddings.torchrec_backend import to_torchrec

    ref = EmbeddingTables(_tables(), pooling="sum", generator=torch.Generator().manual_seed(1))
    sharded = shard_embeddings(to_torchrec(ref, torch.device("cpu")), backend="torchrec")
    assert sharded.fused_optimizer is None
    params = [p for p in sharded.parameters() if p.numel()]
    owned = {name.split(".")[-2]: p for name, p in sharded.named_parameters() if p.numel()}
    assert owned, "table-wise placement left a rank without a table"
    opt = torch.optim.AdamW(params, lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(2):
        batches = [_batch(10 * step + r) for r in range(WORLD)]
        out = sharded(_kjt(batches[rank]))
        _assert_close(_flat(out), _flat(ref(_kjt(batches[rank]))), f"dense forward {step}")
        opt.zero_grad()
        # each rank's loss is over its own batch; torchrec divides the gradients it returns to
        # the tables by the world size, so the tables see the gradient of the ranks' mean
        _loss(_flat(out), step).backward()
        ref_opt.zero_grad()
        union = ref(_kjt(_union(batches)))
        sum(
            _loss(_flat(union, slice(3 * r, 3 * r + 3)), step) / WORLD for r in range(WORLD)
        ).backward()
        for name, p in owned.items():
            _assert_close(p.grad, ref.weights[name].grad, f"dense grad {name} {step}")
        opt.step()
        ref_opt.step()
    for name, table in _full_tables(sharded).items():
        _assert_close(table, ref.weights[name].detach(), f"dense table {name}")


def _check_fused(rank, pooling):
    """EmbeddingTables with a fused RowwiseAdagrad, sharded by torchrec's ``fused`` kernel."""
    from gem_parallel.embeddings import EmbeddingTables, RowwiseAdagrad, shard_embeddings

    def tables():
        t = EmbeddingTables(_tables(), pooling=pooling, generator=torch.Generator().manual_seed(2))
        t.fuse_optimizer(RowwiseAdagrad(lr=0.2))
        return t

    ref, to_shard = tables(), tables()
    sharded = shard_embeddings(to_shard, backend="torchrec")
    assert sharded.fused_optimizer is to_shard.fused_optimizer
    for step, lr in enumerate((0.2, 0.05)):
        sharded.fused_optimizer.lr = ref.fused_optimizer.lr = lr
        batches = [_batch(10 * step + r) for r in range(WORLD)]
        out = sharded(_kjt(batches[rank]))
        _assert_close(_flat(out), _flat(ref(_kjt(batches[rank]))), f"{pooling} forward {step}")
        _loss(_flat(out), step).backward()
        union = ref(_kjt(_union(batches)))  # one lookup: one row-wise update per row
        if pooling == "none":
            per_rank = [_flat_tokens(union, batches, r) for r in range(WORLD)]
        else:
            per_rank = [_flat(union, slice(3 * r, 3 * r + 3)) for r in range(WORLD)]
        sum(_loss(flat, step) / WORLD for flat in per_rank).backward()
    for name, table in _full_tables(sharded).items():
        _assert_close(table, ref.weights[name].detach(), f"{pooling} table {name}")


def _check_refusals():
    from gem_parallel.embeddings import EmbeddingTables, shard_embeddings
    from torch.distributed.device_mesh import init_device_mesh

    unpooled = EmbeddingTables(_tables(), pooling="none")
    with pytest.raises(ValueError, match="EmbeddingCollection only with a fused_optimizer"):
        shard_embeddings(unpooled, backend="torchrec")
    replicas = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "model_parallel"))
    with pytest.raises(ValueError, match="keeps no replicas; got 2 replicas"):
        shard_embeddings(EmbeddingTables(_tables()), backend="torchrec", mesh=replicas)


def _worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    _check_dense_pooled(rank)
    for pooling in ("sum", "none"):
        _check_fused(rank, pooling)
    _check_refusals()
    from parallel_launch import finish_rank  # the script's folder is on sys.path

    finish_rank()


if __name__ == "__main__":
    from parallel_launch import free_port, launch_spawned  # the script's folder is on sys.path

    failed = launch_spawned(_worker, WORLD, free_port())
    if failed:
        sys.exit(f"a rank failed (exit code {failed})")
    print(f"all {WORLD} ranks passed")

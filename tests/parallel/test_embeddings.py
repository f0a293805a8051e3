"""Single-process tests of the embedding tables: semantics against torchrec, pooling against a
per-sample loop, the input checks, and the sharded module on a one-rank group (CPU and GPU).

The 4-rank equivalence of the sharded module lives in ``test_embeddings_distributed.py``.
"""

import pytest
import torch
import torch.distributed as dist
from gem_parallel.embeddings import (
    EmbeddingTables,
    KeyedJagged,
    RowwiseAdagrad,
    ShardingConfig,
    TableConfig,
    shard_embeddings,
    split_features,
)
from gem_parallel.embeddings.kjt import pool
from hypothesis import given
from hypothesis import strategies as st

TABLES = [TableConfig("t0", 11, 4, ("a", "b")), TableConfig("t1", 7, 3, ("c",))]


def _kjt(tables, seed, *, batch=3, device="cpu", max_len=4, cls=KeyedJagged):
    gen = torch.Generator().manual_seed(seed)
    keys, values, lengths = [], [], []
    for t in tables:
        for f in t.feature_names:
            lens = torch.randint(0, max_len + 1, (batch,), generator=gen)
            keys.append(f)
            lengths.append(lens)
            values.append(torch.randint(0, t.num_embeddings, (int(lens.sum()),), generator=gen))
    return cls(
        keys=keys, values=torch.cat(values).to(device), lengths=torch.cat(lengths).to(device)
    )


@pytest.fixture(scope="module")
def one_rank_world():
    """A one-rank process group (gloo for CPU tensors, NCCL for CUDA ones where present)."""
    created = not dist.is_initialized()
    if created:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def _compare_forward_backward(sharded, ref, kjt):
    out, expected = sharded(kjt), ref(kjt)
    if ref.pooling == "none":
        for k in expected:
            torch.testing.assert_close(out[k].values, expected[k].values)
            assert torch.equal(out[k].offsets, expected[k].offsets)
        loss = sum(out[k].values.square().sum() for k in out)
        ref_loss = sum(expected[k].values.square().sum() for k in expected)
    else:
        assert out.keys == expected.keys and out.dims == expected.dims
        torch.testing.assert_close(out.values, expected.values)
        loss, ref_loss = out.values.square().sum(), expected.values.square().sum()
    loss.backward()
    ref_loss.backward()
    for t in ref.tables:
        start, rows = sharded.shard_range(t.name)
        torch.testing.assert_close(
            sharded.shards[t.name].grad[:rows], ref.weights[t.name].grad[start : start + rows]
        )


@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_reference_matches_torchrec_collections(pooling):
    torchrec = pytest.importorskip("torchrec")
    from gem_parallel.embeddings.torchrec_backend import to_torchrec

    # torchrec's EmbeddingCollection needs one embedding dim for all its tables
    tables = (
        TABLES
        if pooling != "none"
        else [TableConfig("t0", 11, 4, ("a", "b")), TableConfig("t1", 7, 4, ("c",))]
    )
    ref = EmbeddingTables(tables, pooling=pooling, generator=torch.Generator().manual_seed(0))
    theirs = to_torchrec(ref, torch.device("cpu"))
    kjt = _kjt(tables, 1, cls=torchrec.KeyedJaggedTensor)
    ours, expected = ref(kjt), theirs(kjt)
    if pooling == "none":
        for k in expected:
            torch.testing.assert_close(ours[k].values, expected[k].values())
            assert torch.equal(ours[k].offsets, expected[k].offsets())
        ours_loss = sum(ours[k].values.square().sum() for k in ours)
        their_loss = sum(expected[k].values().square().sum() for k in expected)
    else:
        assert ours.keys == expected.keys()
        torch.testing.assert_close(ours.values, expected.values())
        ours_loss, their_loss = ours.values.square().sum(), expected.values().square().sum()
    ours_loss.backward()
    their_loss.backward()
    prefix = "embeddings" if pooling == "none" else "embedding_bags"
    params = dict(theirs.named_parameters())
    for t in tables:
        torch.testing.assert_close(
            ref.weights[t.name].grad, params[f"{prefix}.{t.name}.weight"].grad
        )
    back = EmbeddingTables.from_torchrec(theirs)
    assert back.pooling == pooling
    for t in tables:
        assert torch.equal(back.weights[t.name], ref.weights[t.name])


@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pool_matches_per_sample_loop(lengths, mode, weighted, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(lengths), 3, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(sum(lengths), generator=gen, dtype=torch.float64) if weighted else None
    lengths_B = torch.tensor(lengths)
    got = pool(rows, lengths_B, mode, weights)
    expected, start = [], 0
    for n in lengths:
        r = rows[start : start + n]
        if weights is not None:
            r = r * weights[start : start + n, None]
        s = r.sum(0)
        expected.append(s / max(n, 1) if mode == "mean" else s)
        start += n
    expected = torch.stack(expected)
    torch.testing.assert_close(got, expected)
    cot = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    (g,) = torch.autograd.grad(got, rows, cot)
    (e,) = torch.autograd.grad(expected, rows, cot)
    torch.testing.assert_close(g, e)


def test_split_features_checks_keys_lengths_and_dtypes():
    kjt = _kjt(TABLES, 0)
    parts = split_features(kjt, expected=["a", "b", "c"])
    assert [p.lengths.numel() for p in parts.values()] == [3, 3, 3]
    assert sum(p.ids.numel() for p in parts.values()) == kjt.values().numel()
    with pytest.raises(ValueError, match=r"missing \['d'\]"):
        split_features(kjt, expected=["a", "b", "c", "d"])
    with pytest.raises(ValueError, match=r"not in any table \['c'\]"):
        split_features(kjt, expected=["a", "b"])
    with pytest.raises(TypeError, match="int32 or int64"):
        split_features(KeyedJagged(["a"], torch.zeros(2), torch.tensor([1, 1])), expected=["a"])
    with pytest.raises(ValueError, match="sums to 3"):
        split_features(
            KeyedJagged(["a"], torch.zeros(2, dtype=torch.int64), torch.tensor([1, 2])),
            expected=["a"],
        )
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        split_features({"a": torch.zeros(1)}, expected=["a"])
    with pytest.raises(ValueError, match="multiple of len"):
        KeyedJagged(["a", "b"], torch.zeros(3, dtype=torch.int64), torch.tensor([1, 1, 1]))


def test_length_per_key_given_is_used_and_computed_otherwise():
    """Counts given at construction split the ids without summing ``lengths`` (a device read on
    a GPU); without them they are summed once and remembered; a wrong count is refused."""
    values, lengths = torch.arange(6), torch.tensor([1, 2, 0, 3])  # a: 3 ids, b: 3 ids
    kjt = KeyedJagged(["a", "b"], values, lengths)
    assert kjt.length_per_key() == [3, 3]
    given = KeyedJagged(["a", "b"], values, lengths, length_per_key=[3, 3])
    given._lengths = torch.full_like(lengths, 99)  # would sum differently: the counts are trusted
    parts = split_features(given, expected=["a", "b"])
    assert parts["a"].ids.tolist() == [0, 1, 2] and parts["b"].ids.tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="one count per key"):
        KeyedJagged(["a", "b"], values, lengths, length_per_key=[6])
    with pytest.raises(ValueError, match="sums to 5"):
        split_features(
            KeyedJagged(["a", "b"], values, lengths, length_per_key=[2, 3]), expected=["a", "b"]
        )


def test_tables_reject_bad_configuration_and_ids():
    with pytest.raises(ValueError, match="pooling must be one of"):
        EmbeddingTables(TABLES, pooling="max")
    with pytest.raises(ValueError, match="one table only"):
        EmbeddingTables([TableConfig("x", 3, 2, ("a",)), TableConfig("y", 3, 2, ("a",))])
    with pytest.raises(ValueError, match="num_embeddings must be >= 1"):
        TableConfig("x", 0, 2, ("a",))
    ref = EmbeddingTables(TABLES)
    bad = KeyedJagged(["a", "b", "c"], torch.tensor([0, 11, 0]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"table 't0'.*\[0, 11\).*to 11"):
        ref(bad)
    with pytest.raises(ValueError, match="reduce must be one of"):
        ShardingConfig(reduce="mean")


def test_tables_skip_the_id_check_when_told():
    """``validate_ids=False`` (ids checked by the reader) does no per-table check, so no host
    sync: valid ids give the same rows, and an id out of range reaches the lookup itself."""
    kjt = KeyedJagged(["a", "b", "c"], torch.tensor([0, 1, 2]), torch.tensor([1, 1, 1]))
    checked = EmbeddingTables(TABLES)
    unchecked = EmbeddingTables(TABLES, validate_ids=False)
    unchecked.load_state_dict(checked.state_dict())
    expected, got = checked(kjt).to_dict(), unchecked(kjt).to_dict()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0)
    bad = KeyedJagged(["a", "b", "c"], torch.tensor([0, 11, 0]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="ids of table"):
        checked(bad)
    with pytest.raises(IndexError):  # torch's own bounds check in the lookup, not ours
        unchecked(bad)


@pytest.mark.parametrize("pooling", ["sum", "none"])
@pytest.mark.parametrize("fully_sharded", [True, False])
def test_sharded_on_one_rank_matches_unsharded(one_rank_world, pooling, fully_sharded):
    from torch.distributed.device_mesh import init_device_mesh

    ref = EmbeddingTables(TABLES, pooling=pooling, generator=torch.Generator().manual_seed(2))
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "model_parallel"))
    sharded = shard_embeddings(
        ref, mesh=mesh, config=ShardingConfig(fully_sharded=fully_sharded, reduce="sum")
    )
    _compare_forward_backward(sharded, ref, _kjt(TABLES, 3))


def test_shard_embeddings_rejects_bad_arguments(one_rank_world):
    ref = EmbeddingTables(TABLES)
    with pytest.raises(ValueError, match="backend must be one of"):
        shard_embeddings(ref, backend="fbgemm")
    with pytest.raises(TypeError, match="EmbeddingTables"):
        shard_embeddings(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="either mesh or the process groups"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
        shard_embeddings(ref, mesh=mesh, model_parallel_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="fused_optimizer: the native back end keeps dense"):
        shard_embeddings(ref, fused_optimizer=RowwiseAdagrad(lr=0.1))


def test_torchrec_back_end_on_the_cpu_refuses_what_it_cannot_run(one_rank_world):
    pytest.importorskip("torchrec", reason="torchrec is not installed")
    # torchrec's EmbeddingCollection needs one embedding dim for all its tables
    same_dim = [TableConfig("t0", 11, 4, ("a", "b")), TableConfig("t1", 7, 4, ("c",))]
    unpooled = EmbeddingTables(same_dim, pooling="none")
    with pytest.raises(ValueError, match="EmbeddingCollection only with a fused_optimizer"):
        shard_embeddings(unpooled, backend="torchrec", device="cpu")
    with pytest.raises(TypeError, match="fused_optimizer must be a RowwiseAdagrad or None"):
        shard_embeddings(unpooled, backend="torchrec", fused_optimizer=torch.optim.SGD)
    unpooled.fuse_optimizer(RowwiseAdagrad(lr=0.1))
    with pytest.raises(ValueError, match="the tables carry a fused optimizer already"):
        shard_embeddings(unpooled, backend="torchrec", fused_optimizer=RowwiseAdagrad(lr=0.1))


def test_table_wise_placement_balances_elements_the_same_way_everywhere():
    from gem_parallel.embeddings.torchrec_backend import table_placement

    sizes = {"big": 100, "mid": 60, "small": 50, "tiny": 10}
    assert table_placement(sizes, 2) == {"big": 0, "mid": 1, "small": 1, "tiny": 0}
    assert table_placement({"a": 5, "b": 5}, 4) == {"a": 0, "b": 1}


def test_torchrec_layout_matches_dmp_collection_groups():
    from gem_parallel.embeddings.torchrec_backend import torchrec_layout

    assert torchrec_layout([4, 5, 6, 7], world=8) is True  # contiguous model-parallel groups
    assert torchrec_layout([1, 3, 5, 7], world=8) is False  # strided, torchrec's default
    with pytest.raises(ValueError, match="neither contiguous nor strided"):
        torchrec_layout([0, 1, 4, 5], world=8)


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", ["mean", "none"])
def test_sharded_on_one_gpu_matches_unsharded(one_rank_world, pooling):
    """The native back end on CUDA without fbgemm (the GPU image has none)."""
    ref = EmbeddingTables(
        TABLES, pooling=pooling, device="cuda", generator=torch.Generator().manual_seed(4)
    )
    sharded = shard_embeddings(
        ref, model_parallel_group=dist.group.WORLD, config=ShardingConfig(reduce="sum")
    )
    _compare_forward_backward(sharded, ref, _kjt(TABLES, 5, device="cuda"))


def test_memory_benchmark_smoke_runs():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks/parallel/bench_embeddings_memory.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "saved by full sharding: 50.0%" in proc.stdout, proc.stdout[-2000:]

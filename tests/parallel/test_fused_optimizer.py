"""Row-wise Adagrad fused into the embedding lookup's backward: the sync-free update against the
plain reference, and ``EmbeddingTables(fused_optimizer=...)`` against a dense step."""

import pytest
import torch
from gem_parallel.embeddings import (
    EmbeddingTables,
    KeyedJagged,
    RowwiseAdagrad,
    TableConfig,
    shard_embeddings,
)
from gem_parallel.embeddings.fused_optimizer import (
    rowwise_adagrad_reference,
    rowwise_adagrad_update_,
)
from hypothesis import given
from hypothesis import strategies as st

TABLES = [TableConfig("t0", 11, 4, ("a", "b")), TableConfig("t1", 7, 3, ("c",))]


@st.composite
def lookups(draw):
    """Ids with repeats: none, one, all the same row, a heavy hitter among others, row 0 or not."""
    rows = draw(st.integers(1, 40))
    kind = draw(st.sampled_from(["uniform", "one_row", "heavy", "skip_row_0"]))
    n = draw(st.integers(0, 60))
    if kind == "one_row":
        ids = [draw(st.integers(0, rows - 1))] * n
    elif kind == "heavy":
        hot = draw(st.integers(0, rows - 1))
        ids = [hot if draw(st.booleans()) else draw(st.integers(0, rows - 1)) for _ in range(n)]
    else:
        low = 1 if kind == "skip_row_0" and rows > 1 else 0
        ids = draw(st.lists(st.integers(low, rows - 1), min_size=n, max_size=n))
    return rows, ids, draw(st.integers(0, 2**31 - 1))


@given(case=lookups(), lr=st.sampled_from([0.5, 0.01]), steps=st.integers(1, 3))
def test_update_matches_the_reference(case, lr, steps):
    rows, ids, seed = case
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, 5, generator=gen, dtype=torch.float64)
    state = torch.rand(rows, generator=gen, dtype=torch.float64)
    ids_t = torch.tensor(ids, dtype=torch.int64)
    expected_w, expected_s = weight.clone(), state.clone()
    for _ in range(steps):  # the state carries over between steps
        grad = torch.randn(len(ids), 5, generator=gen, dtype=torch.float64)
        rowwise_adagrad_update_(weight, state, ids_t, grad, lr=lr, eps=1e-8)
        rowwise_adagrad_reference(expected_w, expected_s, ids_t, grad, lr=lr, eps=1e-8)
    torch.testing.assert_close(weight, expected_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, expected_s, rtol=1e-12, atol=1e-12)
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[ids_t] = False
    # rows the batch did not touch keep their bits (row 0 too, which the unused slots point at)
    assert torch.equal(weight[untouched], expected_w[untouched])
    assert torch.equal(state[untouched], expected_s[untouched])


def test_reference_is_adagrad_by_row():
    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    state = torch.zeros(2, dtype=torch.float64)
    ids = torch.tensor([1, 1])
    grad = torch.tensor([[1.0, 0.0], [1.0, 2.0]], dtype=torch.float64)  # row 1: g = [2, 2]
    rowwise_adagrad_reference(weight, state, ids, grad, lr=0.1, eps=0.0)
    assert state.tolist() == [0.0, 4.0]
    assert weight.tolist() == [[1.0, 2.0], [3.0 - 0.1 * 2 / 2, 4.0 - 0.1 * 2 / 2]]


def _features(seed, batch=4):
    """``(keyed jagged ids, {feature: ids})``, each feature with repeats and empty samples."""
    gen = torch.Generator().manual_seed(seed)
    ids, lengths = {}, []
    for t in TABLES:
        for f in t.feature_names:
            lens = torch.randint(0, 5, (batch,), generator=gen)
            lengths.append(lens)
            ids[f] = torch.randint(0, t.num_embeddings, (int(lens.sum()),), generator=gen)
    kjt = KeyedJagged(
        keys=list(ids), values=torch.cat(list(ids.values())), lengths=torch.cat(lengths)
    )
    return kjt, ids


def _loss(out, pooling):
    if pooling == "none":
        return sum((out[k].values * torch.arange(out[k].values.numel()).view_as(out[k].values)).sin().sum() for k in out)  # fmt: skip
    return (out.values * torch.arange(out.values.numel()).view_as(out.values)).sin().sum()


@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_tables_train_themselves_as_a_dense_gradient_would(pooling):
    optimizer = RowwiseAdagrad(lr=0.05)
    fused = EmbeddingTables(TABLES, pooling=pooling, fused_optimizer=optimizer)
    dense = EmbeddingTables(TABLES, pooling=pooling)
    dense.load_state_dict(fused.state_dict(), strict=False)
    state = {t.name: torch.zeros(t.num_embeddings) for t in TABLES}
    for step in range(3):
        optimizer.lr = 0.05 / (step + 1)  # a schedule changes lr between steps
        kjt, ids = _features(step)
        _loss(fused(kjt), pooling).backward()
        _loss(dense(kjt), pooling).backward()
        for t in TABLES:
            assert fused.weights[t.name].grad is None
            grad = dense.weights[t.name].grad
            touched = torch.cat([ids[f] for f in t.feature_names]).unique()
            with torch.no_grad():  # the reference step, from the dense gradient's touched rows
                rowwise_adagrad_reference(
                    dense.weights[t.name], state[t.name], touched, grad[touched],
                    lr=optimizer.lr, eps=optimizer.eps,
                )  # fmt: skip
            dense.weights[t.name].grad = None
            torch.testing.assert_close(fused.weights[t.name], dense.weights[t.name])
            torch.testing.assert_close(getattr(fused.rowwise_state, t.name), state[t.name])
    assert {f"rowwise_state.{t.name}" for t in TABLES} <= set(fused.state_dict())


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="lr: expected a positive"):
        RowwiseAdagrad(lr=0.0)
    with pytest.raises(ValueError, match="eps: expected a positive"):
        RowwiseAdagrad(eps=-1.0)
    with pytest.raises(TypeError, match="fused_optimizer: expected a RowwiseAdagrad"):
        EmbeddingTables(TABLES, fused_optimizer="adagrad")
    with pytest.raises(TypeError, match="fused_optimizer: expected a RowwiseAdagrad"):
        EmbeddingTables(TABLES).fuse_optimizer(torch.optim.Adagrad)


def test_sharding_tables_with_a_fused_optimizer_is_refused():
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tables = EmbeddingTables(TABLES, fused_optimizer=RowwiseAdagrad())
        with pytest.raises(ValueError, match="fused_optimizer train on one process"):
            shard_embeddings(tables)
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.gpu
def test_gpu_update_matches_the_reference_without_a_host_sync():
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(0, 50_000, (20_000,), generator=gen), torch.full((5000,), 7)])
    grad = torch.randn(ids.numel(), 64, generator=gen)
    weight, state = torch.randn(50_000, 64, generator=gen), torch.rand(50_000, generator=gen)
    expected_w, expected_s = weight.clone(), state.clone()
    rowwise_adagrad_reference(expected_w, expected_s, ids, grad, lr=0.05, eps=1e-8)
    weight, state, ids, grad = (t.cuda() for t in (weight, state, ids, grad))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rowwise_adagrad_update_(weight, state, ids, grad, lr=0.05, eps=1e-8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(weight.cpu(), expected_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.cpu(), expected_s, rtol=1e-5, atol=1e-6)

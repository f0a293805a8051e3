"""MoE layer: fixed-capacity dispatch against the loop reference, drops counted, gradients, the
all-to-all path on a one-rank group, and (on a GPU) no device-to-host synchronization."""

import os

import pytest
import torch
import torch.distributed as dist
from gem_parallel.moe import MoE, MoEConfig, moe_reference
from hypothesis import given
from hypothesis import strategies as st


def _layer(d, h, e, k, cf, seed, dtype=torch.float64, bound=None):
    torch.manual_seed(seed)
    config = MoEConfig(d, h, e, top_k=k, capacity_factor=cf, max_tokens_per_rank=bound)
    return MoE(config).to(dtype)


def _reference(layer, x):
    cfg = layer.config
    tokens = x.reshape(-1, cfg.d_model).shape[0]
    capacity = None if cfg.capacity_factor is None else cfg.dispatch_capacity(tokens)
    return moe_reference(
        x,
        layer.router.weight,
        layer.experts.w_in,
        layer.experts.w_out,
        top_k=cfg.top_k,
        capacity=capacity,
    )


@given(
    tokens=st.integers(1, 24),
    experts=st.sampled_from([1, 2, 4, 5]),
    top_k=st.integers(1, 3),
    capacity_factor=st.sampled_from([None, 0.5, 1.0, 2.0]),
    headroom=st.sampled_from([None, 0, 5]),
    seed=st.integers(0, 2**16),
)
def test_forward_and_gradients_match_the_reference(
    tokens, experts, top_k, capacity_factor, headroom, seed
):
    """Also with a token bound above the call's count: the capacity then derives from the bound."""
    top_k = min(top_k, experts)
    bound = None if headroom is None else tokens + headroom
    layer = _layer(8, 12, experts, top_k, capacity_factor, seed, bound=bound)
    x = torch.randn(
        tokens,
        8,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(seed),
        requires_grad=True,
    )
    out = layer(x)
    ref_layer = _layer(8, 12, experts, top_k, capacity_factor, seed, bound=bound)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = _reference(ref_layer, x_ref)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p), p_ref in zip(layer.named_parameters(), ref_layer.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)


def test_drops_are_counted_not_hidden():
    layer = _layer(4, 4, 2, 1, 0.5, 0)  # capacity = ceil(0.5 * 16 * 1 / 2) = 4 per expert
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]]))
    x = torch.zeros(16, 4, dtype=torch.float64)
    x[:, 0] = 1.0  # every token prefers expert 0
    layer(x)
    assert int(layer.dropped_assignments) == 16 - 4
    no_drop = _layer(4, 4, 2, 1, None, 0)
    no_drop(x)
    assert int(no_drop.dropped_assignments) == 0


def test_leading_dimensions_are_kept():
    layer = _layer(8, 8, 4, 2, None, 1, dtype=torch.float32)
    x = torch.randn(2, 3, 8)
    assert layer(x).shape == (2, 3, 8)
    torch.testing.assert_close(layer(x).reshape(6, 8), layer(x.reshape(6, 8)))


@pytest.fixture
def one_rank_group():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_all_to_all_path_on_a_one_rank_group(one_rank_group):
    layer = _layer(8, 12, 4, 2, None, 3)
    ref_layer = _layer(8, 12, 4, 2, None, 3)
    layer.shard_experts(one_rank_group)
    assert layer.ep_group is one_rank_group and layer.experts.grad_scale == 1.0
    x = torch.randn(10, 8, dtype=torch.float64)
    out, ref = layer(x), _reference(ref_layer, x)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(layer.experts.w_in.grad, ref_layer.experts.w_in.grad)
    with pytest.raises(RuntimeError, match="already"):
        layer.shard_experts(one_rank_group)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(d_model=4, d_hidden=4, num_experts=2, top_k=3), "top_k=3 exceeds num_experts=2"),
        (dict(d_model=0, d_hidden=4, num_experts=2), "d_model must be >= 1"),
        (dict(d_model=4, d_hidden=4, num_experts=2, capacity_factor=0.0), "capacity_factor"),
        (dict(d_model=4, d_hidden=4, num_experts=2, max_tokens_per_rank=0), "max_tokens_per_rank"),
    ],
)
def test_bad_config_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**kwargs)


def test_capacity_derives_from_the_token_bound():
    config = MoEConfig(4, 4, 4, top_k=2, capacity_factor=1.0, max_tokens_per_rank=32)
    assert config.dispatch_capacity(3) == config.dispatch_capacity(32) == 16  # 1.0 * 32 * 2 / 4
    assert MoEConfig(4, 4, 4, max_tokens_per_rank=32).dispatch_capacity(5) == 32
    assert MoEConfig(4, 4, 4).dispatch_capacity(5) == 5  # no bound: the call's own count


def test_more_tokens_than_the_bound_is_named():
    layer = _layer(8, 8, 2, 1, None, 0, bound=6)
    layer(torch.zeros(2, 3, 8, dtype=torch.float64))  # 6 tokens: at the bound
    with pytest.raises(ValueError, match=r"7 tokens but max_tokens_per_rank=6"):
        layer(torch.zeros(7, 8, dtype=torch.float64))


def test_wrong_width_is_named():
    with pytest.raises(ValueError, match="d_model=8"):
        _layer(8, 8, 2, 1, None, 0)(torch.zeros(3, 4, dtype=torch.float64))


@pytest.mark.gpu
def test_dispatch_never_syncs_with_the_host():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        layer = _layer(64, 128, 8, 2, 1.25, 0, dtype=torch.float32, bound=300).cuda()
        layer.shard_experts(dist.group.WORLD)  # the all-to-all path, on NCCL
        x = torch.randn(256, 64, device="cuda", requires_grad=True)
        layer(x).sum().backward()  # warm-up (allocations, NCCL setup)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()

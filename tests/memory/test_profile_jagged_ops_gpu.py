"""AutoAC's profiler runs every region under its dispatch modes (the accounting meter, FLOP
counting, selective and full recomputation, quantized saved activations, forked RNG state): each
jagged op must run under them on the GPU as it does in training, on the kernels a model reaches.

The regions build q, k, v as views of one fused projection (the trainer's layout: row stride
3·N·H) and take the batch's ``JaggedBatch``, as gem_train's blocks do.
"""

import pytest
import torch
from torch import nn

gem_jagged = pytest.importorskip("gem_jagged")
gem_memory = pytest.importorskip("gem_memory")

pytestmark = pytest.mark.gpu

LENGTHS = [1, 127, 128, 129, 700, 0, 3000, 64]


class OpBlock(nn.Module):
    """One attention op over fused-projection views, with a residual."""

    def __init__(self, op: str, dim: int, heads: int, *, rel_bias_radius: int | None):
        super().__init__()
        self.op, self.heads = op, heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.rel_bias = (
            None
            if rel_bias_radius is None
            else nn.Parameter(torch.randn(heads, 2 * rel_bias_radius + 1) * 0.1)
        )

    def forward(self, x_TD: torch.Tensor, batch) -> torch.Tensor:
        total, dim = x_TD.shape
        q, k, v = self.qkv(x_TD).view(total, 3, self.heads, dim // self.heads).unbind(1)
        if self.op == "jagged_flash_attention":
            o = gem_jagged.jagged_flash_attention(
                q, k, v, batch, causal=True, rel_bias=self.rel_bias
            )
        elif self.op == "gdpa":
            o = gem_jagged.gdpa(q, k, v, batch, causal=True, rel_bias=self.rel_bias)
        else:
            o = gem_jagged.block_attention(q, k, v, batch, block_size=64, rope_theta=10000.0)
        return x_TD + self.proj(o.reshape(total, dim))


class Stack(nn.Module):
    def __init__(self, op: str, *, dim: int, heads: int, rel_bias_radius: int | None):
        super().__init__()
        self.blocks = nn.ModuleList(
            OpBlock(op, dim, heads, rel_bias_radius=rel_bias_radius) for _ in range(2)
        )

    def forward(self, x_TD, batch):
        for block in self.blocks:
            x_TD = block(x_TD, batch)
        return x_TD


CASES = [
    # (op, head dim, rel_bias radius): the no-bias softmax op at head dim 128 is the Hopper path
    ("jagged_flash_attention", 128, None),
    ("jagged_flash_attention", 128, 32),
    ("jagged_flash_attention", 64, None),
    ("gdpa", 128, 32),
    ("gdpa", 64, None),
    ("block_attention", 128, None),
]


@pytest.mark.parametrize(("op", "head_dim", "radius"), CASES)
def test_every_op_profiles_and_trains_under_autoac_modes(op, head_dim, radius):
    torch.manual_seed(0)
    heads = 4
    model = Stack(op, dim=heads * head_dim, heads=heads, rel_bias_radius=radius)
    model = model.cuda().to(torch.bfloat16)
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    batch = gem_jagged.JaggedBatch.from_host(offsets, device="cuda")
    x = torch.randn(int(offsets[-1]), heads * head_dim, device="cuda", dtype=torch.bfloat16)

    profile = gem_memory.profile_model(model, (x, batch), timing_reps=1)
    assert [r.name for r in profile.regions] == ["blocks.0", "blocks.1"]
    torch.cuda.synchronize()

    keep_peak = profile.predict_peak(["keep"] * len(profile.regions))
    plan = gem_memory.plan_checkpointing(model, (x, batch), budget_bytes=keep_peak, profile=profile)
    plan.apply(model)
    loss = model(x, batch).float().square().mean()
    loss.backward()
    torch.cuda.synchronize()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

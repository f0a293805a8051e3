"""A toy stack for the memory tests: input projection, attention + MLP blocks, a head."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ToyStack(nn.Module):
    def __init__(self, *, in_dim=8, dim=32, heads=2, depth=4):
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.head = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, 64), nn.SiLU(), nn.Linear(64, 1)
        )

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_toy(seed: int = 0, **kwargs) -> ToyStack:
    torch.manual_seed(seed)
    return ToyStack(**kwargs)


def toy_batch(seed: int = 0, *, batch=4, length=64, in_dim=8) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, in_dim, generator=gen)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Timings in profiles are steadier with one thread on a shared two-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def toy_factory():
    """``(make_toy, toy_batch)``: test modules cannot import conftest under importlib mode."""
    return make_toy, toy_batch

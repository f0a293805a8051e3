"""A tiny dense + MoE model, its data and its single-process training, shared by the tests."""

import torch
from gem_parallel.moe import MoE, MoEConfig
from torch import nn

D_MODEL, D_HIDDEN, EXPERTS, TOP_K, TOKENS_PER_RANK, STEPS = 16, 32, 4, 2, 8, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = MoE(MoEConfig(D_MODEL, D_HIDDEN, EXPERTS, top_k=TOP_K))

    def forward(self, x):
        return x + self.moe(x)


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), MoEBlock(), Block()])
        self.head = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_model() -> TinyModel:
    torch.manual_seed(0)
    return TinyModel()


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches (inputs, targets) of ``world * TOKENS_PER_RANK`` rows, one per step."""
    g = torch.Generator().manual_seed(1)
    n = world * TOKENS_PER_RANK
    return [
        (torch.randn(n, D_MODEL, generator=g), torch.randn(n, D_MODEL, generator=g))
        for _ in range(STEPS)
    ]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train_single_process(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses (mean over the ranks' local losses) and final parameters, on one process."""
    model = make_model()
    opt = make_optimizer(model)
    losses = []
    for x, y in batches(world):
        per_rank = [
            nn.functional.mse_loss(model(xr), yr)
            for xr, yr in zip(x.chunk(world), y.chunk(world), strict=True)
        ]
        loss = torch.stack(per_rank).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}

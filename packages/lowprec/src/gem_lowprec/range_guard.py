"""Range guard for 32×32 MX tiles: fall back to 1×32 blocks when a tile would starve small rows.

One scale per 32×32 tile is set by the tile's largest element. A row (or column: the tile also
serves the transpose) whose own largest element sits ``s`` binades lower is quantized ``s``
binades further down the fp8 grid; past ~12 binades (E4M3 has 3 mantissa bits and reaches 2^−9
below its top) its values turn into subnormals and zeros. The mean SQNR of the tensor hardly
moves, the worst row's collapses, so the guard checks the worst row: the largest ratio, over all
tiles, between the tile's amax and the smallest non-zero row or column amax inside it. Above
``max_spread`` (default 10^3.5, where workloads.md measured the damage to start) the tensor is
quantized in 1×32 blocks along ``fallback_axis`` instead, and ``fallbacks`` counts it, for the
trainer to log beside ``calls``.
"""

from dataclasses import dataclass

import torch

from gem_lowprec.mx_tensor import MXTensor
from gem_lowprec.ops.mx_quantize import to_mx, to_mx_2d


@dataclass(frozen=True)
class RangeGuardConfig:
    max_spread: float = 10**3.5
    fallback_axis: int = -1


def tile_spread(x: torch.Tensor) -> float:
    """max over 32×32 tiles of (tile amax / smallest non-zero row or column amax in the tile)."""
    m, k = x.shape[-2], x.shape[-1]
    a = x.detach().abs().to(torch.float32).reshape(-1, m // 32, 32, k // 32, 32)
    row_amax = a.amax(dim=-1)  # [B, Mt, 32, Kt]
    col_amax = a.amax(dim=-3)  # [B, Mt, Kt, 32]
    tile_amax = row_amax.amax(dim=-2)  # [B, Mt, Kt]
    inf = torch.tensor(float("inf"), device=x.device)
    smallest_row = torch.where(row_amax > 0, row_amax, inf).amin(dim=-2)
    smallest_col = torch.where(col_amax > 0, col_amax, inf).amin(dim=-1)
    smallest = torch.minimum(smallest_row, smallest_col)
    ratio = torch.where(tile_amax > 0, tile_amax / smallest, torch.zeros_like(tile_amax))
    return float(ratio.max().item()) if ratio.numel() else 0.0


class RangeGuard:
    """``quantize(x)`` -> 32×32 MX, or 1×32 MX when the tiles would starve rows; counts both."""

    def __init__(self, config: RangeGuardConfig | None = None):
        self.config = config or RangeGuardConfig()
        self.calls = 0
        self.fallbacks = 0
        self.last_spread = 0.0

    def quantize(self, x: torch.Tensor, **mx_options) -> MXTensor:
        self.calls += 1
        self.last_spread = tile_spread(x)
        if self.last_spread > self.config.max_spread:
            self.fallbacks += 1
            return to_mx(x, axis=self.config.fallback_axis, **mx_options)
        return to_mx_2d(x, **mx_options)

    def counters(self) -> dict[str, int]:
        return {"range_guard_calls": self.calls, "range_guard_fallbacks": self.fallbacks}

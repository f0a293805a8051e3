"""The 32×32 range guard: keeps tiles for benign tensors, falls back (and counts) when a
32-row group spreads past 10^3.5, which is where 32×32 tiles starve the worst row."""

import torch
from gem_lowprec import to_mx_2d
from gem_lowprec.range_guard import RangeGuard, tile_spread


def worst_row_sqnr(x: torch.Tensor, deq: torch.Tensor) -> float:
    err = (deq - x).pow(2).sum(1)
    return (10 * torch.log10(x.pow(2).sum(1) / err.clamp(min=1e-30))).min().item()


def test_guard_keeps_tiles_for_gaussian_and_falls_back_for_spread_rows():
    gen = torch.Generator().manual_seed(0)
    guard = RangeGuard()
    x = torch.randn(64, 128, generator=gen)
    assert guard.quantize(x).layout.kind == "32x32"
    assert guard.counters() == {"range_guard_calls": 1, "range_guard_fallbacks": 0}

    spread = x.clone()
    spread[5] *= 10.0**-4.5  # one row 10^4.5 below the others in its 32-row group
    tiles = to_mx_2d(spread).dequantize()
    mx = guard.quantize(spread)
    assert mx.layout.kind == "1x32" and guard.fallbacks == 1 and guard.calls == 2
    assert guard.last_spread > 10**3.5
    # the starved row: tiles lose it, the fallback keeps ~31 dB
    assert worst_row_sqnr(spread, tiles) < 15.0
    assert worst_row_sqnr(spread, mx.dequantize()) > 29.0


def test_tile_spread_ignores_zero_rows():
    x = torch.ones(32, 32)
    x[3] = 0.0
    assert tile_spread(x) == 1.0

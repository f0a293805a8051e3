"""Inputs for testing MX quantizers bit for bit (used by this package's tests; reusable).

``all_finite_bf16`` is every finite bf16 bit pattern (±0, subnormals, the largest value);
``every_pattern_matrix`` arranges them twice, in bit order (blocks of like magnitude) and
shuffled (small values meet large scales), as a ``[*, 64]`` matrix whose row count is a multiple
of 32; ``special_matrix`` is a 64×64 bf16 matrix with a zero tile, NaN, ±Inf, subnormal blocks,
the largest bf16 and a negative zero.
"""

import torch

__all__ = ["all_finite_bf16", "every_pattern_matrix", "special_matrix"]


def all_finite_bf16() -> torch.Tensor:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    return x[torch.isfinite(x)]  # 65280 finite patterns (with ±0 and subnormals)


def every_pattern_matrix() -> torch.Tensor:
    """All finite bf16 patterns, twice: in bit order (blocks of like magnitude) and shuffled
    (blocks mixing magnitudes, so small elements meet large scales), as a [*, 64] matrix."""
    x = all_finite_bf16()
    shuffled = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    both = torch.cat([x, shuffled])
    return both[: both.numel() // 2048 * 2048].view(-1, 64)


def special_matrix() -> torch.Tensor:
    """64×64 bf16 with a zero block/tile, NaN, ±Inf, subnormals, the largest bf16, ±0 mixes."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[0:32, 0:32] = 0.0
    x[33, 32:64] = torch.tensor(2.0**-130).to(torch.bfloat16)  # subnormal row block
    x[34:64, 32:64] = torch.tensor(-(2.0**-133)).to(torch.bfloat16)
    x[32, 0] = float("nan")
    x[40, 33] = float("inf")
    x[0, 40] = -float("inf")
    x[5, 5] = -0.0
    big = torch.tensor([0x7F7F], dtype=torch.int16).view(torch.bfloat16)  # largest finite bf16
    x[10, 35] = big[0]
    x[11, 36] = -big[0]
    return x

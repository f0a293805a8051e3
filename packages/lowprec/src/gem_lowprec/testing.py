"""Inputs for testing MX quantizers bit for bit (used by this package's tests; reusable).

``all_finite_bf16`` is every finite bf16 bit pattern (±0, subnormals, the largest value);
``every_pattern_matrix`` arranges them twice, in bit order (blocks of like magnitude) and
shuffled (small values meet large scales), as a ``[*, 64]`` matrix whose row count is a multiple
of 32; ``special_matrix`` is a 64×64 bf16 matrix with a zero tile, NaN, ±Inf, subnormal blocks,
the largest bf16 and a negative zero; ``top_binade_matrix`` holds a dtype's largest magnitudes
(where an RCEIL scale meets the end of the dtype's range). ``assert_within_reference_error`` is
the project's tolerance rule for kernels that are not bit-exact (the fused SwiGLU gate).
"""

import math

import torch

__all__ = [
    "all_finite_bf16",
    "assert_within_reference_error",
    "every_pattern_matrix",
    "special_matrix",
    "top_binade_matrix",
]

_EPS = {
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
    torch.float32: 2.0**-23,
    torch.float64: 2.0**-52,
}


def all_finite_bf16() -> torch.Tensor:
    """Every finite bf16 bit pattern, in bit order, as a 1-D bf16 tensor of 65280 elements."""
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


def top_binade_matrix(dtype: torch.dtype) -> torch.Tensor:
    """128×128 of ``dtype`` (bfloat16, float16 or float32) at its largest magnitudes.

    Rows 0-31 are ±the largest finite value (every 1×32 block, 32×1 block and 32×32 tile of them
    holds nothing else); rows 32-127 hold every bit pattern of the top binade (float32: the
    1024 largest and 1024 spread over the binade) with both signs, one in four replaced by an
    ordinary value, shuffled so that blocks mix them.
    """
    info = torch.finfo(dtype)
    mbits = round(-math.log2(info.eps))
    top_exp = math.frexp(info.max)[1] - 1
    mantissas = torch.arange(1 << mbits, dtype=torch.float64)
    if mantissas.numel() > 2048:
        mantissas = torch.cat([mantissas[:: mantissas.numel() // 1024], mantissas[-1024:]])
    binade = (1 + mantissas / 2.0**mbits) * 2.0**top_exp
    gen = torch.Generator().manual_seed(2)
    tail = torch.cat([binade, -binade]).repeat(96 * 128 // (2 * binade.numel()) + 1)[: 96 * 128]
    ordinary = torch.randn(tail.shape, generator=gen, dtype=torch.float64)
    tail = torch.where(torch.rand(tail.shape, generator=gen) < 0.25, ordinary, tail)
    tail = tail[torch.randperm(tail.numel(), generator=gen)].view(96, 128)
    signs = torch.where(torch.rand(32, 128, generator=gen) < 0.5, -1.0, 1.0).double()
    return torch.cat([signs * info.max, tail]).to(dtype)


def _max_abs_err(x: torch.Tensor, ref64: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return (x.detach().to(torch.float64) - ref64.detach().to(torch.float64)).abs().max().item()


def assert_within_reference_error(
    actual: torch.Tensor,
    reference_lowp: torch.Tensor,
    reference_fp64: torch.Tensor,
    *,
    factor: float,
    name: str = "output",
    floor_ulps: float = 4.0,
) -> None:
    """Assert ``err(actual) <= factor * err(reference_lowp) + floor`` with errors against fp64.

    ``err`` is the largest absolute difference; ``floor`` is ``floor_ulps`` units of the low
    dtype's epsilon times the largest magnitude of the fp64 result (at least 1).

    Raises:
        AssertionError: a shape mismatch, a NaN the fp64 result does not have, or the bound
            exceeded.
    """
    if actual.shape != reference_fp64.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(reference_fp64.shape)}"
        )
    if torch.isnan(actual).any() and not torch.isnan(reference_fp64).any():
        raise AssertionError(f"{name}: holds NaN where the fp64 reference has none")
    err_actual = _max_abs_err(actual, reference_fp64)
    err_ref = _max_abs_err(reference_lowp, reference_fp64)
    scale = max(1.0, reference_fp64.detach().abs().max().item() if reference_fp64.numel() else 1.0)
    floor = floor_ulps * _EPS.get(actual.dtype, 2.0**-23) * scale
    bound = factor * err_ref + floor
    if not err_actual <= bound:
        raise AssertionError(
            f"{name}: max error {err_actual:.3e} against fp64 exceeds {factor}x the reference's "
            f"{err_ref:.3e} in {reference_lowp.dtype} (+ floor {floor:.1e}) = {bound:.3e}"
        )

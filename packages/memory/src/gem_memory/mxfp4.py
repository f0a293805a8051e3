"""MXFP4 packing for saved activations: E2M1 elements, one E8M0 scale per 32, two per byte.

gem_lowprec's MX formats have FP8 elements (E4M3, E5M2); this is the 4-bit element format of
the OCP MX spec, kept here in plain PyTorch because only saved activations use it.

- Blocks of 32 consecutive elements along the last dimension share a scale ``2^e``, stored as
  the byte ``e + 127``. The rule is RCEIL, as gem_lowprec and the hardware use: ``e`` is the
  smallest integer with ``amax / 2^e <= 6`` (6 is E2M1's largest value), clamped to
  [-127, 127]. Writing ``amax = m * 2^E`` with ``1 <= m < 2``, that is ``e = E - 2``, plus one
  when ``m > 1.5`` (the largest value is ``1.5 * 2^2``). An all-zero block gets ``e = -127``; a
  block holding Inf or NaN gets the byte 0xFF and unpacks as NaN.
- Elements ``x / 2^e`` (exact: a power of two) are rounded to nearest, ties to even, onto the
  E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at 6. The tie rule is spelled out below as
  comparisons against the midpoints; at each midpoint the neighbour with an even code wins.
- Codes are 4 bits (sign in bit 3), two per byte: element ``2k`` in the low nibble.
"""

from dataclasses import dataclass

import torch

__all__ = ["MXFP4", "to_mxfp4"]

BLOCK = 32
_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbours on the grid; a tie rounds up where the upper code is even.
_ROUND_DOWN_AT_TIE = (0.25, 1.25, 2.5, 5.0)  # lower neighbour's code is even
_ROUND_UP_AT_TIE = (0.75, 1.75, 3.5)  # upper neighbour's code is even


@dataclass
class MXFP4:
    """A tensor in MXFP4: E2M1 codes two per byte and one E8M0 scale (bias 127, 0xFF NaN) per 32
    elements along the last dimension, and the original shape."""

    codes: torch.Tensor  # uint8, [..., n / 2]: two E2M1 codes per byte
    scale: torch.Tensor  # uint8 E8M0, [..., n / 32]
    shape: torch.Size

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The values as ``dtype``, of the original shape (a NaN scale gives NaN)."""
        low, high = self.codes & 0xF, self.codes >> 4
        codes_N = torch.stack((low, high), dim=-1).reshape(*self.codes.shape[:-1], -1)
        grid = torch.tensor(_GRID, dtype=torch.float32, device=codes_N.device)
        magnitude = grid[(codes_N & 7).long()]
        values = torch.where((codes_N & 8) != 0, -magnitude, magnitude)
        exponent = self.scale.to(torch.int32) - 127
        power = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
        scale = torch.where(self.scale == 0xFF, torch.full_like(power, torch.nan), power)
        blocks = values.reshape(*scale.shape, BLOCK) * scale.unsqueeze(-1)
        return blocks.reshape(self.shape).to(dtype)


def to_mxfp4(x: torch.Tensor) -> MXFP4:
    """``x`` (any floating dtype, last dimension a multiple of 32) in MXFP4.

    Each block of 32 gets the scale ``2^e`` with ``e`` the smallest exponent that maps its amax
    to at most 6 (E2M1's largest value), clamped to [-127, 127] (-127 for an all-zero block; a
    block with Inf or NaN gets the NaN scale); elements round to nearest-even on the E2M1 grid.
    ``ValueError`` for a scalar or a last dimension not a multiple of 32.
    """
    if x.dim() == 0 or x.shape[-1] % BLOCK != 0:
        raise ValueError(
            f"x: expected a last dimension that is a multiple of {BLOCK}, got shape {tuple(x.shape)}"
        )
    blocks_KB = x.detach().to(torch.float32).reshape(*x.shape[:-1], -1, BLOCK)
    amax_K = blocks_KB.abs().amax(dim=-1)
    mantissa_K, exponent_K = torch.frexp(
        amax_K
    )  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    e_K = (exponent_K - 1) - 2 + (mantissa_K * 2 > 1.5).to(torch.int32)
    e_K = torch.where(amax_K > 0, e_K, torch.full_like(e_K, -127)).clamp(-127, 127)
    scale_K = torch.where(torch.isfinite(amax_K), e_K + 127, torch.full_like(e_K, 0xFF))
    y_KB = torch.ldexp(blocks_KB, -e_K.unsqueeze(-1))
    magnitude = y_KB.abs()
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for t in _ROUND_DOWN_AT_TIE:
        code += (magnitude > t).to(torch.uint8)
    for t in _ROUND_UP_AT_TIE:
        code += (magnitude >= t).to(torch.uint8)
    code |= (torch.signbit(y_KB) & (code > 0)).to(torch.uint8) << 3
    code_N = code.reshape(*x.shape[:-1], -1)
    packed = code_N[..., 0::2] | (code_N[..., 1::2] << 4)
    return MXFP4(packed.contiguous(), scale_K.to(torch.uint8), x.shape)

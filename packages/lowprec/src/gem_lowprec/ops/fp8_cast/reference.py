"""Row-wise and column-wise fp8 casts with power-of-two scales: the definition the kernels match.

A row-wise cast of ``x [R, C]`` gives every row one scale ``2^e``: the smallest power of two with
``amax_row / 2^e ≤ max_elem`` (448 for E4M3, 57344 for E5M2), i.e. the MX "rceil" rule applied
to a whole row, with ``e`` stored as an E8M0 byte. Power-of-two scales (torchao's rowwise recipe
rounds its scales the same way) make ``x / 2^e`` exact, so the only rounding is the one
round-to-nearest-even into the element format, saturated to ±max; the bits are those of the MX
codec's integer encoder (``gem_lowprec.codec``) with one block per row.

A column-wise cast gives every column one scale over all rows and stores the result transposed
(``[C, R]``, the operand layout a GEMM contracting over R wants). It may first multiply row ``r``
by a power of two ``row_mult[r]`` (exact in float32 while the product stays normal): that folds
the per-token scale of the other operand of a weight-gradient GEMM into this one (see
``gem_lowprec.linear``).
"""

import torch
from gem_lowprec.codec import ElemFormat, encode, fp32_bits, scale_bytes, scale_to_float

_INF_BITS = 0x7F800000
_QUIET_NAN_BITS = 0x7FC00000


def _scaled_rows(x: torch.Tensor, row_mult: torch.Tensor | None) -> torch.Tensor:
    v = x.to(torch.float32)
    return v if row_mult is None else v * row_mult.to(torch.float32)[:, None]


def column_amax(x: torch.Tensor, row_mult: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[C]``: ``max_r |x[r, c] · row_mult[r]|``; a column holding a NaN gets the
    canonical quiet NaN ``0x7FC00000`` whatever the NaN's payload (a GPU multiply does not keep
    payloads, a CPU one does: canonical bits keep the kernels and this bit-identical)."""
    bits = (fp32_bits(_scaled_rows(x, row_mult)) & 0x7FFFFFFF).amax(dim=0)
    return torch.where(bits > _INF_BITS, _QUIET_NAN_BITS, bits).view(torch.float32)


def cast_rows(x: torch.Tensor, fmt: ElemFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` -> (fp8 bytes uint8 ``[R, C]``, float32 scales ``[R]``), one scale per row."""
    bits = fp32_bits(x)
    byte = scale_bytes((bits & 0x7FFFFFFF).amax(dim=1, keepdim=True), fmt, "rceil")
    return encode(bits, byte, fmt), scale_to_float(byte.squeeze(1))


def cast_columns_transposed(
    x: torch.Tensor, fmt: ElemFormat, row_mult: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` (rows first multiplied by ``row_mult``) -> (fp8 bytes uint8 ``[C, R]``,
    float32 scales ``[C]``), one scale per column, the bytes stored transposed."""
    bits = fp32_bits(_scaled_rows(x, row_mult)).t()
    byte = scale_bytes((bits & 0x7FFFFFFF).amax(dim=1, keepdim=True), fmt, "rceil")
    return encode(bits, byte, fmt).contiguous(), scale_to_float(byte.squeeze(1))

"""MX quantization in plain PyTorch integer arithmetic: the definition every kernel must match.

Why integers: the element rounding is "x / 2^e, rounded to nearest-even into E4M3/E5M2,
saturated, subnormals kept". Doing that with float arithmetic and a cast works only where the
cast is exactly right (Triton's interpreter, for one, rounds fp32 -> fp8 wrongly), and the scale
rule needs ``floor(log2(amax))``, which float ``log2`` gets wrong near powers of two. So the
reference reads the float32 bits and does everything on integers:

1. The block's amax comes from the largest ``|x|`` bit pattern (bit patterns of non-negative
   floats order like their values). A pattern ``>= 0x7F800000`` means a NaN or ±Inf in the block:
   the scale byte is 0xFF and every element is NaN.
2. Scale: with ``amax = m · 2^E`` and biased exponent field ``Eb``, the byte is
   ``Eb − emax_exp`` (FLOOR) plus one when RCEIL and ``m > 1.75`` (mantissa field > 0x600000),
   clamped to [0, 254]. A zero or subnormal amax lands on byte 0 (e = −127).
3. Element: ``|x| = sig · 2^lsb`` with an integer significand. The scaled value's exponent
   ``E = floor(log2|x|) − e`` fixes the grid step ``2^(max(E, emin) − mbits)``; shifting ``sig``
   right by the difference of exponents with round-half-even gives the integer ``n`` of steps, and
   the E4M3/E5M2 bit pattern is ``((max(E, emin) − emin) << mbits) + n`` (a carry into the next
   binade falls out of the addition). Saturation is ``min(bits, max_bits)``; the sign is put back
   last, so a value that rounds to zero keeps its sign, as a hardware cast does.

Stochastic rounding replaces the half-even step by adding ``r`` bits of noise below the kept bit
before truncating (unbiased in expectation). The noise is a counter-based hash of the seed and
the element's flat index in ``x`` with the block axis moved last, so any kernel can reproduce it. Elements more than 32 bits below
the kept bit (below ~2^−8 of the format's smallest subnormal step) round to zero.
"""

import torch
from gem_lowprec.formats import SCALE_NAN, ElemFormat

_FP32_INF_BITS = 0x7F800000
_RCEIL_MANTISSA = 0x600000  # mantissa field of 1.75


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 holding values in [0, 2^32)."""
    m = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & m
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """The per-seed offset added to element indices before hashing (shared with the kernels).

    Plain Python integers (the same arithmetic as ``lowbias32``): every kernel launch asks for
    it, and a round of small tensor ops would cost more host time than the kernel itself."""
    m = 0xFFFFFFFF
    x = seed & m
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def stochastic_noise(flat_index: torch.Tensor, seed: int) -> torch.Tensor:
    """32 random bits per element, a function of (flat index, seed) only."""
    return lowbias32((flat_index.to(torch.int64) + seed_key(seed)) & 0xFFFFFFFF)


def fp32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous().view(torch.int32)


def scale_bytes(amax_bits: torch.Tensor, fmt: ElemFormat, scale_mode: str) -> torch.Tensor:
    """E8M0 byte for blocks whose largest ``|x|`` has float32 bits ``amax_bits`` (int32)."""
    biased_exp = amax_bits >> 23
    byte = biased_exp - fmt.emax_exp
    if scale_mode == "rceil":
        byte = byte + ((amax_bits & 0x7FFFFF) > _RCEIL_MANTISSA).to(torch.int32)
    byte = byte.clamp(0, 254)
    byte = torch.where(amax_bits >= _FP32_INF_BITS, torch.full_like(byte, SCALE_NAN), byte)
    return byte.to(torch.uint8)


def encode(
    x_bits: torch.Tensor, scale: torch.Tensor, fmt: ElemFormat, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """fp8 bit patterns (uint8) of ``x / 2^(scale − 127)``; ``scale`` broadcasts against ``x_bits``.

    ``noise`` (int64 in [0, 2^32)) switches from round-half-even to stochastic rounding.
    """
    wide = torch.int64 if noise is not None else torch.int32  # sig + noise needs 33 bits
    bits = x_bits.to(torch.int32)
    sign = (bits >> 31) & 1
    magnitude = bits & 0x7FFFFFFF
    biased_exp = magnitude >> 23
    mantissa = magnitude & 0x7FFFFF
    normal = biased_exp > 0
    sig = torch.where(normal, mantissa | 0x800000, mantissa)
    lsb_exp = biased_exp.clamp(min=1) - 150  # |x| = sig * 2^lsb_exp
    # floor(log2 |x|): the exponent field, or for subnormals the top set bit of the mantissa
    # (read from the exact int -> float32 conversion of the mantissa).
    top_bit = (mantissa.to(torch.float32).view(torch.int32) >> 23) - 127
    log2_x = torch.where(normal, biased_exp - 127, top_bit - 149)

    e = scale.to(torch.int32) - 127
    exp_scaled = torch.maximum(log2_x - e, torch.full_like(log2_x, fmt.emin))
    step_exp = exp_scaled - fmt.mbits
    shift = (e + step_exp - lsb_exp).clamp(min=0)

    if noise is None:
        shift = shift.clamp(max=30)  # sig < 2^24: any shift beyond 25 already gives 0
        n = sig >> shift
        remainder = sig - (n << shift)
        half = (1 << shift) >> 1
        round_up = (remainder > half) | ((remainder == half) & (half > 0) & ((n & 1) == 1))
        n = n + round_up.to(torch.int32)
    else:
        in_reach = shift <= 32
        shift_c = shift.clamp(max=32).to(wide)
        n = (sig.to(wide) + (noise >> (32 - shift_c))) >> shift_c
        n = torch.where(in_reach, n, 0).to(torch.int32)

    out = ((exp_scaled - fmt.emin) << fmt.mbits) + n
    out = torch.where(sig == 0, torch.zeros_like(out), out).clamp(max=fmt.max_bits)
    out = torch.where(scale == SCALE_NAN, torch.full_like(out, fmt.nan_bits), out | (sign << 7))
    return out.to(torch.uint8)


def _blocks_last(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)


def quantize_1d(
    x: torch.Tensor, fmt: ElemFormat, *, axis: int, scale_mode: str, seed: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 along ``axis``. Returns (data uint8 shaped like x, scale uint8 with
    ``x.shape[axis] // 32`` along ``axis``)."""
    axis = axis % x.dim()
    bits = _blocks_last(fp32_bits(x).movedim(axis, -1))
    amax = (bits & 0x7FFFFFFF).amax(dim=-1, keepdim=True)
    scale = scale_bytes(amax, fmt, scale_mode)
    noise = None
    if seed is not None:
        # The noise index is the flat index in x with the block axis moved last (x itself for
        # axis=-1; x.T for axis 0 of a matrix): what a kernel writing that layout counts.
        moved_shape = x.movedim(axis, -1).shape
        flat = torch.arange(x.numel(), dtype=torch.int64).view(moved_shape)
        noise = stochastic_noise(_blocks_last(flat), seed)
    data = encode(bits, scale, fmt, noise)
    data = data.flatten(-2).movedim(-1, axis)
    return data, scale.squeeze(-1).movedim(-1, axis)


def quantize_2d(
    x: torch.Tensor, fmt: ElemFormat, *, scale_mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """32×32 tiles over the last two dims. Returns (data like x, scale [..., M/32, N/32])."""
    *lead, m, n = x.shape
    bits = fp32_bits(x).reshape(*lead, m // 32, 32, n // 32, 32)
    amax = (bits & 0x7FFFFFFF).amax(dim=(-3, -1), keepdim=True)
    scale = scale_bytes(amax, fmt, scale_mode)
    data = encode(bits, scale, fmt).reshape(x.shape)
    return data, scale.reshape(*lead, m // 32, n // 32)


def dequantize(data_bits: torch.Tensor, scale_full: torch.Tensor, elem_dtype, dtype):
    """``fp8(data) · 2^e`` in float32 (exact), then cast; ``scale_full`` already broadcast."""
    from gem_lowprec.formats import scale_to_float

    values = data_bits.view(elem_dtype).to(torch.float32) * scale_to_float(scale_full)
    return values.to(dtype)

"""The MX codec: element formats, the E8M0 scale rule, element encode and decode, in integers.

Everything the quantizers, the fp8 casts and ``MXTensor`` need to know about the bits lives
here, once; the Triton kernels carry the same rules as ``@triton.jit`` helpers
(``gem_lowprec._triton_codec``), checked against these bit for bit.

**Formats.** An MX block stores one E8M0 scale byte (``e + 127``; ``0xFF`` is NaN) and 32
low-precision elements. The two element formats differ only in how many mantissa bits they keep
and how far their exponent reaches; everything about them sits in one ``ElemFormat``:

- ``mbits``: mantissa bits (3 for E4M3, 2 for E5M2),
- ``emin``: exponent of the smallest normal (−6, −14); below it the grid is evenly spaced
  (subnormals) with step ``2^(emin − mbits)``,
- ``emax_exp``: exponent of the largest finite value (8, 15); that value is ``1.75 · 2^emax_exp``
  (448, 57344) for both formats,
- ``max_bits`` / ``nan_bits``: the byte of the largest finite value and of the NaN we write.

``ElemFormat.kernel_constants`` is the same description as the kernels' constexpr arguments, so
a launcher passes one object and never spells the seven values out.

**Why integers.** The element rounding is "x / 2^e, rounded to nearest-even into E4M3/E5M2,
saturated, subnormals kept". Doing that with float arithmetic and a cast works only where the
cast is exactly right (Triton's interpreter, for one, rounds fp32 -> fp8 wrongly), and the scale
rule needs ``floor(log2(amax))``, which float ``log2`` gets wrong near powers of two. So the
codec reads the float32 bits and does everything on integers:

1. A block's amax comes from the largest ``|x|`` bit pattern (bit patterns of non-negative
   floats order like their values). A pattern ``>= 0x7F800000`` means a NaN or ±Inf in the block:
   the scale byte is 0xFF and every element is NaN.
2. Scale (``scale_bytes``): with ``amax = m · 2^E`` and biased exponent field ``Eb``, the byte is
   ``Eb − emax_exp`` (FLOOR) plus one when RCEIL and ``m > 1.75`` (mantissa field > 0x600000),
   clamped to [0, 254]. A zero or subnormal amax lands on byte 0 (e = −127). ``1.75 ·
   2^emax_exp`` being the largest value is why RCEIL needs only the amax's exponent and one
   mantissa comparison: ``amax`` fits below the largest value at ``e = E − emax_exp`` exactly
   when ``m ≤ 1.75``, else it needs ``e + 1``.
3. Element (``encode``): ``|x| = sig · 2^lsb`` with an integer significand. The scaled value's
   exponent ``E = floor(log2|x|) − e`` fixes the grid step ``2^(max(E, emin) − mbits)``;
   shifting ``sig`` right by the difference of exponents with round-half-even gives the integer
   ``n`` of steps, and the E4M3/E5M2 bit pattern is ``((max(E, emin) − emin) << mbits) + n`` (a
   carry into the next binade falls out of the addition). Saturation is ``min(bits,
   max_bits)``, with ``max_bits`` lowered where the range of the input's dtype ends (below);
   the sign is put back last, so a value that rounds to zero keeps its sign, as a hardware
   cast does.
4. Decode (``decode``): ``fp8 · 2^e`` in float32 is exact (byte 0 is 2^−127, a float32
   subnormal; 0xFF is NaN).

**Where the input's range ends.** RCEIL scales a block's amax into the format's top binade, and
the rounding can carry it into the next: the largest bf16, ``1.99 · 2^127``, gets ``e = 120``
and rounds to ``256 · 2^120 = 2^128``, past float32. So an element also saturates at the
largest element value ``v`` with ``v · 2^e < 2^(range_emax + 1)``, where ``range_emax`` is the
exponent of the largest binade of the quantized tensor's dtype (``range_emax``: 127 for float32
and bfloat16, 15 for float16; ``range_max_bits`` gives the bit pattern per block). Every finite
input then dequantizes to a finite value, in float32 and in its own dtype. It changes only
RCEIL blocks whose elements reach the last 1/32 (E4M3) or 1/16 (E5M2) of the dtype's top binade
(they become ``1.875 · 2^range_emax`` and ``1.75 · 2^range_emax``; with stochastic rounding any
element above those may), never a FLOOR block: FLOOR's ``e = E − emax_exp`` saturates at
``1.75 · 2^E`` by the format's own maximum. The scale byte itself never needs the clamp at 254
for a finite input (the largest is ``254 − emax_exp + 1``).

Stochastic rounding replaces the half-even step by adding ``r`` bits of noise below the kept bit
before truncating (unbiased in expectation). The noise is a counter-based hash (``lowbias32``)
of the seed and the element's flat index in ``x`` with the block axis moved last, so any kernel
can reproduce it. Elements more than 32 bits below the kept bit (below ~2^−8 of the format's
smallest subnormal step) round to zero.
"""

import math
import types
from dataclasses import dataclass, field

import torch

__all__ = [
    "E4M3",
    "E5M2",
    "SCALE_BIAS",
    "SCALE_NAN",
    "ElemFormat",
    "decode",
    "elem_format",
    "encode",
    "fp32_bits",
    "lowbias32",
    "range_emax",
    "range_max_bits",
    "scale_bytes",
    "scale_to_float",
    "seed_key",
    "stochastic_noise",
]

SCALE_NAN = 0xFF
SCALE_BIAS = 127
_FP32_INF_BITS = 0x7F800000
_RCEIL_MANTISSA = 0x600000  # mantissa field of 1.75


@dataclass(frozen=True)
class ElemFormat:
    """One fp8 element format, described by the numbers the codec needs (see the module)."""

    name: str
    dtype: torch.dtype
    mbits: int
    emin: int
    emax_exp: int
    max_bits: int
    nan_bits: int
    kernel_constants: types.MappingProxyType = field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self):
        # Built once per format: launchers splice it into every launch's keywords.
        constants = {
            "E4M3": self.name == "e4m3",
            "MBITS": self.mbits,
            "EMIN": self.emin,
            "EMAX_EXP": self.emax_exp,
            "MAX_BITS": self.max_bits,
            "MAX_VALUE": self.max_value,
            "NAN_BITS": self.nan_bits,
        }
        object.__setattr__(self, "kernel_constants", types.MappingProxyType(constants))

    @property
    def max_value(self) -> float:
        """The largest finite element, ``1.75 · 2^emax_exp`` (448 for E4M3, 57344 for E5M2)."""
        return 1.75 * 2.0**self.emax_exp


E4M3 = ElemFormat("e4m3", torch.float8_e4m3fn, 3, -6, 8, 0x7E, 0x7F)
E5M2 = ElemFormat("e5m2", torch.float8_e5m2, 2, -14, 15, 0x7B, 0x7F)
_FORMATS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}


def elem_format(elem_dtype: torch.dtype) -> ElemFormat:
    """The ``ElemFormat`` of ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Raises:
        TypeError: any other dtype.
    """
    if elem_dtype not in _FORMATS:
        raise TypeError(
            f"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype}"
        )
    return _FORMATS[elem_dtype]


def range_emax(dtype: torch.dtype) -> int:
    """The exponent of the largest binade of a float dtype: 127 for float32 and bfloat16, 15 for
    float16 (every finite value of it is below ``2^(range_emax + 1)``)."""
    return math.frexp(torch.finfo(dtype).max)[1] - 1


def range_max_bits(scale: torch.Tensor, fmt: ElemFormat, range_emax: int) -> torch.Tensor:
    """Per block (int32, the shape of ``scale``): the largest element bit pattern whose value
    times ``2^(scale − 127)`` stays below ``2^(range_emax + 1)``, at most ``fmt.max_bits``.

    That value is ``(2 − 2^−mbits) · 2^(range_emax − e)``, the last of binade ``range_emax − e``,
    whose exponent field is ``range_emax − e − emin + 1``. A finite input of the dtype gets
    ``e ≤ range_emax − emax_exp + 1``, so the binade is one of the format's normal ones (the
    formula is not meant for larger ``e``: a NaN block's byte gets some limit, and NaN data)."""
    e = scale.to(torch.int32) - SCALE_BIAS
    return (((range_emax - e - fmt.emin + 2) << fmt.mbits) - 1).clamp(0, fmt.max_bits)


def fp32_bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns of ``x`` (any float dtype, widened exactly) as int32."""
    return x.to(torch.float32).contiguous().view(torch.int32)


def scale_bytes(amax_bits: torch.Tensor, fmt: ElemFormat, scale_mode: str) -> torch.Tensor:
    """E8M0 bytes (uint8, the shape of ``amax_bits``) of blocks whose largest ``|x|`` has the
    float32 bits ``amax_bits`` (int32), by ``scale_mode`` ``"rceil"`` or ``"floor"``."""
    biased_exp = amax_bits >> 23
    byte = biased_exp - fmt.emax_exp
    if scale_mode == "rceil":
        byte = byte + ((amax_bits & 0x7FFFFF) > _RCEIL_MANTISSA).to(torch.int32)
    byte = byte.clamp(0, 254)
    byte = torch.where(amax_bits >= _FP32_INF_BITS, torch.full_like(byte, SCALE_NAN), byte)
    return byte.to(torch.uint8)


def encode(
    x_bits: torch.Tensor,
    scale: torch.Tensor,
    fmt: ElemFormat,
    noise: torch.Tensor | None = None,
    *,
    range_emax: int | None = None,
) -> torch.Tensor:
    """fp8 bit patterns (uint8) of ``x / 2^(scale − 127)``.

    Args:
        x_bits: float32 bit patterns of x (int32), any shape.
        scale: E8M0 bytes broadcasting against ``x_bits``.
        fmt: the element format.
        noise: int64 in [0, 2^32), like ``x_bits``; switches from round-half-even to
            stochastic rounding.
        range_emax: ``range_emax`` of the dtype x came from: elements also saturate where
            their value times the scale would leave that dtype's range (``range_max_bits``).
            None saturates at the format's maximum only (a cast whose result a GEMM scales
            in float32, not an MX tensor to dequantize).
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
    out = torch.where(sig == 0, torch.zeros_like(out), out)
    if range_emax is None:
        out = out.clamp(max=fmt.max_bits)
    else:
        out = torch.minimum(out, range_max_bits(scale, fmt, range_emax))
    out = torch.where(scale == SCALE_NAN, torch.full_like(out, fmt.nan_bits), out | (sign << 7))
    return out.to(torch.uint8)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 ``2^(byte − 127)`` (byte 0 is 2^−127, a float32 subnormal; 0xFF NaN)."""
    byte = scale.to(torch.int32)
    normal = (byte << 23).view(torch.float32)
    out = torch.where(byte == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(byte == SCALE_NAN, torch.full_like(out, float("nan")), out)


def decode(
    data: torch.Tensor, scale_per_element: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``fp8(data) · 2^e``, exact in float32, then cast to ``dtype``.

    Args:
        data: float8 (E4M3 or E5M2) elements, any shape.
        scale_per_element: E8M0 bytes broadcasting against ``data`` (one per element).
        dtype: the result's dtype.
    """
    return (data.to(torch.float32) * scale_to_float(scale_per_element)).to(dtype)


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
    """32 random bits per element (int64), a function of (flat index, seed) only."""
    return lowbias32((flat_index.to(torch.int64) + seed_key(seed)) & 0xFFFFFFFF)

"""The MX codec's rules as ``@triton.jit`` helpers, shared by every quantize and cast kernel.

These are the integer rules of ``gem_lowprec.codec`` (the scale byte, the element encoder, the
decoder, the stochastic-rounding hash) plus the hardware-cast encoder, written for Triton:

- ``scale_byte``: the E8M0 byte of a block amax (RCEIL or FLOOR), 255 for NaN/Inf.
- ``scale_float``: that byte as a float32 power of two (byte 0 the subnormal 2^−127).
- ``load_as_float32``: bf16 widened by a shift (exact for subnormals, which the interpreter's
  bf16 cast flushes).
- ``encode``: on a GPU (``HW_CONVERT``) multiply by ``2^−e`` (exact in float32 until the result
  drops below 2^−126, which rounds to zero in fp8 either way; a NaN/Inf block multiplies by NaN)
  and let the hardware's round-to-nearest-even ``satfinite`` cast do the rest: it saturates to
  ±max and turns NaN into the format's NaN byte, so each element costs one multiply and half a
  packed cast instruction. Under the interpreter and for stochastic rounding, ``encode_int``,
  the codec's integer encoder. Both are checked bit for bit against the reference.
- ``range_max_bits``: with ``RANGE_EMAX`` (an MX quantizer's input dtype, ``codec.range_emax``)
  an element also saturates where its value times the scale would leave that dtype's range,
  so that every finite input dequantizes to a finite value (``gem_lowprec.codec``). The
  integer encoder lowers its ``min(bits, MAX_BITS)`` to that per-block limit at no cost; the
  hardware path clamps the scaled value to the limit's value before the cast (one clamp per
  element, NaN kept). ``RANGE_EMAX=None`` (the fp8 casts, the re-encode of a merge, whose
  values are in range already) saturates at the format's maximum only.
- ``decode``: fp8 bytes back to exact float32.

The element format arrives as the constexprs of ``ElemFormat.kernel_constants`` (``E4M3``,
``MBITS``, ``EMIN``, ``EMAX_EXP``, ``MAX_BITS``, ``MAX_VALUE``, ``NAN_BITS``); the MX kernels
add ``RANGE_EMAX`` for their input dtype.
"""

import triton
import triton.language as tl


@triton.jit
def scale_byte(amax_bits, EMAX_EXP: tl.constexpr, RCEIL: tl.constexpr):
    """E8M0 byte (int32) of blocks whose amax has float32 bits ``amax_bits``; 255 for NaN/Inf."""
    byte = (amax_bits >> 23) - EMAX_EXP
    if RCEIL:
        byte += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    byte = tl.minimum(tl.maximum(byte, 0), 254)
    return tl.where(amax_bits >= 0x7F800000, 255, byte)


@triton.jit
def load_as_float32(ptrs, mask, IN_BF16: tl.constexpr):
    """Load and widen to float32. bf16 arrives as int16 bits and is widened by a shift (exact for
    subnormals too, which the interpreter's bf16 cast flushes)."""
    if IN_BF16:
        raw = tl.load(ptrs, mask=mask, other=0)
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def lowbias32(x):
    """Wellons' 32-bit hash on int64 values in [0, 2^32) (same as the reference)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def range_max_bits(
    byte,
    RANGE_EMAX: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    MAX_BITS: tl.constexpr,
):
    """Per block: the largest element bits whose value times ``2^(byte − 127)`` stays below
    ``2^(RANGE_EMAX + 1)``, at most ``MAX_BITS`` (the codec's ``range_max_bits``)."""
    bits = ((RANGE_EMAX - (byte - 127) - EMIN + 2) << MBITS) - 1
    return tl.minimum(tl.maximum(bits, 0), MAX_BITS)


@triton.jit
def encode_hw(
    x_f32,
    byte,
    max_bits,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    RANGE_EMAX: tl.constexpr,
):
    """fp8 bytes of x / 2^(byte − 127) through the hardware round-to-nearest-even cast.

    Per block (``byte`` is a block vector broadcast against ``x_f32``): ``2^−e``, or NaN for a
    NaN/Inf block, so that every element of such a block becomes NaN by the product alone. Per
    element: one multiply and the ``satfinite`` cast, which saturates to ±max and maps NaN to the
    format's NaN byte (0x7F for both formats), as the reference does. With ``RANGE_EMAX`` the
    product is first clamped to the value of the block's ``max_bits`` (NaN passes through)."""
    inv_scale = (tl.maximum(254 - byte, 1) << 23).to(tl.float32, bitcast=True)  # 2^−e
    inv_scale = tl.where(byte == 255, float("nan"), inv_scale)
    v = x_f32 * inv_scale
    if RANGE_EMAX is not None:
        limit = decode(max_bits, E4M3, MBITS, EMIN, True)
        v = tl.clamp(v, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    if E4M3:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return v.to(tl.float8e5).to(tl.uint8, bitcast=True)


@triton.jit
def encode_int(
    x_bits,
    byte,
    noise,
    max_bits,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    NAN_BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """fp8 bytes of x / 2^(byte − 127) by integer arithmetic (the reference's ``encode``),
    saturated at ``max_bits`` (``MAX_BITS``, or a block's ``range_max_bits``)."""
    sign = (x_bits >> 31) & 1
    magnitude = x_bits & 0x7FFFFFFF
    biased_exp = magnitude >> 23
    mantissa = magnitude & 0x7FFFFF
    normal = biased_exp > 0
    sig = tl.where(normal, mantissa | 0x800000, mantissa)
    lsb_exp = tl.maximum(biased_exp, 1) - 150
    top_bit = (mantissa.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    log2_x = tl.where(normal, biased_exp - 127, top_bit - 149)
    e = byte - 127
    exp_scaled = tl.maximum(log2_x - e, EMIN)
    shift = tl.maximum(e + exp_scaled - MBITS - lsb_exp, 0)
    if STOCHASTIC:
        shift_c = tl.minimum(shift, 32).to(tl.int64)
        n64 = (sig.to(tl.int64) + (noise >> (32 - shift_c))) >> shift_c
        n = tl.where(shift <= 32, n64, 0).to(tl.int32)
    else:
        shift = tl.minimum(shift, 30)
        n = sig >> shift
        remainder = sig - (n << shift)
        half = (tl.full(shift.shape, 1, tl.int32) << shift) >> 1
        round_up = (remainder > half) | ((remainder == half) & (half > 0) & ((n & 1) == 1))
        n = n + round_up.to(tl.int32)
    out = ((exp_scaled - EMIN) << MBITS) + n
    out = tl.minimum(tl.where(sig == 0, 0, out), max_bits)
    return tl.where(byte == 255, NAN_BITS, out | (sign << 7))


@triton.jit
def encode(
    x_f32,
    byte,
    noise,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NAN_BITS: tl.constexpr,
    HW_CONVERT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    RANGE_EMAX: tl.constexpr,
):
    """uint8 fp8 bytes of ``x_f32 / 2^(byte − 127)``, ``byte`` broadcast per block. The hardware
    cast on a GPU, the integer encoder under the interpreter and for stochastic rounding (with
    ``noise``, 32 random bits per element). ``MAX_VALUE`` stays in the shared signature (the
    fp8 casts pass it): the ``satfinite`` cast saturates at it by itself. ``RANGE_EMAX``: the
    input dtype's ``range_emax`` (saturate where its range ends too), or None."""
    if RANGE_EMAX is None:
        max_bits = MAX_BITS
    else:
        max_bits = range_max_bits(byte, RANGE_EMAX, MBITS, EMIN, MAX_BITS)
    if HW_CONVERT and not STOCHASTIC:
        return encode_hw(x_f32, byte, max_bits, E4M3, MBITS, EMIN, RANGE_EMAX)
    x_bits = x_f32.to(tl.int32, bitcast=True)
    q = encode_int(x_bits, byte, noise, max_bits, MBITS, EMIN, NAN_BITS, STOCHASTIC)
    return q.to(tl.uint8)


@triton.jit
def decode(
    q, E4M3: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, HW_CONVERT: tl.constexpr
):
    """fp8 bytes (int32) -> exact float32 values (NaN bytes are the caller's business)."""
    if HW_CONVERT:
        if E4M3:
            return q.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return q.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
    exp_field = (q & 0x7F) >> MBITS
    mantissa = q & ((1 << MBITS) - 1)
    normal_bits = ((exp_field - (1 - EMIN) + 127) << 23) | (mantissa << (23 - MBITS))
    subnormal = mantissa.to(tl.float32) * (2.0 ** (EMIN - MBITS))
    magnitude = tl.where(exp_field > 0, normal_bits.to(tl.float32, bitcast=True), subnormal)
    return tl.where((q & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def scale_float(byte):
    """float32 ``2^(byte − 127)``: byte 0 is the subnormal 2^−127, byte 255 NaN."""
    bits = tl.where(byte == 0, 0x00400000, byte << 23)
    return tl.where(byte == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)

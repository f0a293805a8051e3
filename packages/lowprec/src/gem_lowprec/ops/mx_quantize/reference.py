"""MX quantization in plain PyTorch integer arithmetic: the definition every kernel must match.

``quantize_1d`` (blocks of 32 along one axis) and ``quantize_2d`` (32×32 tiles) take each
block's amax from the largest ``|x|`` bit pattern and apply the codec's scale rule and element
encoder (``gem_lowprec.codec``: why integers, and the bit-level rules), saturating where x's
dtype's range ends, so that every finite input dequantizes to a finite value. ``merge_k128``
turns 1×32 MX blocks along K into the 1×128 blocks of Hopper's blockwise fp8 GEMM.
"""

import torch
from gem_lowprec.codec import (
    SCALE_NAN,
    ElemFormat,
    encode,
    fp32_bits,
    range_emax,
    scale_bytes,
    scale_to_float,
    stochastic_noise,
)
from gem_lowprec.mx_tensor import MXTensor


def _blocks_last(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)


def quantize_1d(
    x: torch.Tensor, fmt: ElemFormat, *, axis: int, scale_mode: str, seed: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 along ``axis``. Returns (data uint8 shaped like x, scale uint8 with
    ``x.shape[axis] // 32`` along ``axis``); ``seed`` (not None) rounds stochastically."""
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
    data = encode(bits, scale, fmt, noise, range_emax=range_emax(x.dtype))
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
    data = encode(bits, scale, fmt, range_emax=range_emax(x.dtype)).reshape(x.shape)
    return data, scale.reshape(*lead, m // 32, n // 32)


def merge_k128(mx: MXTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1×32 MX along the last dim of ``[R, K]`` (K % 128 == 0) -> (fp8 ``[R, K]`` contiguous,
    float32 scales ``[R, K/128]``) with ``value = fp8 · scale`` per 1×128 block.

    Each run of four E8M0 scales along K becomes one 1×128 scale, their maximum ``e_max``, and
    the fp8 values of the smaller blocks shift down by ``e_max − e`` whole binades (a multiply
    by a power of two: exact while the value stays normal; values pushed below the normal range
    are rounded to nearest-even in the element format, as any fp8 cast does).

    Raises:
        ValueError: ``mx`` is not in 1×32 blocks along dim 1, or K is not a multiple of 128.
    """
    r, k = mx.shape
    if mx.layout.kind != "1x32" or mx.layout.axis != 1:
        raise ValueError(f"merge_k128 needs 1x32 blocks along the last dim, got {mx.layout}")
    if k % 128:
        raise ValueError(f"merge_k128 needs K to be a multiple of 128, got K={k}")
    byte = mx.scale.contiguous().to(torch.int32).view(r, k // 128, 4)
    byte_max = byte.amax(dim=-1, keepdim=True)
    shift = byte_max - byte  # whole binades each block's values move down
    down = torch.where(
        shift >= 127,
        torch.zeros_like(shift, dtype=torch.float32),
        ((127 - shift) << 23).view(torch.float32),
    )
    values = mx.data.contiguous().to(torch.float32).view(r, k // 128, 4, 32) * down[..., None]
    nan_block = (byte_max == SCALE_NAN)[..., None]
    values = torch.where(nan_block, torch.full_like(values, float("nan")), values)
    data = values.to(mx.elem_dtype).view(r, k)
    return data, scale_to_float(byte_max.squeeze(-1).to(torch.uint8))

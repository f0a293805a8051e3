"""The MX element formats and the input checks every quantizer shares.

An MX block stores one E8M0 scale byte (``e + 127``; ``0xFF`` is NaN) and 32 low-precision
elements. The two element formats differ only in how many mantissa bits they keep and how far
their exponent reaches; everything the quantizers need about them sits in ``ElemFormat``:

- ``mbits``: mantissa bits (3 for E4M3, 2 for E5M2),
- ``emin``: exponent of the smallest normal (−6, −14); below it the grid is evenly spaced
  (subnormals) with step ``2^(emin − mbits)``,
- ``emax_exp``: exponent of the largest finite value (8, 15); that value is ``1.75 · 2^emax_exp``
  (448, 57344) for both formats,
- ``max_bits`` / ``nan_bits``: the byte of the largest finite value and of the NaN we write.

``1.75 · 2^emax_exp`` is why the RCEIL rule needs only the amax's exponent and one mantissa
comparison: ``amax = m · 2^E`` (``1 ≤ m < 2``) fits below the largest value at ``e = E − emax_exp``
exactly when ``m ≤ 1.75``, else it needs ``e + 1``.
"""

from dataclasses import dataclass

import torch

SCALE_NAN = 0xFF
SCALE_BIAS = 127
SCALE_MODES = ("rceil", "floor")
ROUNDINGS = ("nearest", "stochastic")
BACKENDS = ("auto", "triton", "reference")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class ElemFormat:
    name: str
    dtype: torch.dtype
    mbits: int
    emin: int
    emax_exp: int
    max_bits: int
    nan_bits: int

    @property
    def max_value(self) -> float:
        return 1.75 * 2.0**self.emax_exp


E4M3 = ElemFormat("e4m3", torch.float8_e4m3fn, 3, -6, 8, 0x7E, 0x7F)
E5M2 = ElemFormat("e5m2", torch.float8_e5m2, 2, -14, 15, 0x7B, 0x7F)
FORMATS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}


def elem_format(elem_dtype) -> ElemFormat:
    if elem_dtype not in FORMATS:
        raise TypeError(
            f"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype}"
        )
    return FORMATS[elem_dtype]


def check_input(x, *, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{name} must be bfloat16, float16 or float32 to be quantized, got {x.dtype}"
        )
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")


def check_options(*, scale_mode: str, rounding: str = "nearest", backend: str = "auto") -> None:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_block_size(block_size: int) -> None:
    if block_size != 32:
        raise ValueError(
            f"block_size must be 32 (the MX block; E8M0 scales serve 32 elements), got {block_size}"
        )


def check_divisible(x: torch.Tensor, dim: int, block: int, *, what: str) -> None:
    if x.shape[dim] % block != 0:
        raise ValueError(
            f"x has size {x.shape[dim]} along dim {dim}, which must be a multiple of the {what} "
            f"{block}; pad x (zeros leave every other block unchanged) or pick another axis"
        )


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` takes Triton on CUDA tensors and the reference on CPU tensors."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return backend


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 ``2^(byte − 127)`` (byte 0 is 2^−127, a float32 subnormal; 0xFF NaN)."""
    byte = scale.to(torch.int32)
    normal = (byte << 23).view(torch.float32)
    out = torch.where(byte == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(byte == SCALE_NAN, torch.full_like(out, float("nan")), out)

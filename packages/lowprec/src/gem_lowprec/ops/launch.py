"""How the Triton launchers choose a launch: launch shapes, the element encoder, the SM count.

By default every choice follows the tensor: on a CUDA device (and not under Triton's
interpreter) the GPU launch shapes and the hardware fp8 cast; otherwise the interpreter's
launch shapes (few, large programs: each interpreted program is a round of numpy calls) and the
integer encoder (the interpreter's fp32 -> fp8 cast rounds wrongly). ``Launch`` makes each
choice explicit, so that a test can run the GPU launch shapes under the interpreter, or an
offline compile for sm_90 can ask for the GPU's code paths on CPU tensors, by passing an
argument instead of patching module attributes.
"""

from dataclasses import dataclass
from enum import StrEnum

import torch
from gem_lowprec._checks import triton_interpreting

__all__ = ["AUTO_LAUNCH", "INTERPRETING", "Encoder", "Launch", "Shapes"]

INTERPRETING = triton_interpreting()


class Shapes(StrEnum):
    """Which launch-shape table a launcher uses."""

    AUTO = "auto"  # GPU shapes on CUDA tensors outside the interpreter, else the interpreter's
    GPU = "gpu"
    INTERPRETER = "interpreter"


class Encoder(StrEnum):
    """How the kernels round float32 to fp8 (both give the reference's bits)."""

    AUTO = "auto"  # the hardware cast on CUDA tensors outside the interpreter, else integers
    HARDWARE = "hardware"  # multiply by 2^-e, then the satfinite round-to-nearest-even cast
    INTEGER = "integer"  # the codec's integer encoder (stochastic rounding always uses it)


@dataclass(frozen=True)
class Launch:
    """A launcher's choices. ``sm_count`` sizes the persistent grid of the fp8 rows cast
    (None: the device's)."""

    shapes: Shapes = Shapes.AUTO
    encoder: Encoder = Encoder.AUTO
    sm_count: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "shapes", Shapes(self.shapes))
        object.__setattr__(self, "encoder", Encoder(self.encoder))
        if self.sm_count is not None and self.sm_count < 1:
            raise ValueError(f"sm_count must be a positive int or None, got {self.sm_count!r}")

    def gpu_shapes(self, x: torch.Tensor) -> bool:
        """Whether the launch for ``x`` takes the GPU launch shapes."""
        if self.shapes is Shapes.AUTO:
            return x.is_cuda and not INTERPRETING
        return self.shapes is Shapes.GPU

    def hardware_encoder(self, x: torch.Tensor) -> bool:
        """Whether the launch for ``x`` encodes with the hardware fp8 cast."""
        if self.encoder is Encoder.AUTO:
            return x.is_cuda and not INTERPRETING
        return self.encoder is Encoder.HARDWARE


AUTO_LAUNCH = Launch()

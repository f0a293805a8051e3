"""``MXTensor``: MX data, its E8M0 scales and the block layout, with exact dequantization.

An MXTensor is a plain container, not a ``torch.Tensor`` subclass: it holds

- ``data``: float8 (E4M3 or E5M2) with the shape of the quantized tensor (possibly a strided
  view: the column-wise copy of a matrix is stored ``[K, M]`` and exposed as its transpose),
- ``scale``: uint8 E8M0 bytes (``e + 127``; 0xFF = NaN), one per block,
- ``layout``: ``MXLayout(kind="1x32", axis=a)`` (blocks of 32 along dim ``a``; ``scale`` has the
  data's shape with dim ``a`` divided by 32) or ``MXLayout(kind="32x32")`` (tiles over the last two
  dims; ``scale`` is ``[..., M/32, N/32]``).

``t()`` / ``mT`` return the transposed view without copying bytes. For 32×32 tiles one scale
serves a tile and its transpose, so the same bytes feed the forward GEMM and the transposed
backward GEMM; for 1×32 blocks the block axis moves with the transpose.
"""

from dataclasses import dataclass

import torch

from gem_lowprec.codec import decode, scale_to_float


@dataclass(frozen=True)
class MXLayout:
    """Where an MXTensor's blocks lie: ``"1x32"`` along ``axis``, or ``"32x32"`` tiles."""

    kind: str  # "1x32" or "32x32"
    axis: int | None = None  # non-negative block axis for "1x32"
    block_size: int = 32


class MXTensor:
    """MX data, its E8M0 scales and their layout (see the module docstring).

    Args:
        data: float8_e4m3fn or float8_e5m2, the quantized tensor's shape.
        scale: uint8 E8M0 bytes, the shape ``layout`` gives for ``data``.
        layout: an ``MXLayout``.

    Raises:
        TypeError: data not float8, or scale not uint8.
        ValueError: scale's shape does not match data's in ``layout``.
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, layout: MXLayout):
        if data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError(f"data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
        if scale.dtype != torch.uint8:
            raise TypeError(f"scale must hold uint8 E8M0 bytes, got {scale.dtype}")
        expected = _scale_shape(tuple(data.shape), layout)
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"scale has shape {tuple(scale.shape)}, expected {expected} for data of shape "
                f"{tuple(data.shape)} in layout {layout}"
            )
        self.data = data
        self.scale = scale
        self.layout = layout

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def elem_dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def scale_per_element(self) -> torch.Tensor:
        """The scale bytes broadcast to the data's shape (a copy)."""
        if self.layout.kind == "1x32":
            return self.scale.repeat_interleave(32, dim=self.layout.axis)
        return self.scale.repeat_interleave(32, dim=-2).repeat_interleave(32, dim=-1)

    def scale_float(self) -> torch.Tensor:
        """The scales as float32 powers of two (NaN for 0xFF), one per block."""
        return scale_to_float(self.scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``fp8 · 2^e`` computed exactly in float32, then cast to ``dtype``.

        Finite for every finite input, in float32 and in the quantized tensor's own dtype: the
        quantizers saturate an element that would round past that dtype's range (the largest
        bf16 becomes ``240 · 2^120``, not ``256 · 2^120 = 2^128``; ``gem_lowprec.codec``).
        """
        return decode(self.data, self.scale_per_element(), dtype)

    def t(self) -> "MXTensor":
        """The transpose of a 2-D MXTensor, sharing its bytes (``mT``)."""
        if self.data.dim() != 2:
            raise ValueError(f"t() needs a 2-D MXTensor, this one has shape {tuple(self.shape)}")
        return self.mT

    @property
    def mT(self) -> "MXTensor":
        """The transpose of the last two dims, sharing the bytes; a 1×32 block axis among them
        moves with it."""
        nd = self.data.dim()
        if nd < 2:
            raise ValueError("mT needs at least 2 dimensions")
        layout = self.layout
        if layout.kind == "1x32" and layout.axis in (nd - 2, nd - 1):
            layout = MXLayout("1x32", axis=(2 * nd - 3) - layout.axis)
        return MXTensor(self.data.mT, self.scale.mT, layout)

    def __repr__(self) -> str:
        return (
            f"MXTensor(shape={tuple(self.shape)}, elem_dtype={self.elem_dtype}, "
            f"layout={self.layout}, device={self.device})"
        )


def _scale_shape(shape: tuple, layout: MXLayout) -> tuple:
    if layout.kind == "1x32":
        axis = layout.axis
        return tuple(s // 32 if d == axis else s for d, s in enumerate(shape))
    if layout.kind == "32x32":
        return (*shape[:-2], shape[-2] // 32, shape[-1] // 32)
    raise ValueError(f"layout.kind must be '1x32' or '32x32', got {layout.kind!r}")

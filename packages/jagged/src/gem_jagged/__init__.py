"""gem_jagged: attention over jagged sequences that never pads.

Three ops, each a ``torch.library`` custom op with a readable PyTorch reference and a Triton
kernel (``backend="auto"`` takes Triton on CUDA tensors, the reference on CPU tensors):

- ``jagged_flash_attention``: softmax attention per sequence, self or cross, causal aligned
  bottom-right, optional learned relative bias.
- ``gdpa``: generalized dot-product attention (an activation such as SiLU in place of softmax)
  for self-attention, cross-attention over short K/V, and PMA pooling with shared seeds.
- ``block_attention``: softmax attention inside fixed blocks of tokens with fused RoPE.

Jagged tensors follow torchrec: ``values [T, ...]`` plus ``offsets [B+1]``. What is known about
one batch's offsets (checked values, the range of lengths, each op's tile work lists) lives in a
``JaggedBatch`` that the model builds once per batch and passes to every call in place of the
offsets tensor (``gem_jagged.batch``); ``JaggedBatch.from_host`` checks host offsets on the
host as it moves them. The ops are imported on first use, so ``import gem_jagged`` stays cheap
and does not import triton.
"""

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("gem-jagged")
except PackageNotFoundError:  # the source tree on PYTHONPATH (the GPU image), not installed
    __version__ = "0.1.0"

# Type checkers read these imports; at run time ``__getattr__`` below imports on first use.
if TYPE_CHECKING:
    from gem_jagged.batch import JaggedBatch
    from gem_jagged.ops.block_attention import block_attention
    from gem_jagged.ops.gdpa import gdpa
    from gem_jagged.ops.jagged_flash_attention import jagged_flash_attention

_OPS = {
    "jagged_flash_attention": "gem_jagged.ops.jagged_flash_attention",
    "gdpa": "gem_jagged.ops.gdpa",
    "block_attention": "gem_jagged.ops.block_attention",
    "JaggedBatch": "gem_jagged.batch",
}

__all__ = ["JaggedBatch", "block_attention", "gdpa", "jagged_flash_attention"]


def __getattr__(name: str):
    if name in _OPS:
        return getattr(importlib.import_module(_OPS[name]), name)
    raise AttributeError(f"module 'gem_jagged' has no attribute {name!r}")

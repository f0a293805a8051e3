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

_OPS = {
    "jagged_flash_attention": "gem_jagged.ops.jagged_flash_attention",
    "gdpa": "gem_jagged.ops.gdpa",
    "block_attention": "gem_jagged.ops.block_attention",
    "JaggedBatch": "gem_jagged.batch",
}

__all__ = list(_OPS)


def __getattr__(name: str):
    if name in _OPS:
        return getattr(importlib.import_module(_OPS[name]), name)
    raise AttributeError(f"module 'gem_jagged' has no attribute {name!r}")

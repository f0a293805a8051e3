"""BlockAttention's launch configuration: program warps and pipeline stages, picked by one function.

A ``BlockAttentionConfig`` is a frozen value the caller passes to the launchers (``config=``);
nothing is read from module state. ``config_for(block_size=, head_dim=)`` gives the kernels 8
warps when a block's tile (its token count rounded up to a power of two, at least 16, times the
head dim) holds 64 × 128 elements or more, 4 below: the whole block's scores and operands live
in the registers of one program, and a small tile on 8 warps leaves most lanes idle.
"""

from dataclasses import dataclass

from gem_jagged._intmath import next_power_of_2

__all__ = ["BlockAttentionConfig", "config_for", "padded_block"]


@dataclass(frozen=True, kw_only=True)
class BlockAttentionConfig:
    """Warps of the forward and of the backward programs, and pipeline stages of both."""

    fwd_warps: int
    bwd_warps: int
    stages: int = 1

    def as_ints(self) -> list[int]:
        """``[fwd_warps, bwd_warps, stages]``, the form a ``torch.library`` custom op carries."""
        return [self.fwd_warps, self.bwd_warps, self.stages]

    @classmethod
    def from_ints(cls, values: list[int]) -> "BlockAttentionConfig":
        """The inverse of ``as_ints``."""
        fwd_warps, bwd_warps, stages = values
        return cls(fwd_warps=fwd_warps, bwd_warps=bwd_warps, stages=stages)


def padded_block(block_size: int) -> int:
    """The kernels' ``BLOCK``: ``block_size`` rounded up to a power of two, at least 16."""
    return max(16, next_power_of_2(block_size))


def config_for(*, block_size: int, head_dim: int) -> BlockAttentionConfig:
    """The configuration for blocks of ``block_size`` tokens (1 to 128) and head dim H."""
    big = padded_block(block_size) * head_dim >= 64 * 128
    return BlockAttentionConfig(fwd_warps=8 if big else 4, bwd_warps=8 if big else 4)

"""Triton pieces every jagged kernel of the package shares: where a sequence lies, and which
work-list slot and head a program takes.

The three attention ops (jagged flash attention, GDPA, BlockAttention) walk the same packed
layout: sequence ``b`` holds rows ``offsets_Bp1[b] : offsets_Bp1[b + 1]`` of a ``[T, N, H]``
tensor, and a program of a work-list launch (``gem_jagged._worklist``) handles one tile of one
head. These helpers are ``@jit`` functions, inlined into each kernel that calls them.
"""

import triton.language as tl

from gem_jagged._jit import jit

__all__ = ["load_sequence", "slot_and_head"]


@jit
def load_sequence(offsets_Bp1, seq):
    """``(first row, length)`` of sequence ``seq``: the row as int64, so that ``row · stride``
    cannot overflow on batches of more than 2³¹ elements, the length as int32."""
    begin = tl.load(offsets_Bp1 + seq).to(tl.int64)
    end = tl.load(offsets_Bp1 + seq + 1).to(tl.int64)
    return begin, (end - begin).to(tl.int32)


@jit
def slot_and_head(num_heads, HEADS_OUTER: tl.constexpr):
    """This program's work-list slot and head.

    With ``HEADS_OUTER`` program ``pid`` takes slot ``pid mod W`` of head ``pid div W`` (one
    head's tiles, heaviest first, then the next head's), so the programs running at once stream
    one head's rows, which can stay in L2; otherwise the heads of one slot run side by side.
    The kernel's caller picks the order per kernel (``docs/design/jagged_flash_attention.md``
    has the measurements).
    """
    pid = tl.program_id(0)
    if HEADS_OUTER:
        num_slots = tl.num_programs(0) // num_heads
        slot = pid % num_slots
        head = pid // num_slots
    else:
        slot = pid // num_heads
        head = pid % num_heads
    return slot, head

"""Integer helpers for host code (grids, block sizes).

``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function`` objects: called from
Python they unwrap every argument first, several microseconds a call, and an fp8 linear's
forward + backward makes a dozen such calls (``docs/design/jagged.md`` has the measurement).
These give the same integers for plain ints.
"""


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)``."""
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for 0, as ``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0

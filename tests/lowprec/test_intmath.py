import pytest
import triton
from gem_lowprec._intmath import cdiv, next_power_of_2


@pytest.mark.parametrize(
    "n", [0, 1, 2, 3, 15, 16, 17, 1000, 1024, 1025, 2**31 - 1, 2**31, 2**40 + 3]
)
def test_host_helpers_equal_tritons(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)
    for d in (1, 2, 16, 128, 1000):
        assert cdiv(n, d) == triton.cdiv(n, d)

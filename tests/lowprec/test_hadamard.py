"""The random Hadamard transform of the fp8 weight-gradient: exact inverse, GEMM invariance,
outlier spreading, and the block sizes a recipe accepts."""

import pytest
import torch
from gem_lowprec import recipe
from gem_lowprec.hadamard import inverse_random_hadamard, random_hadamard


def test_hadamard_round_trip_and_gemm_invariance():
    gen = torch.Generator().manual_seed(3)
    for block in (16, 64, 256):
        x = torch.randn(8, 512, generator=gen)
        y = random_hadamard(x, block_size=block, seed=5)
        torch.testing.assert_close(
            inverse_random_hadamard(y, block_size=block, seed=5), x, rtol=0, atol=1e-5
        )
        b = torch.randn(4, 512, generator=gen)
        torch.testing.assert_close(
            y @ random_hadamard(b, block_size=block, seed=5).t(), x @ b.t(), rtol=1e-4, atol=1e-4
        )
        assert not torch.allclose(y, x)
    # spreads an outlier: its block's max drops by ~sqrt(block)
    spike = torch.zeros(1, 256)
    spike[0, 3] = 100.0
    assert random_hadamard(spike, block_size=256, seed=1).abs().max() < 100.0 / 15
    with pytest.raises(ValueError, match="block_size"):
        random_hadamard(x, block_size=24)
    with pytest.raises(ValueError, match="hadamard_block"):
        recipe("mxfp8", weight_grad="fp8", hadamard_block=512)

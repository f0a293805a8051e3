"""Random Hadamard transform: seeded random signs, then a fast Walsh–Hadamard transform on blocks.

For a block size ``b`` (a power of two, 16..256) and a dimension of length ``L`` (a multiple of
``b``), ``Q = blockdiag(H_b) · diag(s) / sqrt(b)`` with ``H_b`` the Sylvester Hadamard matrix and
``s`` a seeded ±1 vector of length ``L``. ``Q`` is orthogonal, so applying it to both operands of a
GEMM along the contraction dim leaves the product unchanged up to rounding:
``(A Qᵀ)(B Qᵀ)ᵀ = A Qᵀ Q Bᵀ = A Bᵀ``. Its point is to spread outliers across a block before an
fp8 cast (most useful for the weight-gradient, whose operands are gradients and activations).
``inverse_random_hadamard`` undoes it exactly in exact arithmetic (and to rounding in float).

The transform runs in float32: ``log2(b)`` butterfly stages, each adding and subtracting the two
halves of every sub-block.
"""

import torch


def _check(x: torch.Tensor, block_size: int, dim: int) -> int:
    if block_size < 16 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [16, 256], got {block_size}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim() - 1}], got {dim}")
    dim = dim % x.dim()
    if x.shape[dim] % block_size:
        raise ValueError(
            f"x has size {x.shape[dim]} along dim {dim}, not a multiple of block_size {block_size}"
        )
    return dim


def random_signs(length: int, seed: int, device) -> torch.Tensor:
    """float32 ``[length]`` of ±1 drawn from a CPU generator seeded with ``seed``, on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (length,), generator=gen) * 2 - 1).to(device, torch.float32)


def fwht(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Unnormalized Walsh–Hadamard transform over blocks of the last dim (float32)."""
    shape = x.shape
    y = x.reshape(-1, shape[-1] // block_size, block_size)
    h = 1
    while h < block_size:
        y = y.view(y.shape[0], y.shape[1], block_size // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(shape)


def random_hadamard(
    x: torch.Tensor, *, block_size: int = 128, seed: int = 0, dim: int = -1
) -> torch.Tensor:
    """``x`` times ``Qᵀ`` along ``dim``.

    Args:
        x: any float tensor; ``x.shape[dim]`` a multiple of ``block_size``.
        block_size: the Hadamard block, a power of two in [16, 256].
        seed: the seed of the random signs (the same seed for both operands of a GEMM).
        dim: the transformed dim.

    Returns:
        float32, x's shape.

    Raises:
        ValueError: a bad block size, dim out of range, or a length not a multiple of it.
    """
    dim = _check(x, block_size, dim)
    xt = x.movedim(dim, -1).to(torch.float32)
    signs = random_signs(xt.shape[-1], seed, x.device)
    out = fwht(xt * signs, block_size) * block_size**-0.5
    return out.movedim(-1, dim)


def inverse_random_hadamard(
    y: torch.Tensor, *, block_size: int = 128, seed: int = 0, dim: int = -1
) -> torch.Tensor:
    """Undo ``random_hadamard`` with the same block size, seed and dim (float32 result, y's
    shape; the errors of ``random_hadamard``)."""
    dim = _check(y, block_size, dim)
    yt = y.movedim(dim, -1).to(torch.float32)
    signs = random_signs(yt.shape[-1], seed, y.device)
    return (fwht(yt, block_size) * block_size**-0.5 * signs).movedim(-1, dim)

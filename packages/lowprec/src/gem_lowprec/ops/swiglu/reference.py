"""The SwiGLU gate in plain PyTorch: ``h = silu(a) ⊙ b`` from ``u = [a | b]``, and its gradient
by the closed-form formulas of the module ``gem_lowprec.ops.swiglu``."""

import torch
import torch.nn.functional as F


def swiglu_reference(u: torch.Tensor) -> torch.Tensor:
    """``silu(u[..., :F]) * u[..., F:]`` for ``u [..., 2F]`` with PyTorch's ops (autograd saves
    ``silu(a)``; the result is rounded twice in low precision, as the unfused model does)."""
    a, b = u.chunk(2, dim=-1)
    return F.silu(a) * b


def swiglu_backward_reference(u: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """``du = [da | db]`` (the dtype and shape of ``u``) for ``u [..., 2F]`` and ``dh [..., F]``,
    computed in float32 (float64 stays float64)."""
    a, b = u.chunk(2, dim=-1)
    work = torch.promote_types(u.dtype, torch.float32)
    a, b, dh32 = a.to(work), b.to(work), dh.to(work)
    sig = torch.sigmoid(a)
    da = dh32 * b * sig * (1 + a * (1 - sig))
    return torch.cat([da, dh32 * a * sig], dim=-1).to(u.dtype)

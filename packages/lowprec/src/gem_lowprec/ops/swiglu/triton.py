"""Triton kernels of the fused SwiGLU gate: one pass forward, one pass backward.

Legend: ``T`` rows (tokens), ``F`` the gate's width, ``u_TF2`` the ``[T, 2F]`` input ``[a | b]``,
``h_TF`` the output, ``du_TF2`` the input gradient; a program holds ``[BLOCK_R, BLOCK_C]`` of h.
Everything is computed in float32 and rounded once to the tensors' dtype.
"""

import torch
import triton
import triton.language as tl

BLOCK_R, BLOCK_C = 8, 512  # a program gates 8 rows × 512 columns of h (on the CPU too)
# The token count changes with every jagged batch: specialising on it (divisible by 16, equal to
# 1) would compile new variants as batches come.
_jit = triton.jit(do_not_specialize=["n_rows"])


@_jit
def _swiglu_fwd_kernel(u_TF2, h_TF, n_rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows_R = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols_C = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_RC = (rows_R < n_rows)[:, None] & (cols_C < width)[None, :]
    a_RC = tl.load(u_TF2 + rows_R[:, None] * (2 * width) + cols_C[None, :], mask=mask_RC, other=0.0)
    b_RC = tl.load(
        u_TF2 + rows_R[:, None] * (2 * width) + width + cols_C[None, :], mask=mask_RC, other=0.0
    )
    a_RC, b_RC = a_RC.to(tl.float32), b_RC.to(tl.float32)
    h_RC = a_RC * tl.sigmoid(a_RC) * b_RC
    out = h_TF + rows_R[:, None] * width + cols_C[None, :]
    tl.store(out, h_RC.to(h_TF.dtype.element_ty), mask=mask_RC)


@_jit
def _swiglu_bwd_kernel(
    u_TF2, dh_TF, du_TF2, n_rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    rows_R = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols_C = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_RC = (rows_R < n_rows)[:, None] & (cols_C < width)[None, :]
    a_ptr = u_TF2 + rows_R[:, None] * (2 * width) + cols_C[None, :]
    a_RC = tl.load(a_ptr, mask=mask_RC, other=0.0).to(tl.float32)
    b_RC = tl.load(a_ptr + width, mask=mask_RC, other=0.0).to(tl.float32)
    dh_RC = tl.load(dh_TF + rows_R[:, None] * width + cols_C[None, :], mask=mask_RC, other=0.0)
    dh_RC = dh_RC.to(tl.float32)
    sig_RC = tl.sigmoid(a_RC)
    da_RC = dh_RC * b_RC * sig_RC * (1.0 + a_RC * (1.0 - sig_RC))
    db_RC = dh_RC * a_RC * sig_RC
    da_ptr = du_TF2 + rows_R[:, None] * (2 * width) + cols_C[None, :]
    tl.store(da_ptr, da_RC.to(du_TF2.dtype.element_ty), mask=mask_RC)
    tl.store(da_ptr + width, db_RC.to(du_TF2.dtype.element_ty), mask=mask_RC)


def _grid(rows: int, width: int) -> tuple[int, int]:
    return -(-rows // BLOCK_R), -(-width // BLOCK_C)  # not triton.cdiv: a slow host call


def swiglu_forward_triton(u: torch.Tensor) -> torch.Tensor:
    """``h [T, F]`` of ``u [T, 2F]`` (any float dtype; made contiguous)."""
    u = u.contiguous()
    rows, width = u.shape[0], u.shape[1] // 2
    h = u.new_empty(rows, width)
    if rows and width:
        grid = _grid(rows, width)
        _swiglu_fwd_kernel[grid](u, h, rows, width, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return h


def swiglu_backward_triton(u: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """``du [T, 2F]`` of ``u [T, 2F]`` and ``dh [T, F]`` (the dtype of u)."""
    u, dh = u.contiguous(), dh.contiguous()
    rows, width = dh.shape
    du = torch.empty_like(u)
    if rows and width:
        grid = _grid(rows, width)
        _swiglu_bwd_kernel[grid](u, dh, du, rows, width, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return du

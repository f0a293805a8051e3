"""The SwiGLU gate in one pass: ``h = silu(a) ⊙ b`` from ``u = [a | b]``, and its gradient.

The feed-forward computes ``a`` and ``b`` with one linear of twice the hidden width (``u = x
W13ᵀ``, ``[T, 2F]``: one GEMM, and under a low-precision recipe one quantization of ``x``), then
gates. As separate PyTorch ops the gate is two elementwise kernels forward (``silu``, then the
product, with ``silu(a)`` written out and read back) and four backward, and autograd keeps
``silu(a)`` as well as ``a`` and ``b``: at gem-small's 53K tokens × 2816 each tensor is 300 MB,
and a block moves about 3.8 GB through memory for the gate alone. Fused, the forward reads
``a, b`` and writes ``h`` (0.9 GB); the backward reads ``dh, a, b`` and writes ``da, db``
(1.5 GB), recomputing ``silu`` on the fly; only ``u`` is saved.

With ``σ = sigmoid(a)``:

    h  = a σ b
    da = dh · b · σ (1 + a (1 − σ))
    db = dh · a σ

Everything is computed in float32 and rounded once to the inputs' dtype (the unfused ops round
``silu(a)`` before the product). ``swiglu_reference`` is the formula in PyTorch; CUDA tensors take
the Triton kernels, CPU tensors ``swiglu_reference`` and ``swiglu_backward_reference`` (the tests
run the kernels on the CPU through the Triton interpreter). A ``torch.library`` custom op with a
fake implementation, so ``torch.compile`` traces through it.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_R, BLOCK_C = 8, 512  # a program gates 8 rows × 512 columns of h (on the CPU too)
# The token count changes with every jagged batch: specialising on it (divisible by 16, equal to
# 1) would compile new variants as batches come (``gem_jagged._jit`` says more).
_jit = triton.jit(do_not_specialize=["n_rows"])


def swiglu_reference(u: torch.Tensor) -> torch.Tensor:
    a, b = u.chunk(2, dim=-1)
    return F.silu(a) * b


def swiglu_backward_reference(u: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """``du = [da | db]`` by the formulas above, in float32 (float64 stays float64)."""
    a, b = u.chunk(2, dim=-1)
    work = torch.promote_types(u.dtype, torch.float32)
    a, b, dh32 = a.to(work), b.to(work), dh.to(work)
    sig = torch.sigmoid(a)
    da = dh32 * b * sig * (1 + a * (1 - sig))
    return torch.cat([da, dh32 * a * sig], dim=-1).to(u.dtype)


def _check(u: torch.Tensor) -> None:
    if u.dim() != 2 or u.shape[1] % 2:
        raise ValueError(f"u: expected [T, 2F] (an even last dim), got {tuple(u.shape)}")
    if not u.is_floating_point():
        raise ValueError(f"u: expected a floating dtype, got {u.dtype}")


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
    u = u.contiguous()
    rows, width = u.shape[0], u.shape[1] // 2
    h = u.new_empty(rows, width)
    if rows and width:
        grid = _grid(rows, width)
        _swiglu_fwd_kernel[grid](u, h, rows, width, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return h


def swiglu_backward_triton(u: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    u, dh = u.contiguous(), dh.contiguous()
    rows, width = dh.shape
    du = torch.empty_like(u)
    if rows and width:
        grid = _grid(rows, width)
        _swiglu_bwd_kernel[grid](u, dh, du, rows, width, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return du


@torch.library.custom_op("gem_train::swiglu", mutates_args=())
def _swiglu_op(u: torch.Tensor) -> torch.Tensor:
    if u.is_cuda:
        return swiglu_forward_triton(u)
    return swiglu_reference(u)


@_swiglu_op.register_fake
def _(u):
    return u.new_empty(u.shape[0], u.shape[1] // 2)


@torch.library.custom_op("gem_train::swiglu_backward", mutates_args=())
def _swiglu_backward_op(u: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    if u.is_cuda:
        return swiglu_backward_triton(u, dh)
    return swiglu_backward_reference(u, dh)


@_swiglu_backward_op.register_fake
def _(u, dh):
    return torch.empty_like(u)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dh):
    (u,) = ctx.saved_tensors
    return _swiglu_backward_op(u, dh)


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(u: torch.Tensor) -> torch.Tensor:
    """``silu(u[..., :F]) * u[..., F:]`` for ``u [..., 2F]``, fused on CUDA (see the module)."""
    lead = u.shape[:-1]
    u2 = u.reshape(-1, u.shape[-1])
    _check(u2)
    return _swiglu_op(u2).reshape(*lead, u.shape[-1] // 2)

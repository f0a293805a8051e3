"""The fp8 forward and backward of ``LowPrecisionLinear``, one ``autograd.Function`` per recipe.

For ``x [M, K]`` (leading dims flattened) and ``W [N, K]`` the three GEMMs are phrased the same
way, ``a @ bᵀ`` with both operands stored row-major along the contraction dim (the only fp8
layout Hopper's tensor cores take, so ``torch._scaled_mm`` gets ``b.t()`` as a free view):

| GEMM            | a                  | b                   | contraction |
|-----------------|--------------------|---------------------|-------------|
| forward y       | x, along K         | W, along K          | K           |
| input-grad dx   | dy, along N        | Wᵀ, along N         | N           |
| weight-grad dW  | dyᵀ, along M       | xᵀ, along M         | M (tokens)  |

``fp8_rowwise``: one power-of-two scale per row of each operand (``gem_lowprec.ops.fp8_cast``).
W is cast both ways per forward (rows for y, columns for dx; ``cast_both``: one read for the
amaxes, one for both casts) and Wᵀ stays for the backward. x is cast once by a kernel that
reads it once; dy likewise (a transposed copy, where one is needed, is a byte transpose of the
cast). The fp8 weight-gradient contracts over tokens, where a per-token scale cannot sit
outside the GEMM; it is folded into the other operand instead: ``dW = Σ_m dy[m,:]ᵀ x[m,:] =
Σ_m q_dy[m,:]ᵀ (s_m · x[m,:])`` with ``dy[m,:] ≈ s_m · q_dy[m,:]`` (s_m a power of two, so
``s_m · x`` is exact), and ``s_m · x`` gets one scale per column. The row-cast bytes of dy serve
both dx and dW (row-major and transposed). Which operand takes the fold is chosen by size: when
K > N the roles swap (x's per-token scale from the forward folds into dy, and the forward saves
xᵀ in fp8 instead of x).

``mxfp8``: every operand is MX-quantized along its contraction dim and merged into 1×128 blocks
(``quantize_mx_k128``), then the blockwise fp8 GEMM. W is quantized along both dims by one
kernel (``quantize_mx_k128_rowcol``) in the forward and Wᵀ kept for dx; with an fp8
weight-gradient x and dy are too (the forward keeps xᵀ in fp8 instead of x).

A BF16 weight-gradient (the default) is ``dyᵀ @ x`` in dy's dtype.
"""

import torch

from gem_lowprec.hadamard import random_hadamard
from gem_lowprec.ops.fp8_cast import cast_both, cast_columns, cast_rows
from gem_lowprec.ops.mx_quantize import quantize_mx_k128, quantize_mx_k128_rowcol
from gem_lowprec.recipes import Recipe
from gem_lowprec.scaled_matmul import blockwise_matmul, rowwise_matmul


class UnitScales:
    """float32 ones ``[n]`` per (n, device), the unit scales of a folded operand: read-only, so
    one per shape serves every backward of its layer (a fresh one is an allocation and a fill
    kernel per backward). Each ``LowPrecisionLinear`` owns one."""

    def __init__(self):
        self._ones: dict[tuple[int, torch.device], torch.Tensor] = {}

    def get(self, n: int, device: torch.device) -> torch.Tensor:
        key = (n, device)
        if key not in self._ones:
            self._ones[key] = torch.ones(n, dtype=torch.float32, device=device)
        return self._ones[key]


def fp8_weight_grad(recipe: Recipe, m: int) -> bool:
    """Whether a call with ``m`` tokens computes its weight-gradient in fp8: asked for, and the
    tokens a multiple of the recipe's block (and of the Hadamard block, if any)."""
    if recipe.weight_grad.precision != "fp8":
        return False
    block = recipe.weight_grad.hadamard_block or 1
    return m % max(128 if recipe.name == "mxfp8" else 16, block) == 0


class _RowwiseMatmul(torch.autograd.Function):
    """fp8_rowwise: see the module docstring for the fold of the weight-gradient's scales."""

    @staticmethod
    def forward(ctx, x, w, recipe: Recipe, out_dtype: torch.dtype, ones: UnitScales):
        q = recipe.quant
        (m, k), n = x.shape, w.shape[0]
        fp8_wgrad = fp8_weight_grad(recipe, m)
        # The smaller of x [M, K] and dy [M, N] takes the two-pass column cast (Hadamard: x).
        fold_into_dy = fp8_wgrad and k > n and recipe.weight_grad.hadamard_block is None
        xr = cast_rows(x, q.elem_dtype, transposed=fold_into_dy)
        # W along K for y, Wᵀ [K, N] (a scale per k) for dx: both from one kernel pair
        w_q, w_scale, wt, wt_scale = cast_both(w, q.elem_dtype)
        y = rowwise_matmul(xr.data, xr.scale, w_q, w_scale, out_dtype, fast_accum=True)
        ctx.recipe, ctx.out_dtype, ctx.w_dtype, ctx.ones = recipe, out_dtype, w.dtype, ones
        ctx.fp8_wgrad, ctx.fold_into_dy = fp8_wgrad, fold_into_dy
        saved_x = (xr.data_t, xr.scale) if fold_into_dy else (x,)
        ctx.save_for_backward(wt, wt_scale, *saved_x)
        return y

    @staticmethod
    def backward(ctx, dy):
        recipe, q = ctx.recipe, ctx.recipe.quant
        wt, wt_scale, *saved_x = ctx.saved_tensors
        dy = dy.contiguous()
        fold_into_x = ctx.fp8_wgrad and not ctx.fold_into_dy
        hadamard = recipe.weight_grad.hadamard_block
        dyr = cast_rows(
            dy,
            q.grad_elem_dtype,
            transposed=fold_into_x and hadamard is None,
            col_amax_row_mult=saved_x[1] if ctx.fold_into_dy else None,
        )
        dx = rowwise_matmul(dyr.data, dyr.scale, wt, wt_scale, ctx.out_dtype)
        if not ctx.fp8_wgrad:
            (x,) = saved_x
            return dx, (dy.t() @ x.to(dy.dtype)).to(ctx.w_dtype), None, None, None
        if ctx.fold_into_dy:  # dW = (r_m · dy)ᵀ-by-columns @ (q_x)ᵀ, r_m from the forward
            x_t, x_scale = saved_x
            dy_t, dy_t_scale = cast_columns(
                dy, q.grad_elem_dtype, row_mult=x_scale, col_amax=dyr.col_amax
            )
            ones = ctx.ones.get(x_t.shape[0], dy.device)
            dw = rowwise_matmul(dy_t, dy_t_scale, x_t, ones, dy.dtype)
            return dx, dw.to(ctx.w_dtype), None, None, None
        (x,) = saved_x
        if hadamard is not None:  # rotate both along tokens, then the same fold
            seed = int(torch.randint(0, 2**31 - 1, ()).item())
            dy = random_hadamard(dy.t(), block_size=hadamard, seed=seed).t().to(dy.dtype)
            x = random_hadamard(x.t(), block_size=hadamard, seed=seed).t().to(x.dtype)
            dyr = cast_rows(dy, q.grad_elem_dtype, transposed=True)
        x_t, x_t_scale = cast_columns(x, q.elem_dtype, row_mult=dyr.scale)
        ones = ctx.ones.get(dy.shape[1], dy.device)
        dw = rowwise_matmul(dyr.data_t, ones, x_t, x_t_scale, dy.dtype)
        return dx, dw.to(ctx.w_dtype), None, None, None


class _MXMatmul(torch.autograd.Function):
    """mxfp8: MX 1×32 along each contraction dim, merged to 1×128 blocks. W (and, for an fp8
    weight-gradient, x and dy) are quantized along both dims by one kernel that reads them once."""

    @staticmethod
    def forward(ctx, x, w, recipe: Recipe, out_dtype: torch.dtype, ones: UnitScales):
        q = recipe.quant
        mx = dict(scale_mode=q.scale_mode)
        fp8_wgrad = fp8_weight_grad(recipe, x.shape[0])
        both_ways = fp8_wgrad and recipe.weight_grad.hadamard_block is None
        if both_ways:  # xᵀ in fp8 is all the weight-gradient needs: x is not kept
            x_k128, (xt, xt_scale) = quantize_mx_k128_rowcol(x, q.elem_dtype, **mx)
            saved_x = (xt, xt_scale)
        else:
            x_k128, saved_x = quantize_mx_k128(x, q.elem_dtype, **mx), (x,)
        # W [N, K] along K for y, Wᵀ [K, N] along N for dx
        w_k128, (wt, wt_scale) = quantize_mx_k128_rowcol(w, q.elem_dtype, **mx)
        y = blockwise_matmul(*x_k128, *w_k128, out_dtype)
        ctx.recipe, ctx.out_dtype, ctx.w_dtype = recipe, out_dtype, w.dtype
        ctx.fp8_wgrad, ctx.both_ways = fp8_wgrad, both_ways
        ctx.save_for_backward(wt, wt_scale, *saved_x)
        return y

    @staticmethod
    def backward(ctx, dy):
        wt, wt_scale, *saved_x = ctx.saved_tensors
        recipe, q = ctx.recipe, ctx.recipe.quant
        mx = dict(scale_mode=q.scale_mode)
        dy = dy.contiguous()
        if ctx.both_ways:
            dy_k128, dyt_k128 = quantize_mx_k128_rowcol(dy, q.grad_elem_dtype, **mx)
            dx = blockwise_matmul(*dy_k128, wt, wt_scale, ctx.out_dtype)
            dw = blockwise_matmul(*dyt_k128, *saved_x, dy.dtype)
            return dx, dw.to(ctx.w_dtype), None, None, None
        dy_k128 = quantize_mx_k128(dy, q.grad_elem_dtype, **mx)
        dx = blockwise_matmul(*dy_k128, wt, wt_scale, ctx.out_dtype)
        (x,) = saved_x
        if not ctx.fp8_wgrad:
            return dx, (dy.t() @ x.to(dy.dtype)).to(ctx.w_dtype), None, None, None
        block = recipe.weight_grad.hadamard_block  # rotate both along tokens, then quantize
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
        dy_t = random_hadamard(dy.t(), block_size=block, seed=seed).to(dy.dtype)
        x_t = random_hadamard(x.t(), block_size=block, seed=seed).to(x.dtype)
        a = quantize_mx_k128(dy_t.contiguous(), q.grad_elem_dtype, **mx)
        b = quantize_mx_k128(x_t.contiguous(), q.elem_dtype, **mx)
        return dx, blockwise_matmul(*a, *b, dy.dtype).to(ctx.w_dtype), None, None, None


def fp8_linear(
    x2: torch.Tensor, w: torch.Tensor, recipe: Recipe, out_dtype: torch.dtype, ones: UnitScales
) -> torch.Tensor:
    """``x2 @ wᵀ`` (no bias) with the fp8 GEMMs of ``recipe`` forward and backward, for a
    contiguous ``x2 [M, K]`` and ``w [N, K]``; the result is ``[M, N]`` in ``out_dtype``."""
    fn = _MXMatmul if recipe.name == "mxfp8" else _RowwiseMatmul
    return fn.apply(x2, w, recipe, out_dtype, ones)

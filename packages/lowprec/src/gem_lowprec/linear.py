"""``LowPrecisionLinear``: a drop-in ``nn.Linear`` whose GEMMs run in fp8 per a ``Recipe``.

For ``x [M, K]`` (leading dims flattened) and ``W [N, K]`` the three GEMMs are phrased the same
way, ``a @ bᵀ`` with both operands quantized along the contraction dim:

| GEMM            | a                  | b                   | contraction |
|-----------------|--------------------|---------------------|-------------|
| forward y       | x, along K         | W, along K          | K           |
| input-grad dx   | dy, along N        | Wᵀ, along N         | N           |
| weight-grad dW  | dyᵀ, along M       | xᵀ, along M         | M (tokens)  |

For ``mxfp8`` every operand goes through ``quantize_mx_k128``: MX quantization along the
contraction dim and the merge of four E8M0 scales into a 1×128 block (one fused kernel on a GPU),
then the blockwise fp8 GEMM. Wᵀ (the column-wise copy of W) is quantized in the forward and
saved in fp8; x is saved in BF16 (the weight-gradient needs it in that precision or transposed).
``fp8_rowwise`` uses one scale per row of each operand.

Fallback: a shape the fp8 path cannot take (K or N not a multiple of 128 for mxfp8, of 16 for
rowwise; tokens for an fp8 weight-grad likewise) runs in BF16; on a GPU the first call for a
shape also times fp8 against BF16 (forward + backward) and keeps the faster. Every fallback is
warned about once and listed by ``fallback_report()``.
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from gem_lowprec.hadamard import random_hadamard
from gem_lowprec.recipes import Recipe
from gem_lowprec.scaled_matmul import (
    blockwise_matmul,
    quantize_mx_k128,
    quantize_rowwise,
    rowwise_matmul,
)

_DECISIONS: dict[tuple, tuple[bool, str]] = {}


def fallback_report() -> dict[tuple, str]:
    """``{(recipe, M, K, N, dtype): reason}`` for every shape that runs in BF16 instead of fp8."""
    return {key: why for key, (use_fp8, why) in _DECISIONS.items() if not use_fp8}


def _shape_ok(recipe: Recipe, m: int, k: int, n: int) -> str | None:
    align = 128 if recipe.name == "mxfp8" else 16
    if k % align or n % align:
        return f"K={k} and N={n} must be multiples of {align} for {recipe.name}"
    if m % 16:
        return f"tokens M={m} must be a multiple of 16 for the fp8 GEMM"
    return None


def _fp8_weight_grad(recipe: Recipe, m: int) -> bool:
    if recipe.weight_grad.precision != "fp8":
        return False
    block = recipe.weight_grad.hadamard_block or 1
    return m % max(128 if recipe.name == "mxfp8" else 16, block) == 0


class _LowPrecisionMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, recipe: Recipe):
        ctx.recipe = recipe
        q = recipe.quant
        m = x.shape[0]
        ctx.fp8_wgrad = _fp8_weight_grad(recipe, m)
        out_dtype = x.dtype
        ctx.out_dtype = out_dtype
        if recipe.name == "mxfp8":
            mx = dict(scale_mode=q.scale_mode)
            x_k128 = quantize_mx_k128(x, q.elem_dtype, **mx)
            w_k128 = quantize_mx_k128(w, q.elem_dtype, **mx)
            y = blockwise_matmul(*x_k128, *w_k128, out_dtype)
            # Wᵀ [K, N] with blocks along N: the column-wise MX copy of W, merged along N
            ctx.w_for_dgrad = quantize_mx_k128(w.t().contiguous(), q.elem_dtype, **mx)
        else:
            xq, xs = quantize_rowwise(x, q.elem_dtype)
            wq, ws = quantize_rowwise(w, q.elem_dtype)
            y = rowwise_matmul(xq, xs, wq, ws, out_dtype)
            ctx.w_for_dgrad = quantize_rowwise(w.t(), q.elem_dtype)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        recipe = ctx.recipe
        q = recipe.quant
        dy = dy.contiguous()
        if recipe.name == "mxfp8":
            dy_k128 = quantize_mx_k128(dy, q.grad_elem_dtype, scale_mode=q.scale_mode)
            dx = blockwise_matmul(*dy_k128, *ctx.w_for_dgrad, ctx.out_dtype)
        else:
            dyq, dys = quantize_rowwise(dy, q.grad_elem_dtype)
            wtq, wts = ctx.w_for_dgrad
            dx = rowwise_matmul(dyq, dys, wtq, wts, ctx.out_dtype)
        ctx.w_for_dgrad = None
        if not ctx.fp8_wgrad:
            return dx, dy.t().to(x.dtype) @ x, None
        dy_t, x_t = dy.t(), x.t()  # [N, M], [K, M]: contraction along tokens
        block = recipe.weight_grad.hadamard_block
        if block is not None:
            seed = int(torch.randint(0, 2**31 - 1, ()).item())
            dy_t = random_hadamard(dy_t, block_size=block, seed=seed).to(dy.dtype)
            x_t = random_hadamard(x_t, block_size=block, seed=seed).to(x.dtype)
        if recipe.name == "mxfp8":
            mx = dict(scale_mode=q.scale_mode)
            a = quantize_mx_k128(dy_t.contiguous(), q.grad_elem_dtype, **mx)
            b = quantize_mx_k128(x_t.contiguous(), q.elem_dtype, **mx)
            dw = blockwise_matmul(*a, *b, x.dtype)
        else:
            aq, as_ = quantize_rowwise(dy_t, q.grad_elem_dtype)
            bq, bs = quantize_rowwise(x_t, q.elem_dtype)
            dw = rowwise_matmul(aq, as_, bq, bs, x.dtype)
        return dx, dw, None


def _time_fwd_bwd(fn, x, w, reps: int = 5) -> float:
    """Mean ms of ``fn`` forward + backward, isolated from the caller's autograd state.

    The first call of a shape may happen inside a checkpointed region or under other
    saved-tensor hooks (activation quantization, memory accounting). Identity hooks keep the
    timing's own saved tensors out of them, so a recomputation, which finds the decision cached
    and does not time, saves exactly what the original forward saved.
    """
    with torch.autograd.graph.saved_tensors_hooks(_same, _same), torch.enable_grad():
        return _timed_loop(fn, x, w, reps)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _timed_loop(fn, x, w, reps: int) -> float:
    for _ in range(2):
        fn(x, w).sum().backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(x, w).sum().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _decide(recipe: Recipe, m: int, k: int, n: int, x: torch.Tensor, w: torch.Tensor) -> bool:
    key = (recipe.name, m, k, n, x.dtype)
    if key in _DECISIONS:
        return _DECISIONS[key][0]
    why = _shape_ok(recipe, m, k, n)
    use_fp8 = why is None
    if (
        use_fp8
        and x.is_cuda
        and recipe.fallback.measure_on_gpu
        and not torch.compiler.is_compiling()
    ):
        xr = torch.randn(m, k, device=x.device, dtype=x.dtype, requires_grad=True)
        wr = torch.randn(n, k, device=x.device, dtype=w.dtype, requires_grad=True)
        t_fp8 = _time_fwd_bwd(lambda a, b: _LowPrecisionMatmul.apply(a, b, recipe), xr, wr)
        t_bf16 = _time_fwd_bwd(lambda a, b: F.linear(a, b), xr, wr)
        use_fp8 = t_fp8 < t_bf16
        why = f"measured fwd+bwd {recipe.name} {t_fp8:.3f} ms >= bf16 {t_bf16:.3f} ms"
    _DECISIONS[key] = (use_fp8, why or "")
    if not use_fp8 and recipe.fallback.warn:
        warnings.warn(
            f"gem_lowprec: linear [{m}x{k}] @ [{n}x{k}]ᵀ falls back to bf16: {why}", stacklevel=3
        )
    return use_fp8


class LowPrecisionLinear(nn.Linear):
    """``nn.Linear`` with fp8 GEMMs per ``recipe`` (same parameters, same state dict)."""

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        *,
        recipe: Recipe | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe if recipe is not None else Recipe()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe) -> "LowPrecisionLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.recipe = recipe
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recipe.name == "bf16":
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if not _decide(self.recipe, m, self.in_features, self.out_features, x2, self.weight):
            return F.linear(x, self.weight, self.bias)
        y = _LowPrecisionMatmul.apply(x2.contiguous(), self.weight, self.recipe)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"

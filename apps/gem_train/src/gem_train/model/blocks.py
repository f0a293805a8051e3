"""The sequence tower's block and its feed-forwards.

``Block``: pre-norm residual layer ``x + Attn(RMSNorm(x))`` then ``x + FFN(RMSNorm(x))`` over the
jagged history tokens ``[T, D]``. The feed-forward is a SwiGLU MLP (``W2 (silu(W1 x) ⊙ W3 x)``) or a
mixture of experts (``gem_parallel.moe.MoE``: softmax router, token-choice top-k, SiLU experts
stored as batched ``[E, D, F]`` weights). Expert parallelism is applied from outside by
``gem_parallel.apply_dense_parallel``, which finds every such layer; built alone, the layer runs
all experts locally.
"""

import torch
from gem_lowprec import swiglu
from gem_lowprec.ops.swiglu import swiglu_reference
from gem_parallel import MoE, MoEConfig
from torch import nn

from gem_train.config import ModelConfig
from gem_train.model.attention import HistorySelfAttention
from gem_train.model.flex import FlexMasks
from gem_train.model.norm import RMSNorm


class SwiGLU(nn.Module):
    """``W2 (silu(W1 x) ⊙ W3 x)``, with ``W1`` and ``W3`` stacked into one linear ``w13`` (one
    GEMM, one quantization of ``x``) and, when ``fused``, the gate in one pass
    (``gem_lowprec.swiglu``)."""

    def __init__(self, d_model: int, hidden: int, *, fused: bool = True):
        super().__init__()
        self.w13 = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.gate = swiglu if fused else swiglu_reference

    def forward(self, x):
        return self.w2(self.gate(self.w13(x)))


class Block(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(m.d_model)
        self.attn = HistorySelfAttention(
            m.d_model, m.n_heads, kind=m.attention, rel_bias_radius=m.rel_bias_radius,
            block_size=m.block_size, rope_theta=m.rope_theta, schedule=m.jagged_schedule,
        )  # fmt: skip
        self.ffn_norm = RMSNorm(m.d_model)
        self.ffn = (
            SwiGLU(m.d_model, m.ffn_hidden, fused=m.fused_swiglu)
            if m.ffn == "swiglu"
            else MoE(
                MoEConfig(
                    m.d_model,
                    m.ffn_hidden,
                    m.n_experts,
                    top_k=m.top_k,
                    capacity_factor=m.moe_capacity_factor or None,
                )
            )  # fmt: skip
        )

    def forward(
        self, x_TD: torch.Tensor, layout, max_len: int, masks: FlexMasks | None = None
    ) -> torch.Tensor:
        """``layout``: the history's ``gem_jagged.JaggedBatch``; ``masks``: the batch's
        ``FlexMasks`` for ``model.attention=flex`` (positional, so that forward pre-hooks see it)."""
        x_TD = x_TD + self.attn(self.attn_norm(x_TD), layout, max_len, masks)
        return x_TD + self.ffn(self.ffn_norm(x_TD))

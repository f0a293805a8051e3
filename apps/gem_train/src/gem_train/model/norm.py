"""RMSNorm that stays on the fused kernel under autocast.

Under BF16 autocast a norm receives BF16 activations while its weight is a float32 parameter;
``torch.rms_norm`` with mixed dtypes leaves its fused kernel for a chain of elementwise ops and
returns float32, which every following linear casts back. Casting the weight to the input's dtype
keeps one fused kernel (it accumulates in float32 internally) and a BF16 output; the parameter,
its gradient and the state dict stay float32.
"""

import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    def forward(self, x):
        weight = self.weight.to(x.dtype) if self.weight is not None else None
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)

"""RMSNorm, for the residual stream ([..., C]) and per head ([..., H, D], one weight vector per head)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalised over the last dimension, computed in fp32 (or fp64).

    ``shape`` is the weight shape: ``C`` for the residual stream, ``(H, D)`` for per-head norms
    (QK-norm, output norm), where x: [..., H, D] and every head has its own weight vector.
    """

    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dt)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(dt)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"

"""RMSNorm, for the residual stream ([..., C]) and per head ([..., H, D], one weight vector per head)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import rms_norm


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalised over the last dimension, computed in fp32 (or fp64).

    ``shape`` is the weight shape: ``C`` for the residual stream, ``(H, D)`` for per-head norms
    (QK-norm, output norm), where x: [..., H, D] and every head has its own weight vector.
    ``forward`` fuses the pre-norm residual add and the sigmoid output gate (see ``foxlm.ops.rms_norm``).
    """

    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, gate: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """y = norm(x) (* sigmoid(gate)), or with ``residual`` (y = norm(s), s = x + residual), the pair (y, s).

        y is in x's dtype, except under CUDA autocast for CUDA tensors (not float64), where it is in autocast's.
        """
        out_dtype = None
        if x.is_cuda and x.dtype != torch.float64 and torch.is_autocast_enabled("cuda"):
            out_dtype = torch.get_autocast_dtype("cuda")
        return rms_norm(x, self.weight, self.eps, residual=residual, gate=gate, out_dtype=out_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"

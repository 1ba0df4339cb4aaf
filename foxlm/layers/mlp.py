"""SwiGLU feed-forward block (LLaMA)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.swiglu import swiglu


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases; the activation fused (``foxlm.ops.swiglu``). x: [..., C] -> [..., C]."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

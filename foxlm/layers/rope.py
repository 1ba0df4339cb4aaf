"""Rotary position embedding (RoPE), for the Transformer baselines."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.rotary import apply_rotary


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position (LLaMA / HF "rotate half" layout), in fp32 (fp64 for fp64 inputs).

    The frequencies are recomputed per call (D/2 numbers) rather than kept in a buffer, so the module
    has no state that a meta-device ``from_pretrained`` would have to rebuild.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head dim, got {head_dim}")
        self.head_dim, self.theta = head_dim, theta

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [B, T, Hq, D], k: [B, T, Hk, D], positions: [B, T] (or [T]) integer -> rotated q, k."""
        half = self.head_dim // 2
        dt = torch.promote_types(q.dtype, torch.float32)
        inv_freq = self.theta ** (-torch.arange(half, device=q.device, dtype=dt) / half)
        angles = positions.to(dt).reshape(-1, q.shape[1])[..., None] * inv_freq  # [B or 1, T, D/2]
        cos, sin = angles.cos(), angles.sin()
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


"""Rotary position embedding (RoPE), for the Transformer baselines."""

from __future__ import annotations

import math

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos and sin of the rotation angles of positions (LLaMA / HF "rotate half" layout), computed once per forward
    by the model and applied in every layer by ``foxlm.ops.apply_rotary``, as Hugging Face's Llama does.

    The frequencies are recomputed per call (D/2 numbers) rather than kept in a buffer, so the module
    has no state that a meta-device ``from_pretrained`` would have to rebuild.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even positive int head dim, got {head_dim!r}")
        # theta <= 0 (or inf, NaN) gave NaN frequencies: every rotated q and k NaN, with no error
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
            raise ValueError(f"theta: expected a finite positive number, got {theta!r}")
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [B, T] (or [T]) integer -> cos, sin: [B or 1, T, D/2] in fp32 (fp64 for an fp64 ``dtype``)."""
        half = self.head_dim // 2
        dt = torch.promote_types(dtype, torch.float32)
        inv_freq = self.theta ** (-torch.arange(half, device=positions.device, dtype=dt) / half)
        angles = positions.to(dt).reshape(-1, positions.shape[-1])[..., None] * inv_freq
        return angles.cos(), angles.sin()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"

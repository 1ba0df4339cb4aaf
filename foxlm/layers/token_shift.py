"""Data-dependent token shift (FoX Pro "KV-shift")."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.token_shift import token_shift


class TokenShift(nn.Module):
    """y_t = alpha_t * x_{t-1} + (1 - alpha_t) * x_t per head, alpha_t = sigmoid(w_h . h_t).

    Applied to the key (or value) projections before QK-norm. ``x_{t-1}`` is zero at the start of a
    sequence and wherever ``reset`` is set (document starts of packed input, the first real token
    after left padding), so nothing leaks across a boundary.
    """

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        # at least fp32 whatever the default dtype (fp64 models stay fp64): in
        # FoxPreTrainedModel._keep_in_fp32_modules_strict
        self.proj = nn.Linear(hidden_size, num_heads, bias=False,
                              dtype=torch.promote_types(torch.get_default_dtype(), torch.float32))

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        prev: torch.Tensor | None = None,
        reset: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [B, T, H, D] projections to shift, h: [B, T, C] layer input (gives alpha),
        prev: [B, H, D] the x of the token before x[:, 0] (decoding with a cache; None = zeros),
        reset: [B, T] bool, True where token t must not see token t-1. Returns [B, T, H, D] (fused
        ``foxlm.ops.token_shift``, computed in fp32)."""
        # proj may be fp32 in a model loaded in bf16 (FoxPreTrainedModel._keep_in_fp32_modules)
        return token_shift(x, self.proj(h.to(self.proj.weight.dtype)), prev=prev, reset=reset)

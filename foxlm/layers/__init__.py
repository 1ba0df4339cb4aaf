"""foxlm.layers: Forgetting Attention and the blocks around it (RMSNorm, SwiGLU, RoPE, token shift)."""

from .attention import GATES, ForgettingAttention, alibi_slopes, attend_sequence, dense_forgetting_attention
from .mlp import SwiGLU
from .norm import RMSNorm
from .rope import RotaryEmbedding
from .segments import Segments
from .token_shift import TokenShift

__all__ = [
    "GATES",
    "ForgettingAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "Segments",
    "SwiGLU",
    "TokenShift",
    "alibi_slopes",
    "attend_sequence",
    "dense_forgetting_attention",
]

"""foxlm.layers: Forgetting Attention and the blocks around it (RMSNorm, SwiGLU, RoPE, token shift)."""

from .attention import GATES, ACPConfig, ForgettingAttention, alibi_slopes
from .attention_backend import AttentionBackend
from .mlp import SwiGLU
from .norm import RMSNorm
from .rope import RotaryEmbedding
from .segments import Segments
from .token_shift import TokenShift

__all__ = [
    "GATES",
    "ACPConfig",
    "AttentionBackend",
    "ForgettingAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "Segments",
    "SwiGLU",
    "TokenShift",
    "alibi_slopes",
]

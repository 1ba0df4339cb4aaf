"""foxlm's ops, each a Triton kernel beside its PyTorch path: Forgetting Attention (a package of its own) and the
fused normalisation, activation, rotary, token-shift and loss ops around it."""

from .backend import use_backend
from .cross_entropy import linear_cross_entropy
from .forgetting_attention import (
    ACP,
    acp_stats,
    acp_threshold,
    acp_tile_stats,
    attention_from_cumsum,
    data_logit_bound,
    forgetting_attention,
    forgetting_attention_decode,
    forgetting_attention_reference,
    forgetting_attention_with_kvcache,
    gate_cumsum,
    onnx_translation_table,
    prune_threshold,
    sequence_attention,
)
from .rms_norm import rms_norm
from .rotary import apply_rotary
from .swiglu import swiglu
from .token_shift import token_shift

__all__ = [
    "forgetting_attention",
    "forgetting_attention_decode",
    "forgetting_attention_with_kvcache",
    "attention_from_cumsum",
    "onnx_translation_table",
    "sequence_attention",
    "forgetting_attention_reference",
    "gate_cumsum",
    "ACP",
    "data_logit_bound",
    "prune_threshold",
    "acp_threshold",
    "acp_stats",
    "acp_tile_stats",
    "use_backend",
    "rms_norm",
    "apply_rotary",
    "swiglu",
    "token_shift",
    "linear_cross_entropy",
]

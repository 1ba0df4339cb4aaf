"""Forgetting Attention kernels, each beside its PyTorch reference."""

from .acp import acp_stats, acp_threshold, acp_tile_stats, data_logit_bound, prune_threshold
from .backend import use_backend
from .chunked import attention_from_cumsum
from .forgetting_attention import forgetting_attention, sequence_attention
from .gate import gate_cumsum
from .reference import forgetting_attention_reference
from .rms_norm import rms_norm
from .rotary import apply_rotary
from .swiglu import swiglu

__all__ = [
    "forgetting_attention",
    "attention_from_cumsum",
    "sequence_attention",
    "forgetting_attention_reference",
    "gate_cumsum",
    "data_logit_bound",
    "prune_threshold",
    "acp_threshold",
    "acp_stats",
    "acp_tile_stats",
    "use_backend",
    "rms_norm",
    "apply_rotary",
    "swiglu",
]

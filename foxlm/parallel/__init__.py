"""Context parallelism: one sequence split over the ranks of a process group, attention computed across them."""

from .attention import CPAcpStats, Traffic, cp_acp_stats, cp_acp_tile_stats, cp_forgetting_attention, record_traffic
from .backend import ContextParallelAttention, apply_context_parallel, remove_context_parallel
from .halo import previous_tokens, sequence_positions
from .layout import ContextParallel, gather_sequence, shard_sequence

__all__ = [
    "apply_context_parallel",
    "remove_context_parallel",
    "ContextParallelAttention",
    "ContextParallel",
    "shard_sequence",
    "gather_sequence",
    "cp_forgetting_attention",
    "cp_acp_stats",
    "cp_acp_tile_stats",
    "CPAcpStats",
    "record_traffic",
    "previous_tokens",
    "sequence_positions",
    "Traffic",
]

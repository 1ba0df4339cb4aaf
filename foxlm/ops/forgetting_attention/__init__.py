"""Forgetting Attention: softmax attention with a forget gate, as one package.

- ``interface``: ``forgetting_attention``, the op on every device, and ``sequence_attention``, a model layer's view;
- ``gate``: the forget gate's fp64 cumsum c and its reverse (the gate gradient), shared by every path;
- ``acp``: Adaptive Computation Pruning, the ``ACP`` setting and the threshold it gives;
- ``triton_op`` and ``triton_kernels``: the fused Triton kernels (GPU; CPU under ``TRITON_INTERPRET=1``);
- ``sdpa``: the PyTorch path, attention from gate cumsums in SDPA's fused CPU kernel (the op on the CPU, and the
  engine of attention from a KV cache and of context parallelism), with ``denormals`` for its CPU threads;
- ``decode``: decoding against a paged KV cache;
- ``kvcache``: ``forgetting_attention_with_kvcache``, attention over a KV cache (contiguous or paged), the one call
  both caches make: it picks the prompt, chunk or decode-step path;
- ``onnx``: the PyTorch path's op as ONNX ops, for ``torch.onnx.export``;
- ``reference``: the naive fp64-capable oracle the others are tested against (it shares no code with them).
"""

from .acp import ACP, acp_stats, acp_threshold, acp_tile_stats, data_logit_bound, prune_threshold
from .decode import forgetting_attention_decode
from .gate import gate_cumsum
from .interface import forgetting_attention, sequence_attention
from .kvcache import forgetting_attention_with_kvcache
from .onnx import onnx_translation_table
from .reference import forgetting_attention_reference
from .sdpa import attention_from_cumsum

__all__ = [
    "ACP",
    "forgetting_attention",
    "sequence_attention",
    "forgetting_attention_decode",
    "forgetting_attention_with_kvcache",
    "attention_from_cumsum",
    "onnx_translation_table",
    "forgetting_attention_reference",
    "gate_cumsum",
    "data_logit_bound",
    "prune_threshold",
    "acp_threshold",
    "acp_stats",
    "acp_tile_stats",
]

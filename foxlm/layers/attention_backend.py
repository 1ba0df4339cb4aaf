"""Where a ``ForgettingAttention`` layer's attention runs: the one back-end object the layer calls.

The layer computes q, k, v and the gates and hands them to ``layer.attention_backend``; it does not know whether
the sequence is whole, sharded over ranks or continued from a KV cache. ``AttentionBackend`` (every layer's
default) runs whole sequences on this process and, given a cache, attends through it. Parallelism is installed
from outside by replacing the back-end, as torchtitan's ``parallelize`` does: ``foxlm.parallel.apply_context_parallel``
puts a ``ContextParallelAttention`` (the same three methods) on every attention layer of a model.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import ACP, acp_stats, sequence_attention
from .segments import Segments
from .token_shift import TokenShift


class AttentionBackend(nn.Module):
    """Whole sequences on this process (packed documents and padding as ``segments``), or new tokens continuing a
    KV cache (``foxlm.models.cache.KVCache``: the cache stores, the op's ``forgetting_attention_with_kvcache``
    attends). No parameters and no state: a module so that it is replaced as one (``apply_context_parallel``)."""

    cp = None  # the ContextParallel a back-end runs over; None: whole sequences (read by FoxModel for positions)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        log_fgate: torch.Tensor | None,
        *,
        scale: float,
        window: int | None,
        prune: ACP | None,
        segments: Segments | None,
        cache,
        valid: torch.Tensor | None,
        layer_idx: int,
        output_attentions: bool,
        deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q: [B, T, Hq, D], k: [B, T, Hk, D], v: [B, T, Hk, Dv], log_fgate: [B, T, Hq] fp32 or None (no gate)
        -> (o [B, T, Hq, Dv], probs [B, Hq, T, T] with ``output_attentions`` else None). With a ``cache`` the new
        tokens are appended under ``layer_idx`` (``valid``: [B, T] bool, False at padding) and attend to everything
        cached; else ``segments`` keep packed documents and padding apart."""
        if cache is not None:
            return cache.attend(layer_idx, q, k, v, log_fgate, scale=scale, valid=valid, window=window,
                                prune=prune), None
        return sequence_attention(
            q, k, v, log_fgate, scale=scale, cu_seqlens=None if segments is None else segments.cu_seqlens,
            max_seqlen=None if segments is None else segments.max_seqlen, window=window, prune=prune,
            deterministic=deterministic, return_probs=output_attentions,
        )

    def shift(
        self,
        shift: TokenShift,
        x: torch.Tensor,
        h: torch.Tensor,
        *,
        reset: torch.Tensor | None,
        cache,
        valid: torch.Tensor | None,
        layer_idx: int,
        name: str,
    ) -> torch.Tensor:
        """The token shift of x: [B, T, Hk, D] (h: the layer input), looking back to the token before x[:, 0]: the
        cache's state of stream ``name`` ("k" or "v"), which it then updates (zeros at padding), else none."""
        prev = None
        if cache is not None:
            prev = cache.get_shift_state(layer_idx, name)
            new = x if valid is None else x * valid[:, :, None, None].to(x.dtype)  # zeros at padding
            cache.set_shift_state(layer_idx, name, new, valid=valid)
        return shift(x, h, prev, reset)

    def tile_stats(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        log_fgate: torch.Tensor,
        *,
        segments: Segments | None,
        scale: float,
        tolerance: float,
        logit_bound: torch.Tensor | None,
        block_m: int,
        block_n: int,
    ) -> torch.Tensor:
        """The share of attention tiles ACP skips per head ([H] fp32; ``foxlm.ops.acp_stats``), for ``ACPProbe``."""
        if segments is not None:  # as sequence_attention: the segments index the flattened batch
            q, k, log_fgate = (x.reshape(1, -1, *x.shape[2:]) for x in (q, k, log_fgate))
        per_head, _ = acp_stats(q, k, log_fgate, scale=scale,
                                cu_seqlens=None if segments is None else segments.cu_seqlens, tolerance=tolerance,
                                logit_bound=logit_bound, block_m=block_m, block_n=block_n)
        return per_head

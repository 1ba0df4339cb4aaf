"""Context parallelism applied to a model from outside, as torchtitan's ``apply_cp``: ``apply_context_parallel``
replaces every attention layer's back-end (``foxlm.layers.AttentionBackend``) with a ``ContextParallelAttention``
over a process group, and ``remove_context_parallel`` puts the replaced back-ends back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..ops import ACP
from .attention import cp_acp_tile_stats, cp_forgetting_attention
from .halo import previous_tokens
from .layout import ContextParallel


class ContextParallelAttention(nn.Module):
    """An attention back-end whose inputs are this rank's shard (``cp.layout``) of sequences split over ``cp.group``:
    attention through ``cp_forgetting_attention``, the token shift's look-back through ``previous_tokens``, ACP's
    tile share through ``cp_acp_tile_stats``. What a shard cannot do (packed documents or padding, a KV cache, a
    sliding window, attention probabilities) is refused by name. ``local``: the back-end it replaced."""

    def __init__(self, cp: ContextParallel, local: nn.Module):
        super().__init__()
        self.cp, self.local = cp, local

    def attend(self, q, k, v, log_fgate, *, scale, window, prune: ACP | None, segments, cache, valid, layer_idx,
               output_attentions, deterministic) -> tuple[torch.Tensor, None]:
        """``AttentionBackend.attend`` on this rank's shard; no probabilities."""
        self.cp.check(segments=segments, cache=cache, window=window, output_attentions=output_attentions)
        if log_fgate is None:  # gate="none": plain softmax attention is the gate log f = 0
            log_fgate = q.new_zeros(*q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))
        # the model compared its input shards between the ranks once this forward (check_shard)
        return cp_forgetting_attention(q, k, v, log_fgate, group=self.cp.group, layout=self.cp.layout, scale=scale,
                                       prune=prune, check=False), None

    def shift(self, shift, x, h, *, reset, cache, valid, layer_idx, name) -> torch.Tensor:
        """``AttentionBackend.shift``: each chunk of the shard continues from the token before it, on another rank."""
        self.cp.check(cache=cache, reset=reset)  # the chunks below shift without resets, which would go unheeded
        # the model compared its input shards between the ranks once this forward (check_shard)
        prev = previous_tokens(x, group=self.cp.group, layout=self.cp.layout, check=False)
        xs, hs = x.chunk(len(prev), dim=1), h.chunk(len(prev), dim=1)
        return torch.cat([shift(xc, hc, p) for xc, hc, p in zip(xs, hs, prev)], dim=1)

    def tile_stats(self, q, k, log_fgate, *, segments, scale, tolerance, logit_bound, block_m, block_n
                   ) -> torch.Tensor:
        """``AttentionBackend.tile_stats`` over the whole sequence (a collective): the same share whatever P."""
        self.cp.check(segments=segments)
        per_head, _ = cp_acp_tile_stats(q, k, log_fgate, group=self.cp.group, layout=self.cp.layout, scale=scale,
                                        tolerance=tolerance, logit_bound=logit_bound, block_m=block_m,
                                        block_n=block_n)
        return per_head

    def extra_repr(self) -> str:
        return f"layout={self.cp.layout!r}"


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    layers = [m for m in model.modules() if hasattr(m, "attention_backend")]
    if not layers:
        raise ValueError(f"model: expected a foxlm model with ForgettingAttention layers, got {type(model).__name__}")
    return layers


def apply_context_parallel(
    model: nn.Module, group: dist.ProcessGroup | DeviceMesh | None = None, *, layout: str = "zigzag"
) -> nn.Module:
    """Run every forward of ``model`` (a foxlm model) context-parallel over ``group`` (a process group such as
    ``mesh.get_group("cp")``, a 1-D ``DeviceMesh``, or None: the default group): each rank passes its ``layout``
    shard of the same rows
    (``shard_sequence(input_ids, dim=1)``) and ``shift_labels`` sharded alike, and gets its shard of the outputs.
    Attention, the token shift and RoPE positions cross the shards. Installs one ``ContextParallelAttention`` on
    every attention layer; returns the model. ``remove_context_parallel`` undoes it."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group: expected a 1-D DeviceMesh (e.g. mesh['cp']), got {group.ndim} dims")
        group = group.get_group()
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group: expected a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}")
    cp = ContextParallel(group, layout)
    layers = _attention_layers(model)
    remove_context_parallel(model)
    for layer in layers:
        layer.attention_backend = ContextParallelAttention(cp, layer.attention_backend)
    return model


def remove_context_parallel(model: nn.Module) -> nn.Module:
    """Whole sequences again: every attention layer gets back the back-end ``apply_context_parallel`` replaced."""
    for layer in _attention_layers(model):
        if isinstance(layer.attention_backend, ContextParallelAttention):
            layer.attention_backend = layer.attention_backend.local
    return model

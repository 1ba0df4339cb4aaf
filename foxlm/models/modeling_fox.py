"""FoX models in the HF ecosystem: ``FoxModel`` (the decoder) and ``FoxForCausalLM`` (+ untied LM head).

Pre-norm blocks ``x + attn(norm(x))``, ``x + mlp(norm(x))``, a final RMSNorm, no positional embedding
(RoPE inside attention for the Transformer baselines). Packed documents (``cu_seqlens``) and padded
batches (``attention_mask``) are handled as segments that never see each other, in attention and in
the token shift; decoding goes through a KV cache that follows the protocol of ``foxlm.models.cache``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging
from transformers.utils.generic import can_return_tuple

from ..layers import ForgettingAttention, RMSNorm, RotaryEmbedding, Segments, SwiGLU
from ..ops.cross_entropy import check_label_values, linear_cross_entropy
from ..ops.forgetting_attention.acp import check_tolerance
from ..ops.forgetting_attention.gate import first_and_end
from ..parallel import ContextParallel, sequence_positions
from ..parallel.layout import check_same_on_ranks, chunks_per_rank
from .cache import FoxCache, KVCache
from .configuration_fox import FoxConfig

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the outputs' ``past_key_values`` to ``cache`` (and reads that name in generate).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass
class FoxModelOutput(BaseModelOutputWithPast):
    """BaseModelOutputWithPast plus log_fgates: per layer [B, T, H] fp32 (zeros for gate="none")."""

    log_fgates: tuple[torch.Tensor, ...] | None = None


@dataclass
class FoxCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus per_token_loss: [B, T-1] (position i: loss of predicting token i+1,
    0 where the label is -100) and log_fgates: per layer [B, T, H] fp32 (zeros for gate="none")."""

    per_token_loss: torch.Tensor | None = None
    log_fgates: tuple[torch.Tensor, ...] | None = None


@dataclass
class ACPShare:
    """What ``probe_acp`` recorded: per layer, one [H] share of skipped tiles per forward."""

    records: list[list[torch.Tensor]]

    def per_head(self) -> torch.Tensor:
        """[layers, H] fp32: the mean over the recorded forwards (no host sync)."""
        if not all(self.records):
            raise RuntimeError("probe_acp: no forward was recorded (a cache-less forward inside the block)")
        return torch.stack([torch.stack(r).mean(0) for r in self.records])


class FoxBlock(GradientCheckpointingLayer):
    """Pre-norm transformer block: Forgetting Attention then SwiGLU. A ``GradientCheckpointingLayer``:
    ``gradient_checkpointing_enable`` checkpoints it (reentrant or not), x positional, the rest keywords."""

    def __init__(self, config: FoxConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = ForgettingAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            gate=config.gate,
            qk_norm=config.qk_norm,
            qk_norm_shared=config.qk_norm_shared,
            qk_norm_eps=config.qk_norm_eps,
            output_gate=config.output_gate,
            output_norm=config.output_norm,
            k_shift=config.k_shift,
            v_shift=config.v_shift,
            rope=config.rope,
            window=config.window,
            acp_config=config,  # the layer reads acp and acp_tolerance here: set_acp changes only the config
            deterministic=config.deterministic_attention,
            norm_eps=config.rms_norm_eps,
            layer_idx=layer_idx,
        )
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, **attn_kwargs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x: [B, T, C] -> (x [B, T, C], log_fgate, attention probs); attn_kwargs go to ForgettingAttention."""
        a, log_fgate, probs = self.attn(self.attn_norm(x), **attn_kwargs)
        h, x = self.mlp_norm(a, residual=x)  # x + a and its norm in one pass
        return x + self.mlp(h), log_fgate, probs


class FoxPreTrainedModel(PreTrainedModel):
    config_class = FoxConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["FoxBlock"]
    # attention is foxlm's own op (forgetting_attention), HF's "eager": so transformers refuses "sdpa", "flash_*"
    _supports_sdpa = False
    # the forget gate and the token shift's mixing weights stay fp32 when from_pretrained loads in fp16 / bf16 (the
    # strict list) and are never quantized (bitsandbytes skips the plain list): a gate's log f sums over the whole
    # context, so a small error in it moves every attention weight; the layers cast their input to these dtypes
    _keep_in_fp32_modules = _keep_in_fp32_modules_strict = ["fgate_proj", "fgate_bias", "k_shift.proj", "v_shift.proj"]

    def post_init(self) -> None:
        """transformers' post_init, then the fp32 lists cut to the modules this config has (a LLaMA block has no
        token shift, a "bias" gate no fgate_proj): transformers checks that every name it is given exists."""
        super().post_init()
        names = [name for name, _ in self.named_parameters()]
        for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
            kept = {key for key in getattr(self, attr) if any(_names_module(name, key) for name in names)}
            setattr(self, attr, kept)

    def set_acp(self, enabled: bool, tolerance: float | None = None) -> None:
        """Turn Adaptive Computation Pruning on or off in every attention layer's forward, e.g. to evaluate a model
        trained without it; ``tolerance``: a new epsilon (default: keep the config's). The layers read the config
        (``FoxConfig.set_acp``)."""
        self.config.set_acp(bool(enabled), tolerance)

    @contextlib.contextmanager
    def probe_acp(self, tolerance: float | None = None, block_m: int = 128, block_n: int = 64
                  ) -> Iterator[ACPShare]:
        """Within the block, every cache-less forward records what ACP skips in each layer (or, with ACP off, would
        skip): the share of attention tiles of ``block_m`` queries x ``block_n`` keys (the forward kernel's) whose
        mass is below ``tolerance`` (default: the config's). Yields an ``ACPShare``, read after the forwards. On
        leaving (an exception too), every layer's probe is as it was: an enclosing ``probe_acp`` records on."""
        if self.config.gate == "none":
            raise ValueError("probe_acp: the model has no forget gates (gate='none'); ACP applies to FoX models only")
        if tolerance is not None:
            check_tolerance(tolerance)
        if block_m < 1 or block_n < 1:
            raise ValueError(f"block_m, block_n: expected tile sizes >= 1, got {block_m} and {block_n}")
        probes = [m.acp_probe for m in self.modules() if isinstance(m, ForgettingAttention)]
        share = ACPShare([[] for _ in probes])
        before = [dict(vars(probe)) for probe in probes]  # its records list itself: an outer block's
        for probe, records in zip(probes, share.records):
            probe.active, probe.tolerance, probe.block_m, probe.block_n, probe.records = (
                True, tolerance, block_m, block_n, records)
        try:
            yield share
        finally:
            for probe, state in zip(probes, before):
                vars(probe).update(state)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Normal(0, initializer_range) for linear and embedding weights, zero biases (the forget-gate bias
        too), ones for norms; the "bias" gate starts at the ALiBi slopes."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, ForgettingAttention) and module.fgate_bias is not None:
            if not getattr(module.fgate_bias, "_is_hf_initialized", False):
                module.fgate_bias.copy_(module.bias_gate_init(module.num_heads))


class FoxModel(FoxPreTrainedModel):
    """The FoX decoder: embeddings, ``num_hidden_layers`` FoxBlocks, final RMSNorm."""

    def __init__(self, config: FoxConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(FoxBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta) if config.rope else None  # once a forward
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    @property
    def context_parallel(self) -> ContextParallel | None:
        """What the attention layers' back-end runs over (``foxlm.parallel.apply_context_parallel``), or None for
        whole sequences: RoPE positions and the defaults follow it."""
        return self.layers[0].attn.attention_backend.cp if len(self.layers) else None

    def _default_use_cache(self, cu_seqlens: torch.Tensor | None, output_attentions: bool) -> bool:
        """What ``use_cache=None`` means: ``config.use_cache`` (True by default, as for transformers' models), except
        where no decoding can follow or the cache path cannot give what is asked: in training (as transformers'
        models under gradient checkpointing), for packed documents, a context-parallel shard, attention
        probabilities (only the cache-less path computes them) and inside ``probe_acp`` (it records cache-less
        forwards)."""
        if not self.config.use_cache or self.training or cu_seqlens is not None or output_attentions:
            return False
        if self.context_parallel is not None:
            return False
        return not any(block.attn.acp_probe is not None and block.attn.acp_probe.active for block in self.layers)

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        cache: KVCache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_log_fgates: bool = False,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> FoxModelOutput | tuple:
        """input_ids: [B, T] (or inputs_embeds: [B, T, C]).

        attention_mask: [B, T] (with a cache [B, cached + T]), 1 for real tokens, padding anywhere, except between
            real tokens of a cache's later call (refused). Padding is kept apart from real tokens.
        position_ids: [B, T] RoPE positions (default: from the mask / document starts / cache length). Without
            a mask, a cache or cu_seqlens, a position that does not follow the one before starts a new document,
            as in transformers' models (the padding-free batches of ``DataCollatorWithFlattening``).
        cu_seqlens: [N+1] int32 offsets of documents packed into one row (B == 1): documents never see
            each other, the gate cumsum and the token shift restart, RoPE positions restart.
        past_key_values / cache: a KV cache (``FoxCache`` or any ``KVCache``); the new tokens
            are appended. use_cache: create a FoxCache when none is given (default: ``_default_use_cache``).
        output_attentions, output_hidden_states: default to the config's, as in transformers.
        return_dict=False (or config.return_dict False): the output's non-None fields as a tuple.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids: pass exactly one of input_ids and inputs_embeds")
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        _check_inputs(input_ids, inputs_embeds, position_ids, self.config.hidden_size,
                      sharded=self.context_parallel is not None)
        if self.context_parallel is not None and inputs_embeds is None:
            _agree_in_range(self.context_parallel, "input_ids", input_ids, self.embed_tokens.num_embeddings)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        cache = cache if cache is not None else past_key_values
        if (use_cache or cache is not None) and self.gradient_checkpointing and self.training \
                and torch.is_grad_enabled():
            # as transformers' models: the checkpointed blocks drop the cache (a replay would append twice), so the
            # forward lays padding out as without one (with a cache it would be valid flags that no block then reads)
            logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing. Setting "
                                "`use_cache=False`.")
            use_cache, cache = False, None
        if use_cache is None and cache is None:
            use_cache = self._default_use_cache(cu_seqlens, output_attentions)
        cache = _as_fox_cache(cache, use_cache, self.config.num_hidden_layers)
        order, past = None, 0 if cache is None else cache.get_seq_length()
        # with a cache, only a first call's padding moves before its real tokens (where the token shift starts afresh,
        # as at left padding: a later call's would cut its first real token off the cached one before it), and not
        # with a sliding window (it counts cache slots); _layout refuses what stays between real tokens
        if cu_seqlens is None and attention_mask is not None and self.context_parallel is None and (
                cache is None or (past == 0 and T > 1 and self.config.window is None)):
            _check_mask(attention_mask, B, past + T)
            order = _compaction(attention_mask[:, past:], B, T, sync=not torch.compiler.is_compiling(),
                                pads_first=cache is not None)
        if order is not None:  # without a cache: right padding, which a forward keeps inert; with one: left padding
            x = x.gather(1, order[..., None].expand_as(x))
            attention_mask = torch.cat([attention_mask[:, :past], attention_mask[:, past:].gather(1, order)], 1)
            position_ids = None if position_ids is None else position_ids.gather(1, order)
        packed = None
        if cache is None and cu_seqlens is None and attention_mask is None and self.context_parallel is None:
            packed = _packed_starts(position_ids, B, T)
        segments, positions, reset, valid = _layout(B, T, x.device, cu_seqlens, attention_mask, position_ids, cache,
                                                    self.config.window, packed)
        cp = self.context_parallel
        if cp is not None:
            # positions that restart mark packed documents, which attention and the token shift would cross
            positions_ok, whole = True, None
            if T and T % chunks_per_rank(cp.layout) == 0:  # else check_shard refuses the length
                whole = sequence_positions(T, group=cp.group, layout=cp.layout, device=x.device).expand(B, T)
                positions_ok = position_ids is None or torch.equal(position_ids.to(x.device).expand(B, T), whole)
            # compared before any rank refuses them: a right-padded batch's mask has zeros in one rank's shard only,
            # and that rank's error left the others waiting in the comparison's collective
            cp.check_shard("input_ids" if inputs_embeds is None else "inputs_embeds", (B, T), x.device,
                           {"position_ids are the shard's": positions_ok,
                            "cu_seqlens / attention_mask with padding": segments is not None})
            cp.check(segments=segments, cache=cache, output_attentions=output_attentions)
            if not positions_ok:
                raise ValueError("position_ids: under context parallelism expected the shard's positions in the whole "
                                 "sequence (shard_sequence(arange(T), dim=0)); packed documents are not supported")
            positions = whole  # RoPE rotates by the position in the whole sequence
        attentions_unavailable = output_attentions and cache is not None
        if attentions_unavailable:  # as transformers' SDPA attention: a warning and no weights, not an error
            logger.warning_once("FoX attention through a KV cache does not support `output_attentions=True`: the "
                                "attentions come back empty. Run without a cache (use_cache=False) for them.")
            output_attentions = False

        attn_kwargs = dict(
            segments=segments, rotary=None if self.rotary is None else self.rotary(positions, x.dtype), reset=reset,
            cache=cache, valid=valid, output_attentions=output_attentions,
        )
        hidden_states, attentions, log_fgates = [], [], []
        for block in self.layers:
            if output_hidden_states:
                hidden_states.append(x)
            x, log_fgate, probs = block(x, **attn_kwargs)  # x positional: reentrant checkpointing passes it
            attentions.append(probs)
            if output_log_fgates:
                log_fgates.append(log_fgate if log_fgate is not None else x.new_zeros(B, T, block.attn.num_heads,
                                                                                        dtype=torch.float32))
        x = self.norm(x)
        if valid is None and cache is None and attention_mask is not None and segments is not None:
            valid = attention_mask.bool()  # right padding of a cache-less forward: its output, the last real token's
        keeps_output = cache is not None and hasattr(cache, "set_last_output")
        if valid is not None:
            x = _carry_over_padding(x, valid, cache.get_last_output() if keeps_output else None)
        if keeps_output:
            cache.set_last_output(x[:, -1])  # the last real token's so far (carried over this call's padding)
        if output_hidden_states:
            hidden_states.append(x)
        if order is not None:  # back to the caller's positions
            inverse = order.argsort(1)
            x, hidden_states, log_fgates = (_unpermute(t, inverse) for t in (x, hidden_states, log_fgates))
            attentions = [p if p is None else _unpermute(p.transpose(1, 2), inverse).transpose(1, 2)
                          .gather(3, inverse[:, None, None, :].expand_as(p)) for p in attentions]
        return FoxModelOutput(
            last_hidden_state=x,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=() if attentions_unavailable else tuple(attentions) if output_attentions else None,
            log_fgates=tuple(log_fgates) if output_log_fgates else None,
            **{_CACHE_FIELD: cache},
        )


class FoxForCausalLM(FoxPreTrainedModel, GenerationMixin):
    """FoxModel + untied LM head; HF ``generate`` decodes through a FoxCache."""

    def __init__(self, config: FoxConfig):
        super().__init__(config)
        self.model = FoxModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        """transformers' preparation, after refusing a given cache that is not a transformers ``Cache`` (a
        ``PagedFoxCache``, any bare ``KVCache``): ``generate`` reorders, repeats and crops its cache by transformers'
        API, and would fail deep inside (or, with beams, at the first forward) on one without it. The empty
        DynamicCache transformers makes becomes a FoxCache here, not at the first forward: assisted decoding calls
        the cache's ``activate_past_recording`` before it, so that its crops can drop drafts of any length."""
        key = "cache" if "cache" in model_kwargs else "past_key_values"  # transformers >= 5.24: "cache"
        cache = model_kwargs.get(key)
        if cache is not None and not isinstance(cache, (Cache, tuple)):  # a tuple: transformers' own error
            raise ValueError(f"past_key_values: HF generate decodes FoX models with a FoxCache (or none: it makes "
                             f"one), got a {type(cache).__name__}; foxlm.generate.generate decodes with a "
                             f"PagedFoxCache, and any KVCache plugs into the model's forward")
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        key = "cache" if "cache" in model_kwargs else "past_key_values"
        made = model_kwargs.get(key)
        if cache is None and isinstance(made, Cache) and type(made) is not DynamicCache:  # cache_implementation's
            raise ValueError(f"cache_implementation: FoX models decode with their own FoxCache, not a "
                             f"{type(made).__name__}; leave cache_implementation unset (or 'dynamic')")
        if type(made) is DynamicCache and made.get_seq_length() == 0:  # transformers' or the caller's
            _become_fox_cache(made, self.config.num_hidden_layers,
                              "past_key_values" if cache is not None else "cache_implementation")
            if getattr(generation_config, "is_assistant", False):  # transformers recorded the DynamicCache's past
                made.activate_past_recording()
        return result

    def _assisted_decoding(self, *args, **kwargs):
        """transformers' assisted decoding, then the cache stops recording its past (transformers' off-switch, as its
        deferred stop check does): transformers leaves it on, so that a generate continuing on the returned cache
        kept the token-shift history of every token since the last crop."""
        try:
            return super()._assisted_decoding(*args, **kwargs)
        finally:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers >= 5.24: "cache"
            for layer in getattr(cache, "layers", ()):
                if hasattr(layer, "record_past"):
                    layer.record_past = False

    def init_continuous_batching(self, *args, **kwargs):
        """Refused: transformers' continuous batching (``generate_batch``, ``generate(cache_implementation="paged")``)
        attends through its own paged cache and kernels, which have no forget gate; its loop would log each request's
        failure and ``generate`` return the prompts alone."""
        raise ValueError("cache_implementation: FoX models do not run transformers' continuous batching ('paged', "
                         "generate_batch): its paged attention has no forget gate; use generate without it, or "
                         "foxlm.generate.generate (foxlm's paged cache)")

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs: dict, *args, **kwargs) -> dict:
        """transformers' update, then, for a batch with padding after real tokens (right padding), RoPE positions
        that count real tokens: transformers (>= 5) continues from the last position, a pad's 0."""
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
        if mask is not None and positions is not None and positions.shape == mask.shape:
            real = mask.long()
            if bool(((real.cumsum(-1) > 0) & (real == 0)).any()):  # a pad after a real token
                model_kwargs["position_ids"] = (real.cumsum(-1) - 1).clamp_min(0)
        return model_kwargs

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        cache: KVCache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_log_fgates: bool = False,
        output_hidden_states: bool | None = None,
        return_per_token_loss: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> FoxCausalLMOutput | tuple:
        """input_ids: [B, T]; labels: [B, T] (shifted inside: position i predicts labels[i+1]; -100 is
        ignored) -> .loss, the mean over counted labels; return_per_token_loss -> .per_token_loss [B, T-1].
        shift_labels (a keyword in ``kwargs``, as in Llama: transformers' Trainer takes every forward argument named
        *label* for a label it must be given, and computed no eval loss without it): [B, T] the targets already
        shifted (position i predicts shift_labels[i]; HF's name); they win over labels when both come, as in
        transformers' ForCausalLMLoss. A context-parallel shard needs them,
        since its last token's target is on another rank; then .per_token_loss is [B, T], and .loss is the mean
        over the whole rows' counted labels on every rank (``ContextParallel.mean_loss``).
        num_items_in_batch: the counted labels of the whole step (HF ``Trainer`` passes it, summed over gradient
        accumulation and processes): .loss is then the sum over this batch's (this shard's) labels divided by it.
        logits_to_keep: compute logits for the last n positions only (0: all), or, as a tensor, for the
        positions it lists (transformers' forms, ``_keep_positions``: 1-D; 2-D [B, K] per row; a 2-D bool [B, T]
        mask gives .logits [N, V]). Other arguments as in ``FoxModel.forward``; .logits: [B, T, V], except in
        training with labels, config.fuse_cross_entropy and no per-token loss: then the loss is fused with the LM
        head (``linear_cross_entropy``), .logits None."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            past_key_values=past_key_values,
            cache=cache,
            use_cache=use_cache,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_log_fgates=output_log_fgates,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        h = out.last_hidden_state
        shift_labels = kwargs.pop("shift_labels", None)
        if shift_labels is not None:
            labels = None  # transformers' ForCausalLMLoss uses shift_labels alone when both come
        if labels is not None and self.model.context_parallel is not None:
            raise ValueError("labels: a context-parallel shard's last target is on another rank; pass shift_labels "
                             "(the whole rows' labels shifted by one, then sharded as input_ids)")
        name, given = ("labels", labels) if shift_labels is None else ("shift_labels", shift_labels)
        if given is not None and given.shape != h.shape[:2]:
            raise ValueError(f"{name}: expected shape {tuple(h.shape[:2])}, got {tuple(given.shape)}")
        # every position predicts its shift_labels entry; with labels, all but the last predict the next label
        targets = shift_labels if shift_labels is not None else None if labels is None else labels[:, 1:]
        if isinstance(logits_to_keep, torch.Tensor) and targets is None:
            h = _keep_positions(h, logits_to_keep.to(h.device))
        elif logits_to_keep and targets is None:
            h = h[:, -logits_to_keep:]
        logits = loss = per_token = None
        cp = self.model.context_parallel
        reduction = "mean" if num_items_in_batch is None and cp is None else "sum"
        if targets is not None:  # F.cross_entropy's own errors name no argument (on CUDA: a bare device assert)
            if cp is not None:
                _agree_in_range(cp, name, targets, self.lm_head.out_features, ignore_index=-100)
            check_label_values(targets, self.lm_head.out_features, name=name)
        if targets is not None and self.training and self.config.fuse_cross_entropy and not return_per_token_loss:
            loss = linear_cross_entropy(h[:, :targets.shape[1]].flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                        reduction=reduction)
        else:
            logits = self.lm_head(h)
            if targets is not None:
                per_token = F.cross_entropy(
                    logits[:, :targets.shape[1]].flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                    targets.flatten(),
                    ignore_index=-100,
                    reduction="none",
                ).view(targets.shape)
                loss = per_token.sum() if reduction == "sum" else per_token.sum() / (targets != -100).sum().clamp_min(1)
        if loss is not None and num_items_in_batch is not None:
            loss = loss / _as_count(num_items_in_batch, loss.device)
        elif loss is not None and cp is not None:  # the shards' counts differ: a mean of their means is not the mean
            loss = cp.mean_loss(loss, (targets != -100).sum())
        return FoxCausalLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            per_token_loss=per_token if return_per_token_loss else None,
            log_fgates=out.log_fgates,
            **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)},
        )


def _names_module(name: str, key: str) -> bool:
    """Whether parameter ``name`` lies in a module (or is a parameter) that ``key`` names, as transformers matches
    its ``_keep_in_fp32_modules``: ``key`` a whole dotted part of ``name``."""
    return f".{key}." in f".{name}."


def _keep_positions(h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """h: [B, T, C] at the positions a tensor ``logits_to_keep`` names, in transformers' forms: 1-D, the same
    positions in every row -> [B, K, C]; 2-D integer [B, K], each row's own -> [B, K, C]; 2-D bool [B, T], the True
    positions of all rows in order -> [N, C] (rows may keep different counts, e.g. packed training)."""
    if keep.dim() == 1:
        return h[:, keep]
    if keep.dim() != 2 or keep.shape[0] != h.shape[0] or (keep.dtype == torch.bool and keep.shape[1] != h.shape[1]):
        raise ValueError(f"logits_to_keep: expected an int, a 1-D tensor, a [B, K] = [{h.shape[0]}, K] tensor of "
                         f"positions or a [B, T] = {tuple(h.shape[:2])} bool mask, got shape {tuple(keep.shape)}")
    if keep.dtype == torch.bool:
        return h[keep]
    return h.gather(1, keep[..., None].expand(-1, -1, h.shape[2]))


def _as_count(num_items_in_batch: torch.Tensor | int, device: torch.device) -> torch.Tensor | int:
    """num_items_in_batch as a divisor on ``device``: a positive int or a one-element tensor."""
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch: expected a count (an int or a one-element tensor), got a tensor "
                             f"of shape {tuple(num_items_in_batch.shape)}")
        return num_items_in_batch.to(device)
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, int):
        raise ValueError(f"num_items_in_batch: expected a count (an int or a one-element tensor), got "
                         f"{type(num_items_in_batch).__name__}")
    return num_items_in_batch


def _as_fox_cache(cache, use_cache: bool | None, num_layers: int):
    """The cache to decode with: a given cache that speaks the protocol, an empty generic HF cache turned into a
    FoxCache (``_become_fox_cache``), a new FoxCache when none is given and use_cache is set; else None. A given cache
    is used whatever use_cache says, as in transformers' models (use_cache only asks for a new one)."""
    if cache is None:
        return FoxCache(num_layers) if use_cache else None
    if isinstance(cache, KVCache):
        return cache
    if type(cache) is DynamicCache and cache.get_seq_length() == 0:  # e.g. DynamicCache() in transformers' docs
        return _become_fox_cache(cache, num_layers, "past_key_values")
    if hasattr(cache, "get_seq_length") and cache.get_seq_length() == 0:  # e.g. a StaticCache
        raise ValueError(f"past_key_values: FoX models decode with their own FoxCache, not a {type(cache).__name__}; "
                         f"pass a FoxCache (foxlm.models.FoxCache()), an empty DynamicCache or none")
    if hasattr(cache, "get_seq_length"):  # e.g. the keys and values of PEFT prefix tuning's virtual tokens
        raise ValueError(f"past_key_values: a {type(cache).__name__} that holds {cache.get_seq_length()} tokens has no "
                         f"forget-gate sums or token-shift states for them, so FoX models cannot attend to it (PEFT "
                         f"prefix tuning gives one: use LoRA or prompt tuning); pass a FoxCache, an empty "
                         f"DynamicCache or none")
    raise ValueError(f"past_key_values: expected a FoxCache (or any KVCache), got {type(cache).__name__}")


def _become_fox_cache(cache: DynamicCache, num_layers: int, arg: str) -> FoxCache:
    """Make the empty DynamicCache ``cache`` an empty FoxCache, the same object: a caller that goes on passing the
    cache it made (transformers' docs' decoding loop) rather than the output's, decodes on the tokens it holds; a new
    FoxCache left that one empty, and each call started from nothing. An offloading one (``arg``, the argument that
    asked for it) is refused: a FoxCache keeps its layers on the model's device, so the memory it was to save would
    silently not be saved."""
    if getattr(cache, "offloading", False):
        raise ValueError(f"{arg}: FoX models decode with their own FoxCache, which does not offload its layers to "
                         f"the CPU; leave cache_implementation unset (or 'dynamic') and pass no offloading cache")
    cache.__class__ = FoxCache
    vars(cache).clear()
    FoxCache.__init__(cache, num_layers)
    return cache


def _compaction(attention_mask: torch.Tensor, B: int, T: int, sync: bool = True, pads_first: bool = False
                ) -> torch.Tensor | None:
    """[B, T] per-row order that moves each row's real tokens to its front (in their order), or None where every row's
    real tokens are one run. Padding between real tokens (generate without a cache on a right-padded batch appends
    after the pads) becomes right padding, which a causal forward keeps inert; FoX has no positions to disturb, and
    RoPE positions count real tokens only. ``pads_first`` (a cache's first call): the padding between real tokens to
    the front instead, left padding, which a cache keeps inert (PEFT prompt tuning's virtual tokens before a
    left-padded prompt; the token shift would cross padding between them); right padding stays. ``sync=False``
    (compiled): no host sync,
    so never None: the identity where eager's would be None."""
    mask = _check_mask(attention_mask, B, T).bool()
    several = (Segments.real_runs(mask) > 1).any()
    if sync and not bool(several):
        return None
    key = (~mask).to(torch.int8)
    if pads_first:  # 0: padding before the last real token, 1: real, 2: right padding, which stays at the end
        positions = torch.arange(T, device=mask.device)
        last = torch.where(mask, positions, -1).amax(1, keepdim=True)
        key = torch.where(mask, 1, torch.where(positions > last, 2, 0)).to(torch.int8)
    order = torch.sort(key, dim=1, stable=True).indices
    return order if sync else torch.where(several, order, torch.arange(T, device=mask.device))


def _unpermute(x, inverse: torch.Tensor):
    """x [B, T, ...] (or a list of them) in the caller's token order, ``inverse`` undoing ``_compaction``'s."""
    if isinstance(x, list):
        return [_unpermute(t, inverse) for t in x]
    return x.gather(1, inverse.view(*inverse.shape, *[1] * (x.dim() - 2)).expand_as(x))


def _carry_over_padding(x: torch.Tensor, valid: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
    """x: [B, T, C] with, at each padded position after a real token, that token's state: a pad is inert, so the
    state after it is the one before it (generate reads the next token off a right-padded prompt's last position).
    before: [B, C] the state of each row's last real token of earlier calls (a cache's ``get_last_output``), for
    the positions with no real token before them in this call; None: leave those."""
    T = x.shape[1]
    last = torch.where(valid, torch.arange(T, device=x.device), -1).cummax(1).values  # last real position <= t
    fill = (last >= 0) & ~valid
    if before is not None:
        x = torch.where((last < 0)[..., None], before[:, None].to(x.dtype), x)
    if not torch.compiler.is_compiling() and not bool(fill.any()):  # compiled: no host sync, the gather below
        return x
    carried = x.gather(1, last.clamp_min(0)[..., None].expand(-1, -1, x.shape[2]))
    return torch.where(fill[..., None], carried, x)


def _packed_starts(position_ids: torch.Tensor | None, B: int, T: int) -> torch.Tensor | None:
    """[B, T] bool, True where a position does not follow the one before (a document of a padding-free batch
    starts there, as transformers' ``find_packed_sequence_indices`` reads position_ids), or None where none does
    (under export always the starts, all False where none does)."""
    if position_ids is None or T < 2 or position_ids.dim() != 2 or position_ids.shape[0] not in (1, B) \
            or position_ids.shape[1] != T:
        return None
    starts = torch.cat([torch.zeros_like(position_ids[:, :1], dtype=torch.bool),
                        position_ids[:, 1:] - position_ids[:, :-1] != 1], dim=1).expand(B, T)
    if torch.compiler.is_exporting():  # no host sync to look: a graph for every packing (none: one document a row)
        return starts
    return starts if bool(starts.any()) else None


def _offsets_of_starts(starts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``Segments.from_starts``' offsets without a host sync (export): cu_seqlens [B*T + 1] int32, a sequence per
    token, the one at t from its document's start to t + 1 where t ends a document, else empty; and T, a bound on
    the longest."""
    B, T = starts.shape
    t = torch.arange(T, device=starts.device)
    first = torch.where(starts, t, 0).cummax(1).values  # the document start at or before t (column 0 starts one)
    row = torch.arange(B, device=starts.device)[:, None] * T
    return torch.cat([(row + first).flatten(), first.new_full((1,), B * T)]).to(torch.int32), T


def _layout(B, T, device, cu_seqlens, attention_mask, position_ids, cache, window=None, packed=None):
    """How the [B, T] new tokens are laid out: (segments, RoPE positions [B, T], token-shift reset [B, T] or
    None, valid [B, T] or None). Packed documents and padding without a cache become ``Segments``; with a
    cache, padding becomes ``valid`` (the cache keeps padded keys out of reach, adds no decay at them and
    carries the token-shift state over them) and positions count real tokens only. Left padding, and right
    padding that later calls continue after (generate on a right-padded batch), are inert; a real token after
    padding that follows real tokens in the same call is refused (the token shift looks back one position; in a
    cache's first call ``FoxModel.forward`` has moved such padding before the real tokens),
    and so is any padding between real tokens with a sliding window (it counts cache slots). ``packed``: [B, T]
    document starts read off position_ids (``_packed_starts``), segments too."""
    segments = reset = valid = None
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens: packed input needs a batch of one row, got B={B}")
        if cache is not None or attention_mask is not None:
            raise ValueError("cu_seqlens: cannot be combined with a KV cache or an attention_mask")
        segments = Segments.from_cu_seqlens(cu_seqlens, T)
    elif cache is not None:
        past = cache.get_seq_length()
        if attention_mask is not None:
            mask = _check_mask(attention_mask, B, past + T).bool()
            _check_gaps(mask, T, window)
            if torch.compiler.is_compiling() or not bool(mask[:, -T:].all()):  # compiled: no host sync to look
                valid = mask[:, -T:]
                reset = torch.cat([torch.zeros_like(valid[:, :1]), ~valid[:, :-1]], dim=1)
            if position_ids is None:
                position_ids = (mask.long().cumsum(1) - 1).clamp_min(0)[:, -T:]
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=device).expand(B, T)
    elif attention_mask is not None and torch.compiler.is_compiling():  # no host sync: an all-ones mask too
        segments = Segments.from_mask(_check_mask(attention_mask, B, T), sync=False)
    elif attention_mask is not None and not bool(_check_mask(attention_mask, B, T).all()):
        segments = Segments.from_mask(attention_mask)
    elif packed is not None:
        segments = Segments.from_starts(packed, _offsets_of_starts(packed) if torch.compiler.is_exporting() else None)
    if segments is not None:
        reset = segments.starts
        if position_ids is None:
            position_ids = segments.positions
    if position_ids is None:
        position_ids = torch.arange(T, device=device).expand(B, T)
    return segments, position_ids, reset, valid


def _check_gaps(mask: torch.Tensor, T: int, window: int | None) -> None:
    """Refuse what a cache cannot make inert: padding between real tokens inside the last T positions (the
    token shift looks back one position) or, with a sliding window, anywhere (the window counts cache slots)."""
    real = mask.long()
    positions = torch.arange(mask.shape[1], device=mask.device)
    first = first_and_end(mask)[0][:, None]  # leading padding: left padding
    gap_before = mask & (positions - first - (real.cumsum(1) - real) > 0)  # real, some padding between it and the first
    just_after = gap_before[:, -T:][:, 1:] & ~mask[:, -T:][:, :-1]
    errors = [("attention_mask: with a cache, padding between real tokens must end a call (right padding of a prompt, "
               "then decoding); the token shift cannot skip it within one call", just_after)]
    if window is not None:
        errors.insert(0, (f"attention_mask: a sliding-window model (window={window}) decodes left-padded batches "
                          f"only (the window counts cache slots, padding included)", gap_before[:, -T:]))
    for message, bad in errors:
        if torch.compiler.is_compiling():  # an assertion in the graph, as the compiled loss checks its labels
            torch._assert_async(~bad.any(), message)
        elif bool(bad.any()):
            raise ValueError(message)


def _agree_in_range(cp: ContextParallel, name: str, values: torch.Tensor, size: int,
                    ignore_index: int | None = None) -> None:
    """Under context parallelism off CUDA, refuse on every rank (a collective) ``values`` outside [0, size) (other
    than ``ignore_index``) in one rank's shard only: that rank's own error (the embedding's, the labels' check) left
    the others waiting in the next collective. Where every shard's are out of range, each rank's own error follows.
    On CUDA an out-of-range index is a device assertion, which ends every rank's job."""
    if values.is_cuda:
        return
    ok = (values >= 0) & (values < size)
    if ignore_index is not None:
        ok |= values == ignore_index
    check_same_on_ranks(cp.group, values.device, {f"{name} within [0, {size})": bool(ok.all())})


def _check_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                  position_ids: torch.Tensor | None, hidden_size: int, sharded: bool) -> None:
    """Refuse, naming the argument, the shapes the layers would fail on deep inside (or, position_ids in a model
    without RoPE, silently ignore): input_ids [B, T], inputs_embeds [B, T, hidden_size], T >= 1 (unless ``sharded``: a
    context-parallel shard), position_ids [T] or [B or 1, T]."""
    if inputs_embeds is not None:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[2] != hidden_size:
            raise ValueError(f"inputs_embeds: expected a 3-D [B, T, {hidden_size}] tensor, got "
                             f"{tuple(inputs_embeds.shape)}")
        name, (B, T) = "inputs_embeds", inputs_embeds.shape[:2]
    else:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected a 2-D [B, T] tensor, got {tuple(input_ids.shape)}")
        name, (B, T) = "input_ids", input_ids.shape
    if T == 0 and not sharded:  # a context-parallel shard's length is checked with the other ranks'
        raise ValueError(f"{name}: expected at least one token, got T=0")
    if position_ids is not None and not (position_ids.shape[-1:] == (T,) and (
            position_ids.dim() == 1 or (position_ids.dim() == 2 and position_ids.shape[0] in (1, B)))):
        raise ValueError(f"position_ids: expected [T] or [B or 1, T] = [{B} or 1, {T}], "
                         f"got {tuple(position_ids.shape)}")


def _check_mask(attention_mask: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, length):
        raise ValueError(f"attention_mask: expected a 2-D [B, T] = {(batch, length)} mask, "
                         f"got {tuple(attention_mask.shape)}")
    return attention_mask

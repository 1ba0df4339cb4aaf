"""The trainer's model: its config (arch, size and ``model.*`` over the data's tokenizer), a new randomly initialized
model, and its loss. ``parallel.parallelize`` then applies context parallelism, compilation and FSDP2 / DDP."""

from __future__ import annotations

import math

import torch
from transformers import PretrainedConfig

from ..models import FoxConfig, FoxForCausalLM
from ..models.baselines import check_device
from ..models.hf import build_model as build_hf_model
from ..models.hf import hf_config, use_chunked_loss
from ..presets import is_hf_arch
from .config import TrainConfig


def model_config(cfg: TrainConfig, tok_spec: dict, device: torch.device) -> PretrainedConfig:
    """The config of the model ``cfg`` trains on data of tokenizer ``tok_spec``: the vocabulary (padded to a multiple of
    64) and end-of-text id are the tokenizer's, a Hugging Face model's pad id None (the tokenizer has no pad token),
    the context its ``seq_len``, unless ``model.*`` says otherwise."""
    overrides = {"vocab_size": 64 * math.ceil(tok_spec["vocab_size"] / 64), "bos_token_id": tok_spec["eot_id"],
                 "eos_token_id": tok_spec["eot_id"], **cfg.model}
    try:
        if is_hf_arch(cfg.arch):
            check_device(cfg.arch, device.type)
            config = hf_config(cfg.arch, overrides, cfg.size)
            if "pad_token_id" not in cfg.model:  # foxlm's tokenizers have no pad token: the config's pad id is
                config.pad_token_id = None  # another vocabulary's, and an embedding's padding_idx never learns
        else:
            config = FoxConfig.preset(cfg.arch, cfg.size, **{"train_length": cfg.seq_len, **overrides})
    except ValueError as e:  # the config names its field; the user gave it as model.FIELD
        if str(e).split(":", 1)[0] in cfg.model:
            raise ValueError(f"model.{e}") from None
        raise
    if config.vocab_size < tok_spec["vocab_size"]:
        raise ValueError(f"model.vocab_size: {config.vocab_size} is smaller than the tokenizer's "
                         f"{tok_spec['vocab_size']}")
    config.foxlm_tokenizer = tok_spec
    return config


def build_model(cfg: TrainConfig, config: PretrainedConfig, device: torch.device) -> torch.nn.Module:
    """A new model of ``config`` on ``device``, initialized from ``cfg.seed``, with activation checkpointing as
    ``cfg`` asks; a Hugging Face model computes its loss chunk by chunk (``use_chunked_loss``)."""
    torch.manual_seed(cfg.seed)
    if is_hf_arch(cfg.arch):
        model = use_chunked_loss(build_hf_model(config)).to(device)
    else:
        model = FoxForCausalLM(config).to(device)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def causal_lm_loss(model: torch.nn.Module, autocast: bool, input_ids: torch.Tensor, labels: torch.Tensor,
                   cu_seqlens: torch.Tensor | None = None, shifted: bool = False) -> torch.Tensor:
    """The model's mean next-token loss on input_ids / labels [B, T] (0 without a target), under bf16 autocast when
    ``autocast``; ``shifted``: labels are the targets of the tokens (a context-parallel shard's)."""
    # the sum over the batch's own count, at least 1: a shard's own mean (a CP model's mean is the rows'), and 0 where
    # no label counts (a Hugging Face model's own mean, a soft cap's or a logit scale's, is NaN there, its gradient too)
    count = (labels if shifted else labels[:, 1:]) != -100
    targets = {"shift_labels" if shifted else "labels": labels, "num_items_in_batch": count.sum().clamp_min(1)}
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=input_ids, cu_seqlens=cu_seqlens, use_cache=False, **targets).loss

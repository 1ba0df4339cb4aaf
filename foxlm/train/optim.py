"""The trainer's optimization: AdamW with decoupled weight decay on matrices, the learning-rate schedule (linear warmup,
cosine decay), and gradient clipping."""

from __future__ import annotations

import math

import torch

from . import parallel
from .config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``max_steps``. A warmup
    longer than the run is cut to ``max_steps`` (the trainer warns): the last step reaches ``lr``."""
    warmup = min(cfg.warmup_steps, cfg.max_steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, cfg.max_steps - warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups, as the FoX authors' ``group_parameters``: decay on matrices (projections, embeddings, LM head),
    none on norms, biases and gate biases. A per-head norm's weight ([H, D]: QK-norm, output norm) is a norm's, not a
    matrix: norms are told by their module (any class named ...Norm...), not by their number of dims."""
    norms = {id(p) for m in model.modules() if "Norm" in type(m).__name__ for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in norms else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, d: parallel.Dist,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``model``'s ``param_groups``, fused on a GPU (but for sharded FSDP2 parameters)."""
    fused = device.type == "cuda" and not (d.world > 1 and cfg.parallel == "fsdp")
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, **({"fused": True} if fused else {}))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate to ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """The gradients' global norm, after clipping them to ``max_norm`` (when it is positive)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)

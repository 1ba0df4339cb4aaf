"""What every evaluation shares: loading a model, device and precision, log-probabilities that never
materialise [B, T, V] logits, held-out documents, and matplotlib (Agg) figures."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..checkpoint.run_folder import read_train_config

# Positions whose logits are computed at once (per batch): [chunk, V] fp32 stays a few hundred MB.
_LOGIT_CHUNK_TOKENS = 2048


def autocast(device: torch.device, dtype: str = "auto") -> contextlib.AbstractContextManager:
    """Mixed precision as in training: fp32 weights, bf16 autocast on CUDA (``"auto"``), fp32 on the CPU."""
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: expected 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def load_model(path: str | os.PathLike, device: torch.device, progress: bool = True) -> torch.nn.Module:
    """A foxlm model from a run dir, a checkpoint dir or a ``save_pretrained`` dir, in eval mode on ``device``
    (``progress=False``: without transformers' loading bar).

    The weights are fp32 whatever the folder stores (e.g. ``foxlm convert --dtype bfloat16``): ``autocast`` then
    gives training's mixed precision, as the FoX authors' evaluations ran (fp32 weights, bf16 autocast), rather than
    bf16 arithmetic throughout."""
    from foxlm.models import load_checkpoint_model

    if not Path(path).exists():
        raise ValueError(f"CHECKPOINT: {path} does not exist (expected a run, checkpoint or save_pretrained dir)")
    return load_checkpoint_model(path, "CHECKPOINT", progress, dtype=torch.float32).to(device).eval()


def run_train_length(checkpoint: str | os.PathLike) -> int | None:
    """The training context (``seq_len``) recorded in a checkpoint's run (``train_config.yaml``); None if there is
    none."""
    cfg = read_train_config(checkpoint)
    return cfg["seq_len"] if cfg is not None and isinstance(cfg.get("seq_len"), int) else None


def run_train_data(checkpoint: str | os.PathLike) -> tuple[str, str | None] | None:
    """The dataset (``data``: a prepared folder as it was given, or "shakespeare") and the tokenizer recorded in a
    checkpoint's run; None if there is none."""
    cfg = read_train_config(checkpoint)
    if cfg is None or not isinstance(cfg.get("data"), str):
        return None
    return cfg["data"], cfg.get("tokenizer")


def check_positions(model: torch.nn.Module, length: int, what: str, extra: int = 0) -> None:
    """Refuse ``length`` tokens, and ``extra`` the model reads after them (a completion), to a model whose learned
    position table has fewer rows (GPT-2's ``n_positions``, OPT's ``max_position_embeddings``): it failed with an
    IndexError inside its embedding (on CUDA a device-side assert). Rotary and foxlm models, which compute positions,
    take any length. ``what``: the flag that asked for ``length``."""
    config = model.config
    rows = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not isinstance(rows, int) or length + extra <= rows:
        return
    tables = {m.num_embeddings for m in model.modules()
              if isinstance(m, torch.nn.Embedding) and m is not model.get_input_embeddings()}
    if tables & {rows, rows + 2}:  # OPT's table has 2 rows more than its positions
        more = f" and {extra} generated after them" if extra else ""
        raise ValueError(f"{what}: {length} tokens{more}, but the {config.model_type!r} model learned position "
                         f"embeddings for {rows} only; evaluate at {rows - extra} tokens or fewer")


def hidden_states(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Final (normed) hidden states of a causal LM without its head: [B, T] -> [B, T, d_model]."""
    return model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state


def head_logprobs(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) under the LM head, chunked over positions: hidden [B, T, d], targets [B, T] -> [B, T] fp32."""
    head = model.get_output_embeddings()
    chunk = max(1, _LOGIT_CHUNK_TOKENS // hidden.shape[0])
    out = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    for a in range(0, hidden.shape[1], chunk):
        logits = head(hidden[:, a:a + chunk]).float()
        out[:, a:a + chunk] = -F.cross_entropy(logits.transpose(1, 2), targets[:, a:a + chunk], reduction="none")
    return out


def streams_logits(model: torch.nn.Module) -> bool:
    """Whether ``model``'s logits are its output embedding applied to its decoder's last hidden state, and so can be
    made a chunk of positions at a time: foxlm's models. Other architectures may change them after the head (Gemma 2
    soft-caps them, Cohere scales them), which the head alone would leave out."""
    from foxlm.models import FoxPreTrainedModel

    return isinstance(model, FoxPreTrainedModel)


@torch.no_grad()
def next_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """log p(x_{t+1} | x_<=t) for t = start .. T-2: input_ids [B, T] -> [B, T-1-start] fp32.

    The model reads ``input_ids[:, :-1]``, T - 1 tokens: the last one is only a target (a model with a learned
    position table of T - 1 rows is evaluated on T tokens, as HF's own loss of T - 1 predictions reads them).

    A foxlm model streams: the backbone runs once (Forgetting Attention never builds a T x T matrix) and the LM head
    is applied a chunk of positions at a time, so [B, T, V] logits never exist. Any other model's logits are its own
    forward's (those of positions ``start`` on), as the model defines them.
    """
    if not 0 <= start < input_ids.shape[1] - 1:
        raise ValueError(f"start: expected 0 <= start < T - 1 = {input_ids.shape[1] - 1}, got {start}")
    inputs, targets = input_ids[:, :-1], input_ids[:, start + 1:]
    if streams_logits(model):
        return head_logprobs(model, hidden_states(model, inputs)[:, start:], targets)
    keep = {"logits_to_keep": targets.shape[1]} if "logits_to_keep" in inspect.signature(
        model.forward).parameters else {}
    logits = model(input_ids=inputs, use_cache=False, **keep).logits[:, -targets.shape[1]:]
    chunk = max(1, _LOGIT_CHUNK_TOKENS // input_ids.shape[0])
    out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
    for a in range(0, targets.shape[1], chunk):  # fp32 a chunk at a time: one [B, T, V] copy is enough
        out[:, a:a + chunk] = -F.cross_entropy(logits[:, a:a + chunk].float().transpose(1, 2),
                                               targets[:, a:a + chunk], reduction="none")
    return out


def heldout_documents(data: str | os.PathLike, split: str, min_length: int, max_docs: int | None,
                      what: str = "length") -> list[np.ndarray]:
    """Documents of a prepared dataset (``foxlm data prepare``) with at least ``min_length`` tokens, in order.

    Each document starts with the ``<|endoftext|>`` BOS, as in training. Raises ``ValueError`` when none is
    long enough, naming the longest one and ``what`` asked for the length (a command's flag).
    """
    from foxlm.data import TokenDataset

    if min_length < 2:
        raise ValueError(f"{what}: expected at least 2 tokens, got {min_length}")
    docs, longest = [], 0
    for doc in TokenDataset(data, split).documents():
        longest = max(longest, len(doc))
        if len(doc) >= min_length:
            docs.append(np.asarray(doc))
            if max_docs is not None and len(docs) == max_docs:
                break
    if not docs:
        raise ValueError(
            f"{what}: no {split!r} document of {data} has {min_length} tokens (the longest has {longest}); "
            "evaluate at a shorter length or prepare a corpus with longer documents"
        )
    return docs


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def progress(iterable, total: int | None = None, desc: str = "", enabled: bool = True) -> Iterator:
    """A tqdm progress bar on stderr (disabled with ``enabled=False``)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, disable=not enabled, dynamic_ncols=True)

"""What the trainer evaluates while it trains: the validation loss (with ACP's share of skipped tiles), and a sampled
continuation of a prompt."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..parallel import apply_context_parallel, remove_context_parallel
from . import parallel
from .data import TrainData
from .loader import Batch, TokenLoader


def validation_batches(val_loader: TokenLoader, max_batches: int) -> int:
    """How many validation batches ``validation_loss`` reads: ``max_batches``, but no more than it takes to read the
    split's whole rows of ``seq_len`` tokens once, the last batch maybe partial (its rows past the split's end have no
    target), as HF ``Trainer`` evaluates a dataset whole; at least one."""
    rows = len(val_loader.ds.tokens) // val_loader.seq_len
    return max(1, min(max_batches, -(-rows // val_loader.batch_size)))


@torch.no_grad()
def validation_loss(model: torch.nn.Module, forward: Callable[[Batch], torch.Tensor], val_loader: TokenLoader,
                    max_batches: int, d: parallel.Dist, device: torch.device,
                    interruptible: contextlib.AbstractContextManager) -> dict:
    """Over the first ``validation_batches`` validation batches: the mean loss ``val_loss`` and, for a model with
    forget gates, ``val_acp_skipped``, the share of attention tiles ACP skips there (or, with ACP off, would skip).
    ``forward`` gives a batch's mean loss; the model is back in training mode after, whatever happens."""
    batches = validation_batches(val_loader, max_batches)
    module = parallel.unwrap(model)
    gated = getattr(module.config, "gate", "none") != "none"  # a Hugging Face model has no forget gates
    model.eval()
    loss_sum = torch.zeros((), device=device)
    count = 0.0
    try:
        with module.probe_acp() if gated else contextlib.nullcontext() as share, interruptible:
            for k in range(batches):
                for b in val_loader.batch(k):
                    loss = forward(b)  # every process runs every forward: FSDP's gathers are collective
                    if b.num_targets:  # past the split's end: a model's own mean over no target is NaN, not 0
                        loss_sum += loss.float() * b.num_targets
                        count += b.num_targets
    finally:
        model.train()
    total = d.sum(torch.tensor([count], device=device)).item()
    out = {"val_loss": (d.sum(loss_sum) / total).item()}
    if gated:
        out["val_acp_skipped"] = (d.sum(share.per_head().mean().reshape(1)) / d.world).item()
    return out


def prompt_ids(text: str | None, data: TrainData) -> list[int]:
    """The sample's prompt: ``text`` after an end-of-text token, as documents open; None: the first 24 tokens of the
    first validation document (of the train split where the val split has none)."""
    if text is not None:
        return [data.tokenizer.eot_id] + data.tokenizer.encode(text)
    source = data.val if data.val.num_docs else data.train
    return source.document(0)[:24].tolist()


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], tokens: int, seed: int, device: torch.device, autocast: bool,
           eot_id: int, hf: bool) -> list[int]:
    """The token ids of a sampled continuation of ``prompt`` (top-k 50, temperature 0.8, seeded with ``seed``; the
    global RNG is left as it was), the prompt's first token dropped."""
    module = parallel.unwrap(model)
    module.eval()
    cp = None if hf else module.model.context_parallel
    if cp is not None:
        remove_context_parallel(module)  # decoding holds whole sequences
    try:
        # the CPU's and the device's generators, both of which manual_seed reseeds, come back as they were
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            # decoding changes shapes at every token: compiled blocks (compile=true) would recompile, and warn, at each
            with (torch.compiler.set_stance("force_eager"),
                  torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)):
                out = module.generate(torch.tensor([prompt], device=device), max_new_tokens=tokens, do_sample=True,
                                      top_k=50, temperature=0.8, pad_token_id=eot_id)
    finally:
        if cp is not None:  # the loader goes on giving shards, which would otherwise pass for whole sequences
            apply_context_parallel(module, cp.group, layout=cp.layout)
        module.train()
    return out[0, 1:].tolist()

"""Per-token loss L(l) and length extrapolation P(l) (FoX paper protocol; shared/ANCHORS.md section 3).

A model evaluated at length T reads T tokens x_1..x_T (x_1 the document's BOS) and predicts x_2..x_{T+1}.
L(l) = mean over held-out sequences of -log p(x_{l+1} | x_1..x_l), the loss at position l (l tokens of
context, l = 1..T), and P(l) = exp(mean of L(1..l)), the perplexity of the first l predictions.
Evaluating at T = 4x the training length shows whether a model extrapolates.
"""

from __future__ import annotations

import csv
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..parallel import ContextParallel, apply_context_parallel, gather_sequence, remove_context_parallel, shard_sequence
from .utils import autocast, head_logprobs, hidden_states, next_token_logprobs, progress, pyplot


@dataclass
class LossCurve:
    """Mean per-position loss of one model over ``num_sequences`` sequences, at T = ``len(loss)`` positions."""

    label: str
    loss: np.ndarray  # [T] float64: loss[l-1] = L(l), predicting token l+1 from l tokens
    num_sequences: int

    @property
    def perplexity(self) -> np.ndarray:
        """P(l) = exp(mean L(1..l)), [T]."""
        return np.exp(np.cumsum(self.loss) / np.arange(1, len(self.loss) + 1))

    def perplexity_at(self, length: int) -> float:
        """P(length), the perplexity of the first ``length`` predictions (1 <= length <= T)."""
        if not 1 <= length <= len(self.loss):
            raise ValueError(f"length: expected 1 <= length <= {len(self.loss)}, got {length}")
        return float(np.exp(self.loss[:length].mean()))


@torch.no_grad()
def per_token_loss(
    model: torch.nn.Module,
    sequences: list[np.ndarray],
    *,
    label: str = "model",
    batch_size: int = 1,
    dtype: str = "auto",
    show_progress: bool = True,
    context_parallel: ContextParallel | None = None,
) -> LossCurve:
    """L(l), l = 1..T, of ``model`` averaged over equally long token ``sequences`` ([T + 1] each), ``batch_size``
    at a time.

    Memory is O(batch_size * T) for a foxlm model: the backbone streams (no T x T attention matrix) and logits are
    made a chunk of positions at a time; another model's forward makes its [batch_size, T, V] logits at once.
    ``dtype``: autocast precision (``utils.autocast``), bf16 on CUDA by default.
    context_parallel: every rank of its group calls this with the same sequences and holds a shard of each
    (memory O(batch_size * T / ranks)); every rank returns the whole curve.
    """
    if not sequences:
        raise ValueError("sequences: expected at least one sequence")
    n = len(sequences[0])
    if any(len(s) != n for s in sequences) or n < 2:
        lengths = sorted({len(s) for s in sequences})
        raise ValueError(f"sequences: expected sequences of one length >= 2, got lengths {lengths}")
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    device = next(model.parameters()).device
    total = torch.zeros(n - 1, dtype=torch.float64, device=device)
    batches = range(0, len(sequences), batch_size)
    for a in progress(batches, total=len(batches), desc=f"loss {label} @ {n - 1}", enabled=show_progress):
        ids = torch.as_tensor(np.stack(sequences[a:a + batch_size]).astype(np.int64), device=device)
        with autocast(device, dtype):
            logp = next_token_logprobs(model, ids) if context_parallel is None else _cp_logprobs(
                model, ids, context_parallel)
        if not torch.isfinite(logp).all():
            raise FloatingPointError(f"{label}: non-finite loss in sequences {a}..{a + len(ids) - 1}")
        total -= logp.double().sum(0)
    return LossCurve(label, (total / len(sequences)).cpu().numpy(), len(sequences))


def _cp_logprobs(model: torch.nn.Module, ids: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """``next_token_logprobs`` with each sequence split over ``cp``'s ranks: ids [B, T+1] -> [B, T] on every rank."""
    inputs, targets = (shard_sequence(x, dim=1, group=cp.group, layout=cp.layout) for x in (ids[:, :-1], ids[:, 1:]))
    apply_context_parallel(model, cp.group, layout=cp.layout)
    try:
        logp = head_logprobs(model, hidden_states(model, inputs), targets)
    finally:
        remove_context_parallel(model)
    return gather_sequence(logp, dim=1, group=cp.group, layout=cp.layout)


def milestones(train_length: int, eval_length: int) -> dict[str, int]:
    """The summary lengths train/2, train, 2x, 4x that fit in ``eval_length`` predictions."""
    marks = {"train/2": train_length // 2, "train": train_length, "2x train": 2 * train_length,
             "4x train": 4 * train_length}
    return {name: n for name, n in marks.items() if 1 <= n <= eval_length}


def write_csv(curves: list[LossCurve], path: str | os.PathLike) -> None:
    """Columns: position l, then ``<label> L`` and ``<label> P`` per model."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["position"] + [f"{c.label} {k}" for c in curves for k in ("L", "P")])
        cols = [x for c in curves for x in (c.loss, c.perplexity)]
        for i, row in enumerate(zip(*cols)):
            w.writerow([i + 1] + [f"{x:.6g}" for x in row])


def summary_table(curves: list[LossCurve], train_length: int) -> tuple[list[str], list[list[str]]]:
    """Header and rows of P(l) at train/2, train, 2x, 4x (those within the evaluation length)."""
    marks = milestones(train_length, len(curves[0].loss))
    header = ["model", "sequences"] + [f"P({name}={n})" for name, n in marks.items()]
    rows = [[c.label, str(c.num_sequences)] + [f"{c.perplexity_at(n):.3f}" for n in marks.values()] for c in curves]
    return header, rows


def write_summary(curves: list[LossCurve], train_length: int, csv_path, md_path) -> str:
    """Write the summary as CSV and as a Markdown table; return the Markdown."""
    header, rows = summary_table(curves, train_length)
    with open(csv_path, "w", newline="") as f:
        csv.writer(f).writerows([header] + rows)
    md = "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header)] + rows) + "\n"
    Path(md_path).write_text(md)
    return md


def _log_binned(x: np.ndarray, bins_per_decade: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """Mean of x[l-1] over log-spaced bins of l: per-position loss is noisy, its trend is not."""
    n = len(x)
    num = max(2, int(bins_per_decade * np.log10(n + 1)))
    edges = np.unique(np.round(np.logspace(0, np.log10(n + 1), num)).astype(int))
    centers, means = [], []
    for lo, hi in itertools.pairwise(edges):
        centers.append(np.sqrt(lo * max(lo, hi - 1)))
        means.append(x[lo - 1:hi - 1].mean())
    return np.array(centers), np.array(means)


def figure(curves: list[LossCurve], train_length: int, title: str = ""):
    """Two panels, every model overlaid: L(l) (log-binned) and P(l), with the training length marked.

    P(l)'s axis is logarithmic: P(1), one token of context, is about the vocabulary's size and would otherwise
    flatten the rest of the curve."""
    plt = pyplot()
    fig, (ax_l, ax_p) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in curves:
        x, y = _log_binned(c.loss)
        ax_l.plot(x, y, label=c.label)
        ax_p.plot(np.arange(1, len(c.loss) + 1), c.perplexity, label=c.label)
    for ax, name in ((ax_l, "per-token loss L(l) (nats, log-binned mean)"), (ax_p, "P(l) = exp(mean L(1..l))")):
        ax.axvline(train_length, color="k", ls="--", lw=1, label=f"training length ({train_length})")
        ax.set_xscale("log")
        ax.set_xlabel("token position l (tokens of context)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    ax_p.set_yscale("log")
    T = len(curves[0].loss)
    ax_l.set_title("Per-token loss")
    ax_p.set_title("Cumulative perplexity")
    fig.suptitle(title or f"Held-out loss by position ({curves[0].num_sequences} sequences of {T} tokens)")
    fig.tight_layout()
    return fig


def plot(curves: list[LossCurve], train_length: int, path: str | os.PathLike, title: str = "") -> None:
    """``figure`` saved to ``path``."""
    fig = figure(curves, train_length, title)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)

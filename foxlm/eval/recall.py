"""Multi-query associative recall (``foxlm.data.mqar``): accuracy by context length and number of key-value pairs.

Each cell draws ``samples`` documents of ``context_length`` tokens with ``pairs`` pairs (their own seed, so the cells
of one run are independent of each other and of the order they run in) and reads, in one teacher-forced forward pass,
the model's greedy prediction (argmax over the tokenizer's ids) at every answer position: after the second
occurrence of a key, its value. Accuracy is the share of answers predicted exactly. Two chance levels come with it:
a model that knows nothing but the value range guesses right 1 in ``len(values)``, one that guesses among the
values in its context 1 in ``pairs``.
"""

from __future__ import annotations

import csv
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch

from foxlm.data.mqar import MQARSpec, sample

from .utils import autocast, hidden_states, progress, pyplot


@dataclass
class RecallCell:
    context_length: int
    pairs: int
    sequences: int
    queries: int
    correct: int
    accuracy: float
    chance_values: float  # 1 / |value range|: a guess from the value range alone
    chance_in_context: float  # 1 / pairs: a guess among the values seen in the context


def cell_sequences(spec: MQARSpec, context_length: int, pairs: int, samples: int, seed: int, bos_id: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """A cell's documents ([samples, context_length] int64, ``bos_id`` first) and answer positions [pairs]."""
    if samples < 1:
        raise ValueError(f"samples: expected >= 1, got {samples}")
    rng = np.random.default_rng([seed, context_length, pairs])
    rows, answers = [], None
    for _ in range(samples):
        body, answers = sample(spec, context_length, pairs, rng)
        rows.append(np.concatenate([[bos_id], body]))
    return np.stack(rows), answers


@torch.no_grad()
def predict(model: torch.nn.Module, ids: torch.Tensor, answers: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Greedy predictions of the tokens at ``answers`` (positions in ``ids`` [B, T]) from the tokens before them:
    [B, len(answers)], over the first ``vocab_size`` ids (a model's padded vocabulary is never predicted)."""
    hidden = hidden_states(model, ids)[:, answers - 1]
    logits = model.get_output_embeddings()(hidden).float()[..., :vocab_size]
    return logits.argmax(-1)


def run_recall(
    model: torch.nn.Module,
    spec: MQARSpec,
    context_lengths: list[int],
    pairs: list[int],
    *,
    bos_id: int,
    vocab_size: int,
    samples: int = 64,
    seed: int = 1,
    batch_size: int = 8,
    dtype: str = "auto",
    show_progress: bool = True,
) -> list[RecallCell]:
    """Accuracy of every (context length, pairs) cell; a cell whose length cannot hold its pairs is refused first."""
    if samples < 1 or batch_size < 1:
        raise ValueError(f"samples, batch_size: expected >= 1, got {samples} and {batch_size}")
    for name, grid in (("context_lengths", context_lengths), ("pairs", pairs)):
        if not grid:
            raise ValueError(f"{name}: expected at least one value, got none")
    for n in context_lengths:
        for p in pairs:
            spec.check_document(n, p)
    device = next(model.parameters()).device
    cells = [(n, p) for n in context_lengths for p in pairs]
    results = []
    for n, p in progress(cells, desc="recall", enabled=show_progress):
        seqs, answers = cell_sequences(spec, n, p, samples, seed, bos_id)
        where = torch.as_tensor(answers, device=device)
        correct = 0
        for a in range(0, samples, batch_size):
            ids = torch.as_tensor(seqs[a:a + batch_size], device=device)
            with autocast(device, dtype):
                guess = predict(model, ids, where, vocab_size)
            correct += int((guess == ids[:, where]).sum())
        queries = samples * p
        results.append(RecallCell(n, p, samples, queries, correct, correct / queries,
                                  1.0 / spec.third, 1.0 / p))
    return results


def write_csv(cells: list[RecallCell], path: str | os.PathLike) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(RecallCell.__dataclass_fields__))
        w.writeheader()
        for c in cells:
            w.writerow(asdict(c))


def table(cells: list[RecallCell], train_length: int | None) -> str:
    """Accuracy as a Markdown table: a row per number of pairs, a column per context length (with its multiple of
    the training length)."""
    lengths = sorted({c.context_length for c in cells})
    pairs = sorted({c.pairs for c in cells})
    acc = {(c.context_length, c.pairs): c.accuracy for c in cells}
    head = [f"{n}" + (f" ({n / train_length:g}x)" if train_length else "") for n in lengths]
    lines = ["| pairs | " + " | ".join(head) + " | chance (in context) |",
             "|---|" + "---|" * len(lengths) + "---|"]
    for p in pairs:
        lines.append(f"| {p} | " + " | ".join(f"{acc[n, p]:.3f}" for n in lengths) + f" | {1 / p:.3f} |")
    return "\n".join(lines) + "\n"


def plot(cells: list[RecallCell], path: str | os.PathLike, train_length: int | None = None, title: str = "") -> None:
    """Accuracy against context length, a line per number of pairs, with the training length marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in sorted({c.pairs for c in cells}):
        row = sorted((c.context_length, c.accuracy) for c in cells if c.pairs == p)
        ax.plot([n for n, _ in row], [a for _, a in row], marker="o", label=f"{p} pairs")
    if train_length:
        ax.axvline(train_length, color="k", ls="--", lw=1, label=f"training length ({train_length})")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("recall accuracy (greedy)")
    ax.set_title(title or "Multi-query associative recall")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Needle in a haystack (shared/ANCHORS.md section 3), the FoX authors' prompts, scored offline with no external judge.

A prompt of exactly ``context_length`` tokens is BOS, held-out text with the needle on a line of its own at a
sentence boundary near ``depth`` (0 = start, 1 = end), then the authors' quiz and the question, which ends in the
answer's first words. In ``standard`` mode the needle is the fact; in ``easy`` mode it is the question and answer in
the very words the prompt ends with, so the model need only copy (their config-prompt-{standard,easy}.yaml).
Each cell is scored by (1) whether the answer phrase appears in the greedy completion and (2) log p(answer | prompt).

Where this differs from their eval/niah on purpose: the haystack is the held-out split rather than Paul Graham's
essays; a prompt is exactly ``context_length`` tokens of the pieces' own tokens, each as the tokenizer writes it
inside a text (theirs keeps 200 spare and re-tokenizes the joined text); the "." before the depth is searched for up
to 256 tokens back, the depth kept where there is none (theirs search back to the start); and the score is the
answer phrase in a short greedy completion, not a GPT-4o rating from 1 to 10. Their grid, for models trained at
16k: depths 0, 0.1, ..., 1 and lengths 1000, 4100, ..., 32000 (11 each; ``--depths`` and ``--lengths`` take it).
"""

from __future__ import annotations

import csv
import logging
import os
import re
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .utils import autocast, next_token_logprobs, progress, pyplot

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER_PREFIX = "Answer: The best thing to do in San Francisco is"
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day."
# the needle of each mode: easy mode's is the question with its answer, worded as the prompt's end
NEEDLES = {"easy": f"{QUESTION} {ANSWER_PREFIX} {ANSWER}", "standard": NEEDLE}
# what the authors' prompt says between the haystack and the question
QUIZ = ("There is an important piece of information hidden inside the above document. Now that you've read the "
        "document, I will quiz you about it. Answer the following question: ")
MODES = ("easy", "standard")
_BOUNDARY_LOOKBACK = 256  # tokens searched back from the requested depth for a "."
_SPARE_TOKENS = 4  # generated past the answer's length: an answer that opens with a token or two more still fits


def completion_tokens(tokenizer) -> int:
    """Tokens of the greedy completion: the answer's, and a few spare. The model reads all but the last after the
    prompt (the scored answer, whose last token is only a target, is shorter)."""
    return len(in_text(tokenizer, ANSWER_PREFIX, " " + ANSWER)) + _SPARE_TOKENS


def in_text(tokenizer, before: str, text: str) -> list[int]:
    """The ids of ``text`` where it follows ``before`` in a whole text: ``encode(before + text)`` past
    ``encode(before)``. Encoded alone, a SentencePiece-style tokenizer (Llama's, Mistral's) writes a text's first word
    with its prefix space, "▁" ("." alone is "▁", "."), which a sentence's "." or a line inside a text does not have.
    A ``ValueError`` where the tokenizer joins the two into one token (the pieces cannot be told apart)."""
    head, whole = tokenizer.encode(before), tokenizer.encode(before + text)
    if whole[:len(head)] != head:
        raise ValueError(f"tokenizer: {tokenizer.name} encodes {before!r} followed by {text!r} with a token across "
                         "the two; the needle prompt is built from such pieces")
    return whole[len(head):]


@dataclass
class NeedleResult:
    mode: str
    context_length: int
    depth: float  # requested depth in [0, 1]
    needle_position: int  # token index of the needle's first token in the prompt
    trial: int
    found: bool
    answer_logprob: float  # log p(answer tokens | prompt), summed
    answer_logprob_per_token: float
    completion: str


def normalize(text: str) -> str:
    """Lower case, punctuation dropped, whitespace collapsed: what 'the answer appears' compares."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def answer_found(completion: str) -> bool:
    """Whether the whole answer phrase appears in ``completion`` as whole words (case, punctuation and spacing
    ignored): "... on a sunny days" or "Beat a sandwich ..." is another phrase."""
    return f" {normalize(ANSWER)} " in f" {normalize(completion)} "


def haystack_tokens(tokenizer, documents: list[np.ndarray]) -> np.ndarray:
    """Held-out documents joined into one stream of plain text: BOS/EOT tokens become blank lines, so the
    haystack reads as one long text rather than as separate documents."""
    sep = np.asarray(in_text(tokenizer, ".", "\n\n"), dtype=np.int64)
    parts = []
    for doc in documents:
        doc = np.asarray(doc, dtype=np.int64)
        parts += [doc[doc != tokenizer.eot_id], sep]
    return np.concatenate(parts)


class PromptBuilder:
    """Builds needle prompts of an exact token length from one tokenized haystack."""

    def __init__(self, tokenizer, haystack: np.ndarray):
        self.tok = tokenizer
        self.haystack = haystack
        # each piece as the tokenizer writes it inside the prompt's text: the needle and the quiz after a sentence's
        # ".", the "." after a line break (a letter before it may be joined with it), the answer after its first words
        self.needle = {mode: in_text(tokenizer, ".", "\n" + text + "\n") for mode, text in NEEDLES.items()}
        self.tail = in_text(tokenizer, ".", "\n\n" + QUIZ + QUESTION + " " + ANSWER_PREFIX)
        self.period = set(in_text(tokenizer, "\n", "."))
        self.answer = in_text(tokenizer, ANSWER_PREFIX, " " + ANSWER)

    def haystack_length(self, context_length: int, mode: str) -> int:
        """Haystack tokens in a prompt of ``context_length`` tokens."""
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        n = context_length - 1 - len(self.needle[mode]) - len(self.tail)
        if n < 0:
            raise ValueError(f"context_length (--lengths): {context_length} tokens cannot hold the needle and "
                             f"question, which take {context_length - n}")
        return n

    def _sentence_boundary(self, hay: list[int], cut: int) -> int:
        """The nearest position at or before ``cut`` (within a lookback) just after a "." token, as the authors'
        prompt.py places it, so that the needle goes between sentences; ``cut`` itself if there is none."""
        for i in range(cut, max(0, cut - _BOUNDARY_LOOKBACK) - 1, -1):
            if i == 0 or i == len(hay):  # the haystack's ends are boundaries only where asked for (a cut of a text)
                return cut
            if hay[i - 1] in self.period:
                return i
        return cut

    def build(self, context_length: int, depth: float, mode: str, offset: int) -> tuple[list[int], int]:
        """Prompt ids (BOS first, exactly ``context_length`` of them) and the needle's token index."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth: expected a fraction in [0, 1], got {depth}")
        n = self.haystack_length(context_length, mode)
        if offset + n > len(self.haystack):
            raise ValueError(f"haystack: {len(self.haystack)} held-out tokens, but a {context_length}-token prompt "
                             f"at offset {offset} needs {offset + n}; use more documents or shorter contexts")
        hay = self.haystack[offset:offset + n].tolist()
        # floor, as the authors' int(); rounded first so that e.g. 0.7 * 1000 = 699.99... is 700
        cut = self._sentence_boundary(hay, int(round(depth * n, 6)))
        head = [self.tok.eot_id] + hay[:cut]
        return head + self.needle[mode] + hay[cut:] + self.tail, len(head)


class _PastTrainingLength(logging.Filter):
    """Drops transformers' reminder that a generation passed the model's ``max_position_embeddings`` (a FoxConfig's
    ``train_length``): the haystacks go past the training length on purpose, and the line broke the progress bar."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exceeded the model's predefined maximum length" not in record.getMessage()


@torch.no_grad()
def greedy_complete(model, prompts: torch.Tensor, max_new_tokens: int, tokenizer) -> list[list[int]]:
    """Greedy continuation (HF ``generate``) of equally long prompts [B, T], each cut at its first EOT.

    Ids beyond the tokenizer's vocabulary (the model's is padded, e.g. 50304) are never generated.
    """
    eot = tokenizer.eot_id
    padded = list(range(tokenizer.vocab_size, model.config.vocab_size)) or None
    logger, quiet = logging.getLogger("transformers.generation.stopping_criteria"), _PastTrainingLength()
    logger.addFilter(quiet)
    try:
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eot, pad_token_id=eot, suppress_tokens=padded)
    finally:
        logger.removeFilter(quiet)
    new = out[:, prompts.shape[1]:].tolist()
    return [ids[:ids.index(eot)] if eot in ids else ids for ids in new]


@torch.no_grad()
def run_niah(
    model: torch.nn.Module,
    tokenizer,
    haystack: np.ndarray,
    context_lengths: list[int],
    depths: list[float],
    *,
    modes: tuple[str, ...] = MODES,
    trials: int = 1,
    batch_size: int = 1,
    dtype: str = "auto",
    show_progress: bool = True,
    results: list[NeedleResult] | None = None,
) -> list[NeedleResult]:
    """Score every (mode, context length, depth, trial), in that order; trials read different stretches of the
    haystack.

    Prompts of one (mode, length) are batched ``batch_size`` at a time: they have equal lengths, so no padding.
    ``results``: the list each cell is appended to as its batch finishes, and returned (a new one by default); what it
    holds when a Ctrl-C stops the grid is the cells finished before it.
    """
    if trials < 1 or batch_size < 1:
        raise ValueError(f"trials, batch_size: expected >= 1, got {trials} and {batch_size}")
    builder = PromptBuilder(tokenizer, haystack)
    device = next(model.parameters()).device
    answer = torch.tensor(builder.answer, device=device)
    need = max(builder.haystack_length(n, m) for n in context_lengths for m in modes)
    if need > len(haystack):
        raise ValueError(f"context_lengths (--lengths): the longest prompt needs {need} haystack tokens, "
                         f"only {len(haystack)} are held out; use shorter lengths or more held-out text")
    offsets = np.linspace(0, len(haystack) - need, trials).astype(int).tolist()
    batches = []
    for m in modes:
        for n in context_lengths:
            cells = [(d, t) for d in depths for t in range(trials)]
            batches += [(m, n, cells[a:a + batch_size]) for a in range(0, len(cells), batch_size)]
    results = [] if results is None else results
    for mode, n, cells in progress(batches, desc="needle", enabled=show_progress):
        built = [builder.build(n, d, mode, offsets[t]) for d, t in cells]
        ids = torch.tensor([p for p, _ in built], device=device)
        with autocast(device, dtype):
            new = greedy_complete(model, ids, completion_tokens(tokenizer), tokenizer)
            full = torch.cat([ids, answer.expand(len(cells), -1)], 1)
            logp = next_token_logprobs(model, full, start=n - 1).sum(1).tolist()
        for (d, t), (_, pos), gen, lp in zip(cells, built, new, logp):
            text = tokenizer.decode(gen)
            results.append(NeedleResult(mode, n, d, pos, t, answer_found(text), lp, lp / len(builder.answer), text))
    return results


def write_csv(results: list[NeedleResult], path: str | os.PathLike) -> None:
    fields = list(NeedleResult.__dataclass_fields__)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in results:
            w.writerow(asdict(r))


def grid(results: list[NeedleResult], mode: str, field: str) -> tuple[list[int], list[float], np.ndarray]:
    """Mean of ``field`` over trials as [depth, context length] (NaN for a cell without results), with the axes'
    values."""
    rs = [r for r in results if r.mode == mode]
    lengths = sorted({r.context_length for r in rs})
    depths = sorted({r.depth for r in rs})
    g = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            vals = [float(getattr(r, field)) for r in rs if r.depth == d and r.context_length == n]
            if vals:  # a cell an interrupted grid did not reach stays NaN
                g[i, j] = np.mean(vals)
    return lengths, depths, g


def plot(results: list[NeedleResult], path: str | os.PathLike, train_length: int | None = None,
         title: str = "") -> None:
    """Heatmaps per mode: answer found (fraction of trials) and log p(answer) per token."""
    plt = pyplot()
    modes = [m for m in MODES if any(r.mode == m for r in results)]
    lp = [r.answer_logprob_per_token for r in results]
    panels = (("found", "answer found (fraction of trials)", "RdYlGn", (0, 1)),
              ("answer_logprob_per_token", "log p(answer | context) per token", "viridis",
               (min(lp), max(max(lp), min(lp) + 1e-3))))  # one scale for every mode
    fig, axes = plt.subplots(len(modes), 2, figsize=(12, 4 * len(modes)), squeeze=False)
    for row, mode in enumerate(modes):
        for col, (field, name, cmap, lim) in enumerate(panels):
            lengths, depths, g = grid(results, mode, field)
            ax = axes[row, col]
            im = ax.imshow(g, cmap=cmap, vmin=lim[0], vmax=lim[1], aspect="auto", origin="upper")
            for i in range(g.shape[0]):
                for j in range(g.shape[1]):
                    ax.text(j, i, f"{g[i, j]:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
            ax.set_xlabel("context length (tokens)" + (f"; training length {train_length}" if train_length else ""))
            ax.set_ylabel("needle depth")
            ax.set_title(f"{mode} mode: {name}")
            cbar = fig.colorbar(im, ax=ax)
            cbar.formatter.set_useOffset(False)
            cbar.update_ticks()
    fig.suptitle(title or "Needle in a haystack (greedy decoding)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

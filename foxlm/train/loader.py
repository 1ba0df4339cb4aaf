"""Deterministic training batches from a ``TokenDataset``.

A step's global batch is a pure function of ``(seed, step)``: row ``r`` of step ``s`` is fixed whatever the number
of processes, each process takes its contiguous share of rows, and splits it into micro-batches. So the loader's
state is the step counter, resuming is exact, and 1 or N processes see the same global batch. Under context
parallelism (``cp_size > 1``) the processes of one share each take their zigzag shard of its sequences.

- ``windows``: each row is ``seq_len`` tokens from a uniformly random offset (documents are separated by
  ``<|endoftext|>``; attention runs across them, as in GPT-2/nanoGPT training).
- ``documents``: the documents, shuffled per epoch, are laid end to end and cut into rows of ``seq_len``; a
  micro-batch is one packed row ``[1, rows * seq_len]`` with ``cu_seqlens`` at every document and row start, so
  no token attends across a document. A row's first token is not a target; a document's opening
  ``<|endoftext|>`` is the target of the previous document's last token in the same row (the end of that document,
  which a model must learn to generate), the only one that crosses a segment.

Validation (``shuffle=False``) reads the split in order, each token once: rows of consecutive ``seq_len`` tokens
(both packings); a row past the split's end has no target.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from ..data import TokenDataset
from ..parallel.layout import rank_chunks


@dataclass
class Batch:
    """One micro-batch. ``input_ids``/``labels``: [B, T] int64 (labels shifted inside the model, -100 ignored);
    ``cu_seqlens``: int32 [N+1] when packed (B == 1); ``num_targets``: labels that count. ``shifted``: a
    context-parallel shard, [B, T / cp]; its labels are the targets of its tokens (the model's ``shift_labels``)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor | None
    num_targets: int
    shifted: bool = False

    def to(self, device: torch.device) -> "Batch":
        cu = None if self.cu_seqlens is None else self.cu_seqlens.to(device, non_blocking=True)
        return Batch(self.input_ids.to(device, non_blocking=True), self.labels.to(device, non_blocking=True),
                     cu, self.num_targets, self.shifted)


class TokenLoader:
    """Batches for one process. ``batch(step)`` -> list of micro-batches making its share of the global batch."""

    def __init__(self, dataset: TokenDataset, *, seq_len: int, batch_size: int, micro_batch_size: int,
                 packing: str = "windows", seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, cp_rank: int = 0, cp_size: int = 1):
        if batch_size % (micro_batch_size * world_size):
            raise ValueError(f"batch_size: {batch_size} is not a multiple of micro_batch_size ({micro_batch_size}) "
                             f"x processes ({world_size})")
        if len(dataset.tokens) < seq_len + 1:
            raise ValueError(f"seq_len: {seq_len} is longer than the {dataset.split} split "
                             f"({len(dataset.tokens)} tokens)")
        if packing not in ("windows", "documents"):
            raise ValueError(f"packing: expected 'windows' or 'documents', got {packing!r}")
        if cp_size > 1 and (packing != "windows" or seq_len % (2 * cp_size)):
            raise ValueError(f"cp_size: {cp_size} shards need packing='windows' and seq_len a multiple of "
                             f"{2 * cp_size}, got {packing!r} and {seq_len}")
        self.ds, self.seq_len, self.batch_size, self.micro = dataset, seq_len, batch_size, micro_batch_size
        self.packing, self.seed, self.rank, self.world, self.shuffle = packing, seed, rank, world_size, shuffle
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._fingerprint: str | None = None

    @property
    def grad_accum(self) -> int:
        return self.batch_size // (self.micro * self.world)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "seq_len": self.seq_len, "batch_size": self.batch_size, "packing": self.packing,
                "num_tokens": len(self.ds.tokens), "data": self.fingerprint()}

    def fingerprint(self) -> str:
        """A hash of the split's document boundaries and of its first and last tokens: data prepared again
        differently (another tokenizer, order or source) but to the same length still tells itself apart."""
        if self._fingerprint is None:
            n = len(self.ds.tokens)
            h = hashlib.sha256(np.ascontiguousarray(self.ds.doc_offsets).tobytes())
            for part in (self.ds.tokens[:4096], self.ds.tokens[max(n - 4096, 0):n]):
                h.update(np.ascontiguousarray(np.asarray(part)).tobytes())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def load_state_dict(self, state: dict) -> None:
        """Check that a checkpoint's loader matches this one (the step counter itself lives with the trainer)."""
        mine = self.state_dict()
        for key, value in state.items():
            if mine.get(key) != value:
                raise ValueError(f"{key}: the checkpoint's loader used {value!r}, this run {mine.get(key)!r}; "
                                 f"resuming would not reproduce the run (start a new out_dir)")

    # --- rows -------------------------------------------------------------------------------------------------
    def _window_rows(self, step: int, rows: np.ndarray) -> list[tuple[np.ndarray, list[int]]]:
        n = len(self.ds.tokens) - self.seq_len + 1
        if self.shuffle:
            starts = np.random.default_rng([self.seed, step]).integers(0, n, size=self.batch_size)[rows]
        else:  # evenly spaced, fixed (validation)
            starts = (np.arange(step * self.batch_size, (step + 1) * self.batch_size)[rows] * self.seq_len) % n
        return [(np.asarray(self.ds.tokens[s:s + self.seq_len]), [0]) for s in starts.tolist()]

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative lengths in that order) of one epoch."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            n = self.ds.num_docs
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            lengths = np.diff(self.ds.doc_offsets)[order]
            self._epoch_cache = (epoch, order, np.concatenate([[0], np.cumsum(lengths)]))
        return self._epoch_cache[1:]

    def _document_row(self, index: int) -> tuple[np.ndarray, list[int]]:
        """Row ``index`` of the endless stream of shuffled documents, with its segment starts."""
        total = int(self.ds.doc_offsets[-1])
        pos, filled, pieces, starts = index * self.seq_len, 0, [], []
        while filled < self.seq_len:
            epoch, offset = divmod(pos, total)
            order, cum = self._epoch(epoch)
            d = int(np.searchsorted(cum, offset, side="right")) - 1  # the document under stream position pos
            src = int(self.ds.doc_offsets[order[d]]) + offset - int(cum[d])
            take = min(int(cum[d + 1]) - offset, self.seq_len - filled)
            starts.append(filled)
            pieces.append(np.asarray(self.ds.tokens[src:src + take]))
            filled, pos = filled + take, pos + take
        return np.concatenate(pieces), starts

    def _rows(self, step: int, rows: np.ndarray) -> list[tuple[np.ndarray, list[int]]]:
        if self.packing == "windows":
            return self._window_rows(step, rows)
        return [self._document_row(step * self.batch_size + int(r)) for r in rows]

    # --- batches ----------------------------------------------------------------------------------------------
    def batch(self, step: int) -> list[Batch]:
        """This process's micro-batches of global step ``step``."""
        per_rank = self.batch_size // self.world
        mine = np.arange(self.rank * per_rank, (self.rank + 1) * per_rank)
        rows = self._rows(step, mine)
        # validation reads its split at most once: a row past the split's end (one shorter than a batch) wraps around
        # to tokens read already; it keeps its shape, as every process runs the same forwards, and loses its targets
        keep = None if self.shuffle else (step * self.batch_size + mine + 1) * self.seq_len <= len(self.ds.tokens)
        return [self._collate(rows[i:i + self.micro], None if keep is None else keep[i:i + self.micro])
                for i in range(0, per_rank, self.micro)]

    def _collate(self, rows: list[tuple[np.ndarray, list[int]]], keep: np.ndarray | None = None) -> Batch:
        """The micro-batch of ``rows``; those that ``keep`` (bool [rows]) leaves out have no target."""
        ids = torch.from_numpy(np.stack([r for r, _ in rows]).astype(np.int64))
        labels = ids.clone()
        kept = len(rows)  # rows with targets: each has seq_len - 1 (its first token predicts nothing before it)
        if keep is not None and not keep.all():
            labels[torch.from_numpy(~keep)] = -100
            kept = int(keep.sum())
        if self.packing == "windows" and self.cp_size > 1:
            targets = torch.cat([labels[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
            size = self.seq_len // (2 * self.cp_size)
            chunks = rank_chunks(self.cp_rank, self.cp_size, "zigzag")
            ids, targets = (torch.cat([x[:, c * size:(c + 1) * size] for c in chunks], dim=1) for x in (ids, targets))
            return Batch(ids, targets, None, int((targets != -100).sum()), shifted=True)
        if self.packing == "windows":
            return Batch(ids, labels, None, kept * (self.seq_len - 1))
        starts = [i * self.seq_len + s for i, (_, row_starts) in enumerate(rows) for s in row_starts]
        ids, labels = ids.view(1, -1), labels.view(1, -1)
        # a row's last token must not predict the next row's first; within a row a segment opens a document with
        # <|endoftext|>, the previous document's end: its last token learns to end it (as an EOS target in HF)
        labels[0, torch.arange(len(rows)) * self.seq_len] = -100
        cu = torch.tensor(starts + [ids.shape[1]], dtype=torch.int32)
        return Batch(ids, labels, cu, kept * (self.seq_len - 1))

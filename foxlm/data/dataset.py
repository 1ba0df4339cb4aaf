"""``TokenDataset``: read-only view of one split of a folder written by ``foxlm data prepare``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..checkpoint.files import read_json
from .sources import FORMAT
from .tokenizer import TOKENIZER_DIR, Tokenizer, tokenizer_from_spec


class ShardedTokens:
    """The tokens of several shards as one 1-D sequence: ``len()``, integer and contiguous-slice indexing."""

    def __init__(self, shards: list[np.ndarray]):
        self.shards = shards
        self.starts = np.cumsum([0] + [len(s) for s in shards])
        self.dtype = shards[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            i = int(key) + len(self) if key < 0 else int(key)
            if not 0 <= i < len(self):
                raise IndexError(f"token index {key} out of range for {len(self)} tokens")
            s = int(np.searchsorted(self.starts, i, side="right")) - 1
            return self.shards[s][i - self.starts[s]]
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("ShardedTokens: only contiguous slices are supported")
        parts, pos = [], start
        while pos < stop:
            s = int(np.searchsorted(self.starts, pos, side="right")) - 1
            end = min(stop, int(self.starts[s + 1]))
            parts.append(self.shards[s][pos - self.starts[s]:end - self.starts[s]])
            pos = end
        if not parts:  # an empty slice, as a memmap gives it
            return np.zeros(0, dtype=self.dtype)
        return np.concatenate(parts) if len(parts) != 1 else np.asarray(parts[0])

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out.astype(dtype) if dtype is not None else out


class TokenDataset:
    """One split (``"train"`` or ``"val"``) of a prepared token folder.

    - ``tokens``: 1-D array-like of ids (an ``np.memmap`` for one shard, a ``ShardedTokens`` view for several).
    - ``doc_offsets``: int64 ``[num_docs + 1]``, document ``i`` is ``tokens[doc_offsets[i]:doc_offsets[i+1]]``
      and starts with ``eot_id`` (like ``cu_seqlens``).
    - ``meta``: the folder's ``meta.json``; ``tokenizer()`` rebuilds its tokenizer and checks it is the same.
    """

    def __init__(self, path: str | os.PathLike, split: str = "train"):
        self.path = Path(path).expanduser()
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"path: {self.path} has no meta.json (prepare it with `foxlm data prepare`)")
        self.meta = read_json(meta_path, "prepare the data again with `foxlm data prepare`")
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"path: {meta_path} has format {self.meta.get('format')!r}, expected {FORMAT!r}")
        missing = [key for key in ("splits", "dtype", "tokenizer") if key not in self.meta]
        if missing:
            raise ValueError(f"{meta_path}: no {', '.join(missing)} (damaged since `foxlm data prepare` wrote it); "
                             "prepare the data again")
        if split not in self.meta["splits"]:
            raise ValueError(f"split: expected one of {sorted(self.meta['splits'])}, got {split!r}")
        self.split = split
        info = self.meta["splits"][split]
        dtype = np.dtype(self.meta["dtype"])
        arrays, offsets, base = [], [np.zeros(1, dtype=np.int64)], 0
        for shard in info["shards"]:
            file = self.path / shard["tokens"]
            expected = shard["num_tokens"] * dtype.itemsize
            if not file.is_file() or file.stat().st_size != expected:
                raise ValueError(f"{file}: missing or truncated (expected {expected} bytes); re-run prepare")
            # numpy cannot map an empty file: a shard of no tokens is an empty array
            arrays.append(np.memmap(file, dtype=dtype, mode="r") if expected else np.zeros(0, dtype=dtype))
            if not (self.path / shard["offsets"]).is_file():
                raise ValueError(f"{self.path / shard['offsets']}: missing; re-run prepare")
            idx = np.fromfile(self.path / shard["offsets"], dtype=np.int64)
            if (len(idx) != shard["num_docs"] + 1 or idx[0] != 0 or idx[-1] != shard["num_tokens"]
                    or (np.diff(idx) < 0).any()):  # in order, so every document lies within the shard
                raise ValueError(f"{self.path / shard['offsets']}: document offsets do not match meta.json")
            offsets.append(idx[1:] + base)
            base += shard["num_tokens"]
        self.doc_offsets = np.concatenate(offsets)
        self._shard_tokens = arrays
        self._max_ids: list[int] | None = None  # each shard's largest id as read by verify()
        if not arrays:
            self.tokens = np.zeros(0, dtype=dtype)
        else:
            self.tokens = arrays[0] if len(arrays) == 1 else ShardedTokens(arrays)

    @property
    def num_docs(self) -> int:
        return len(self.doc_offsets) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def document(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` (leading ``eot_id`` included)."""
        return np.asarray(self.tokens[int(self.doc_offsets[i]):int(self.doc_offsets[i + 1])])

    def documents(self) -> Iterator[np.ndarray]:
        """Every document in order, as arrays of ids starting with ``eot_id``."""
        for i in range(self.num_docs):
            yield self.document(i)

    def tokenizer(self, folders: Sequence[str | os.PathLike] = ()) -> Tokenizer:
        """The recorded tokenizer: the copy the dataset carries, else from one of ``folders`` (e.g. the model folders
        of a run on it, for a dataset prepared before datasets carried one), else where it was read."""
        return tokenizer_from_spec(self.meta["tokenizer"], [self.path / TOKENIZER_DIR, *folders])

    def check_ids(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the shard if a token id is ``>= vocab_size`` (an embedding lookup would fail
        mid-training). Cheap: each shard's largest id as ``verify()`` read it, else as ``meta.json`` records it (read
        from the shard if it does not)."""
        shards = self.meta["splits"][self.split]["shards"]
        for i, (shard, tokens) in enumerate(zip(shards, self._shard_tokens)):
            if self._max_ids is not None:
                largest = self._max_ids[i]
            else:
                largest = shard["max_id"] if "max_id" in shard else int(tokens.max(initial=0))
            if largest >= vocab_size:
                raise ValueError(f"data: {self.path / shard['tokens']} holds token id {largest}, outside the model's "
                                 f"vocabulary of {vocab_size}; prepare the data with the model's tokenizer")

    def verify(self) -> None:
        """Check every shard's files against the sha256 that ``meta.json`` records (reads all the data, once; a
        ValueError naming the file that differs), and note each shard's largest id for ``check_ids``."""
        dtype = np.dtype(self.meta["dtype"])
        max_ids = []
        for shard in self.meta["splits"][self.split]["shards"]:
            for key in ("tokens", "offsets"):
                file = self.path / shard[key]
                digest, largest = _sha256_and_max(file, dtype if key == "tokens" else None)
                if digest != shard["sha256"][key]:
                    raise ValueError(f"data: {file} does not match the sha256 in meta.json (changed or damaged since "
                                     f"`foxlm data prepare` wrote it); prepare the data again")
                if key == "tokens":
                    max_ids.append(largest)
        self._max_ids = max_ids


def _sha256_and_max(path: Path, dtype: np.dtype | None, chunk: int = 1 << 24) -> tuple[str, int]:
    """(hex sha256 of a file, its largest value as ``dtype``; -1 without a dtype or values), in one read."""
    h, largest = hashlib.sha256(), -1
    with open(path, "rb") as f:
        while block := f.read(chunk):  # a multiple of the item size: blocks hold whole ids
            h.update(block)
            if dtype is not None:
                largest = max(largest, int(np.frombuffer(block, dtype=dtype).max()))
    return h.hexdigest(), largest

"""``foxlm data prepare``: text → packed token shards with document boundaries and ``meta.json``.

Output folder layout (``TokenDataset`` reads it)::

    meta.json                      tokenizer spec, counts, sources (with sha256), skipped documents, shard hashes
    train-00000.bin, ...           tokens, raw uint16 (uint32 if the vocabulary needs it), for np.memmap
    train-00000.idx, ...           int64 document offsets into the shard: [0, start_1, ..., num_tokens]
    val-00000.bin / .idx           the same for the validation split
    tokenizer/                     a copy of a folder's tokenizer (tokenizer.json, or encoder.json + vocab.bpe), so
                                   the data keeps its tokenizer when that folder moves

Every document is stored as ``[eot_id] + encode(text)``: ``<|endoftext|>`` opens each document (BOS) and so also
separates them. The split is by whole documents: document ``i`` (in the sorted input order) goes to validation
iff ``floor((i + 1) * val_fraction) > floor(i * val_fraction)``, an even, deterministic spread; a dataset's own
train/validation splits are kept instead (``sources``). Tokenization runs in
a process pool over batches of pieces, with a bounded number of batches in flight, so memory stays flat. The
folder is written under a temporary name and renamed when complete: an interrupted run leaves no ``meta.json``.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from ..checkpoint.files import file_above, remove_stale_temporaries, replace_folder, sha256_file, temporary_path
from .sources import FORMAT, PIECE_CHARS, Cuts, Source, find_sources, is_token_dataset, source_events, source_size
from .tokenizer import TOKENIZER_DIR, Tokenizer, copy_files, get_tokenizer

BATCH_CHARS = 1 << 18
MAX_SKIP_EXAMPLES = 100
_SHARD_FILE = re.compile(r"(train|val)-\d{5}\.(bin|idx)")
# what a dataset's tokenizer/ holds (``copy_files``: a folder tokenizer's files)
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "encoder.json", "vocab.bpe"}

_worker_tok: Tokenizer | None = None


def _init_worker(name: str) -> None:
    global _worker_tok
    _worker_tok = get_tokenizer(name)


def _encode_batch(texts: list[str], dtype: str) -> list[np.ndarray]:
    return [np.asarray(_worker_tok.encode(t), dtype=dtype) for t in texts]


def token_dtype(vocab_size: int) -> str:
    """Smallest unsigned dtype holding every id: ``uint16`` up to 65,536 tokens, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class _SplitWriter:
    """Appends documents to ``<split>-NNNNN.bin/.idx`` shards; a shard closes only between documents."""

    def __init__(self, folder: Path, split: str, dtype: str, eot_id: int, shard_tokens: int):
        self.folder, self.split, self.dtype, self.eot_id = folder, split, np.dtype(dtype), eot_id
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self._bin = None
        self._offsets: list[int] = []
        self._pos = self._doc_start = 0
        self._max_id = -1

    @property
    def num_tokens(self) -> int:
        """Tokens written so far, over all shards."""
        return self._pos + sum(s["num_tokens"] for s in self.shards)

    def begin(self) -> None:
        if self._bin is None:
            self._bin = open(self.folder / f"{self.split}-{len(self.shards):05d}.bin", "wb")
            self._offsets, self._pos = [0], 0
        self._doc_start = self._pos
        self.write(np.asarray([self.eot_id], dtype=self.dtype))

    def write(self, ids: np.ndarray) -> None:
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes())
        self._pos += len(ids)
        if len(ids):
            self._max_id = max(self._max_id, int(ids.max()))

    def end(self) -> int:
        """Close the current document; return its length in tokens (with the leading eot)."""
        length = self._pos - self._doc_start
        self._offsets.append(self._pos)
        if self._pos >= self.shard_tokens:
            self._close_shard()
        return length

    def abort(self) -> None:
        """Drop the current document: truncate the shard back to its start."""
        self._bin.seek(self._doc_start * self.dtype.itemsize)
        self._bin.truncate()
        self._pos = self._doc_start

    def _close_shard(self) -> None:
        self._bin.close()
        name = self._bin.name
        idx = Path(name).with_suffix(".idx")
        np.asarray(self._offsets, dtype=np.int64).tofile(idx)
        self.shards.append({"tokens": Path(name).name, "offsets": idx.name, "num_tokens": self._pos,
                            "num_docs": len(self._offsets) - 1, "max_id": self._max_id,
                            "sha256": {"tokens": sha256_file(name), "offsets": sha256_file(idx)}})
        self._bin, self._pos, self._max_id = None, 0, -1

    def finish(self) -> dict:
        if self._bin is not None:
            if len(self._offsets) > 1:
                self._close_shard()
            else:  # opened for a document that was then dropped
                self._bin.close()
                os.remove(self._bin.name)
                self._bin = None
        return {"num_tokens": sum(s["num_tokens"] for s in self.shards),
                "num_docs": sum(s["num_docs"] for s in self.shards), "shards": self.shards}


def _batches(sources: list[Source], text_key: str, on_bytes, cuts: Cuts) -> Iterator[list]:
    """Group events into batches of about ``BATCH_CHARS`` characters: ``[(source_index, kind, payload), ...]``."""
    batch, chars = [], 0
    for si, src in enumerate(sources):
        for kind, payload in source_events(src, text_key, on_bytes, cuts):
            batch.append((si, kind, payload))
            chars += len(payload) if kind == "piece" else 0
            if chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def check_out_dir(out_dir: Path, inputs: list[str | os.PathLike], overwrite: bool) -> None:
    """Refuse an ``out_dir`` that is, or lies inside, an input, and one that holds anything but a foxlm dataset.

    ``overwrite`` replaces only a folder that is recognizably a dataset ``prepare`` wrote and holds nothing else,
    so no user file is ever deleted.
    """
    resolved = out_dir.resolve()
    for raw in inputs:
        src = Path(raw).expanduser().resolve()
        if resolved == src or src in resolved.parents:
            raise ValueError(f"out_dir (--out): {out_dir} is or lies inside the input {raw}; write the dataset to a "
                             "folder outside the inputs")
    if not out_dir.exists():
        # a file above it fails only at the first mkdir, naming a temporary folder
        if (above := file_above(out_dir)) is not None:
            raise NotADirectoryError(f"out_dir (--out): {out_dir} lies under the file {above}; expected a folder")
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"out_dir (--out): {out_dir} is a file; expected a new or empty folder")
    entries = sorted(e.name for e in out_dir.iterdir())
    if not entries:
        return
    if not is_token_dataset(out_dir):
        raise FileExistsError(f"out_dir (--out): {out_dir} holds files and is not a foxlm dataset; "
                              "choose a new or empty folder")
    if not overwrite:
        raise FileExistsError(f"out_dir (--out): {out_dir} already holds a dataset; pass overwrite=True / --overwrite "
                              "to replace it")
    foreign = [name for name in entries if name != "meta.json" and not _SHARD_FILE.fullmatch(name)
               and not (name == TOKENIZER_DIR and _is_tokenizer_copy(out_dir / name))]
    if foreign:
        raise FileExistsError(f"out_dir (--out): {out_dir} holds a dataset and other files ({', '.join(foreign[:5])})"
                              "; --overwrite replaces only a folder that holds nothing but a dataset")


def out_folder(out_dir: str | os.PathLike, inputs: list[str | os.PathLike], overwrite: bool) -> Path:
    """The folder a dataset is written to: ``out_dir`` made absolute (a link's target: the dataset goes where it
    points and the link stays, where a swap would move it), with what killed runs left beside it removed, checked by
    ``check_out_dir``. Then ``writing_dataset`` writes it."""
    out = Path(os.path.abspath(Path(out_dir).expanduser()))  # "." and ".." name their folder
    if out.is_symlink():
        out = out.resolve()
    remove_stale_temporaries(out)  # first: a killed swap's set-aside dataset is put back, then checked
    check_out_dir(out, inputs, overwrite)
    return out


@contextlib.contextmanager
def writing_dataset(out_dir: Path, inputs: list[str | os.PathLike], overwrite: bool, tok: Tokenizer
                    ) -> Iterator[Path]:
    """A temporary folder beside ``out_dir`` (``out_folder``'s) to write a dataset into, holding a copy of ``tok``'s
    files (``copy_files``) so the data keeps its tokenizer when that folder moves. When the block ends ``out_dir`` is
    checked again, then the folder is swapped in (``replace_folder``: a kill at any point leaves a whole dataset
    there, the old or the new); on an error or Ctrl-C it is deleted and ``out_dir`` left as it was."""
    tmp = temporary_path(out_dir, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed run's, whose PID this process has now
    tmp.mkdir(parents=True)
    try:
        copy_files(tok, tmp / TOKENIZER_DIR)
        yield tmp
        # again: a folder made there while the dataset was written (another job's) would be swapped out and deleted
        check_out_dir(out_dir, inputs, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_folder(tmp, out_dir)


def _is_tokenizer_copy(folder: Path) -> bool:
    """Whether ``folder`` holds nothing but the tokenizer files ``copy_files`` copies into a dataset."""
    return folder.is_dir() and not folder.is_symlink() and all(
        e.name in _TOKENIZER_FILES and e.is_file() and not e.is_symlink() for e in folder.iterdir())


class _Documents:
    """Routes tokenized events into documents: the train/val split, the writers, and the skipped documents."""

    def __init__(self, sources: list[Source], writers: dict[str, _SplitWriter], val_fraction: float):
        self.sources, self.writers, self.val_fraction = sources, writers, val_fraction
        self.report = lambda line: print(line, file=sys.stderr)  # _tokenize routes it through its progress bar
        self.doc_index, self.open_split = 0, None
        self.skipped: collections.Counter = collections.Counter()
        self.examples: list[dict] = []

    def consume(self, batch: list, arrays: list[np.ndarray]) -> None:
        """Apply one batch of events, with the token arrays of its pieces in order."""
        it = iter(arrays)
        for si, kind, payload in batch:
            src = self.sources[si]
            if kind == "piece":
                if self.open_split is None and src.to is not None:  # a dataset's own split
                    self.open_split = src.to
                    self.writers[self.open_split].begin()
                elif self.open_split is None:
                    i, f = self.doc_index, self.val_fraction
                    self.open_split = "val" if int((i + 1) * f) > int(i * f) else "train"
                    self.doc_index += 1
                    self.writers[self.open_split].begin()
                self.writers[self.open_split].write(next(it))
            elif kind == "end":
                src.documents += 1
                src.tokens += self.writers[self.open_split].end()
                self.open_split = None
            else:
                self._skip(src, *payload)

    def _skip(self, src: Source, category: str, detail: str) -> None:
        if self.open_split is not None:  # its index (if it took one) goes to the next document
            self.writers[self.open_split].abort()
            self.open_split, self.doc_index = None, self.doc_index - (src.to is None)
        src.skipped += 1
        self.skipped[category] += 1
        if len(self.examples) < MAX_SKIP_EXAMPLES:
            self.examples.append({"source": str(src.path), "reason": category, "detail": detail})
            self.report(f"skipped {src.path}: {category} ({detail})")

    def counts(self) -> dict:
        """Documents and tokens so far, for the progress bar."""
        return {"docs": sum(s.documents for s in self.sources),
                "tokens": sum(w.num_tokens for w in self.writers.values())}


def _ignore_sigint(name: str) -> None:
    """Pool initializer: Ctrl-C is the parent's to handle (it terminates the pool); a worker that raised
    KeyboardInterrupt itself could leave the pool's result pipe half-read and the parent waiting forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(name)


def _tokenize(sources: list[Source], docs: _Documents, tokenizer: str, dtype: str, text_key: str, workers: int,
              cuts: Cuts, progress: bool) -> None:
    """Read every source, tokenize its pieces in ``workers`` processes (0: here) and hand them to ``docs``."""
    from tqdm.auto import tqdm

    total_bytes = sum(source_size(s) for s in sources if s.error is None and s.path.exists())
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    docs.report = lambda line: bar.write(line, file=sys.stderr)
    pool = None
    if workers > 0:
        ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
        pool = ctx.Pool(workers, initializer=_ignore_sigint, initargs=(tokenizer,))
    else:
        _init_worker(tokenizer)
    try:
        in_flight: collections.deque = collections.deque()
        for batch in _batches(sources, text_key, bar.update, cuts):
            texts = [p for _, kind, p in batch if kind == "piece"]
            if pool is None:
                docs.consume(batch, _encode_batch(texts, dtype))
            else:
                in_flight.append((batch, pool.apply_async(_encode_batch, (texts, dtype))))
                while len(in_flight) > 4 * workers:
                    b, res = in_flight.popleft()
                    docs.consume(b, res.get())
            bar.set_postfix(docs.counts(), refresh=False)
        while in_flight:
            b, res = in_flight.popleft()
            docs.consume(b, res.get())
        bar.set_postfix(docs.counts(), refresh=True)  # the batches still in flight at the end are counted too
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()


def check_arguments(*, val_fraction: float = 0.01, shard_tokens: int = 1, workers: int | None = None) -> None:
    """Raise ``ValueError`` naming the flag for a value ``prepare`` refuses (a recipe checks them before its work)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction (--val-fraction): expected a value in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens (--shard-tokens): expected a positive count, got {shard_tokens}")
    cpus = os.cpu_count() or 1
    if workers is not None and not 0 <= workers <= 4 * cpus:
        raise ValueError(f"workers (--workers): expected 0 (tokenize in this process) to {4 * cpus} (4 per CPU), got "
                         f"{workers}")


def prepare(
    inputs: str | os.PathLike | list[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.01,
    text_key: str = "text",
    pattern: str = "*",
    workers: int | None = None,
    shard_tokens: int = 1 << 28,
    piece_chars: int = PIECE_CHARS,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize ``inputs`` (files, folders, ``datasets`` folders; a list, or one of them) into shards under
    ``out_dir``; return the meta.

    ``workers``: tokenizer processes (default: all CPUs; 0 tokenizes in this process). ``pattern`` selects files
    inside folders, at any depth (see ``find_sources``). Skipped documents (bad UTF-8, binary, empty, unreadable, bad
    JSON) are reported on stderr and listed in ``meta.json``. ``overwrite`` replaces only a previous dataset.
    """
    check_arguments(val_fraction=val_fraction, shard_tokens=shard_tokens, workers=workers)
    if isinstance(inputs, (str, os.PathLike)):  # one input: a str is no list of its characters
        inputs = [inputs]
    cpus = os.cpu_count() or 1
    out_dir = out_folder(out_dir, inputs, overwrite)
    tok = get_tokenizer(tokenizer)
    sources = find_sources(inputs, pattern)
    if not sources:
        raise ValueError(f"inputs: no files found in {[str(p) for p in inputs]}")
    dtype = token_dtype(tok.vocab_size)
    workers = cpus if workers is None else workers

    with writing_dataset(out_dir, inputs, overwrite, tok) as tmp:
        writers = {s: _SplitWriter(tmp, s, dtype, tok.eot_id, shard_tokens) for s in ("train", "val")}
        docs = _Documents(sources, writers, val_fraction)
        _tokenize(sources, docs, tokenizer, dtype, text_key, workers, Cuts(piece_chars, tok.cut_spaces), progress)
        meta = _meta(tok, dtype, val_fraction, text_key, {name: w.finish() for name, w in writers.items()}, docs)
        if meta["num_docs"] == 0:
            first = [f"; the first: {e['source']}: {e['detail']}" for e in meta["skipped"]["examples"][:1]]
            raise ValueError(f"inputs: no usable document ({meta['skipped']['count']} skipped: "
                             f"{meta['skipped']['by_reason']}{''.join(first)})")  # the error alone says what to fix
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if docs.skipped:
        print(f"skipped {sum(docs.skipped.values())} documents: {dict(docs.skipped)}", file=sys.stderr)
    if val_fraction > 0 and meta["splits"]["val"]["num_docs"] == 0:
        print(f"no document held out: val_fraction={val_fraction} of {meta['num_docs']} documents rounds to none, so "
              f"training reports no validation loss (raise --val-fraction)", file=sys.stderr)
    return meta


def _meta(tok: Tokenizer, dtype: str, val_fraction: float, text_key: str, splits: dict, docs: _Documents) -> dict:
    return {
        "format": FORMAT,
        "tokenizer": tok.spec(),
        "dtype": dtype,
        "document_prefix": "eot",
        "val_fraction": val_fraction,
        "text_key": text_key,
        "num_tokens": sum(s["num_tokens"] for s in splits.values()),
        "num_docs": sum(s["num_docs"] for s in splits.values()),
        "splits": splits,
        "sources": [s.record() for s in docs.sources],
        "skipped": {"count": sum(docs.skipped.values()), "by_reason": dict(docs.skipped), "examples": docs.examples},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

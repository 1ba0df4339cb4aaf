"""Streaming document readers for ``foxlm data prepare``.

Inputs: text files (``.gz`` too; one file = one document), directories of them, JSON Lines (one document per line,
under ``text_key``; a ``.json`` file may also hold one array of such records), both UTF-8 (a leading byte-order mark
is dropped), Parquet (needs ``pyarrow``), local Hugging Face ``datasets`` folders saved with ``save_to_disk`` and
``hub:NAME``, a dataset ``datasets.load_dataset(NAME, streaming=True)`` streams (a Hub name or a local dataset
folder; both need ``datasets``). A dataset with a validation split (``validation``, ``valid`` or ``val``) keeps its
own splits: its ``train`` split is trained on, its validation split held out, any other split (``test``) left unread;
one without is read whole (but for a ``test`` split beside others, left unread: never trained on) and split like
any input. Every reader yields *events* so that memory stays flat whatever the size (a ``.json`` array apart):

- ``("piece", text)``: the next piece of the current document. Long texts are cut into pieces of about
  ``Cuts.chars`` characters only where the tokenizer splits anyway (for GPT-2's pre-tokenizer: where whitespace
  follows a non-space), so tokenizing the pieces one by one gives exactly the ids of the whole text; for a
  tokenizer with no such place (``Cuts.spaces=None``) a document is one piece.
- ``("end", None)``: the current document is complete.
- ``("skip", (category, detail))``: the current document (possibly after some pieces) is dropped; categories:
  ``bad UTF-8``, ``binary`` (a text file with a NUL byte), ``empty``, ``bad JSON``, ``no text`` (missing or
  non-string field), ``unreadable``.

A document opens with its first event. ``Source`` keeps per-input statistics and a progress callback.
"""

from __future__ import annotations

import codecs
import fnmatch
import gzip
import hashlib
import io
import json
import os
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

from ..hub import offline_unless_reachable

Event = tuple[str, "str | tuple[str, str] | None"]

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")
JSON_SUFFIXES = (".json", ".json.gz")  # JSON Lines, or one array of records (as ``datasets``' json loader reads)
PARQUET_SUFFIXES = (".parquet",)
PIECE_CHARS = 1 << 20
FORMAT = "foxlm.tokens/1"  # the meta.json format of what `prepare` writes: never read back as text
# Unicode White_Space, what GPT-2's pre-tokenizer regex calls \s (Python's str.isspace() also takes \x1c-\x1f).
UNICODE_SPACES = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | frozenset(
    chr(c) for c in range(0x2000, 0x200B))
_CUT_SEARCH = 4096
VAL_SPLITS = ("validation", "valid", "val")
TEST_SPLIT = "test"  # never read beside other splits: a later evaluation on it would measure memorized text
HUB_PREFIX = "hub:"
_SURROGATE = re.compile("[\ud800-\udfff]")  # in a str only from a JSON escape of half a UTF-16 pair
RUN_PIECES = 4  # a run without whitespace longer than this many pieces is cut inside (see forced_cut)


@dataclass(frozen=True)
class Cuts:
    """How long documents are cut into pieces: about every ``chars`` characters, just before a character of
    ``spaces`` that follows one not in it (``safe_cut``), where the tokenizer's ids do not change; ``spaces=None``
    (a tokenizer that may merge across any place, see ``Tokenizer.cut_spaces``): never, documents are read whole."""

    chars: int = PIECE_CHARS
    spaces: frozenset[str] | None = UNICODE_SPACES


@lru_cache(maxsize=4)
def _safe_cut_pattern(spaces: frozenset[str]) -> re.Pattern:
    chars = "".join(re.escape(c) for c in sorted(spaces))
    return re.compile(f"[^{chars}](?=[{chars}])")


def safe_cut(text: str, limit: int, spaces: frozenset[str] = UNICODE_SPACES) -> int:
    """Largest ``i <= limit`` (searching back a few KiB) where a character of ``spaces`` follows one not in it; 0 if
    none.

    With Unicode whitespace as ``spaces``, GPT-2's pre-tokenizer always ends a pre-token there (none of its patterns
    runs from a non-space into whitespace, and its lookaheads only look forward), so tokenizing ``text[:i]`` and
    ``text[i:]`` one after the other gives exactly the ids of ``text``; trivially so for bytes.
    """
    limit = min(limit, len(text) - 1)
    for i in range(limit, max(limit - _CUT_SEARCH, 0), -1):
        if text[i] in spaces and text[i - 1] not in spaces:
            return i
    return 0


def split_pieces(text: str, piece_chars: int = PIECE_CHARS,
                 spaces: frozenset[str] | None = UNICODE_SPACES) -> Iterator[str]:
    """Cut ``text`` into pieces of about ``piece_chars`` at safe places (see ``safe_cut``); a run with no safe place
    within ``RUN_PIECES`` pieces is cut where it is (see ``forced_cut``). ``spaces=None``: ``text`` whole."""
    while spaces is not None and len(text) > piece_chars:
        yield text[:(cut := safe_cut(text, piece_chars, spaces) or forced_cut(text, piece_chars, spaces))]
        text = text[cut:]
    if text:  # none left where the last cut took the rest whole
        yield text


def forced_cut(text: str, piece_chars: int, spaces: frozenset[str] = UNICODE_SPACES) -> int:
    """Where to cut ``text`` that has no safe place near ``piece_chars``: the first safe place after it; its end
    (``len(text)``: it is one piece) where it is all within ``RUN_PIECES * piece_chars``; else, in a run of more than
    that without whitespace, ``piece_chars`` itself.

    The tokenizer holds a whole pre-token in memory (a 100 MB run took GBs), so such runs are split as tiktoken's
    users do; the ids differ from the unsplit run's only at the cut. The end of ``text`` must be the end of its
    document (a reader holding only part of one first reads on while the rest is that short)."""
    m = _safe_cut_pattern(spaces).search(text, piece_chars, RUN_PIECES * piece_chars)
    if m is not None:
        return m.end()
    return len(text) if len(text) <= RUN_PIECES * piece_chars else piece_chars


def document_events(text: str, cuts: Cuts = Cuts()) -> Iterator[Event]:
    """Events of one in-memory document."""
    if not text.strip():
        yield "skip", ("empty", "no text")
        return
    for piece in split_pieces(text, cuts.chars, cuts.spaces):
        yield "piece", piece
    yield "end", None


class _HashingReader(io.RawIOBase):
    """Binary reader that hashes and counts what it reads (the raw file, before any decompression)."""

    def __init__(self, f, on_bytes: Callable[[int], None]):
        self._f, self._on_bytes, self.sha256 = f, on_bytes, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = self._f.readinto(buf)
        if n:
            self.sha256.update(memoryview(buf)[:n])
            self._on_bytes(n)
        return n


@dataclass
class Source:
    """One input: a file or a ``datasets`` folder, with what was read from it."""

    path: Path
    kind: str  # "text" | "jsonl" | "json" | "parquet" | "hf" | "hub"
    split: str | None = None  # the dataset's split read (None: all of it)
    to: str | None = None  # "train" | "val": where its documents go (None: by val_fraction)
    sha256: str | None = None
    bytes: int = 0
    documents: int = 0
    tokens: int = 0
    skipped: int = 0
    error: str | None = field(default=None)

    def record(self) -> dict:
        return {"path": str(self.path), "kind": self.kind, "bytes": self.bytes, "sha256": self.sha256,
                "documents": self.documents, "tokens": self.tokens, "skipped": self.skipped,
                **({"split": self.split, "to": self.to} if self.split is not None else {})}


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(JSON_SUFFIXES):
        return "json"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _is_hf_dataset(path: Path) -> bool:
    """Whether folder ``path`` is a ``datasets`` ``save_to_disk`` folder (a DatasetDict's, or a Dataset's: not just
    any folder holding a ``state.json``)."""
    return (path / "dataset_dict.json").is_file() or all((path / f).is_file() for f in ("state.json",
                                                                                        "dataset_info.json"))


def is_token_dataset(path: Path) -> bool:
    """Whether folder ``path`` holds token shards written by ``prepare``."""
    try:
        return json.loads((path / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def find_sources(inputs: list[str | os.PathLike], pattern: str = "*") -> list[Source]:
    """Expand files and folders into sources, sorted within each folder, each file once where inputs overlap.

    Inside folders: the files whose name matches ``pattern`` (e.g. ``*.md``) at any depth, or, for a pattern with a
    ``/``, the files it globs; hidden entries and prepared token datasets are skipped, a ``datasets`` folder is read
    as a dataset (with the default pattern, else skipped), and a subfolder that cannot be listed becomes an
    ``unreadable`` source (reported and counted like an unreadable file).
    """
    if Path(pattern).is_absolute() or ".." in Path(pattern).parts:  # it could only match outside the folders
        raise ValueError(f"pattern (--glob): expected a pattern inside the input folders (e.g. '*.md' or "
                         f"'docs/**/*.txt'), got {pattern!r}; to read other files, name them or their folder as inputs")
    sources: list[Source] = []
    for raw in inputs:
        if str(raw).startswith(HUB_PREFIX):
            sources.extend(_split_sources(Path(str(raw)[len(HUB_PREFIX):]), "hub", _hub_splits(str(raw))))
            continue
        path = Path(raw).expanduser()
        if path.is_dir() and is_token_dataset(path):
            raise ValueError(f"inputs: {path} holds prepared token shards, not text (its `foxlm data prepare` output)")
        if path.is_dir() and _is_hf_dataset(path):
            sources.extend(_hf_folder_sources(path))
        elif path.is_dir():
            sources.extend(_folder_sources(path, pattern))
        elif path.exists():
            sources.append(Source(path, _kind(path)))
        else:
            raise FileNotFoundError(f"inputs: {path} does not exist")
    return _unique(sources)


def _unique(sources: list[Source]) -> list[Source]:
    """``sources`` with each file (or dataset split) once, where inputs overlap (a folder and a file or subfolder
    in it, one named twice, a DatasetDict and its split's folder): read twice, its documents would be trained on twice
    and could land in both splits. Of one split read twice, the dataset's own (its ``to``: train or val) is kept."""
    keys = [_identity(src) for src in sources]
    whole = {(kind, path) for kind, path, split in keys if split is None}
    unique: dict[tuple, Source] = {}
    for src, key in zip(sources, keys):
        kind, path, split = key
        covered = split is not None and (kind, path) in whole  # read with its whole dataset
        if not covered and key not in unique:
            unique[key] = src
            continue
        dropped = src
        if not covered and src.to is not None and unique[key].to is None:
            dropped, unique[key] = unique[key], src  # in the place of the first
        of = f" (the {split!r} split of {path})" if split is not None and dropped.split is None else ""
        print(f"{dropped.path}: named by more than one input{of}; read once", file=sys.stderr)
    return list(unique.values())


def _identity(src: Source) -> tuple:
    """What ``src`` reads: (kind, real path, split). A DatasetDict's split folder (save_to_disk's ``NAME/train``)
    named itself is that split of ``NAME``."""
    if src.kind == "hub":
        return src.kind, src.path, src.split
    path = src.path.resolve()
    if src.kind == "hf" and src.split is None and (path.parent / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path.parent / "dataset_dict.json").read_text(encoding="utf-8")).get("splits")
        except (OSError, ValueError, AttributeError):  # no split list: the folder is read as a dataset of its own
            splits = None
        if isinstance(splits, list) and path.name in splits:
            return src.kind, path.parent, path.name
    return src.kind, path, src.split


def _hf_folder_sources(path: Path) -> list[Source]:
    """The sources of a ``datasets`` folder (``save_to_disk``): its train and validation splits, or all of it."""
    dict_file = path / "dataset_dict.json"
    if not dict_file.is_file():
        return _split_sources(path, "hf", [])
    try:
        splits = json.loads(dict_file.read_text(encoding="utf-8")).get("splits")
    except (ValueError, AttributeError) as e:  # bad JSON or UTF-8; JSON that is no object
        raise ValueError(f"inputs: {dict_file}: not a datasets split list ({e or type(e).__name__}); save the "
                         "dataset again with save_to_disk") from None
    if not isinstance(splits, list) or not all(isinstance(name, str) for name in splits):
        raise ValueError(f"inputs: {dict_file}: expected {{\"splits\": [names]}} as save_to_disk writes it, got "
                         f"splits={splits!r}; save the dataset again with save_to_disk")
    return _split_sources(path, "hf", splits)


def _split_sources(path: Path, kind: str, splits: list[str]) -> list[Source]:
    """One source for a whole dataset, or, where it has a validation split, one for its train and one for that."""
    val = next((name for name in VAL_SPLITS if name in splits), None)
    if val is None and TEST_SPLIT in splits and len(splits) > 1:  # the others, split by val_fraction
        print(f"{path}: has no validation split; its other splits are split by val_fraction; not read: "
              f"{TEST_SPLIT} (never trained on)", file=sys.stderr)
        return [Source(path, kind, split=name) for name in sorted(splits) if name != TEST_SPLIT]
    if val is None:
        return [Source(path, kind)]
    if "train" not in splits:
        raise ValueError(f"inputs: {path} has a {val!r} split but no 'train' split (splits: {splits})")
    unread = [name for name in splits if name not in ("train", val)]
    if unread:
        print(f"{path}: kept its own splits (train, {val}); not read: {', '.join(unread)}", file=sys.stderr)
    return [Source(path, kind, split="train", to="train"), Source(path, kind, split=val, to="val")]


def _hub_splits(raw: str) -> list[str]:
    name = raw[len(HUB_PREFIX):]
    if not name:
        raise ValueError(f"inputs: {raw!r} names no dataset; expected hub:NAME (a Hub dataset or a local folder)")
    if not Path(name).expanduser().exists():  # a Hub name: offline at once where the hub cannot be reached
        offline_unless_reachable()
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"inputs: {raw} needs `datasets` (pip install 'foxlm[data]')") from e
    try:
        return list(datasets.load_dataset(name, streaming=True))
    except ConnectionError as e:  # datasets' own: no hub (or offline mode) and nothing cached
        raise ValueError(f"inputs: {raw}: the Hugging Face hub cannot be reached from here ({e}); prepare it where "
                         "the hub is reachable, or pass a local copy: a `save_to_disk` folder, or hub:FOLDER holding "
                         "its data files") from None


def _folder_sources(root: Path, pattern: str) -> list[Source]:
    found: list[Source] = []
    def unreadable(e: OSError) -> None:
        found.append(Source(Path(e.filename), "text", error=f"{type(e).__name__}: {e.strerror}"))

    walked: list[Path] = []
    # linked subfolders are followed (a corpus of links to where the text lies); each real folder is walked once, by
    # the first path in name order, so a folder linked twice is read once and a link to an ancestor ends
    seen = {os.path.realpath(root)}
    for folder, dirs, files in os.walk(root, onerror=unreadable, followlinks=True):
        here = Path(folder)
        if here != root and is_token_dataset(here):
            print(f"skipped {here}: prepared token shards, not text", file=sys.stderr)
            dirs.clear()
            continue
        if here != root and _is_hf_dataset(here):  # its files are Arrow data and JSON metadata, not documents
            dirs.clear()
            if pattern == "*":
                found.extend(_hf_folder_sources(here))
            else:
                print(f"skipped {here}: a datasets folder, not files matching {pattern!r} (name it as an input to "
                      "read it)", file=sys.stderr)
            continue
        dirs[:] = [d for d in sorted(dirs) if not d.startswith(".") and _first_visit(here / d, seen)]
        walked += [here / f for f in files if not f.startswith(".") and ("/" in pattern or fnmatch.fnmatch(f, pattern))]
    if "/" in pattern:  # a path pattern: the files the walk admitted whose path under root it matches
        walked = [f for f in walked if _path_matches(f.relative_to(root).parts, Path(pattern).parts)]
    found += [Source(p, _kind(p)) for p in walked if p.is_file()]
    return sorted(found, key=lambda s: s.path)


def _path_matches(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Whether a relative path (its ``parts``) matches a glob pattern's parts as ``Path.glob`` would, ``**`` being
    any number of folders (a trailing one: every file below), through linked folders too, which ``Path.glob``'s
    ``**`` does not enter."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_path_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatch(parts[0], pattern[0]) and _path_matches(parts[1:], pattern[1:])


def _first_visit(folder: Path, seen: set[str]) -> bool:
    """Whether the real folder behind ``folder`` is not in ``seen`` (then it is added)."""
    real = os.path.realpath(folder)
    if real in seen:
        return False
    seen.add(real)
    return True


def _open_binary(path: Path, on_bytes: Callable[[int], None]) -> tuple[io.BufferedReader, _HashingReader]:
    raw = _HashingReader(open(path, "rb"), on_bytes)
    stream = io.BufferedReader(raw)
    if path.name.lower().endswith(".gz"):
        stream = io.BufferedReader(gzip.GzipFile(fileobj=stream, mode="rb"))
    return stream, raw


def _bad_utf8(e: UnicodeDecodeError, read: int) -> Event:
    """The skip event of a text file's decoding error, at its byte offset in the file: ``e.object`` is what the
    incremental decoder held (the bytes it kept from the block before, and this block), ending at ``read``."""
    return "skip", ("bad UTF-8", f"{e.reason} at byte {read - len(e.object) + e.start}")


def _text_file_events(src: Source, on_bytes, cuts: Cuts) -> Iterator[Event]:
    stream, raw = _open_binary(src.path, on_bytes)
    with stream:
        decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="strict")  # a byte-order mark is no text
        buf, seen_text, read = "", False, 0
        while block := stream.read(cuts.chars):
            if b"\0" in block:  # no text file has one; UTF-16 text or binary data that passes as UTF-8 does
                yield "skip", ("binary", "a NUL byte: binary data or UTF-16 text, not UTF-8 text")
                return
            read += len(block)
            try:
                buf += decoder.decode(block)
            except UnicodeDecodeError as e:
                yield _bad_utf8(e, read)
                return
            seen_text = seen_text or bool(buf.strip())
            while cuts.spaces is not None and len(buf) > cuts.chars:
                if not (cut := safe_cut(buf, cuts.chars, cuts.spaces)):
                    if len(buf) <= RUN_PIECES * cuts.chars:  # the run may end in the next block
                        break
                    cut = forced_cut(buf, cuts.chars, cuts.spaces)
                yield "piece", buf[:cut]
                buf = buf[cut:]
        try:
            buf += decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:  # a character cut short by the end of the file
            yield _bad_utf8(e, read)
            return
        src.sha256 = raw.sha256.hexdigest()
    if not (seen_text or buf.strip()):
        yield "skip", ("empty", "no text")
        return
    yield "piece", buf
    yield "end", None


def _jsonl_events(src: Source, text_key: str, on_bytes, cuts: Cuts) -> Iterator[Event]:
    stream, raw = _open_binary(src.path, on_bytes)
    with stream:
        for lineno, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8-sig" if lineno == 1 else "utf-8"))  # no byte-order mark
            except UnicodeDecodeError as e:
                yield "skip", ("bad UTF-8", f"line {lineno}: {e.reason} at byte {e.start}")
                continue
            except json.JSONDecodeError as e:
                yield "skip", ("bad JSON", f"line {lineno}: {e.msg}")
                continue
            yield from _record_events(obj, text_key, f"line {lineno}", cuts)
        src.sha256 = raw.sha256.hexdigest()


def _record_events(obj, text_key: str, where: str, cuts: Cuts) -> Iterator[Event]:
    """Events of one JSON record (``where``: its line or index, for a skip's detail)."""
    if not isinstance(obj, dict) or text_key not in obj:
        yield "skip", ("no text", f"{where}: no {text_key!r} field")
        return
    text = obj[text_key]
    if not isinstance(text, str):
        yield "skip", ("no text", f"{where}: {text_key!r} is not a string")
        return
    if (half := _SURROGATE.search(text)) is not None:  # no UTF-8 has it: tokenizers raise or replace it
        yield "skip", ("bad UTF-8", f"{where}: {text_key!r} holds a lone surrogate \\u{ord(half.group()):04x} "
                                    f"(half of a character) at index {half.start()}")
        return
    yield from document_events(text, cuts)


def _json_events(src: Source, text_key: str, on_bytes, cuts: Cuts) -> Iterator[Event]:
    """A ``.json`` file: JSON Lines, or an array of records (read whole), as ``datasets.load_dataset("json")`` takes
    both; its raw JSON is no document."""
    with (gzip.open if src.path.name.lower().endswith(".gz") else open)(src.path, "rb") as f:
        head = f.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip()
    if not head.startswith(b"["):
        yield from _jsonl_events(src, text_key, on_bytes, cuts)
        return
    stream, raw = _open_binary(src.path, on_bytes)
    with stream:
        data = stream.read()
    src.sha256 = raw.sha256.hexdigest()
    try:
        records = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        yield "skip", ("bad UTF-8", f"{e.reason} at byte {e.start}")
        return
    except json.JSONDecodeError as e:
        yield "skip", ("bad JSON", f"line {e.lineno}: {e.msg}")
        return
    for i, obj in enumerate(records):
        yield from _record_events(obj, text_key, f"record {i}", cuts)


def _column_events(src: Source, text_key: str, batches: Iterator[list], total_rows: int, on_bytes, cuts: Cuts):
    """Events of string rows arriving in batches; progress is spread over the source's on-disk size."""
    done_rows, done_bytes = 0, 0
    for batch in batches:
        for text in batch:
            if not isinstance(text, str):
                yield "skip", ("no text", f"row {done_rows}: {text_key!r} is {type(text).__name__}, not a string")
            else:
                yield from document_events(text, cuts)
            done_rows += 1
        advance = src.bytes * done_rows // max(total_rows, 1) - done_bytes
        on_bytes(advance)
        done_bytes += advance


def _parquet_events(src: Source, text_key: str, on_bytes, cuts: Cuts) -> Iterator[Event]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise OSError("reading Parquet needs pyarrow (pip install pyarrow)") from e
    from ..checkpoint.files import sha256_file

    src.sha256 = sha256_file(src.path)
    pf = pq.ParquetFile(src.path)
    if text_key not in pf.schema_arrow.names:
        raise OSError(f"no column {text_key!r} (text_key, --text-key; columns: {pf.schema_arrow.names})")
    batches = (b.column(0).to_pylist() for b in pf.iter_batches(batch_size=1024, columns=[text_key]))
    yield from _column_events(src, text_key, batches, pf.metadata.num_rows, on_bytes, cuts)


def _hf_events(src: Source, text_key: str, on_bytes, cuts: Cuts) -> Iterator[Event]:
    try:
        import datasets
    except ImportError as e:
        raise OSError("reading a Hugging Face datasets folder needs `datasets` (pip install datasets)") from e
    from ..checkpoint.files import sha256_file

    loaded = datasets.load_from_disk(str(src.path))
    if src.split is not None:
        parts = [loaded[src.split]]
    else:
        parts = [loaded[k] for k in sorted(loaded)] if isinstance(loaded, datasets.DatasetDict) else [loaded]
    digest = hashlib.sha256()
    for f in _arrow_files(src):
        digest.update(sha256_file(f).encode())
    src.sha256 = digest.hexdigest()
    for ds in parts:
        if text_key not in ds.column_names:
            raise OSError(f"no column {text_key!r} (text_key, --text-key; columns: {ds.column_names})")
    total = sum(len(ds) for ds in parts)
    batches = (b[text_key] for ds in parts for b in ds.select_columns([text_key]).iter(batch_size=1024))
    yield from _column_events(src, text_key, batches, total, on_bytes, cuts)


def _hub_events(src: Source, text_key: str, on_bytes, cuts: Cuts) -> Iterator[Event]:
    """A streamed dataset (``hub:NAME``), split by split in name order; no size or hash is known beforehand."""
    import datasets

    loaded = datasets.load_dataset(str(src.path), streaming=True)
    for name in [src.split] if src.split is not None else sorted(loaded):
        ds = loaded[name]
        if ds.column_names is not None and text_key not in ds.column_names:
            raise OSError(f"no column {text_key!r} (text_key, --text-key) in split {name!r} "
                          f"(columns: {ds.column_names})")
        batches = (b[text_key] for b in ds.select_columns([text_key]).iter(batch_size=1024))
        yield from _column_events(src, text_key, batches, 0, on_bytes, cuts)


def _arrow_files(src: Source) -> list[Path]:
    """The Arrow files of a ``datasets`` folder (of the split read, where one is)."""
    return sorted((src.path / src.split if src.split is not None else src.path).rglob("*.arrow"))


def source_size(src: Source) -> int:
    """On-disk bytes of a source (the ``datasets`` folder: its Arrow files)."""
    if src.kind == "hf":
        return sum(f.stat().st_size for f in _arrow_files(src))
    if src.kind == "hub":
        return 0  # streamed: not known beforehand
    return src.path.stat().st_size


def source_events(src: Source, text_key: str, on_bytes: Callable[[int], None],
                  cuts: Cuts = Cuts()) -> Iterator[Event]:
    """Events of one source; an unreadable source or a decoding error ends in a ``skip`` event, never a crash."""
    readers = {"text": lambda: _text_file_events(src, on_bytes, cuts),
               "jsonl": lambda: _jsonl_events(src, text_key, on_bytes, cuts),
               "json": lambda: _json_events(src, text_key, on_bytes, cuts),
               "parquet": lambda: _parquet_events(src, text_key, on_bytes, cuts),
               "hf": lambda: _hf_events(src, text_key, on_bytes, cuts),
               "hub": lambda: _hub_events(src, text_key, on_bytes, cuts)}
    if src.error is not None:  # found unreadable (a folder that could not be listed)
        yield "skip", ("unreadable", src.error)
        return
    try:
        src.bytes = source_size(src)
        yield from readers[src.kind]()
    except (OSError, EOFError, ValueError) as e:  # unreadable, truncated gzip, corrupt parquet, ...
        src.error = f"{type(e).__name__}: {e}"
        yield "skip", ("unreadable", src.error)

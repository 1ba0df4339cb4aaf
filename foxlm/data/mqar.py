"""Multi-query associative recall (MQAR; Arora et al., Zoology, 2023): synthetic retrieval documents as token ids.

A document of ``length`` tokens (its leading ``<|endoftext|>`` included, as every foxlm document has one)::

    <eot> k_1 v_1 k_2 v_2 ... k_N v_N  f f f ... f  k_p1 v_p1 k_p2 v_p2 ... k_pN v_pN

N key-value pairs, then filler, then every key again in a random order, each followed by its value. A model that
predicts ``v_pi`` after the second ``k_pi`` has retrieved it from ``length - 4N`` or so tokens back; the first
occurrences are random and unpredictable. ``vocab = (lo, hi)`` is split into thirds: keys, values and filler are
drawn from disjoint id ranges (keys and values without replacement within a document, filler uniformly), so a key
appears exactly twice and nothing else looks like one. Everything is a pure function of the seed (numpy's
``default_rng``).

``write_dataset`` writes such documents as a ``foxlm data prepare`` folder (``foxlm train data=DIR``), alone or
interleaved with the documents of an existing prepared dataset at a given share of the tokens; ``meta.json`` records
the task under ``"synthetic"``, which ``foxlm eval recall`` reads back.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..checkpoint.files import sha256_file
from .dataset import TokenDataset
from .prepare import _SplitWriter, out_folder, token_dtype, writing_dataset
from .sources import FORMAT
from .tokenizer import Tokenizer, get_tokenizer

TASK = "mqar"


@dataclass(frozen=True)
class MQARSpec:
    """The id ranges of the task: ``vocab = (lo, hi)``, split into thirds for keys, values and filler."""

    vocab: tuple[int, int]

    def __post_init__(self):
        lo, hi = self.vocab
        if not 0 <= lo < hi or (hi - lo) < 3:
            raise ValueError(f"vocab: expected a range LO:HI of at least 3 ids with 0 <= LO < HI, got {lo}:{hi}")

    @property
    def third(self) -> int:
        return (self.vocab[1] - self.vocab[0]) // 3

    @property
    def keys(self) -> tuple[int, int]:
        return self.vocab[0], self.vocab[0] + self.third

    @property
    def values(self) -> tuple[int, int]:
        return self.vocab[0] + self.third, self.vocab[0] + 2 * self.third

    @property
    def filler(self) -> tuple[int, int]:
        return self.vocab[0] + 2 * self.third, self.vocab[0] + 3 * self.third

    def check(self, tokenizer: Tokenizer) -> None:
        """Raise ``ValueError`` if the ids leave the tokenizer's vocabulary or take in its end-of-text id."""
        lo, hi = self.vocab
        if hi > tokenizer.vocab_size:
            raise ValueError(f"vocab: {lo}:{hi} goes past {tokenizer.name}'s {tokenizer.vocab_size} ids")
        if lo <= tokenizer.eot_id < hi:
            raise ValueError(f"vocab: {lo}:{hi} holds {tokenizer.name}'s end-of-text id {tokenizer.eot_id}, which "
                             f"opens every document; pick a range without it")

    def check_document(self, length: int, pairs: int) -> None:
        """Raise ``ValueError`` unless a document of ``length`` tokens can hold ``pairs`` distinct pairs twice."""
        if pairs < 1 or pairs > self.third:
            raise ValueError(f"pairs: expected 1 to {self.third} (the ids in a third of vocab {self.vocab[0]}:"
                             f"{self.vocab[1]}), got {pairs}")
        if length < 1 + 4 * pairs:
            raise ValueError(f"length: {length} tokens cannot hold {pairs} pairs and their queries (1 + 4 x {pairs} "
                             f"= {1 + 4 * pairs} tokens)")

    def record(self) -> dict:
        return {"task": TASK, "vocab": list(self.vocab), "keys": list(self.keys), "values": list(self.values),
                "filler": list(self.filler)}


def sample(spec: MQARSpec, length: int, pairs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One document's tokens after its ``<|endoftext|>`` (``length - 1`` int64 ids) and the positions, in the whole
    document (``<|endoftext|>`` at 0), of its ``pairs`` answers: the values that follow the second occurrence of
    their keys, each predictable from the token before it."""
    spec.check_document(length, pairs)
    keys = rng.choice(spec.third, pairs, replace=False) + spec.keys[0]
    values = rng.choice(spec.third, pairs, replace=False) + spec.values[0]
    filler = rng.integers(spec.filler[0], spec.filler[1], size=length - 1 - 4 * pairs)
    order = rng.permutation(pairs)
    kv = np.stack([keys, values], 1).reshape(-1)
    queries = np.stack([keys[order], values[order]], 1).reshape(-1)
    body = np.concatenate([kv, filler, queries]).astype(np.int64)
    answers = length - 2 * pairs + 1 + 2 * np.arange(pairs)
    return body, answers


def documents(spec: MQARSpec, lengths: tuple[int, int], pairs: list[int], seed: int | list[int]
              ) -> Iterator[np.ndarray]:
    """Endless documents (bodies, as ``sample`` gives them): each draws its number of pairs from ``pairs`` and its
    length uniformly from ``lengths = (min, max)``, raised where needed to hold its pairs. The arguments are checked
    here, not when the first document is drawn (a generator's body runs only then)."""
    if not pairs:
        raise ValueError("pairs: expected at least one count of pairs")
    lo, hi = lengths
    if not 2 <= lo <= hi:
        raise ValueError(f"length: expected 2 <= MIN <= MAX, got {lo}:{hi}")
    for n in pairs:
        spec.check_document(hi, n)
    if any(int(s) < 0 for s in np.atleast_1d(seed)):  # numpy's own error names no argument
        raise ValueError(f"seed: expected a non-negative integer, got {seed}")
    return _documents(spec, lo, hi, pairs, np.random.default_rng(seed))


def _documents(spec: MQARSpec, lo: int, hi: int, pairs: list[int], rng: np.random.Generator
               ) -> Iterator[np.ndarray]:
    while True:
        n = int(pairs[rng.integers(len(pairs))])
        yield sample(spec, int(rng.integers(max(lo, 1 + 4 * n), hi + 1)), n, rng)[0]


def _base_documents(base: TokenDataset) -> Iterator[np.ndarray]:
    for doc in base.documents():
        yield doc[1:]  # the writer puts back the leading <|endoftext|>


def _write_split(writer: _SplitWriter, synthetic: Iterator[np.ndarray], budget: int,
                 base: TokenDataset | None) -> tuple[int, int]:
    """Write ``base``'s documents (if any) with synthetic ones until those reach ``budget`` tokens, spread evenly:
    the next document is synthetic while the synthetic tokens lag their share of the tokens written so far.
    Returns (synthetic documents, synthetic tokens)."""
    base_total = len(base.tokens) if base is not None else 0
    base_docs = _base_documents(base) if base is not None else iter(())
    base_done, syn_docs, syn_tokens = 0, 0, 0
    pending = next(base_docs, None)
    while pending is not None or syn_tokens < budget:
        if syn_tokens < budget and (pending is None or syn_tokens * base_total <= base_done * budget):
            writer.begin()
            writer.write(next(synthetic))
            syn_tokens += writer.end()
            syn_docs += 1
        else:
            writer.begin()
            writer.write(pending)
            base_done += writer.end()
            pending = next(base_docs, None)
    return syn_docs, syn_tokens


def write_dataset(
    out_dir: str | os.PathLike,
    spec: MQARSpec,
    *,
    lengths: tuple[int, int],
    pairs: list[int],
    seed: int = 0,
    tokens: int | None = None,
    val_fraction: float = 0.01,
    mix: str | os.PathLike | None = None,
    mix_fraction: float | None = None,
    tokenizer: str = "gpt2",
    shard_tokens: int = 1 << 28,
    overwrite: bool = False,
) -> dict:
    """Write MQAR documents as a prepared token folder under ``out_dir``; return its ``meta.json``.

    Alone (``tokens``): at least ``tokens`` training tokens of MQAR, and ``val_fraction`` of that (at least one
    document) held out. Mixed (``mix``, a prepared folder, and ``mix_fraction`` in (0, 1)): every document of
    ``mix``'s splits, with MQAR documents interleaved so that they make ``mix_fraction`` of each split's tokens; the
    tokenizer is ``mix``'s. Training and validation documents come from separate streams of ``seed``. The folder is
    written as ``prepare`` writes one (``out_folder``, ``writing_dataset``): ``overwrite`` replaces only a previous
    dataset, and a killed run leaves the one there whole.
    """
    if (tokens is None) == (mix is None):
        raise ValueError("tokens, mix: expected exactly one: tokens (MQAR alone) or mix (a dataset to mix into)")
    if mix is not None and (mix_fraction is None or not 0.0 < mix_fraction < 1.0):
        raise ValueError(f"mix_fraction: expected a fraction in (0, 1) of the tokens to be MQAR, got {mix_fraction}")
    if mix is None and mix_fraction is not None:
        raise ValueError("mix_fraction: only with mix (a dataset to mix into)")
    if tokens is not None and tokens < 1:
        raise ValueError(f"tokens: expected a positive number of training tokens, got {tokens}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction: expected a value in [0, 1), got {val_fraction}")
    if seed < 0:  # said by documents() too, but of the stream's [seed, part]
        raise ValueError(f"seed: expected a non-negative integer, got {seed}")
    streams = {split: documents(spec, lengths, pairs, [seed, part]) for part, split in enumerate(("train", "val"))}
    bases = None
    if mix is not None:
        if not (Path(mix).expanduser() / "meta.json").is_file():  # TokenDataset's message names a "path"
            raise FileNotFoundError(f"mix: {mix} is not a prepared dataset (no meta.json); prepare it with "
                                    "`foxlm data prepare`")
        bases = {split: TokenDataset(mix, split) for split in ("train", "val")}
        for ds in bases.values():
            ds.verify()  # copied token by token: a damaged shard would be copied silently
        if bases["train"].meta.get("document_prefix") != "eot":
            raise ValueError(f"mix: {mix}'s documents do not open with <|endoftext|>; prepare it again")
        tok = bases["train"].tokenizer()
    else:
        tok = get_tokenizer(tokenizer)
    spec.check(tok)
    if bases is not None:
        share = mix_fraction / (1.0 - mix_fraction)
        budgets = {split: round(share * len(ds.tokens)) for split, ds in bases.items()}
    else:
        budgets = {"train": tokens, "val": max(1, round(val_fraction * tokens)) if val_fraction > 0 else 0}

    inputs = [mix] if mix is not None else []
    out_dir = out_folder(out_dir, inputs, overwrite)
    dtype = token_dtype(tok.vocab_size)
    with writing_dataset(out_dir, inputs, overwrite, tok) as tmp:
        synthetic, splits = {}, {}
        for split in ("train", "val"):
            writer = _SplitWriter(tmp, split, dtype, tok.eot_id, shard_tokens)
            docs, count = _write_split(writer, streams[split], budgets[split], None if bases is None else bases[split])
            synthetic[split] = {"documents": docs, "tokens": count}
            splits[split] = writer.finish()
        record = spec.record() | {"lengths": list(lengths), "pairs": list(pairs), "seed": seed,
                                  "written": synthetic}
        sources = []
        if mix is not None:
            record["mixed_with"] = {"path": str(mix), "fraction": mix_fraction}
            sources = [{"path": str(mix), "kind": "foxlm.tokens", "sha256": sha256_file(Path(mix) / "meta.json"),
                        "documents": bases["train"].num_docs + bases["val"].num_docs,
                        "tokens": len(bases["train"].tokens) + len(bases["val"].tokens)}]
        meta = {"format": FORMAT, "tokenizer": tok.spec(), "dtype": dtype, "document_prefix": "eot",
                "val_fraction": val_fraction if mix is None else None,
                "num_tokens": sum(s["num_tokens"] for s in splits.values()),
                "num_docs": sum(s["num_docs"] for s in splits.values()), "splits": splits, "sources": sources,
                "skipped": {"count": 0, "by_reason": {}, "examples": []}, "synthetic": record,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def recorded_task(data: str | os.PathLike) -> dict | None:
    """The MQAR record (``write_dataset``'s ``"synthetic"``: ranges, lengths, pairs, seed) of a prepared folder's
    ``meta.json``; None if it holds no MQAR."""
    try:
        record = json.loads((Path(data).expanduser() / "meta.json").read_text()).get("synthetic")
    except (OSError, ValueError, AttributeError):
        return None
    return record if isinstance(record, dict) and record.get("task") == TASK else None

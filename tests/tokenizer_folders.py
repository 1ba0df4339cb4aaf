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

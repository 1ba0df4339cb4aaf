"""foxlm.data: offline tokenizers, ``foxlm data prepare`` (text → packed token shards) and their reader."""

from .corpus import ensure_default_corpus
from .dataset import ShardedTokens, TokenDataset
from .prepare import prepare
from .tokenizer import (
                        BPETokenizer,
                        ByteTokenizer,
                        JSONGPT2Tokenizer,
                        Tokenizer,
                        check_tokenizer,
                        get_tokenizer,
                        matches_spec,
                        model_tokenizer,
                        same_tokenizer,
                        tokenizer_from_spec,
)

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "JSONGPT2Tokenizer",
    "ShardedTokens",
    "TokenDataset",
    "Tokenizer",
    "check_tokenizer",
    "ensure_default_corpus",
    "get_tokenizer",
    "matches_spec",
    "model_tokenizer",
    "prepare",
    "same_tokenizer",
    "tokenizer_from_spec",
]

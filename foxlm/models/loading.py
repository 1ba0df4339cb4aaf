"""A trained model as a causal LM: the model of a run folder, a checkpoint folder or a ``save_pretrained`` folder,
found and verified by ``foxlm.checkpoint.weights`` and built by the Auto classes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from ..checkpoint.files import read_json
from ..checkpoint.weights import DAMAGED_MODEL, reading_weights, resolve_model_dir


def load_checkpoint_model(path: str | os.PathLike, arg: str = "path", progress: bool = True,
                          **from_pretrained_kwargs):
    """The causal LM (``FoxForCausalLM``, or any model registered with ``AutoModelForCausalLM``) of a run folder, a
    checkpoint folder or a ``save_pretrained`` folder. ``arg``: what errors call ``path`` (a command's argument);
    ``progress=False``: without transformers' "Loading weights" bar (a command's ``--no-progress``)."""
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
    with transformers_bars(progress), reading_weights(folder, arg):
        return AutoModelForCausalLM.from_pretrained(folder, config=config, **from_pretrained_kwargs)


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

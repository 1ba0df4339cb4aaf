"""The Hugging Face export (``foxlm export``): a checkpoint's model as a ``save_pretrained`` folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM

from ..models.card import write_model_card
from .dcp import load_shards
from .files import check_parents, fsync_tree, remove_stale_temporaries, temporary_path
from .manifest import verify_checkpoint, write_manifest
from .run_folder import SHARDS, is_sharded, latest_valid_checkpoint


def export_model(src: str | os.PathLike, dst: str | os.PathLike, dst_arg: str = "dst") -> Path:
    """Write the model of ``src`` (a run folder: its latest valid checkpoint, or a checkpoint folder, sharded or not)
    as a ``save_pretrained`` folder ``dst`` (safetensors, with the tokenizer where the checkpoint has one), for
    ``AutoModelForCausalLM.from_pretrained``. One process; a sharded checkpoint's weights are read whole into it.
    ``dst`` must not exist; it appears complete or not at all. Errors about ``dst`` name it ``dst_arg``."""
    src, dst = Path(src).expanduser(), Path(dst).expanduser()
    if (src / "config.json").is_file():  # an export's manifest would pass it for a checkpoint
        raise ValueError(f"src: {src} is a save_pretrained folder already; export reads a run or checkpoint folder")
    ckpt = latest_valid_checkpoint(src) if (src / "checkpoints").is_dir() else src
    if ckpt is None:
        raise FileNotFoundError(f"src: run {src} has no complete checkpoint")
    if not (ckpt / "manifest.json").is_file():
        raise FileNotFoundError(f"src: {src} is neither a run folder nor a checkpoint folder (no manifest.json)")
    problem = verify_checkpoint(ckpt)
    if problem is not None:
        raise ValueError(f"src: checkpoint {ckpt}: {problem}; refusing to export it")
    # killed exports' half-written copies (each a model's size); first, as a killed swap's model is put back at dst
    remove_stale_temporaries(dst)
    if dst.exists() or dst.is_symlink():  # a dangling link too: the final rename could not replace it
        raise FileExistsError(f"{dst_arg}: {dst} exists{' (a link to a missing path)' if not dst.exists() else ''}; "
                              f"export into a new folder")
    check_parents(dst, dst_arg)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(dst, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed export's, whose PID this process has now
    try:
        shutil.copytree(ckpt / "model", tmp)  # config, tokenizer, and the weights of an unsharded checkpoint
        if is_sharded(ckpt):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp))  # foxlm's or any registered
            weights = model.state_dict()
            load_shards({"model": weights}, ckpt / SHARDS, "src", no_dist=True)  # the model's keys only
            model.load_state_dict(weights)
            model.save_pretrained(tmp)
        run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
        # the step the (verified) manifest records, not the folder's name: a checkpoint copied under another name
        step = json.loads((ckpt / "manifest.json").read_text()).get("step")
        write_model_card(tmp, title=dst.name, run_dir=run_dir, step=step, source=(
            f"Exported by `foxlm export` from step {step} of the `foxlm train` run `{run_dir or ckpt}`. Load it with "
            "`import foxlm` and `AutoModelForCausalLM.from_pretrained`."))
        write_manifest(tmp)  # checked whenever foxlm loads it
        fsync_tree(tmp)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst

"""Reading trained models back: from a run folder, a checkpoint folder or a ``save_pretrained`` folder.

The read side of the checkpoint layout ``foxlm train`` writes (``foxlm/train/checkpoint.py``)::

    <run>/checkpoints/step_0000100/{model/, trainer.pt, manifest.json}        one process
    <run>/checkpoints/step_0000100/{dcp/, model/, trainer.pt, manifest.json}  several: sharded, model/ without weights

A checkpoint is used only once every file matches the sha256 its ``manifest.json`` records; weights are read from
safetensors only (a sharded checkpoint's, after ``foxlm export``). A ``save_pretrained`` folder that ``foxlm export``
or ``foxlm convert`` wrote has a ``manifest.json`` too, checked the same way; one without (e.g. from the hub) is used
unchecked.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..data.assets import read_json, sha256_file

STEP_DIR = re.compile(r"^step_(\d{7,})$")
SHARDS = "dcp"  # a sharded checkpoint's torch.distributed.checkpoint folder
MANIFEST = "manifest.json"
# what to do about a model folder's damaged JSON file (read_json's fix)
DAMAGED_MODEL = "the model folder is damaged: restore it, or write it again (foxlm export or foxlm convert)"


def is_sharded(ckpt: str | os.PathLike) -> bool:
    """Whether checkpoint folder ``ckpt`` holds its model and optimizer as torch.distributed.checkpoint shards."""
    return (Path(ckpt) / SHARDS).is_dir()


def _refuse_sharded(ckpt: Path, arg: str) -> None:
    if is_sharded(ckpt):
        raise ValueError(f"{arg}: {ckpt} is a sharded checkpoint (torch.distributed.checkpoint, written by a run of "
                         f"several processes); `foxlm export {ckpt} DST` writes its model as a save_pretrained folder")


def checkpoint_step(ckpt: str | os.PathLike) -> int:
    """The step of a checkpoint folder ``step_NNNNNNN``."""
    match = STEP_DIR.match(Path(ckpt).name)
    if match is None:
        raise ValueError(f"checkpoint: {ckpt} is not a step_NNNNNNN folder")
    return int(match.group(1))


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete-looking checkpoint folders of a run, oldest first (temporary folders excluded)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=checkpoint_step)


def write_manifest(folder: str | os.PathLike, digests: dict[str, str] | None = None, **fields) -> None:
    """Write ``folder``'s ``manifest.json``: ``fields`` and the sha256 of every file under it (those ``digests`` has
    by relative path are taken from it, already hashed)."""
    folder = Path(folder)
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    files = {name: (digests or {}).get(name) or sha256_file(folder / name) for name in names if name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({**fields, "files": files}, indent=1))


def verify_checkpoint(ckpt: str | os.PathLike) -> str | None:
    """None if ``ckpt`` (a checkpoint, or a model folder with a manifest) is complete and every file matches its
    manifest, else what is wrong."""
    ckpt = Path(ckpt)
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"no readable manifest.json ({e})"
    for name, digest in manifest.get("files", {}).items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_file(path) != digest:
            return f"{name} does not match its sha256"
    if not manifest.get("files"):
        return "empty manifest"
    return None


def verify_model_folder(folder: str | os.PathLike, arg: str = "path") -> None:
    """Refuse (``ValueError`` naming the argument ``arg`` and the file) a ``save_pretrained`` folder that no longer
    matches its ``manifest.json``; one without a manifest is not checked."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        return
    problem = verify_checkpoint(folder)
    if problem is not None:
        raise ValueError(f"{arg}: model folder {folder}: {problem}; refusing to load it. Export or convert it again "
                         f"(or delete its {MANIFEST} to load it unchecked)")


def latest_valid_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint of a run that verifies; damaged ones are reported and skipped, never loaded."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            return ckpt
        warnings.warn(f"skipping damaged checkpoint {ckpt}: {problem}", stacklevel=2)
    return None


def resolve_model_dir(path: str | os.PathLike, arg: str = "path") -> Path:
    """A ``save_pretrained`` folder from a run folder (its latest valid checkpoint), a checkpoint folder, or
    a ``save_pretrained`` folder itself; errors name the argument ``arg``."""
    path = Path(path).expanduser()
    if (path / "config.json").is_file() and any(path.glob("model*.safetensors*")):
        verify_model_folder(path, arg)
        return path
    if (path / "model" / "config.json").is_file():
        problem = verify_checkpoint(path) if (path / "manifest.json").exists() else "no manifest.json"
        if problem is not None:
            raise ValueError(f"{arg}: checkpoint {path}: {problem}; refusing to load it")
        _refuse_sharded(path, arg)
        return path / "model"
    if (path / "checkpoints").is_dir():
        ckpt = latest_valid_checkpoint(path)
        if ckpt is None:
            raise FileNotFoundError(f"{arg}: run {path} has no complete checkpoint")
        _refuse_sharded(ckpt, arg)
        return ckpt / "model"
    raise FileNotFoundError(f"{arg}: {path} is not a run folder, a checkpoint folder or a save_pretrained folder")


@contextlib.contextmanager
def reading_weights(where: str | os.PathLike, arg: str) -> Iterator[None]:
    """A weights file that is damaged, or a pickle that ``weights_only`` refuses, read inside the block: a one-line
    ValueError naming the argument and the file (or folder), not the reader's traceback."""
    try:
        yield
    except pickle.UnpicklingError as e:  # torch.load(weights_only=True): objects that could run code, or not a pickle
        found = re.search(r"(?:Trying to load )?unsupported [^\n]*", str(e), re.IGNORECASE)  # torch's one useful line
        found = found.group(0).strip() if found else "objects other than tensors"
        raise ValueError(f"{arg}: {where} was refused: not a plain tensor file (weights-only loading found: {found}); "
                         f"convert it to safetensors where it came from, if you trust it") from e
    except (SafetensorError, EOFError) as e:
        raise ValueError(f"{arg}: {where} is damaged or not a weights file ({' '.join(str(e).split())})") from e
    except RuntimeError as e:
        if "PytorchStreamReader" not in str(e):  # torch.load's reader on a damaged zip; anything else is a bug
            raise
        raise ValueError(f"{arg}: {where} is damaged or not a weights file (not a complete torch zip archive)") from e


def read_model_weights(folder: str | os.PathLike, arg: str = "path") -> dict[str, torch.Tensor]:
    """The weights of a ``save_pretrained`` folder: ``model.safetensors``, or the shards its index names."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(read_json(index, DAMAGED_MODEL)["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    weights = {}
    for name in files:
        with reading_weights(folder / name, arg):
            weights.update(load_file(str(folder / name)))
    return weights


def load_checkpoint_model(path: str | os.PathLike, **from_pretrained_kwargs):
    """The causal LM (``FoxForCausalLM``, or any model registered with ``AutoModelForCausalLM``) of a run folder, a
    checkpoint folder or a ``save_pretrained`` folder."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ..presets import FLA, MODEL_TYPES
    from . import register_auto_classes
    from .baselines import require_fla
    from .hf import config_class

    register_auto_classes()
    folder = resolve_model_dir(path)
    model_type = read_json(folder / "config.json", DAMAGED_MODEL).get("model_type")
    fla_arch = next((arch for arch in FLA if MODEL_TYPES[arch] == model_type), None)
    if fla_arch is not None:  # importing fla registers its models with the Auto classes
        require_fla(fla_arch)
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"path: {folder}/config.json has model_type {model_type!r}, which no installed library "
                         f"registers with AutoModelForCausalLM")
    config = config_class(model_type).from_pretrained(folder)
    with reading_weights(folder, "path"):
        return AutoModelForCausalLM.from_pretrained(folder, config=config, **from_pretrained_kwargs)

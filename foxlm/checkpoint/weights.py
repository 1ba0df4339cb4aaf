"""Reading a trained model's weights back: from a run folder, a checkpoint folder or a ``save_pretrained`` folder.

A checkpoint (or its ``model/`` folder) is used only once every file matches the sha256 its ``manifest.json`` records;
weights are read from safetensors only (a sharded checkpoint's, after ``foxlm export``). A ``save_pretrained`` folder
that ``foxlm export`` or ``foxlm convert`` wrote has a ``manifest.json`` too, checked the same way; one without (e.g.
from the hub) is used unchecked. Damaged files and pickles that ``weights_only`` refuses are one-line errors naming
the argument.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .files import read_json
from .manifest import MANIFEST, verify_checkpoint, verify_model_folder
from .run_folder import is_sharded, latest_valid_checkpoint

# what to do about a model folder's damaged JSON file (read_json's fix)
DAMAGED_MODEL = "the model folder is damaged: restore it, or write it again (foxlm export or foxlm convert)"


def _refuse_sharded(ckpt: Path, arg: str) -> None:
    if is_sharded(ckpt):
        raise ValueError(f"{arg}: {ckpt} is a sharded checkpoint (torch.distributed.checkpoint, written by a run of "
                         f"several processes); `foxlm export {ckpt} DST` writes its model as a save_pretrained folder")


def resolve_model_dir(path: str | os.PathLike, arg: str = "path") -> Path:
    """A ``save_pretrained`` folder from a run folder (its latest valid checkpoint), a checkpoint folder, or
    a ``save_pretrained`` folder itself; errors name the argument ``arg``."""
    path = Path(path).expanduser()
    if (path / "config.json").is_file() and any(path.glob("model*.safetensors*")):
        if _in_checkpoint(path):  # a checkpoint's model/ folder, its sha256 in the checkpoint's manifest
            problem = verify_checkpoint(path.parent)
            if problem is not None:
                raise ValueError(f"{arg}: {path} is the model of checkpoint {path.parent}: {problem}; refusing to "
                                 "load it")
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
    if (path / "config.json").is_file():  # a save_pretrained folder, but its weights are a pickle or missing
        raise FileNotFoundError(f"{arg}: {path} holds no model.safetensors (or its shards); foxlm reads weights from "
                                "safetensors only, never a pickle such as pytorch_model.bin: save the model again with "
                                "save_pretrained where you trust it")
    raise FileNotFoundError(f"{arg}: {path} is not a run folder, a checkpoint folder or a save_pretrained folder")


def _in_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is the ``model/`` folder of a checkpoint (beside its ``trainer.pt`` and ``manifest.json``,
    which records the sha256 of its files)."""
    return folder.name == "model" and (folder.parent / MANIFEST).is_file() and (folder.parent / "trainer.pt").is_file()


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


def index_shards(index: Path, arg: str) -> list[str]:
    """The shard files a ``*.index.json`` names, each a file of its folder (errors name the argument ``arg``)."""
    weight_map = read_json(index, DAMAGED_MODEL).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{arg}: {index}: expected a weight_map of tensor names to shard files; {DAMAGED_MODEL}")
    shards = sorted(set(weight_map.values()))
    if (outside := [f for f in shards if Path(f).name != f]):  # never read a file outside the model's folder
        raise ValueError(f"{arg}: {index}: shard {outside[0]!r} is not a file of its folder; {DAMAGED_MODEL}")
    if (missing := [f for f in shards if not (index.parent / f).is_file()]):
        raise ValueError(f"{arg}: {index.parent / missing[0]}, a shard {index.name} names, is missing; {DAMAGED_MODEL}")
    return shards


def read_model_weights(folder: str | os.PathLike, arg: str = "path") -> dict[str, torch.Tensor]:
    """The weights of a ``save_pretrained`` folder: ``model.safetensors``, or the shards its index names."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = index_shards(index, arg) if index.is_file() else ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        with reading_weights(folder / name, arg):
            add_shard(weights, load_file(str(folder / name)), folder / name, arg)
    return weights


def add_shard(weights: dict[str, torch.Tensor], part: dict[str, torch.Tensor], path: Path, arg: str) -> None:
    """Add a shard's tensors to ``weights``, refusing (naming ``arg``) a tensor an earlier shard holds too: which of
    the two a model gets would depend on the order the shards are read in."""
    if (twice := sorted(part.keys() & weights.keys())):
        raise ValueError(f"{arg}: {twice[0]} is in {path} and in an earlier shard; {DAMAGED_MODEL}")
    weights.update(part)

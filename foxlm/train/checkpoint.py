"""Atomic, verified training checkpoints.

Layout::

    <run>/checkpoints/step_0000100/
        model/            save_pretrained folder (config.json + safetensors, and tokenizer.json for GPT-2 BPE data):
                          AutoModelForCausalLM / AutoTokenizer.from_pretrained work on it
        trainer.pt        optimizer, scheduler, loader, RNG, counters (torch.load(weights_only=True))
        manifest.json     sha256 of every file above, written last
    <run>/checkpoints/latest      name of the newest complete checkpoint

A checkpoint is written into a temporary folder and renamed into place, so a killed run leaves no
``step_*`` folder half-written (the next save removes its temporary folder); ``manifest.json`` is checked before
loading, so a damaged one is never used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import IO

import torch
from safetensors.torch import load_file

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

from ..data.assets import replace_folder, sha256_file

STEP_DIR = re.compile(r"^step_(\d{7,})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


def write_checkpoint(run_dir: Path, step: int, save_model, trainer_state: dict, keep_last: int) -> Path:
    """Write checkpoint ``step`` atomically (``save_model(folder)`` writes the model), update ``latest``, prune.

    Called on the process that writes (rank 0).
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    for stale in root.glob(".step_*.tmp-*"):  # saves of a killed run: one process writes a run's checkpoints
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    save_model(tmp / "model")
    torch.save(trainer_state, tmp / "trainer.pt")
    files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    manifest = {"step": step, "files": {f: sha256_file(tmp / f) for f in files}}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _fsync_tree(tmp)
    replace_folder(tmp, final)  # a step saved again (Trainer.save called twice) is swapped, never lost
    _write_atomic(root / "latest", final.name)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def lock_run(run_dir: str | os.PathLike) -> IO[str] | None:
    """An exclusive lock on a run folder (its ``.lock`` file, which records the holder's pid), held while the
    returned file stays open, or None if another process holds it. The OS releases it with its process, killed or
    not. Where ``fcntl`` is missing (not POSIX) or the filesystem has no ``flock``, the file is returned unlocked."""
    f = open(Path(run_dir) / ".lock", "a+")
    if fcntl is not None:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        except OSError as e:  # a filesystem without flock (some FUSE or network mounts): run unlocked
            warnings.warn(f"out_dir: cannot lock {run_dir} ({e}); a second run there would not be detected",
                          stacklevel=2)
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete-looking checkpoint folders of a run, oldest first (temporary folders excluded)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(ckpt: str | os.PathLike) -> int:
    """The step of a checkpoint folder ``step_NNNNNNN``."""
    match = STEP_DIR.match(Path(ckpt).name)
    if match is None:
        raise ValueError(f"checkpoint: {ckpt} is not a step_NNNNNNN folder")
    return int(match.group(1))


def is_run_checkpoint(run_dir: str | os.PathLike, ckpt: str | os.PathLike) -> bool:
    """Whether checkpoint folder ``ckpt`` is one of ``run_dir``'s."""
    return Path(ckpt).resolve().parent == (Path(run_dir) / "checkpoints").resolve()


def conflicting_checkpoints(run_dir: str | os.PathLike, start: str | os.PathLike | None) -> list[Path]:
    """The checkpoints of ``run_dir`` that a run starting from checkpoint ``start`` (None: from scratch) would mix
    its own with, and prune by step: all of them, unless ``start`` is one of them; then those after it."""
    found = list_checkpoints(run_dir)
    if start is None or not is_run_checkpoint(run_dir, start):
        return found
    return [p for p in found if checkpoint_step(p) > checkpoint_step(start)]


def verify_checkpoint(ckpt: str | os.PathLike) -> str | None:
    """None if ``ckpt`` is complete and every file matches its manifest, else what is wrong."""
    ckpt = Path(ckpt)
    try:
        manifest = json.loads((ckpt / "manifest.json").read_text())
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


def latest_valid_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint of a run that verifies; damaged ones are reported and skipped, never loaded."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            return ckpt
        warnings.warn(f"skipping damaged checkpoint {ckpt}: {problem}", stacklevel=2)
    return None


def load_trainer_state(ckpt: str | os.PathLike) -> dict:
    """The non-model state of a verified checkpoint (safe: ``weights_only=True``)."""
    problem = verify_checkpoint(ckpt)
    if problem is not None:
        raise ValueError(f"checkpoint {ckpt}: {problem}; refusing to load it")
    return torch.load(Path(ckpt) / "trainer.pt", map_location="cpu", weights_only=True)


def resolve_model_dir(path: str | os.PathLike, arg: str = "path") -> Path:
    """A ``save_pretrained`` folder from a run folder (its latest valid checkpoint), a checkpoint folder, or
    a ``save_pretrained`` folder itself; errors name the argument ``arg``."""
    path = Path(path).expanduser()
    if (path / "config.json").is_file() and any(path.glob("model*.safetensors*")):
        return path
    if (path / "model" / "config.json").is_file():
        problem = verify_checkpoint(path) if (path / "manifest.json").exists() else "no manifest.json"
        if problem is not None:
            raise ValueError(f"{arg}: checkpoint {path}: {problem}; refusing to load it")
        return path / "model"
    if (path / "checkpoints").is_dir():
        ckpt = latest_valid_checkpoint(path)
        if ckpt is None:
            raise FileNotFoundError(f"{arg}: run {path} has no complete checkpoint")
        return ckpt / "model"
    raise FileNotFoundError(f"{arg}: {path} is not a run folder, a checkpoint folder or a save_pretrained folder")


def read_model_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The weights of a ``save_pretrained`` folder: ``model.safetensors``, or the shards its index names."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    weights = {}
    for name in files:
        weights.update(load_file(str(folder / name)))
    return weights


def load_checkpoint_model(path: str | os.PathLike, **from_pretrained_kwargs):
    """``FoxForCausalLM`` from a run folder, a checkpoint folder or a ``save_pretrained`` folder."""
    from ..models import FoxForCausalLM

    return FoxForCausalLM.from_pretrained(resolve_model_dir(path), **from_pretrained_kwargs)

"""A training run's folder (``out_dir``) and its files::

    <run>/.foxlm-run              marks the folder as a run's: its files are the run's own to overwrite
    <run>/.lock                   held (flock) by the run training there; records its pid
    <run>/train_config.yaml       the run's training config, read back by the evaluations and the model card
    <run>/log.jsonl, tb/          the run's logs (``foxlm.train.logging``)
    <run>/checkpoints/step_0000100/{model/, trainer.pt, manifest.json}        one process
    <run>/checkpoints/step_0000100/{dcp/, model/, trainer.pt, manifest.json}  several: sharded, model/ without weights
    <run>/checkpoints/latest      name of the newest complete checkpoint

Which checkpoints a run has, which is the latest that verifies, where a run resumes from, and which folders a run
may take.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import IO

import yaml

from .files import check_parents, remove_stale_temporaries, write_atomic
from .manifest import MANIFEST, verify_checkpoint

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

STEP_DIR = re.compile(r"^step_(\d{7,})$")
SHARDS = "dcp"  # a sharded checkpoint's torch.distributed.checkpoint folder
# in every out_dir a run has taken: the run's files there are its own to overwrite
RUN_MARKER = ".foxlm-run"
LOCK_FILE = ".lock"
TRAIN_CONFIG = "train_config.yaml"


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


def checkpoint_step(ckpt: str | os.PathLike) -> int:
    """The step of a checkpoint folder ``step_NNNNNNN``."""
    match = STEP_DIR.match(Path(ckpt).name)
    if match is None:
        raise ValueError(f"checkpoint: {ckpt} is not a step_NNNNNNN folder")
    return int(match.group(1))


def is_sharded(ckpt: str | os.PathLike) -> bool:
    """Whether checkpoint folder ``ckpt`` holds its model and optimizer as torch.distributed.checkpoint shards."""
    return (Path(ckpt) / SHARDS).is_dir()


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete-looking checkpoint folders of a run, oldest first (temporary folders excluded)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=checkpoint_step)


def latest_valid_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint of a run that verifies; damaged ones are reported and skipped, never loaded."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(ckpt)
        if problem is None:
            return ckpt
        warnings.warn(f"skipping damaged checkpoint {ckpt}: {problem}", stacklevel=2)
    return None


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


def resume_point(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint a run resumes from, as ``resume`` (auto | never | a checkpoint path) says; None: none."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_valid_checkpoint(run_dir)
    ckpt = Path(resume).expanduser()
    if not ((ckpt / MANIFEST).is_file() and (ckpt / "trainer.pt").is_file()):
        run = (ckpt / "checkpoints").is_dir()
        raise ValueError(f"resume: {ckpt} is not a checkpoint folder{' but a run folder' if run else ''}; expected "
                         f"auto, never, or a checkpoint: a checkpoints/step_NNNNNNN folder holding {MANIFEST} and "
                         f"trainer.pt{f' (resume=auto with out_dir={ckpt} continues that run)' if run else ''}")
    return ckpt


def check_out_dir(run_dir: Path, ckpt: Path | None, resume: str) -> None:
    """Refuse to train into checkpoints a run starting from ``ckpt`` (found as ``resume`` says) does not continue
    from: its saves would interleave with them, and keeping the last ``keep_last`` by step would delete them, or the
    run's own."""
    in_the_way = conflicting_checkpoints(run_dir, ckpt)
    if not in_the_way:
        return
    names = ", ".join(p.name for p in in_the_way[:3]) + (", ..." if len(in_the_way) > 3 else "")
    where = f"out_dir: {run_dir} holds"
    if ckpt is None and resume == "auto":
        problem, fix = f"{where} only checkpoints that do not verify ({names})", "move them away"
    elif ckpt is None:
        problem, fix = f"{where} another run's checkpoints ({names})", "resume=auto to continue that run"
    elif not is_run_checkpoint(run_dir, ckpt):
        problem, fix = f"{where} checkpoints of another run than {ckpt}'s ({names})", "move them away"
    elif resume == "auto":  # auto took the newest checkpoint that verifies: the later ones do not
        problem, fix = f"{where} checkpoints after {ckpt.name}, the newest that verifies, that do not verify " \
            f"({names})", f"move them away to go on from {ckpt.name}"
    else:
        problem, fix = f"{where} checkpoints after {ckpt.name}, which this run resumes from ({names})", \
            f"move them away to go on from {ckpt.name}"
    raise ValueError(f"{problem}: this run's saves would be mixed with them and pruned by step. Train into a new "
                     f"out_dir, or {fix}")


def check_run_folder(run_dir: Path) -> None:
    """Refuse an ``out_dir`` holding files no run wrote, which a run would overwrite (``log.jsonl``,
    ``train_config.yaml``, ``tb/``) or mix its own with. Taken: a new or empty folder, a run's (marked by
    ``lock_run``), and one holding checkpoints (a run's from before the mark; ``check_out_dir`` says whether this run
    may continue them)."""
    if not run_dir.exists():
        check_parents(run_dir, "out_dir")
        return
    if not run_dir.is_dir():
        raise NotADirectoryError(f"out_dir: {run_dir} is a file; expected a folder for the run")
    if (run_dir / RUN_MARKER).is_file() or list_checkpoints(run_dir):
        return
    entries = sorted(e.name for e in run_dir.iterdir())
    if entries:
        raise ValueError(f"out_dir: {run_dir} holds files no foxlm run wrote ({', '.join(entries[:5])}"
                         f"{', ...' if len(entries) > 5 else ''}), which a run would overwrite or mix with its own; "
                         "train into a new or empty out_dir")


def lock_run(run_dir: str | os.PathLike) -> IO[str] | None:
    """An exclusive lock on a run folder (its ``.lock`` file, which records the holder's pid), held while the
    returned file stays open, or None if another process holds it; the folder is marked as a run's
    (``check_run_folder``), and its checkpoints that a killed save set aside are put back. The OS releases the lock
    with its process, killed or not. Where ``fcntl`` is missing (not POSIX) or the filesystem has no ``flock``, the
    file is returned unlocked."""
    marker = Path(run_dir) / RUN_MARKER
    if not marker.is_file():
        marker.write_text("a foxlm train run's out_dir: its log.jsonl, train_config.yaml, tb/ and checkpoints/\n")
    f = open(Path(run_dir) / LOCK_FILE, "a+")
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
    restore_set_aside_checkpoints(run_dir)
    return f


def restore_set_aside_checkpoints(run_dir: str | os.PathLike) -> None:
    """Put back each checkpoint that a run killed while saving its step again set aside (``replace_folder``'s swap:
    ``.step_NNNNNNN.foxlm-old-PID``, and no ``step_NNNNNNN``), and delete what such runs left: unseen by
    ``list_checkpoints``, it was neither resumed from nor ever deleted."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return
    steps = {match.group(1) for entry in root.iterdir()
             if (match := re.fullmatch(r"\.(step_\d{7,})\.foxlm-(?:old|tmp)-\d+", entry.name))}
    for step in sorted(steps):
        remove_stale_temporaries(root / step)


def lock_holder(run_dir: str | os.PathLike) -> str:
    """The pid the holder of ``run_dir``'s lock recorded."""
    return (Path(run_dir) / LOCK_FILE).read_text().strip()


def write_train_config(run_dir: str | os.PathLike, config: dict) -> None:
    """Record the run's training config (``train_config.yaml``, replaced whole), in its keys' order."""
    write_atomic(Path(run_dir) / TRAIN_CONFIG, yaml.safe_dump(config, sort_keys=False))


def read_train_config(path: str | os.PathLike, up: int = 3) -> dict | None:
    """The training config of the run ``path`` belongs to: ``train_config.yaml`` in ``path`` or one of its ``up``
    parents (a run, checkpoint, or checkpoint's model folder); None if there is none, or it is no YAML mapping."""
    path = Path(path).expanduser().resolve()
    for folder in (path, *list(path.parents)[:up]):
        try:
            cfg = yaml.safe_load((folder / TRAIN_CONFIG).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(cfg, dict):
            return cfg
    return None

"""Safe filesystem helpers for every folder foxlm writes (checkpoints, exports, conversions, prepared data, caches):
hashing, damaged-JSON errors, temporaries beside their destination, and the swap that replaces a folder so that a
kill at any point leaves a complete copy. Imports nothing of foxlm: the data floor uses it too."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_json(path: str | os.PathLike, fix: str) -> dict:
    """The JSON object in file ``path``; a damaged one is a ValueError naming the file and ``fix``, what to do
    about it (json's own errors name no file)."""
    try:
        value = json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); {fix}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, found a {type(value).__name__}; {fix}")
    return value


def file_above(path: Path) -> Path | None:
    """The nearest existing path above ``path`` where it is a file (then ``path`` cannot be made: ``mkdir`` says only
    "[Errno 17] File exists" or "[Errno 20] Not a directory", naming no argument), else None."""
    above = next((p for p in path.parents if p.exists()), None)
    return above if above is not None and not above.is_dir() else None


def check_parents(path: Path, arg: str) -> None:
    """Refuse (``NotADirectoryError`` naming the argument ``arg``) a ``path`` under a file (``file_above``)."""
    if (blocked := file_above(path)) is not None:
        raise NotADirectoryError(f"{arg}: {path}: {blocked} is a file, not a folder")


def temporary_path(dest: Path, kind: str) -> Path:
    """``.NAME.foxlm-KIND-PID`` beside ``dest``: this process's temporary folder of ``kind`` ("tmp": being written,
    "old": being replaced). foxlm's own prefix keeps a user's folder (``.NAME.old-2024``) from ever being taken for
    one by ``remove_stale_temporaries``."""
    return dest.with_name(f".{dest.name}.foxlm-{kind}-{os.getpid()}")


def remove_stale_temporaries(dest: Path) -> None:
    """Delete the temporary folders (``temporary_path``) that killed processes left beside ``dest``. A process killed
    inside ``replace_folder``'s swap, after it set the old copy aside and before it moved the new one in, left no
    ``dest``: its old copy, the last complete one, is put back first."""
    if not dest.parent.is_dir():
        return
    ours = re.compile(rf"\.{re.escape(dest.name)}\.foxlm-(tmp|old)-(\d+)")
    stale = [(entry, match.group(1)) for entry in dest.parent.iterdir()
             if (match := ours.fullmatch(entry.name)) and entry.is_dir() and not entry.is_symlink()
             and not _alive(int(match.group(2)))]
    aside = sorted((entry for entry, kind in stale if kind == "old"), key=lambda e: e.stat().st_mtime)
    if aside and not dest.exists() and not dest.is_symlink():
        aside[-1].rename(dest)
        stale = [(entry, kind) for entry, kind in stale if entry != aside[-1]]
    for entry, _ in stale:
        shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists (PermissionError: another user's, alive)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def replace_folder(new: Path, dest: Path) -> None:
    """Move folder ``new`` to ``dest``, replacing what is there by a swap (rename the old copy aside, rename the new
    one in, delete the old one): a kill at any point leaves a complete copy, never none. ``new``'s files are flushed
    to disk first, so that a power loss after the swap cannot leave them unwritten (files of the right size holding
    zeros) in place of a deleted old copy. A replaced folder's permissions are kept (a private ``chmod 700`` folder
    stays private)."""
    fsync_tree(new)
    if not dest.exists():
        new.rename(dest)
        return
    os.chmod(new, stat.S_IMODE(dest.stat().st_mode))
    old = temporary_path(dest, "old")
    shutil.rmtree(old, ignore_errors=True)  # a killed process's, whose PID this one has now
    dest.rename(old)
    new.rename(dest)
    shutil.rmtree(old)


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` to disk (before it is renamed into place)."""
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` into ``path`` through a temporary file renamed over it: readers see the old or the new text, and
    a write that fails (a full disk) leaves the old one, and no temporary file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

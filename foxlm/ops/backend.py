"""Which implementation a foxlm op runs: the Triton kernels or the PyTorch path.

By default (``"auto"``) CUDA tensors take the Triton kernels and CPU tensors the PyTorch path, except
under ``TRITON_INTERPRET=1``, where CPU tensors go through the Triton kernels in Triton's interpreter.
``use_backend`` overrides that for a block of code, like ``torch.nn.attention.sdpa_kernel``. ``resolve_device``
turns the commands' ``device`` argument into a ``torch.device`` (``auto``: CUDA when there is one).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    jit = triton.jit
except ImportError:  # Triton ships for Linux only; elsewhere the PyTorch paths run (no CUDA, no interpreter)
    triton = tl = None

    def jit(fn):
        return fn


BACKENDS = ("auto", "triton", "torch")
_backend = "auto"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run foxlm ops on ``name`` ("auto", "triton" or "torch") inside the block."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"name: expected one of {BACKENDS}, got {name!r}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


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


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on tensor ``x`` runs its Triton kernel (float64 always takes the PyTorch path)."""
    if x.dtype == torch.float64 or _backend == "torch":
        return False
    if _backend == "triton":
        if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            raise ValueError("backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
        return True
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def interpreted(kernel) -> bool:
    """Whether ``kernel`` was built by Triton's interpreter (TRITON_INTERPRET=1 when it was decorated): it then
    runs on CPU tensors, and loops with run-time bounds need the interpreter-safe form."""
    return triton is not None and isinstance(kernel, InterpretedFunction)


def require_runnable(kernel, x: torch.Tensor, arg: str) -> None:
    """Raise for a CPU tensor ``x`` (argument ``arg``) bound for ``kernel`` that Triton built for the GPU: its module
    was imported before TRITON_INTERPRET=1 was set."""
    if x.device.type == "cpu" and not interpreted(kernel):
        raise ValueError(f"{arg}: CPU tensors need TRITON_INTERPRET=1 set before {kernel.fn.__module__} is imported")


def block_dim(d: int) -> int:
    """A head dim padded to the attention kernels' tile width: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(d))

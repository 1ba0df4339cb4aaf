"""Which implementation a foxlm op runs: the Triton kernels or the PyTorch path.

By default (``"auto"``) CUDA tensors take the Triton kernels and CPU tensors the PyTorch path, except
under ``TRITON_INTERPRET=1``, where CPU tensors go through the Triton kernels in Triton's interpreter.
``use_backend`` overrides that for a block of code, like ``torch.nn.attention.sdpa_kernel``.
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


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on tensor ``x`` runs its Triton kernel (float64 always takes the PyTorch path, and so does
    everything where Triton is not installed)."""
    if x.dtype == torch.float64 or _backend == "torch":
        return False
    if _backend == "triton":
        if triton is None:
            raise ValueError("backend 'triton' needs Triton, which is not installed: pip install 'foxlm[triton]'")
        if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            raise ValueError("backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
        return True
    if triton is None:
        return False
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def interpreted(kernel) -> bool:
    """Whether ``kernel`` was built by Triton's interpreter (TRITON_INTERPRET=1 when it was decorated): it then
    runs on CPU tensors, and its loops with run-time bounds need ``tile_loop``'s interpreter form."""
    return triton is not None and isinstance(kernel, InterpretedFunction)


def require_runnable(kernel, x: torch.Tensor, arg: str) -> None:
    """Raise for a CPU tensor ``x`` (argument ``arg``) bound for ``kernel`` that Triton built for the GPU: its module
    was imported before TRITON_INTERPRET=1 was set."""
    if x.device.type == "cpu" and not interpreted(kernel):
        raise ValueError(f"{arg}: CPU tensors need TRITON_INTERPRET=1 set before {kernel.fn.__module__} is imported")


@jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest as the GPU does. Triton 3.6's interpreter truncates fp32 to bf16, which
    doubles bf16's rounding error and biases it; there an fp32 ``x`` is rounded to bf16's 8 bits first (ties to
    even, finite values), which the truncating cast then keeps exactly."""
    if INTERPRET and dtype == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@jit
def tile_loop(tile, state, lo, hi, STEP: tl.constexpr, INTERPRET: tl.constexpr, args):
    """``state = tile(state, start, *args)`` for ``start`` in range(lo, hi, STEP): a kernel's loop over tiles between
    run-time bounds. A ``for`` loop where Triton compiles the kernel (it software-pipelines those), a ``while`` loop
    for the interpreter (INTERPRET), whose range() rejects tensor bounds with NumPy >= 2.4. Pass ``args`` as a tuple
    literal: a tuple held in a variable loses its constexprs."""
    if INTERPRET:
        start = lo
        while start < hi:
            state = tile(state, start, *args)
            start += STEP
    else:
        for start in range(lo, hi, STEP):
            state = tile(state, start, *args)
    return state


def block_dim(d: int) -> int:
    """A head dim padded to the attention kernels' tile width: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(d))

"""Flushing fp32 denormals to zero on every CPU thread torch computes on, for the PyTorch path's kernel calls.

``torch.set_flush_denormal`` sets the calling thread's mode only; OpenMP workers keep the mode they started with, so
the setting is run on each of them through the OpenMP runtime torch uses.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import threading

import torch


@contextlib.contextmanager
def flush_denormals(on: bool = True):
    """Flush fp32 denormals to zero on every intra-op thread during the kernel calls, then restore each thread's mode
    (``on``: else nothing).

    The gate drives many probabilities of a row below 1e-38, where the CPU computes with denormals at a fraction of
    its speed (several times slower on the backward); values that small are zero to fp32's precision.
    ``torch.set_flush_denormal`` sets the calling thread's mode only, and the OpenMP workers keep the mode they
    started with, so the setting runs on each of them through the OpenMP runtime torch uses (where it is found; else
    on the calling thread only). torch has no getter, so each thread's mode is read off a product of Python floats
    (the same MXCSR flags govern them).
    """
    if not on:
        yield
        return
    modes: dict[int, bool] = {}

    def flush(on: bool | None) -> None:
        tid = threading.get_ident()
        if on:
            modes[tid] = _TINY * _ONE == 0.0
        torch.set_flush_denormal(bool(on) or modes.get(tid, False))

    _on_all_threads(lambda: flush(True))
    try:
        yield
    finally:
        _on_all_threads(lambda: flush(None))


_TINY, _ONE = 5e-324, 1.0  # the smallest double denormal, and a factor that keeps it unless denormals are flushed
_OMP_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _on_all_threads(fn) -> None:
    """Run fn() once on each of torch's intra-op threads (the calling thread is one of them)."""
    parallel, threads = _omp_parallel(), torch.get_num_threads()
    if parallel is None or threads == 1:
        fn()
        return

    def each(_):
        try:
            fn()
        except Exception:  # noqa: BLE001 - an exception cannot cross the C frame; the mode is only a speed matter
            pass

    parallel(_OMP_CALLBACK(each), None, threads, 0)


@functools.cache
def _omp_parallel():
    """GOMP_parallel(fn, data, num_threads, flags) of the OpenMP runtime loaded with torch (libgomp, or LLVM's and
    Intel's, which export it too), or None. Where other packages loaded runtimes of their own, torch's comes first:
    another runtime's threads are not the ones torch computes on."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if re.search(r"/lib[gi]?omp[-.\w]*\.so", line)}
    except OSError:  # not Linux
        return None
    torch_dir = os.path.dirname(os.path.dirname(torch.__file__))  # site-packages: torch/lib and torch.libs
    for path in sorted(paths, key=lambda p: (not p.startswith(os.path.join(torch_dir, "torch")), p)):
        try:
            fn = ctypes.CDLL(path).GOMP_parallel
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [_OMP_CALLBACK, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint], None
        return fn
    return None

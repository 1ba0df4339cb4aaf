"""Input checks shared by foxlm's ops: the floating dtypes they take, and the shapes attention's q, k and v must have.

Each raises a ``ValueError`` that names the argument and what was expected.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The attention kernels' largest head dim (their tiles are padded to a power of two, at most this).
MAX_HEAD_DIM = 256


def check_dtype(name: str, t: torch.Tensor) -> None:
    """``t`` is a tensor of one of ``DTYPES``."""
    if not isinstance(t, torch.Tensor) or t.dtype not in DTYPES:
        raise ValueError(f"{name}: expected float16, bfloat16, float32 or float64, got {getattr(t, 'dtype', type(t))}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, what: str = "a 4-D tensor [B, T, H, D]") -> None:
    """q: [B, Tq, Hq, D], k: [B, Tk, Hk, D], v: [B, Tk, Hk, Dv]: floating tensors of one dtype and device, with at
    least one batch row, head and head dim, Hq a multiple of Hk (GQA), head dims up to ``MAX_HEAD_DIM``. ``what``
    names the expected tensor in the messages (e.g. a context-parallel shard)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected {what}, got {getattr(t, 'shape', type(t))}")
        check_dtype(name, t)
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}; all inputs must share a device")
    if 0 in (q.shape[0], q.shape[2], q.shape[3], k.shape[2], v.shape[3]):
        raise ValueError(f"q, k, v: expected at least one batch row, head and head dim, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k, v: expected q's dtype {q.dtype}, got {k.dtype} and {v.dtype}")
    B, _, Hq, D = q.shape
    if k.shape[0] != B or k.shape[-1] != D:
        raise ValueError(f"k: expected [B={B}, Tk, Hk, D={D}], got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: expected [B, Tk, Hk] = {tuple(k.shape[:3])} leading dims, got {tuple(v.shape)}")
    if Hq % k.shape[2]:
        raise ValueError(f"q: its {Hq} heads must be a multiple of k's {k.shape[2]} heads (GQA)")
    if D > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"q, v: head dims up to {MAX_HEAD_DIM} are supported, got {D} and {v.shape[-1]}")

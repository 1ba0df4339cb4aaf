"""The forget gate's cumulative sum c and the packed-sequence index, shared by every attention path."""

from __future__ import annotations

import torch


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of every packed position: ``cu_seqlens [N+1] -> [total]`` (int64)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


def gate_cumsum(log_fgate: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """c_t = sum_{l <= t} log f_l in fp64, restarting at every sequence of ``cu_seqlens``.

    log_fgate: [B, T, H] -> c: [B, T, H] float64. The fp64 sum keeps c_i - c_j exact to ~1e-12 even
    when |c| grows to 1e6 over a million tokens, which an fp32 cumsum cannot (see tests).
    """
    # Scan along the contiguous dim: CUDA's cumsum over a strided dim is one thread per column.
    c = torch.cumsum(log_fgate.transpose(1, 2).to(torch.float64).contiguous(), dim=-1).transpose(1, 2)
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].long()
        # c just before each sequence start (0 for the first); subtracting it restarts the sum.
        before = torch.cat([c.new_zeros(c.shape[0], 1, c.shape[2]), c[:, :-1]], dim=1)[:, starts]
        seg = segment_ids(cu_seqlens, c.shape[1])
        c = c - before[:, seg]
    return c

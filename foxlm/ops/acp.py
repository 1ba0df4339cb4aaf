"""Adaptive Computation Pruning (ACP): the decay threshold below which attention is skipped.

With a bound U on every logit |scale * q_i . k_j| of a (sequence, head), the row normaliser is at
least exp(s_ii) >= e^-U and every term with decay c_i - c_j < delta is at most e^(U + delta), so with
delta = -(2U + log N) + log(tolerance) the mass pruned from any row is below ``tolerance``.
"""

from __future__ import annotations

import math

import torch

from .reference import segment_ids


def data_logit_bound(
    q: torch.Tensor, k: torch.Tensor, scale: float, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """U = scale * max_i ||q_i|| * max_j ||k_j|| per (sequence, query head), fp32.

    q: [B, Tq, Hq, D], k: [B, Tk, Hk, D] -> U: [B, Hq] (or [N, Hq] with ``cu_seqlens`` of N sequences).
    """
    group = q.shape[2] // k.shape[2]
    dt = torch.promote_types(q.dtype, torch.float32)
    qn = torch.linalg.vector_norm(q, dim=-1, dtype=dt).float()  # [B, Tq, Hq]
    kn = torch.linalg.vector_norm(k, dim=-1, dtype=dt).float()  # [B, Tk, Hk]
    if cu_seqlens is None:
        qmax, kmax = qn.amax(dim=1), kn.amax(dim=1)
    else:
        n = cu_seqlens.numel() - 1
        seg = segment_ids(cu_seqlens, qn.shape[1])
        qmax = qn.new_zeros(n, qn.shape[2]).scatter_reduce_(0, seg[:, None].expand_as(qn[0]), qn[0], "amax")
        kmax = kn.new_zeros(n, kn.shape[2]).scatter_reduce_(0, seg[:, None].expand_as(kn[0]), kn[0], "amax")
    return scale * qmax * kmax.repeat_interleave(group, dim=-1)


def prune_threshold(
    logit_bound: torch.Tensor, key_lengths: torch.Tensor | int, tolerance: float
) -> torch.Tensor:
    """delta = -(2U + log N) + log(tolerance), fp32, broadcast like ``logit_bound`` ([B or N, Hq]).

    key_lengths: N, the number of keys a query of the sequence can see (an int, or [B or N]).
    """
    n = torch.as_tensor(key_lengths, dtype=torch.float32, device=logit_bound.device).clamp_min(1)
    if n.dim() == 1:
        n = n[:, None]
    return -(2.0 * logit_bound.float() + torch.log(n)) + math.log(tolerance)

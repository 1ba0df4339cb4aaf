"""Adaptive Computation Pruning (ACP): the decay threshold below which attention is skipped.

With a bound U on every logit |scale * q_i . k_j| of a (sequence, head), the row normaliser is at
least exp(s_ii) >= e^-U and every term with decay c_i - c_j < delta is at most e^(U + delta), so with
delta = -(2U + log N) + log(tolerance) the mass pruned from any row is below ``tolerance``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .gate import gate_cumsum, segment_ids
from .sdpa import row_starts  # the prefix each query row skips, shared with the PyTorch path


def check_tolerance(tolerance: float, name: str = "tolerance") -> None:
    """ACP's epsilon must be a mass in (0, 1): log(tolerance) is finite and negative."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not 0.0 < tolerance < 1.0:
        raise ValueError(f"{name}: expected a value in (0, 1), got {tolerance!r}")


def check_logit_bound(logit_bound: float | torch.Tensor | None) -> None:
    """A host-number bound must be finite and >= 0 (a tensor's values are checked with the op's value checks)."""
    if logit_bound is None or isinstance(logit_bound, torch.Tensor):
        return
    if isinstance(logit_bound, bool) or not isinstance(logit_bound, numbers.Real) or not 0.0 <= logit_bound < math.inf:
        raise ValueError(f"logit_bound: expected a finite bound >= 0 on |scale * q . k|, got {logit_bound!r}")


@dataclass(frozen=True, eq=False)
class ACP:
    """Adaptive Computation Pruning's setting, the one value that travels from a model's config to the kernels, the
    caches and context parallelism (``forgetting_attention(..., prune=ACP(...))``); validated when made.

    tolerance: the largest attention mass ACP may drop from a row. logit_bound: U, a bound on |scale * q_i . k_j|
    (a float, or a tensor broadcastable to [B or N, Hq], e.g. from QK-norm weights); None: from the data,
    |scale| * max||q|| * max||k|| per (sequence, head).
    """

    tolerance: float = math.exp(-10)
    logit_bound: float | torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_tolerance(self.tolerance)
        check_logit_bound(self.logit_bound)

    @classmethod
    def of(cls, prune: "bool | ACP | None", tolerance: float = math.exp(-10),
           logit_bound: float | torch.Tensor | None = None) -> "ACP | None":
        """The ACP of an entry point's ``prune`` argument: an ``ACP`` as it is, True: ``ACP(tolerance, logit_bound)``,
        False or None: no pruning (None); the loose ``tolerance`` and ``logit_bound`` are validated either way."""
        if not prune and tolerance == math.exp(-10) and logit_bound is None:  # off, nothing to validate
            return None
        if isinstance(prune, ACP):
            if tolerance != math.exp(-10) or logit_bound is not None:
                raise ValueError("tolerance, logit_bound: an ACP passed as prune carries its own; pass them there")
            return prune
        if prune is not None and not isinstance(prune, bool):
            raise ValueError(f"prune: expected a bool, an ACP or None, got {type(prune).__name__}")
        acp = cls(tolerance, logit_bound)
        return acp if prune else None

    def for_heads(self, heads: slice) -> "ACP":
        """This setting for the query heads ``heads`` alone: a per-head tensor bound ([Hq]) is sliced."""
        bound = self.logit_bound
        if isinstance(bound, torch.Tensor) and bound.dim():
            return replace(self, logit_bound=bound[..., heads])
        return self

    def delta(self, logit_bound: torch.Tensor, key_lengths: torch.Tensor | int) -> torch.Tensor:
        """delta = -(2U + log N) + log(tolerance), fp32, broadcast like ``logit_bound`` ([B or N, Hq]).

        key_lengths: N, the number of keys a query of the sequence can see (an int, or [B or N]).
        """
        if isinstance(key_lengths, torch.Tensor):
            log_n = torch.log(key_lengths.to(device=logit_bound.device, dtype=torch.float32).clamp_min(1))
            if log_n.dim() == 1:
                log_n = log_n[:, None]
        else:  # a host number stays one (a tensor made from it would be a host-to-device copy, a sync on CUDA), folded
            # into one constant: two kernels
            return logit_bound.float().mul(-2.0).add_(math.log(self.tolerance) - math.log(max(key_lengths, 1)))
        return -(2.0 * logit_bound.float() + log_n) + math.log(self.tolerance)

    def threshold(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        scale: float,
        cu_seqlens: torch.Tensor | None = None,
        window: int | None = None,
        num_keys: int | None = None,
        reduce_max: Callable[[torch.Tensor], object] | None = None,
    ) -> torch.Tensor:
        """ACP's delta per (sequence, query head): [B or N, Hq] fp32, from ``logit_bound`` or the data's norms.

        q: [B, Tq, Hq, D], k: [B, Tk, Hk, D]. With a sliding ``window`` a row sees at most ``window`` keys, so
        N = min(sequence length, window). num_keys: N where q and k are a part of the sequence (context
        parallelism: its whole length); reduce_max: then also an in-place elementwise max over the ranks that hold
        the rest (an all-reduce), applied to the data's largest norms. A bound that is NaN or negative (a NaN or inf
        in q or k, or an unchecked tensor ``logit_bound``) prunes nothing: the row gets delta = -inf, so that what it
        cannot see never changes it.
        """
        logit_bound = self.logit_bound
        if logit_bound is None:
            bound = data_logit_bound(q.detach(), k.detach(), scale, cu_seqlens, reduce_max)
        else:
            rows = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
            if isinstance(logit_bound, torch.Tensor):
                bound = logit_bound.float().expand(rows, q.shape[2])
            else:  # filled on the device: no host-to-device copy
                bound = torch.full((rows, q.shape[2]), float(logit_bound), dtype=torch.float32, device=q.device)
        if cu_seqlens is None:
            n = k.shape[1] if num_keys is None else num_keys
            n = n if window is None else min(n, window)
        else:
            n = cu_seqlens[1:] - cu_seqlens[:-1]
            n = n if window is None else n.clamp_max(window)
        bound = bound.masked_fill(~(bound >= 0), math.inf)
        return self.delta(bound, n)


def data_logit_bound(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    reduce_max: Callable[[torch.Tensor], object] | None = None,
) -> torch.Tensor:
    """U = |scale| * max_i ||q_i|| * max_j ||k_j|| per (sequence, query head), fp32 (a bound for any sign of scale).

    q: [B, Tq, Hq, D], k: [B, Tk, Hk, D] -> U: [B, Hq] (or [N, Hq] with ``cu_seqlens`` of N sequences).
    reduce_max: an in-place elementwise max over other ranks' parts of the sequence, of the largest norms
    (``ACP.threshold``).
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
    if reduce_max is not None:
        both = torch.cat([qmax, kmax], 1)
        reduce_max(both)
        qmax, kmax = both[:, :qmax.shape[1]], both[:, qmax.shape[1]:]
    return abs(scale) * qmax * kmax.repeat_interleave(group, dim=-1)


def prune_threshold(
    logit_bound: torch.Tensor, key_lengths: torch.Tensor | int, tolerance: float
) -> torch.Tensor:
    """delta = -(2U + log N) + log(tolerance), fp32, broadcast like ``logit_bound`` ([B or N, Hq]) (``ACP.delta``).

    key_lengths: N, the number of keys a query of the sequence can see (an int, or [B or N]).
    """
    return ACP(tolerance).delta(logit_bound, key_lengths)


def acp_threshold(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    tolerance: float = math.exp(-10),
    logit_bound: float | torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """``ACP(tolerance, logit_bound).threshold(q, k, ...)``: ACP's delta per (sequence, query head), [B or N, Hq]."""
    return ACP(tolerance, logit_bound).threshold(q, k, scale=scale, cu_seqlens=cu_seqlens, window=window)


def acp_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    tolerance: float = math.exp(-10),
    logit_bound: float | torch.Tensor | None = None,
    block_m: int = 128,
    block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fraction of the causal attention tiles (so of the FLOPs) that ACP skips, without a host sync.

    Same arguments as ``forgetting_attention`` (q: [B, Tq, Hq, D], k: [B, Tk, Hk, D], log_fgate: [B, Tk, Hq]);
    tiles are the forward kernel's, ``block_m`` queries x ``block_n`` keys, and a query block skips the
    key blocks whose largest decay is below delta (a prefix, never the diagonal).
    Returns (per_head: [Hq], overall: scalar), fp32 tensors on q's device.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    threshold = ACP(tolerance, logit_bound).threshold(q, k, scale=scale, cu_seqlens=cu_seqlens)
    return acp_tile_stats(log_fgate, threshold, num_queries=q.shape[1], cu_seqlens=cu_seqlens, block_m=block_m,
                          block_n=block_n)


def acp_tile_stats(
    log_fgate: torch.Tensor,
    threshold: torch.Tensor,
    *,
    num_queries: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    block_m: int = 128,
    block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``acp_stats`` from the log forget gates of the keys, [B, Tk, Hq], and ACP's delta ``threshold``
    (``ACP.threshold``'s [B or N, Hq]); the queries are the last ``num_queries`` keys (default: all). What a
    context-parallel group reports too, on the gathered sequence, so that the share does not depend on how the
    sequence is split."""
    tk = log_fgate.shape[1]
    tq = tk if num_queries is None else num_queries
    device = log_fgate.device
    c = gate_cumsum(log_fgate.detach())
    first_kept = row_starts(c[:, tk - tq:], c, tk - tq, cu_seqlens, threshold)
    pos = torch.arange(tk - tq, tk, device=device)  # key-coordinate position of every query row
    if cu_seqlens is None:
        start, end, row = torch.zeros_like(pos), torch.full_like(pos, tk), pos - (tk - tq)
    else:
        seg = segment_ids(cu_seqlens, tk)
        start, end = cu_seqlens.long()[seg], cu_seqlens.long()[seg + 1]
        row = pos - start
    block_start = (row % block_m == 0).double()  # rows that open a query block of the kernel
    last = torch.minimum(pos + block_m, end) - 1 - start  # last query position of the block, in its sequence
    total = (last // block_n + 1).double()
    skipped = torch.minimum((first_kept - start) // block_n, (pos - start) // block_n).double()
    skipped_per_head = (skipped * block_start).sum(dim=(0, 2))
    total_per_head = (total * block_start).sum(dim=0).expand_as(skipped_per_head) * log_fgate.shape[0]
    return (skipped_per_head / total_per_head).float(), (skipped_per_head.sum() / total_per_head.sum()).float()

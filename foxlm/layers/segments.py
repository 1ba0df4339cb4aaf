"""Where the sequences of a batch start: packed documents (``cu_seqlens``) and padding (``attention_mask``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.forgetting_attention.gate import cu_seqlens_of_runs, cu_seqlens_of_starts


@dataclass
class Segments:
    """Segments of a [B, T] batch; no token attends to, or token-shifts from, another segment.

    starts: [B, T] bool, True at the first token of every segment (always at t = 0).
    ids: [B, T] int64 segment index within its row.
    positions: [B, T] int64 position of every token within its segment (RoPE positions).
    cu_seqlens: [N+1] int32 offsets of all segments in the flattened B*T tokens (the op's varlen input).
    max_seqlen: length of the longest segment (T, a bound, for ``from_mask(sync=False)``).
    """

    starts: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @classmethod
    def from_starts(cls, starts: torch.Tensor, offsets: tuple[torch.Tensor, int] | None = None) -> "Segments":
        """starts: [B, T] bool (column 0 is treated as True); offsets: (cu_seqlens, max_seqlen) of the segments
        that ``starts`` cuts, empty segments allowed (default: computed from ``starts``, a host sync)."""
        _check_batch("starts", starts, torch.bool)
        starts = starts.clone()
        starts[:, 0] = True
        B, T = starts.shape
        t = torch.arange(T, device=starts.device).expand(B, T)
        ids = starts.long().cumsum(1) - 1
        positions = t - torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values
        return cls(starts, ids, positions, *(cu_seqlens_of_starts(starts) if offsets is None else offsets))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, total: int) -> "Segments":
        """cu_seqlens: [N+1] int32 document offsets of a packed row of ``total`` tokens (B == 1)."""
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
            got = getattr(cu_seqlens, "dtype", type(cu_seqlens))
            raise ValueError(f"cu_seqlens: expected a 1-D int32 tensor [N+1], got {got}")
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if (cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total
                or bool((lengths < 0).any())):
            raise ValueError(f"cu_seqlens: expected sorted offsets from 0 to T={total}, got {cu_seqlens.tolist()}")
        starts = torch.zeros(1, total, dtype=torch.bool, device=cu_seqlens.device)
        starts[0, cu_seqlens[:-1][lengths > 0].long()] = True
        return cls.from_starts(starts)

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor, sync: bool = True) -> "Segments":
        """attention_mask: [B, T], 1 for real tokens, 0 for padding; the ones of a row must be contiguous
        (left or right padding). Padding becomes segments of its own.

        sync=False (compiled): no host sync. The contiguity is the caller's to vouch for, and cu_seqlens has a
        fixed size, three segments a row (padding, real tokens, padding; empty where a row has none, e.g. every
        segment but the real one for an all-ones mask), with max_seqlen T: the same attention, gate cumsum and
        token shift as the segments cut where the mask changes."""
        _check_batch("attention_mask", attention_mask)
        real = attention_mask.bool()
        starts = real != torch.cat([real[:, :1], real[:, :-1]], dim=1)
        if sync:
            if bool((cls.real_runs(real) > 1).any()):
                raise ValueError("attention_mask: the ones of every row must be contiguous (left or right padding)")
            return cls.from_starts(starts)
        return cls.from_starts(starts, cu_seqlens_of_runs(real))

    @staticmethod
    def real_runs(attention_mask: torch.Tensor) -> torch.Tensor:
        """attention_mask: [B, T] -> [B] int, the number of runs of real (nonzero) tokens in each row."""
        real = attention_mask.bool()
        before = torch.cat([torch.zeros_like(real[:, :1]), real[:, :-1]], dim=1)
        return (real & ~before).sum(1)


def _check_batch(name: str, t, dtype: torch.dtype | None = None) -> None:
    """A [B, T] tensor with T >= 1 (of ``dtype`` if given): an IndexError or a bad unpack deep inside before."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] < 1 or (dtype is not None and t.dtype != dtype):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        kind = "" if dtype is None else f"{dtype} "
        raise ValueError(f"{name}: expected a [B, T] {kind}tensor with T >= 1, got {got}")

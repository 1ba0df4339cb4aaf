"""The forget gate's cumulative sum c, its reverse (the gate gradient from dc), and the packed-sequence index: the one
home of each, shared by every attention path and by context parallelism."""

from __future__ import annotations

import torch


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of every packed position: ``cu_seqlens [N+1] -> [total]`` (int64)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


def cu_seqlens_of_starts(starts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The varlen offsets of a [B, T] batch cut where ``starts`` is True (column 0 always starts one): cu_seqlens
    [N+1] int32 over the flattened B*T tokens, and the longest sequence's length (one host sync)."""
    starts = starts.clone()
    starts[:, 0] = True
    offsets = torch.nonzero(starts.flatten()).flatten()
    cu_seqlens = torch.cat([offsets, offsets.new_tensor([starts.numel()])]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def first_and_end(real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first True position of each row of a [B, T] bool mask and one past its last: ([B], [B]) int64, both T
    for a row without one. A min and a max, with no host sync: not argmax, whose compiled CPU indices for masks were
    wrong before the fix of pytorch#184893 (torch 2.11's inductor)."""
    T = real.shape[1]
    t = torch.arange(T, device=real.device)
    return torch.where(real, t, T).amin(1), torch.where(real.any(1), torch.where(real, t + 1, 0).amax(1), T)


def cu_seqlens_of_runs(real: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``cu_seqlens_of_starts`` for a [B, T] bool batch whose rows' True entries are one run each (padding before
    and/or after real tokens), without a host sync (compiled): three sequences a row, (padding, real, padding),
    empty where a row has none, so cu_seqlens [3B + 1] int32 has a fixed size, and T for the longest (a bound)."""
    B, T = real.shape
    first, end = first_and_end(real)  # a row of padding only: one sequence [0, T)
    row = torch.arange(B, device=real.device) * T
    cu_seqlens = torch.cat([torch.stack([row, row + first, row + end], 1).flatten(), row.new_full((1,), B * T)])
    return cu_seqlens.to(torch.int32), T


# The hardest a finite gate closes: log f below it is taken as GATE_FLOOR. exp(-1e4) is 0 in fp64, so a key behind it
# keeps no weight either way (unless a row's logits |scale * q . k| span ~1e4), while a finite sentinel such as -1e30 or
# fp32's min, which the gate check lets through, would make c so large that no float keeps its differences.
GATE_FLOOR = -1.0e4


def floor_gates(log_fgate: torch.Tensor) -> torch.Tensor:
    """log_fgate with finite values below ``GATE_FLOOR`` raised to it (gradient 0 there, as exp(-1e12) gives); -inf
    and NaN, which only unchecked gates bring, pass unchanged."""
    return torch.where(log_fgate.isneginf(), log_fgate, log_fgate.clamp_min(GATE_FLOOR))


def gate_cumsum(log_fgate: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """c_t = sum_{l <= t} log f_l in fp64, restarting at every sequence of ``cu_seqlens``.

    log_fgate: [B, T, H] -> c: [B, T, H] float64. The fp64 sum keeps c_i - c_j exact to ~1e-12 even
    when |c| grows to 1e6 over a million tokens, which an fp32 cumsum cannot (see tests). Gates below ``GATE_FLOOR``
    are summed as the floor (``floor_gates``), so every path (the kernels, the PyTorch path, context parallelism,
    ACP's statistics) sees the same c.
    """
    # Scan along the contiguous dim: CUDA's cumsum over a strided dim is one thread per column.
    c = torch.cumsum(floor_gates(log_fgate.transpose(1, 2).to(torch.float64)).contiguous(), dim=-1).transpose(1, 2)
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].long()
        # c just before each sequence start (0 for the first); subtracting it restarts the sum.
        before = torch.cat([c.new_zeros(c.shape[0], 1, c.shape[2]), c[:, :-1]], dim=1)[:, starts]
        seg = segment_ids(cu_seqlens, c.shape[1])
        c = c - before[:, seg]
    return c


def reverse_cumsum(dc: torch.Tensor, cu_seqlens: torch.Tensor | None = None, dim: int = -1) -> torch.Tensor:
    """sum_{t' >= t} dc_t' along ``dim`` in fp64, within each sequence of ``cu_seqlens`` (along the last dim): the
    gradient of the log gates from the gradient of their cumsum c."""
    rc = dc.double().flip(dim).cumsum(dim).flip(dim)
    if cu_seqlens is None:
        return rc
    if dim not in (-1, rc.dim() - 1):
        raise ValueError(f"dim: sequences of cu_seqlens run along the last dim, got dim={dim}")
    ends = cu_seqlens[1:].long()[segment_ids(cu_seqlens, rc.shape[-1])]  # first position past each sequence
    return rc - torch.nn.functional.pad(rc, (0, 1))[..., ends]


def continue_cumsum(
    c_last: torch.Tensor, log_fgate: torch.Tensor | None, length: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """The gate cumsum of ``length`` new tokens, continued from a cache's running sum: one add per token, so the
    cache is never re-summed.

    c_last: [B, H] fp64, c of the last cached token (0 before the first); log_fgate: [B, T, H], or None (no gate:
    c stays constant); valid: [B, T] bool, False at padding, which adds nothing. Returns c: [B, T, H] fp64.
    """
    if log_fgate is None:
        return c_last[:, None].expand(-1, length, -1).clone()
    log_f = floor_gates(log_fgate.to(torch.float64))  # as forgetting_attention's prefill does
    if valid is not None:
        log_f = log_f.masked_fill(~valid[..., None], 0.0)
    return c_last[:, None] + log_f.cumsum(1)

"""Plain PyTorch reference of Forgetting Attention: the oracle the kernels are tested against.

It materialises the full ``[Tq, Tk]`` logit matrix, so it is for tests and small inputs only; pass
fp64 tensors to get an fp64 result.
"""

from __future__ import annotations

import math

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
    # Scan along the contiguous dim: CUDA's cumsum over a strided dim is one thread per column (ms at 16k).
    c = torch.cumsum(log_fgate.transpose(1, 2).to(torch.float64).contiguous(), dim=-1).transpose(1, 2)
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].long()
        # c just before each sequence start (0 for the first); subtracting it restarts the sum.
        before = torch.cat([c.new_zeros(c.shape[0], 1, c.shape[2]), c[:, :-1]], dim=1)[:, starts]
        seg = segment_ids(cu_seqlens, c.shape[1])
        c = c - before[:, seg]
    return c


def forgetting_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention with logits ``scale * q_i . k_j + c_i - c_j``, computed naively.

    q: [B, Tq, Hq, D], k: [B, Tk, Hk, D], v: [B, Tk, Hk, Dv], log_fgate: [B, Tk, Hq].
    Queries are the last Tq positions. Hq must be a multiple of Hk (GQA). With ``cu_seqlens``
    (B == 1, Tq == Tk) no query attends to another sequence and the gate cumsum restarts. With
    ``window`` query i sees only keys j with i - window < j <= i.
    Returns o: [B, Tq, Hq, Dv] in q's dtype (and lse: [B, Hq, Tq] in the compute dtype).
    """
    B, Tq, Hq, D = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)
    group = Hq // Hk
    qf = q.to(dtype).transpose(1, 2)  # [B, Hq, Tq, D]
    kf = k.to(dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    vf = v.to(dtype).repeat_interleave(group, dim=2).transpose(1, 2)
    c = gate_cumsum(log_fgate, cu_seqlens).to(dtype).transpose(1, 2)  # [B, Hq, Tk]
    cq = c[:, :, Tk - Tq:]
    logits = scale * qf @ kf.transpose(-1, -2) + cq[..., :, None] - c[..., None, :]
    qpos = torch.arange(Tk - Tq, Tk, device=q.device)
    kpos = torch.arange(Tk, device=q.device)
    allowed = qpos[:, None] >= kpos[None, :]
    if window is not None:
        allowed = allowed & (qpos[:, None] - window < kpos[None, :])
    if cu_seqlens is not None:
        seg = segment_ids(cu_seqlens, Tk)
        allowed = allowed & (seg[Tk - Tq:, None] == seg[None, :])
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    o = (torch.exp(logits - lse[..., None]) @ vf).transpose(1, 2).to(q.dtype)
    return (o, lse) if return_lse else o

"""Plain PyTorch reference of Forgetting Attention: the oracle the kernels are tested against.

It materialises the full ``[Tq, Tk]`` logit matrix, so it is for tests and small inputs only; pass fp64
tensors to get an fp64 result. It shares no code with the paths it checks: it keeps its own gate cumsum
(``_naive_cumsum``, not ``gate.gate_cumsum``), masks and softmax, so that a fault in those cannot hide here.
"""

from __future__ import annotations

import math

import torch


def _naive_cumsum(log_fgate: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """fp64 cumsum over dim 1, restarted at each of ``bounds`` (sequence offsets, first 0, last T)."""
    parts = [torch.cumsum(log_fgate[:, a:b].double(), dim=1) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=1)


def attention_from_cumsum_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    c_q: torch.Tensor,
    c_k: torch.Tensor,
    *,
    scale: float,
    q_offset: int | None = None,
    window: int | None = None,
    threshold: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with logits ``scale * q_i . k_j + c_q[i] - c_k[j]``, computed naively (the contract of
    ``foxlm.ops.attention_from_cumsum``).

    q: [B, Tq, Hq, D], k: [B, Tk, Hk, D], v: [B, Tk, Hk, Dv], c_q: [B, Tq, Hq], c_k: [B, Tk, Hq]. Query i sits
    at key position q_offset + i (default Tk - Tq) and sees keys j <= q_offset + i, j > q_offset + i - window,
    of its own sequence of ``cu_seqlens``, whose decay c_q[i] - c_k[j] is not below ``threshold`` [B or N, Hq].
    Returns o: [B, Tq, Hq, Dv] in q's dtype (0 for a row that sees no key) and lse: [B, Hq, Tq] in the
    compute dtype (-inf there).
    """
    B, Tq, Hq, _ = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    q_offset = Tk - Tq if q_offset is None else q_offset
    dtype = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(dtype).transpose(1, 2)  # [B, Hq, Tq, D]
    kf = k.to(dtype).repeat_interleave(Hq // Hk, dim=2).transpose(1, 2)
    vf = v.to(dtype).repeat_interleave(Hq // Hk, dim=2).transpose(1, 2)
    decay = c_q.transpose(1, 2)[..., :, None] - c_k.transpose(1, 2)[..., None, :]  # [B, Hq, Tq, Tk]
    logits = scale * qf @ kf.transpose(-1, -2) + decay.to(dtype)
    qpos = torch.arange(Tq, device=q.device)[:, None] + q_offset
    kpos = torch.arange(Tk, device=q.device)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed = allowed & (kpos > qpos - window)
    seq = torch.zeros(Tk, dtype=torch.long, device=q.device)
    if cu_seqlens is not None:
        for n, (a, b) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            seq[a:b] = n
        allowed = allowed & (seq[:Tq, None] == seq[None, :])
    allowed = allowed.expand(B, Hq, Tq, Tk)
    if threshold is not None:
        thr = threshold[:, :, None, None] if cu_seqlens is None else threshold[seq[:Tq]].T[None, :, :, None]
        allowed = allowed & (decay >= thr.to(decay.dtype))
    logits = logits.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1)  # rows that see no key: lse = -inf and o = 0, with finite gradients elsewhere
    lse = torch.logsumexp(logits.masked_fill(empty[..., None], 0.0), dim=-1)
    probs = torch.exp(logits - lse.masked_fill(empty, 0.0)[..., None])
    lse = lse.masked_fill(empty, float("-inf"))
    o = (probs @ vf).transpose(1, 2).to(q.dtype)
    return o, lse


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
    Tq, Tk = q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    c = _naive_cumsum(log_fgate, [0, Tk] if cu_seqlens is None else cu_seqlens.tolist())
    o, lse = attention_from_cumsum_reference(
        q, k, v, c[:, Tk - Tq:], c, scale=scale, window=window, cu_seqlens=cu_seqlens
    )
    return (o, lse) if return_lse else o

"""Memory-bounded PyTorch Forgetting Attention: the CPU path of ``forgetting_attention``.

Queries are processed in chunks against only the keys they can see, with a FlashAttention-style
backward that recomputes probabilities chunk by chunk, so memory is O(T * chunk), never T x T.
Varlen, sliding windows and ACP share one mechanism: every query row i sees keys [row_start_i, i],
where row_start is the start of its sequence, moved right to i - window + 1 and past the keys that ACP prunes.
"""

from __future__ import annotations

import torch

from .reference import gate_cumsum, segment_ids

# Upper bound on the elements of one chunk's [B, H, chunk, keys] score matrix.
_CHUNK_ELEMENTS = 1 << 24


def row_starts(
    c_global: torch.Tensor,
    tq: int,
    cu_seqlens: torch.Tensor | None,
    threshold: torch.Tensor | None,
    window: int | None = None,
) -> torch.Tensor:
    """First visible key of every query row: [B, Hq, Tq] int64.

    c_global: [B, Tk, Hq] fp64 gate cumsum that does not restart at sequence starts (so it is
    monotone along the whole row and searchable). threshold: ACP delta, [B or N, Hq], or None.
    window: query i sees keys j > i - window (None: no window).
    """
    B, Tk, H = c_global.shape
    pos = torch.arange(Tk - tq, Tk, device=c_global.device)
    if cu_seqlens is None:
        start = torch.zeros(B, H, tq, dtype=torch.long, device=c_global.device)
        per_pos_threshold = None if threshold is None else threshold[:, :, None]
    else:
        seg = segment_ids(cu_seqlens, Tk)[pos]
        start = cu_seqlens.long()[seg].expand(B, H, tq).clone()
        per_pos_threshold = None if threshold is None else threshold[seg].T[None]  # [1, H, tq]
    if window is not None:
        start = torch.maximum(start, pos - window + 1)
    if threshold is None:
        return start
    cg = c_global.detach().transpose(1, 2).contiguous()  # [B, H, Tk], non-increasing
    target = cg[:, :, pos] - per_pos_threshold.to(cg.dtype)  # keep key j iff c_j <= c_i - delta
    first_kept = torch.searchsorted(-cg, -target.contiguous(), side="left")
    return torch.maximum(start, first_kept)


class _ChunkedForgettingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, c, row_start, scale):
        # q: [B, H, Tq, D], k: [B, H, Tk, D], v: [B, H, Tk, Dv], c: [B, H, Tk] (already per query head)
        B, H, Tq, _ = q.shape
        Tk = k.shape[2]
        cdt = torch.promote_types(q.dtype, torch.float32)
        chunk = max(16, _CHUNK_ELEMENTS // max(1, B * H * Tk))
        o = q.new_empty(B, H, Tq, v.shape[-1])
        lse = torch.empty(B, H, Tq, dtype=cdt, device=q.device)
        for a, ks, ke, allowed in _chunks(row_start, Tq, Tk, chunk):
            b = a + allowed.shape[-2]
            s = _scores(q[:, :, a:b], k[:, :, ks:ke], c, a + Tk - Tq, b + Tk - Tq, ks, ke, scale, cdt, allowed)
            lse[:, :, a:b] = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse[:, :, a:b, None])
            o[:, :, a:b] = (p @ v[:, :, ks:ke].to(cdt)).to(o.dtype)
        ctx.save_for_backward(q, k, v, c, row_start, o, lse)
        ctx.scale, ctx.chunk = scale, chunk
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, c, row_start, o, lse = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        B, H, Tq, _ = q.shape
        Tk = k.shape[2]
        cdt = lse.dtype
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
        dc = torch.zeros(c.shape, dtype=cdt, device=q.device)
        do = do.to(cdt)
        delta = (do * o.to(cdt)).sum(-1)  # [B, H, Tq]
        if dlse is not None:
            delta = delta - dlse.to(cdt)
        for a, ks, ke, allowed in _chunks(row_start, Tq, Tk, chunk):
            b = a + allowed.shape[-2]
            qa, kk, vv = q[:, :, a:b].to(cdt), k[:, :, ks:ke].to(cdt), v[:, :, ks:ke].to(cdt)
            s = _scores(qa, kk, c, a + Tk - Tq, b + Tk - Tq, ks, ke, scale, cdt, allowed)
            p = torch.exp(s - lse[:, :, a:b, None])
            dv[:, :, ks:ke] += p.transpose(-1, -2) @ do[:, :, a:b]
            ds = p * (do[:, :, a:b] @ vv.transpose(-1, -2) - delta[:, :, a:b, None])
            dq[:, :, a:b] = scale * ds @ kk
            dk[:, :, ks:ke] += scale * ds.transpose(-1, -2) @ qa
            dc[:, :, Tk - Tq + a:Tk - Tq + b] += ds.sum(-1)
            dc[:, :, ks:ke] -= ds.sum(-2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dc.to(c.dtype), None, None


def _chunks(row_start: torch.Tensor, tq: int, tk: int, chunk: int):
    """Yield (first query, first key, end key, allowed mask [B, H, rows, keys]) per query chunk."""
    for a in range(0, tq, chunk):
        b = min(tq, a + chunk)
        ks, ke = int(row_start[:, :, a:b].min()), tk - tq + b
        keys = torch.arange(ks, ke, device=row_start.device)
        qpos = torch.arange(tk - tq + a, tk - tq + b, device=row_start.device)
        allowed = (keys >= row_start[:, :, a:b, None]) & (keys <= qpos[:, None])
        yield a, ks, ke, allowed


def _scores(q, k, c, qa, qb, ks, ke, scale, cdt, allowed):
    s = scale * (q.to(cdt) @ k.to(cdt).transpose(-1, -2))
    s = s + (c[:, :, qa:qb, None] - c[:, :, None, ks:ke]).to(cdt)
    return s.masked_fill(~allowed, float("-inf"))


def chunked_forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    window: int | None = None,
    threshold: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forgetting Attention in O(T * chunk) memory, differentiable in q, k, v and log_fgate.

    q: [B, Tq, Hq, D], k: [B, Tk, Hk, D], v: [B, Tk, Hk, Dv], log_fgate: [B, Tk, Hq] (validated by
    the caller). window: query i sees keys j > i - window (None: all). threshold: ACP delta [B or N, Hq] or None. Returns o: [B, Tq, Hq, Dv] and lse: [B, Hq, Tq].
    """
    group = q.shape[2] // k.shape[2]
    c_global = gate_cumsum(log_fgate)  # not restarted per sequence: differences are what matter
    row_start = row_starts(c_global, q.shape[1], cu_seqlens, threshold, window)
    kh = k.repeat_interleave(group, dim=2) if group > 1 else k
    vh = v.repeat_interleave(group, dim=2) if group > 1 else v
    o, lse = _ChunkedForgettingAttention.apply(
        q.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), c_global.transpose(1, 2), row_start, scale
    )
    return o.transpose(1, 2), lse.float()

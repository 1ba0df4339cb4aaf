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


class _BlockAttention(torch.autograd.Function):
    """One (queries x keys) block of Forgetting Attention from given gate cumsums, chunked over queries."""

    @staticmethod
    def forward(ctx, q, k, v, c_q, c_k, q_offset, scale, window, threshold, seg):
        # q: [B, H, Tq, D], k: [B, H, Tk, D], v: [B, H, Tk, Dv], c_q: [B, H, Tq], c_k: [B, H, Tk]
        B, H, Tq, _ = q.shape
        Tk = k.shape[2]
        cdt = torch.promote_types(q.dtype, torch.float32)
        chunk = max(16, _CHUNK_ELEMENTS // max(1, B * H * Tk))
        o = q.new_zeros(B, H, Tq, v.shape[-1])
        lse = torch.full((B, H, Tq), float("-inf"), dtype=cdt, device=q.device)
        for a, b, ks, ke, allowed in _block_chunks(c_q, c_k, Tq, Tk, q_offset, window, threshold, seg, chunk):
            s = _block_scores(q[:, :, a:b], k[:, :, ks:ke], c_q[:, :, a:b], c_k[:, :, ks:ke], scale, cdt, allowed)
            m = torch.logsumexp(s, dim=-1)
            lse[:, :, a:b] = m
            p = torch.exp(s - m.masked_fill(m.isinf(), 0.0)[..., None])  # a row that sees no key: p = 0, o = 0
            o[:, :, a:b] = (p @ v[:, :, ks:ke].to(cdt)).to(o.dtype)
        ctx.save_for_backward(q, k, v, c_q, c_k, o, lse, threshold, seg)
        ctx.args = (q_offset, scale, window, chunk)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, c_q, c_k, o, lse, threshold, seg = ctx.saved_tensors
        q_offset, scale, window, chunk = ctx.args
        Tq, Tk = q.shape[2], k.shape[2]
        cdt = lse.dtype
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
        dc_q = torch.zeros(c_q.shape, dtype=cdt, device=q.device)
        dc_k = torch.zeros(c_k.shape, dtype=cdt, device=q.device)
        do = do.to(cdt)
        delta = (do * o.to(cdt)).sum(-1)  # [B, H, Tq]
        if dlse is not None:
            delta = delta - dlse.to(cdt)
        for a, b, ks, ke, allowed in _block_chunks(c_q, c_k, Tq, Tk, q_offset, window, threshold, seg, chunk):
            qa, kk, vv = q[:, :, a:b].to(cdt), k[:, :, ks:ke].to(cdt), v[:, :, ks:ke].to(cdt)
            s = _block_scores(qa, kk, c_q[:, :, a:b], c_k[:, :, ks:ke], scale, cdt, allowed)
            m = lse[:, :, a:b]
            p = torch.exp(s - m.masked_fill(m.isinf(), 0.0)[..., None])
            dv[:, :, ks:ke] += p.transpose(-1, -2) @ do[:, :, a:b]
            ds = p * (do[:, :, a:b] @ vv.transpose(-1, -2) - delta[:, :, a:b, None])
            dq[:, :, a:b] = scale * ds @ kk
            dk[:, :, ks:ke] += scale * ds.transpose(-1, -2) @ qa
            dc_q[:, :, a:b] = ds.sum(-1)
            dc_k[:, :, ks:ke] -= ds.sum(-2)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dc_q.to(c_q.dtype), dc_k.to(c_k.dtype),
                None, None, None, None, None)


def _block_chunks(c_q, c_k, tq, tk, q_offset, window, threshold, seg, chunk):
    """Yield (first row, end row, first key, end key, allowed [B, H, rows, keys]) per query chunk that sees a key.

    The key range is narrowed to the columns some row of the chunk keeps, so pruned and masked keys cost no FLOPs.
    """
    for a in range(0, tq, chunk):
        b = min(tq, a + chunk)
        ke = min(tk, q_offset + b)  # one past the last key the chunk's last row can see
        if ke <= 0:
            continue
        keys = torch.arange(ke, device=c_q.device)
        qpos = torch.arange(q_offset + a, q_offset + b, device=c_q.device)
        allowed = (keys <= qpos[:, None])[None, None]  # [1, 1, rows, keys]
        if window is not None:
            allowed = allowed & (keys > qpos[:, None] - window)
        if seg is not None:
            allowed = allowed & (seg[qpos][:, None] == seg[keys][None, :])
        if threshold is not None:  # ACP: keep key j iff its decay c_q[i] - c_k[j] reaches delta
            decay = c_q[:, :, a:b, None] - c_k[:, :, None, :ke]
            thr = threshold[:, :, None, None] if seg is None else threshold[seg[qpos]].T[None, :, :, None]
            allowed = allowed & (decay >= thr.to(decay.dtype))
        cols = allowed.flatten(0, 2).any(0).nonzero()
        if cols.numel() == 0:
            continue
        ks, ke = int(cols[0]), int(cols[-1]) + 1
        yield a, b, ks, ke, allowed[..., ks:ke]


def _block_scores(q, k, c_q, c_k, scale, cdt, allowed):
    s = scale * (q.to(cdt) @ k.to(cdt).transpose(-1, -2))
    s = s + (c_q[:, :, :, None] - c_k[:, :, None, :]).to(cdt)  # the difference in c's precision (fp64), then cdt
    return s.masked_fill(~allowed, float("-inf"))


def attention_from_cumsum(
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
    return_probs: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Forgetting Attention of a block of queries against a block of keys, from the gate cumsums.

    q: [B, Tq, Hq, D], k: [B, Tk, Hk, D], v: [B, Tk, Hk, Dv] (Hq a multiple of Hk). c_q: [B, Tq, Hq] and
    c_k: [B, Tk, Hq] (fp64 or fp32): the logit of query i and key j is scale * q_i . k_j + c_q[i] - c_k[j];
    only differences matter. Query i sits at key position q_offset + i (default Tk - Tq) and sees keys
    j <= q_offset + i (q_offset >= Tk: every key), and j > q_offset + i - window with a ``window``.
    threshold: ACP delta [B or N, Hq]; keys whose decay c_q[i] - c_k[j] is below it are not computed.
    cu_seqlens: packed sequences (B == 1, Tq == Tk, q_offset 0): no query sees another sequence's keys.
    Returns o: [B, Tq, Hq, Dv] in q's dtype and lse: [B, Hq, Tq] fp32 (-inf, with o = 0, for a row that sees
    no key), and with ``return_probs`` probs: [B, Hq, Tq, Tk] fp32 (not differentiable; O(Tq * Tk) memory).
    Differentiable in q, k, v, c_q and c_k, also through lse, in O(T * chunk) memory.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v: expected 4-D tensors [B, T, H, D], got {q.dim()}, {k.dim()} and {v.dim()} dims")
    B, Tq, Hq, D = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k, v: expected [B={B}, Tk, Hk, D={D}] and [B, Tk, Hk, Dv], got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if Hq % Hk:
        raise ValueError(f"q: its {Hq} heads must be a multiple of k's {Hk} heads (GQA)")
    if tuple(c_q.shape) != (B, Tq, Hq) or tuple(c_k.shape) != (B, Tk, Hq):
        raise ValueError(f"c_q, c_k: expected [B, Tq, Hq] = {(B, Tq, Hq)} and [B, Tk, Hq] = {(B, Tk, Hq)}, "
                         f"got {tuple(c_q.shape)} and {tuple(c_k.shape)}")
    q_offset = Tk - Tq if q_offset is None else int(q_offset)
    if q_offset < 0:
        raise ValueError(f"q_offset: expected a key position >= 0, got {q_offset}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window: expected a positive number of tokens (int) or None, got {window!r}")
    seg = None
    if cu_seqlens is not None:
        if B != 1 or Tq != Tk or q_offset != 0:
            raise ValueError(f"cu_seqlens: packed input needs B == 1, Tq == Tk and q_offset 0, got B={B}, Tq={Tq}, "
                             f"Tk={Tk}, q_offset={q_offset}")
        seg = segment_ids(cu_seqlens, Tk)
    if threshold is not None:
        rows = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if threshold.dim() != 2 or threshold.shape[1] != Hq or threshold.shape[0] not in (1, rows):
            raise ValueError(f"threshold: expected [B or N, Hq] = [{rows}, {Hq}], got {tuple(threshold.shape)}")
    group = Hq // Hk
    kh = k.repeat_interleave(group, dim=2) if group > 1 else k
    vh = v.repeat_interleave(group, dim=2) if group > 1 else v
    o, lse = _BlockAttention.apply(
        q.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), c_q.transpose(1, 2), c_k.transpose(1, 2),
        q_offset, float(scale), window, None if threshold is None else threshold.detach(), seg,
    )
    o, lse = o.transpose(1, 2), lse.float()
    if not return_probs:
        return o, lse
    with torch.no_grad():
        probs = torch.zeros(B, Hq, Tq, Tk, dtype=torch.float32, device=q.device)
        qt, kt, cq, ck = q.transpose(1, 2), kh.transpose(1, 2), c_q.transpose(1, 2), c_k.transpose(1, 2)
        chunk = max(16, _CHUNK_ELEMENTS // max(1, B * Hq * Tk))
        cdt = torch.promote_types(q.dtype, torch.float32)
        thr = None if threshold is None else threshold.detach()
        for a, b, ks, ke, allowed in _block_chunks(cq, ck, Tq, Tk, q_offset, window, thr, seg, chunk):
            s = _block_scores(qt[:, :, a:b], kt[:, :, ks:ke], cq[:, :, a:b], ck[:, :, ks:ke], scale, cdt, allowed)
            m = lse[:, :, a:b, None].to(cdt)
            probs[:, :, a:b, ks:ke] = torch.exp(s - m.masked_fill(m.isinf(), 0.0)).float()
    return o, lse, probs

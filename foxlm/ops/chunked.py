"""Memory-bounded PyTorch Forgetting Attention from a gate cumsum: the CPU path, and attention from a KV cache.

Queries are processed in chunks against only the keys they can see, with a FlashAttention-style backward that
recomputes probabilities chunk by chunk, so memory is O(T * chunk), never T x T. Causality, varlen, sliding
windows and ACP share one mechanism: every query row i sees the keys [row_start_i, q_offset + i], where
row_start is the start of its sequence, moved right to q_offset + i - window + 1 and past the keys ACP prunes.
"""

from __future__ import annotations

import torch

from .gate import segment_ids

# Upper bound on the elements of one chunk's [B, H, chunk, keys] score matrix.
_CHUNK_ELEMENTS = 1 << 24


def row_starts(
    c_q: torch.Tensor,
    c_k: torch.Tensor,
    q_offset: int,
    cu_seqlens: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """First visible key of every query row: [B, Hq, Tq] int64 (past the row's last key if it sees none).

    c_q: [B, Tq, Hq], c_k: [B, Tk, Hq] gate cumsums; c_k is non-increasing within each sequence (a restart at
    a sequence start is allowed). Query i sits at key position q_offset + i. threshold: ACP delta, [B or N, Hq],
    or None: a key j is kept iff c_q[i] - c_k[j] >= delta. window: query i sees keys j > q_offset + i - window.
    """
    B, Tq, H = c_q.shape
    Tk = c_k.shape[1]
    dev = c_q.device
    pos = q_offset + torch.arange(Tq, device=dev)  # key position of every query row
    if cu_seqlens is None:
        start = torch.zeros(B, H, Tq, dtype=torch.long, device=dev)
        row_threshold = None if threshold is None else threshold[:, :, None]
    else:
        seg = segment_ids(cu_seqlens, Tk)[pos]
        start = cu_seqlens.long()[seg].expand(B, H, Tq).clone()
        row_threshold = None if threshold is None else threshold[seg].T[None]  # [1, H, Tq]
    if window is not None:
        start = torch.maximum(start, pos - window + 1)
    if threshold is None:
        return start
    ck = c_k.detach().transpose(1, 2).contiguous()  # [B, H, Tk]
    target = c_q.detach().transpose(1, 2) - row_threshold.to(ck.dtype)  # keep key j iff c_k[j] <= target
    return _first_at_most(ck, target, start, (pos + 1).clamp(0, Tk).expand(B, H, Tq))


def _first_at_most(c: torch.Tensor, target: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """First j in [lo, hi) with c[j] <= target (else hi), by binary search per row: c is non-increasing on
    [lo, hi) but not across sequence starts, so one sorted search over the whole row would not do."""
    lo, hi = lo.clamp(max=c.shape[-1]), hi.clone()
    lo = torch.minimum(lo, hi)
    for _ in range(c.shape[-1].bit_length()):
        active = lo < hi
        mid = (lo + hi) // 2
        above = c.gather(-1, mid.clamp(max=c.shape[-1] - 1)) > target  # NaN target: keeps every key
        lo = torch.where(active & above, mid + 1, lo)
        hi = torch.where(active & ~above, mid, hi)
    return lo


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, c_q, c_k, row_start, q_offset, scale, return_probs):
        # q: [B, H, Tq, D], k: [B, H, Tk, D], v: [B, H, Tk, Dv], c_q: [B, H, Tq], c_k: [B, H, Tk] (per query head)
        B, H, Tq, _ = q.shape
        Tk = k.shape[2]
        cdt = torch.promote_types(q.dtype, torch.float32)
        chunk = max(16, _CHUNK_ELEMENTS // max(1, B * H * Tk))
        o = q.new_zeros(B, H, Tq, v.shape[-1])
        lse = torch.full((B, H, Tq), float("-inf"), dtype=cdt, device=q.device)
        probs = torch.zeros((B, H, Tq, Tk) if return_probs else (0,), dtype=torch.float32, device=q.device)
        for a, b, ks, ke, allowed in _chunks(row_start, q_offset, Tq, Tk, chunk):
            s = _scores(q[:, :, a:b], k[:, :, ks:ke], c_q[:, :, a:b], c_k[:, :, ks:ke], scale, cdt, allowed)
            lse[:, :, a:b] = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - _finite(lse[:, :, a:b])[..., None])
            o[:, :, a:b] = (p @ v[:, :, ks:ke].to(cdt)).to(o.dtype)
            if return_probs:
                probs[:, :, a:b, ks:ke] = p.float()
        ctx.save_for_backward(q, k, v, c_q, c_k, row_start, o, lse)
        ctx.scale, ctx.chunk, ctx.q_offset = scale, chunk, q_offset
        ctx.mark_non_differentiable(probs)
        return o, lse, probs

    @staticmethod
    def backward(ctx, do, dlse, _dprobs):
        q, k, v, c_q, c_k, row_start, o, lse = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        B, H, Tq, _ = q.shape
        Tk = k.shape[2]
        cdt = lse.dtype
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
        # Row sums of dS are dlse exactly (sum_j p_ij = 1): no rounding noise from summing terms that cancel.
        dc_q = torch.zeros(c_q.shape, dtype=cdt, device=q.device)
        if dlse is not None:
            dc_q = dlse.to(cdt).masked_fill(lse == float("-inf"), 0.0)
        dc_k = torch.zeros(c_k.shape, dtype=cdt, device=q.device)
        do = do.to(cdt)
        delta = (do * o.to(cdt)).sum(-1)  # [B, H, Tq]
        if dlse is not None:
            delta = delta - dlse.to(cdt)
        for a, b, ks, ke, allowed in _chunks(row_start, ctx.q_offset, Tq, Tk, chunk):
            qa, kk, vv = q[:, :, a:b].to(cdt), k[:, :, ks:ke].to(cdt), v[:, :, ks:ke].to(cdt)
            s = _scores(qa, kk, c_q[:, :, a:b], c_k[:, :, ks:ke], scale, cdt, allowed)
            p = torch.exp(s - _finite(lse[:, :, a:b])[..., None])
            dv[:, :, ks:ke] += p.transpose(-1, -2) @ do[:, :, a:b]
            ds = p * (do[:, :, a:b] @ vv.transpose(-1, -2) - delta[:, :, a:b, None])
            dq[:, :, a:b] = scale * ds @ kk
            dk[:, :, ks:ke] += scale * ds.transpose(-1, -2) @ qa
            dc_k[:, :, ks:ke] -= ds.sum(-2)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dc_q.to(c_q.dtype), dc_k.to(c_k.dtype),
                None, None, None, None)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with 0 for rows that see no key, so that their probabilities are exp(-inf) = 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _chunks(row_start: torch.Tensor, q_offset: int, tq: int, tk: int, chunk: int):
    """Yield (first row, end row, first key, end key, allowed mask [B, H, rows, keys]) per query chunk that
    sees a key."""
    for a in range(0, tq, chunk):
        b = min(tq, a + chunk)
        ks, ke = int(row_start[:, :, a:b].min()), min(tk, q_offset + b)
        if ks >= ke:
            continue
        keys = torch.arange(ks, ke, device=row_start.device)
        qpos = torch.arange(q_offset + a, q_offset + b, device=row_start.device)
        allowed = (keys >= row_start[:, :, a:b, None]) & (keys <= qpos[:, None])
        yield a, b, ks, ke, allowed


def _scores(q, k, c_q, c_k, scale, cdt, allowed):
    s = scale * (q.to(cdt) @ k.to(cdt).transpose(-1, -2))
    s = s + (c_q[:, :, :, None] - c_k[:, :, None, :]).to(cdt)
    return s.masked_fill(~allowed, float("-inf"))


def _validate(q, k, v, c_q, c_k, q_offset, window, threshold, cu_seqlens) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor [B, T, H, D], got {tuple(t.shape)}")
    B, Tq, Hq, D = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k, v: expected [B={B}, Tk, Hk, D={D}] and [B, Tk, Hk, Dv], got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"q: its {Hq} heads must be a multiple of k's {Hk} heads (GQA)")
    for name, c, shape in (("c_q", c_q, (B, Tq, Hq)), ("c_k", c_k, (B, Tk, Hq))):
        if tuple(c.shape) != shape or c.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{name}: expected a float32 or float64 gate cumsum {list(shape)}, "
                             f"got {c.dtype} {tuple(c.shape)}")
    if q_offset is not None and (isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0):
        raise ValueError(f"q_offset: expected a non-negative int (a key position) or None, got {q_offset!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window: expected a positive number of tokens (int) or None, got {window!r}")
    rows = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if threshold is not None and tuple(threshold.shape) != (rows, Hq):
        raise ValueError(f"threshold: expected [{'B' if cu_seqlens is None else 'N'}={rows}, Hq={Hq}], "
                         f"got {tuple(threshold.shape)}")
    if cu_seqlens is not None and (B != 1 or Tq != Tk or q_offset not in (None, 0)):
        raise ValueError(f"cu_seqlens: packed input needs B == 1, Tq == Tk and q_offset 0, got B={B}, Tq={Tq}, "
                         f"Tk={Tk}, q_offset={q_offset}")


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
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forgetting Attention from gate cumsums, in O(T * chunk) memory; differentiable in q, k, v, c_q and c_k
    (also through lse).

    Args:
        q: [B, Tq, Hq, D]; k: [B, Tk, Hk, D]; v: [B, Tk, Hk, Dv] (GQA: Hq a multiple of Hk).
        c_q: [B, Tq, Hq], c_k: [B, Tk, Hq]: gate cumsums (fp64 or fp32); the logit of query i and key j is
            ``scale * q_i . k_j + c_q[i] - c_k[j]``. Only differences matter: any common offset is allowed.
        q_offset: query i sits at key position q_offset + i and sees keys j <= q_offset + i (default Tk - Tq:
            the queries are the last Tq keys); q_offset >= Tk makes every key visible to every query.
        window: query i also needs j > q_offset + i - window.
        threshold: ACP delta [B or N, Hq]: keys whose decay c_q[i] - c_k[j] is below it are not computed.
        cu_seqlens: [N+1] int32 offsets of packed sequences (B == 1, Tq == Tk, q_offset 0).
        return_probs: also return the probabilities [B, Hq, Tq, Tk] fp32 (O(Tq * Tk) memory; not differentiable).

    Returns:
        o: [B, Tq, Hq, Dv] in q's dtype, lse: [B, Hq, Tq] fp32 (-inf for a row that sees no key, with o = 0
        there), and probs with ``return_probs``.
    """
    _validate(q, k, v, c_q, c_k, q_offset, window, threshold, cu_seqlens)
    q_offset = k.shape[1] - q.shape[1] if q_offset is None else q_offset
    group = q.shape[2] // k.shape[2]
    row_start = row_starts(c_q, c_k, q_offset, cu_seqlens, threshold, window)
    kh = k.repeat_interleave(group, dim=2) if group > 1 else k
    vh = v.repeat_interleave(group, dim=2) if group > 1 else v
    o, lse, probs = _ChunkedAttention.apply(
        q.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), c_q.transpose(1, 2), c_k.transpose(1, 2),
        row_start, q_offset, float(scale), return_probs,
    )
    o, lse = o.transpose(1, 2), lse.float()
    return (o, lse, probs) if return_probs else (o, lse)

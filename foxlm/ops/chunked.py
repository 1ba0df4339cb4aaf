"""Memory-bounded PyTorch Forgetting Attention from a gate cumsum: the CPU path, and attention from a KV cache.

The work runs in SDPA's fused CPU kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward):
q and k get two extra channels so that the kernel's plain dot product is the gated logit
scale * q_i . k_j + c_i - c_j. Queries go in chunks, each against only the keys it can see, with c re-centred per
chunk; memory is O(T * chunk), never T x T. Causality, varlen, sliding
windows and ACP share one mechanism: every query row i sees the keys [row_start_i, q_offset + i], where
row_start is the start of its sequence, moved right to q_offset + i - window + 1 and past the keys ACP prunes
(a pruned key range is not computed at all). Off the CPU (the caches and context parallelism on a GPU; the op itself
takes Triton there) the same chunks go through a plain-matmul softmax with the kernel's contract.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .gate import segment_ids

# Rows per query chunk (>= 768 rows gets the kernel its largest query blocks), and the largest gate span
# max(c) - min(c) within one: fp32 channels of up to +-32 keep c_i - c_j as precise as the fp64 difference.
_CHUNK = 1024
_C_SPAN = 64.0
# Off the CPU (the caches and context parallelism on a GPU) the kernel is _math_attention: at most this many
# elements in one call's [B, H, rows, keys] score matrix.
_MATH_ELEMENTS = 1 << 24


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


class _SdpaAttention(torch.autograd.Function):
    """Forgetting attention inside SDPA's fused CPU kernel (off the CPU, _math_attention), with q and k extended by
    two gate channels.

    q' = [scale*q, c_q - c_ref, 1] and k' = [k, 1, -(c_k - c_ref)] give q'.k' = scale*q.k + c_q - c_k, so the
    kernel (at scale 1) computes the gated logits and its k' gradient holds the gate's. c_ref is re-centred per
    query chunk, so the channels of the rows and keys that carry mass stay small in fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, c_q, c_k, row_start, scale, q_offset):
        # Buffers are [B, T, H, Dp] in memory, the layout the kernel returns its gradients in (adds stay dense);
        # the kernel gets [B, H, T, Dp] views.
        B, Tq, Hq, D = q.shape
        Dv = v.shape[-1]
        cdt = torch.promote_types(q.dtype, torch.float32)
        ctx.set_materialize_grads(False)
        rows = _CHUNK if _fused(q.device) else min(_CHUNK, max(16, _MATH_ELEMENTS // max(1, B * Hq * k.shape[1])))
        plan = _plan(c_q, row_start, k.shape[1], q_offset, rows)
        qp, kp, vp = _extend(q, k, v, c_q, plan, scale, cdt)
        o = torch.zeros(B, Tq, Hq, Dv, dtype=cdt, device=q.device)
        lse = torch.full((B, Hq, Tq), -math.inf, dtype=cdt, device=q.device)  # stays so for chunks that see no key
        with _flush_denormals():
            for a, b, c_ref, ks, ke, calls in plan:
                if calls:
                    _centre_keys(kp, c_k, c_ref, D, ks, ke)
                outs = []
                for s, e, kind in calls:
                    mask, empty = _mask(kind, row_start, a, b, s, e, q_offset, cdt)
                    oc, lc = _kernel(qp.device)[0](
                        _heads(qp[:, a:b]), _heads(kp[:, s:e]), _heads(vp[:, s:e]), 0.0, kind == "causal",
                        attn_mask=mask, scale=1.0,
                    )
                    # The kernel gives a row that sees no key o = 0 and lse 0, not -inf.
                    lc = lc if empty is None else lc.masked_fill(empty, -math.inf)
                    outs.append((oc.transpose(1, 2)[..., :Dv], lc))
                if len(outs) == 1:
                    o[:, a:b], lse[:, :, a:b] = outs[0]
                elif outs:  # the keys before the chunk and its causal block: every row sees both (finite lse)
                    (o1, l1), (o2, l2) = outs
                    torch.lerp(o1, o2, torch.sigmoid(l2 - l1).transpose(1, 2)[..., None], out=o[:, a:b])
                    torch.logaddexp(l1, l2, out=lse[:, :, a:b])
        ctx.save_for_backward(qp, kp, vp, c_k, row_start, o, lse)
        ctx.plan, ctx.meta = plan, (q.dtype, k.shape, c_q.dtype, c_k.dtype, scale, q_offset)
        return o.to(q.dtype, copy=True), lse.float()  # a copy: callers may change o in place; backward needs it

    @staticmethod
    def backward(ctx, do, dlse):
        qp, kp, vp, c_k, row_start, o, lse = ctx.saved_tensors
        qdt, (_, Tk, Hk, D), cqdt, ckdt, scale, q_offset = ctx.meta
        B, Tq, Hq, Dp = qp.shape
        Dv = o.shape[-1]
        # The kernel's backward takes delta = rowsum(dO * O) from its inputs; a spare channel with dO = 1 and
        # O = -dlse turns it into rowsum(dO * O) - dlse, the lse gradient (its dV column is discarded).
        dop = _cat(qp.new_zeros(B, Tq, Hq, Dv) if do is None else do.to(qp.dtype), 1.0, 0.0, Dp)
        outp = _cat(o, 0.0 if dlse is None else -dlse.transpose(1, 2)[..., None].to(o.dtype), 0.0, Dp)
        lse = lse.masked_fill(lse == -math.inf, math.inf)  # a row that sees no key: P = 0, not NaN
        single = len(ctx.plan) == 1 and len(ctx.plan[0][-1]) == 1
        dqp = None if single else torch.zeros_like(qp)  # zeros: the rows of chunks that see no key
        # k's gate channel still holds the last chunk's values; others are rewritten into a copy, so that the
        # saved tensor stays as it was (a second backward, e.g. gradcheck's, reads it again).
        kp_saved, kp = kp, kp.clone() if len(ctx.plan) > 1 else kp
        dkp = dvp = None
        with _flush_denormals():
            for a, b, c_ref, ks, ke, calls in ctx.plan:
                if calls and kp is not kp_saved:
                    _centre_keys(kp, c_k, c_ref, D, ks, ke)
                for j, (s, e, kind) in enumerate(calls):
                    mask, _ = _mask(kind, row_start, a, b, s, e, q_offset, qp.dtype)
                    gq, gk, gv = _kernel(qp.device)[1](
                        _heads(dop[:, a:b]), _heads(qp[:, a:b]), _heads(kp[:, s:e]), _heads(vp[:, s:e]),
                        _heads(outp[:, a:b]), lse[:, :, a:b], 0.0, kind == "causal", attn_mask=mask, scale=1.0,
                    )
                    if single:  # the kernel's gradients are the result (no copies, no adds)
                        dqp = gq.transpose(1, 2)
                    elif j == 0:
                        dqp[:, a:b] = gq.transpose(1, 2)
                    else:
                        dqp[:, a:b] += gq.transpose(1, 2)
                    if dkp is None and s == 0 and e == Tk:
                        dkp, dvp = gk.transpose(1, 2), gv.transpose(1, 2)
                        continue
                    if dkp is None:
                        dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)
                    dkp[:, s:e] += gk.transpose(1, 2)
                    dvp[:, s:e] += gv.transpose(1, 2)
        if dkp is None:  # no row sees a key
            dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)
        group = Hq // Hk
        dk = dkp[..., :D].unflatten(2, (Hk, group)).sum(3) if group > 1 else dkp[..., :D]
        dv = dvp[..., :Dv].unflatten(2, (Hk, group)).sum(3) if group > 1 else dvp[..., :Dv]
        # Row sums of dS are dlse exactly (sum_j p_ij = 1): the q' channel's gradient would add rounding noise.
        dc_q = None if dlse is None else dlse.transpose(1, 2).masked_fill(lse.transpose(1, 2) == math.inf, 0.0)
        dc_q = torch.zeros(B, Tq, Hq, dtype=cqdt, device=qp.device) if dc_q is None else dc_q.to(cqdt)
        dc_k = -dkp[..., D + 1].to(ckdt)
        return (scale * dqp[..., :D]).to(qdt), dk.to(qdt), dv.to(qdt), dc_q, dc_k, None, None, None


def _fused(device: torch.device) -> bool:
    """Whether SDPA's fused CPU kernel serves tensors on ``device``."""
    return device.type == "cpu"


def _kernel(device: torch.device):
    """(forward, backward) with the signatures of SDPA's fused CPU kernel: the kernel itself on the CPU, else
    _math_attention (the caches and context parallelism call this path with GPU tensors, fp64 included)."""
    if _fused(device):
        ops = torch.ops.aten
        return ops._scaled_dot_product_flash_attention_for_cpu, ops._scaled_dot_product_flash_attention_for_cpu_backward
    return _math_attention, _math_attention_backward


def _math_attention(q, k, v, dropout_p, is_causal, *, attn_mask=None, scale):
    """Softmax attention as the fused CPU kernel computes it: q: [B, H, M, Dp], k, v: [B, H, N, Dp] ->
    (o [B, H, M, Dp], lse [B, H, M]); causal is top-left aligned; a row that sees no key gets o = 0, lse = 0."""
    s = _math_logits(q, k, is_causal, attn_mask, scale)
    lse = torch.logsumexp(s, -1)
    lse = lse.masked_fill(lse == -math.inf, 0.0)
    return torch.exp(s - lse[..., None]) @ v, lse


def _math_attention_backward(do, q, k, v, o, lse, dropout_p, is_causal, *, attn_mask=None, scale):
    """The gradients (dq, dk, dv) of _math_attention, from its o and lse (+inf for a row that sees no key)."""
    p = torch.exp(_math_logits(q, k, is_causal, attn_mask, scale) - lse[..., None])
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do


def _math_logits(q, k, is_causal, attn_mask, scale):
    s = scale * (q @ k.transpose(-1, -2))
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return s if attn_mask is None else s + attn_mask


@contextlib.contextmanager
def _flush_denormals():
    """Flush fp32 denormals to zero in the kernel calls, then restore the caller's mode.

    The gate drives many probabilities of a row below 1e-38, where the CPU computes with denormals at a fraction of
    its speed (the kernel's backward ran 2x faster with flushing); values that small are zero to fp32's precision.
    torch sets the mode of the calling thread only and has no getter, so the current mode is read off a product.
    """
    was_on = bool(torch.tensor(1e-39, dtype=torch.float32).mul(1.0) == 0)
    if not was_on:
        torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if not was_on:
            torch.set_flush_denormal(False)


def _cat(x: torch.Tensor, c1, c2, dp: int) -> torch.Tensor:
    """[x, c1, c2 (repeated to width dp)] along the last dim, in one pass; c1, c2: numbers or [..., 1] tensors."""
    lead = x.shape[:-1]
    parts = [x]
    for c, width in ((c1, 1), (c2, dp - x.shape[-1] - 1)):
        if width > 0:
            parts.append((c if isinstance(c, torch.Tensor) else x.new_full((1,) * x.dim(), c)).expand(*lead, width))
    return torch.cat(parts, dim=-1)


def _heads(t: torch.Tensor) -> torch.Tensor:
    """[B, T, H, Dp] buffer -> the kernel's [B, H, T, Dp] view."""
    return t.transpose(1, 2)


def _row_chunks(c: torch.Tensor, rows: int) -> list[tuple[int, int]]:
    """Query row ranges [a, b): at most ``rows`` rows, cut where c jumps by more than _C_SPAN from one row to the
    next (a sequence restart, or a gate below e^-64), and split evenly where the gates of a range span more
    than _C_SPAN (strong forgetting), down to 16 rows, so that the re-centred channels stay small."""
    Tq = c.shape[1]
    jumps = ((c[:, 1:] - c[:, :-1]).abs().amax((0, 2)) > _C_SPAN).nonzero().flatten() + 1
    bounds = sorted(set(range(0, Tq, rows)) | set(jumps.tolist()) | {Tq})
    pieces = list(zip(bounds, bounds[1:]))
    spans = torch.stack([(c[:, a:b].amax(1) - c[:, a:b].amin(1)).max() for a, b in pieces]).tolist()
    chunks = []
    for (a, b), span in zip(pieces, spans):
        n = math.ceil(span / _C_SPAN) if math.isfinite(span) else 1  # NaN gates (unchecked) just pass through
        n = min(max(1, n), max(1, (b - a) // 16))
        edges = [a + (b - a) * i // n for i in range(n + 1)]
        chunks += list(zip(edges, edges[1:]))
    return chunks


def _plan(c_q: torch.Tensor, row_start: torch.Tensor, tk: int, q_offset: int, rows: int) -> list:
    """Query chunks [a, b) with their gate reference c_ref [B, Hq], keys [ks, ke) and kernel calls (s, e, kind).

    Kinds: "causal" (the chunk's own block: SDPA's top-left causal mask is right), "full" (every row sees every
    key), "masked" and "masked-per-head" (an explicit mask, where rows start at different keys: varlen, windows,
    ACP). A chunk whose rows see no key at all has no call: the kernel is never given an empty key range.
    """
    if c_q.shape[1] == 0:
        return []
    c = c_q.detach().to(torch.float64)
    chunks = _row_chunks(c, rows)
    per_head = bool((row_start != row_start[:, :1]).any())  # ACP: every head has its own row starts
    lims = torch.stack([torch.stack([row_start[:, :, a:b].min(), row_start[:, :, a:b].max()]) for a, b in chunks])
    plan = []
    for (a, b), (lo, hi) in zip(chunks, lims.tolist()):
        p0, ke = q_offset + a, min(q_offset + b, tk)  # the first row's key position; the end of its visible keys
        if lo >= ke:
            calls = []
        elif lo == hi == p0:
            calls = [(lo, ke, "causal")]
        elif lo == hi and ke <= p0 + 1:
            calls = [(lo, ke, "full")]
        elif lo == hi < p0:  # the keys before the chunk in full, then its own block: no mask to build
            calls = [(lo, p0, "full"), (p0, ke, "causal")]
        else:
            calls = [(lo, ke, "masked-per-head" if per_head else "masked")]
        c_ref = (c[:, a:b].amax(1) + c[:, a:b].amin(1)) / 2
        plan.append((a, b, c_ref, lo, ke, calls))
    return plan


def _extend(q, k, v, c_q, plan, scale, cdt):
    """q' = [scale*q, c_q - c_ref, 1], k' = [k, 1, (set per chunk)], v' = [v, 0...]: [B, T, Hq, Dp] each."""
    B, Tq, Hq, D = q.shape
    Tk, Hk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    group = Hq // Hk
    dp = max(D + 2, Dv + 1)  # the kernel needs one head dim; v keeps a spare channel for the lse gradient
    centred = [c_q[:, a:b].detach().to(torch.float64) - c_ref[:, None] for a, b, c_ref, *_ in plan]
    centred = torch.cat(centred, 1) if centred else c_q.new_zeros(B, 0, Hq)
    qp = _cat(q.to(cdt) * scale, centred[..., None].to(cdt), 1.0, D + 2)
    qp = _cat(qp, 0.0, 0.0, dp) if dp > D + 2 else qp
    # GQA: each query head gets its own copy of its k/v head, as k' carries that query head's gates.
    kp = _cat(k.to(cdt)[:, :, :, None].expand(B, Tk, Hk, group, D), 1.0, 0.0, dp).view(B, Tk, Hq, dp)
    vp = _cat(v.to(cdt)[:, :, :, None].expand(B, Tk, Hk, group, Dv), 0.0, 0.0, dp).view(B, Tk, Hq, dp)
    return qp, kp, vp


def _centre_keys(kp, c_k, c_ref, D, ks, ke) -> None:
    """Write k's gate channel -(c_k - c_ref) for this chunk's keys (in place: chunks run one after another)."""
    kp[:, ks:ke, :, D + 1] = c_ref[:, None] - c_k[:, ks:ke].detach().to(torch.float64)


def _mask(kind, row_start, a, b, ks, ke, q_offset, dtype):
    """(additive attn_mask [B, 1 or Hq, rows, keys], rows that see no key [B, Hq, rows]) of a masked call."""
    if not kind.startswith("masked"):
        return None, None
    rs = row_start[:, :, a:b, None] if kind == "masked-per-head" else row_start[:, :1, a:b, None]
    keys = torch.arange(ks, ke, device=rs.device)
    qpos = torch.arange(q_offset + a, q_offset + b, device=rs.device)[:, None]
    mask = torch.where((keys >= rs) & (keys <= qpos), 0.0, -math.inf).to(dtype)
    # Row i sees keys [max(start_i, ks), min(pos_i, ke - 1)]: none when that range is empty.
    empty = torch.clamp(row_start[:, :, a:b], min=ks) > qpos[:, 0].clamp(max=ke - 1)
    return mask, empty


def _probs(q, k, c_q, c_k, row_start, lse, scale, q_offset) -> torch.Tensor:
    """The probabilities [B, Hq, Tq, Tk] fp32 the core's lse normalises, query chunk by chunk (inspection only)."""
    B, Tq, Hq, _ = q.shape
    Tk = k.shape[1]
    cdt = torch.promote_types(q.dtype, torch.float32)
    kh = k.detach().to(cdt).repeat_interleave(Hq // k.shape[2], dim=2)
    keys = torch.arange(Tk, device=q.device)
    probs = torch.zeros(B, Hq, Tq, Tk, dtype=torch.float32, device=q.device)
    for a in range(0, Tq, _CHUNK):
        b = min(Tq, a + _CHUNK)
        s = scale * torch.einsum("bihd,bjhd->bhij", q[:, a:b].detach().to(cdt), kh)
        s = s + (c_q[:, a:b].detach().transpose(1, 2)[..., None] - c_k.detach().transpose(1, 2)[:, :, None]).to(cdt)
        pos = q_offset + torch.arange(a, b, device=q.device)[:, None]
        allowed = (keys >= row_start[:, :, a:b, None]) & (keys <= pos)
        probs[:, :, a:b] = torch.exp(s - lse[:, :, a:b, None].to(cdt)).masked_fill(~allowed, 0.0)
    return probs


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
    row_start = row_starts(c_q, c_k, q_offset, cu_seqlens, threshold, window)
    o, lse = _SdpaAttention.apply(q, k, v, c_q, c_k, row_start, float(scale), q_offset)
    if return_probs:
        return o, lse, _probs(q, k, c_q, c_k, row_start, lse, float(scale), q_offset)
    return o, lse

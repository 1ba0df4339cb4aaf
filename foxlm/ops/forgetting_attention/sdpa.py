"""The PyTorch path of Forgetting Attention, from gate cumsums: the op on the CPU, and the engine of attention from a
KV cache and of context parallelism on any device.

The work runs in SDPA's fused CPU kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward),
with the gate as two extra q/k channels where a backward follows (_SdpaAttention) and as a key-bias mask where none
does (_bias_attention). Queries go in chunks, each against only the keys it can see, with c re-centred per chunk
(_plan); memory is O(T) (the kernel is a flash kernel), never T x T. Causality, varlen, sliding windows and ACP share
one mechanism: every query row i sees the keys [row_start_i, q_offset + i], where row_start is the start of its
sequence, moved right to q_offset + i - window + 1 and past the keys ACP prunes (a pruned key range is not computed
at all); keys whose weight underflows fp32 for every row of a chunk are not computed either. Off the CPU the same
chunks go through a plain-matmul softmax with the kernel's contract.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from ..autograd import first_order_only
from ..checks import check_qkv
from .denormals import flush_denormals
from .gate import segment_ids

# Rows per query chunk at most (the fused kernel's memory does not grow with them: chunks exist to re-centre c). A
# knob for tests: lowered, small inputs cross chunk boundaries (and rows of a chunk that see no key).
CHUNK_ROWS = 1 << 16
# The largest gate span max(c) - min(c) within a chunk: a bias re-centred to within +-32 loses at most 2e-6 to fp32.
_C_SPAN = 64.0
# Off the CPU (the caches and context parallelism on a GPU) the kernel is _math_attention: at most this many
# elements in one call's [B, H, rows, keys] score matrix; and at most this many in a masked call's explicit mask.
_MATH_ELEMENTS = 1 << 24
_MASK_ELEMENTS = 1 << 24
# A key whose logit lies this far below its row's (plus what the dot products can add) has a probability of at most
# e^-110: zero in fp32, whose smallest denormal is e^-103.3 (the margin covers c's own rounding).
_UNDERFLOW = 110.0
_SKIP_MIN_KEYS = 1024  # keys before a chunk from which the skip is looked for
# The forward flushes denormals (flush_denormals) only from this many logits on: the flush has a fixed cost and the
# forward kernel meets few denormals, so below this the flush costs more than it saves. The backward always flushes.
_FLUSH_MIN_LOGITS = 1 << 24
# The fused kernel's query blocks: 256 rows for calls of at least 768 rows (64 or 32 below): _cuts keeps chunks
# at least _KERNEL_ROWS long where it can.
_Q_BLOCK, _KERNEL_ROWS = 256, 768


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
    """Forgetting attention inside SDPA's fused CPU kernel (off the CPU, _math_attention), query chunk by chunk with
    c re-centred on each chunk's c_ref, so that the logits of the keys that carry mass stay small in fp32.

    Where a backward follows, the gate goes in as channels: q' = [scale*q, c_q - c_ref, 1] and
    k' = [k, 1, c_ref - c_k] (v' = [v, 0, 0]), so the kernel's dot product at scale 1 is the gated logit. The q'
    channel keeps the logits of the keys that carry mass small inside the kernel's fp32 sums (a key bias alone loses
    precision on dv and the gate gradient). The backward reuses the forward's k' and v' (saved)
    and rebuilds q' per chunk the same way, so its probabilities agree with the forward's lse to the last bit; the
    k' channel's gradient is the column sums of dS, the gate's gradient. Without a backward, _bias_attention gives
    the gate as a key bias.
    """

    @staticmethod
    def forward(ctx, q, k, v, c_q, c_k, row_start, scale, q_offset):
        ctx.set_materialize_grads(False)
        chunks, kp, vp, o, lse = _channel_attention(q, k, v, c_q, c_k, row_start, scale, q_offset)
        # q' is built per chunk (forward and backward alike, so bit for bit): saving it would add a copy of q to
        # the backward's peak memory. GQA: k' and v' repeat k and v per query head, rebuilt rather than saved.
        gqa = q.shape[2] != k.shape[2]
        ctx.save_for_backward(q, k if gqa else kp, v if gqa else vp, o, lse, c_q, c_k, row_start)
        ctx.plan, ctx.gqa, ctx.scale, ctx.q_offset = chunks, gqa, scale, q_offset
        ctx.kv_shape = k.shape[2], v.shape[-1]
        # Contiguous, as flash_attn's o (a port may .view it): o' is wider than Dv, so this copies where q is fp32.
        return o[..., :v.shape[-1]].to(q.dtype).contiguous(), lse  # in q's dtype promoted to fp32

    @staticmethod
    @first_order_only("forgetting_attention")  # the kernel's backward has none: differentiating it raises
    def backward(ctx, do, dlse):
        q, kp, vp, o, lse, c_q, c_k, row_start = ctx.saved_tensors
        if ctx.gqa:
            kp, vp = _kv_channels(kp, vp, q.shape[2], o.shape[-1], o.dtype)
        grads = _channel_grads(do, dlse, q, kp, vp, o, lse, c_q, c_k, row_start, ctx.q_offset, ctx.plan, ctx.scale,
                               *ctx.kv_shape, ctx.gqa)
        return *grads, None, None, None


def _channel_attention(q, k, v, c_q, c_k, row_start, scale, q_offset):
    """_SdpaAttention's forward: (its chunks, k', v', o' [B, Tq, Hq, Dp], lse [B, Hq, Tq]), k' holding the last
    chunk's bias channel, o' and lse in q's dtype promoted to fp32."""
    plan = _plan(c_q, c_k, row_start, q_offset, _rows(q, k), False, functools.partial(_norms, q, k, scale))
    cdt = torch.promote_types(q.dtype, torch.float32)
    with flush_denormals(_logits(plan, q.shape[0], q.shape[2]) >= _FLUSH_MIN_LOGITS):
        kp, vp = _kv_channels(k, v, q.shape[2], max(q.shape[-1], v.shape[-1]) + 2, cdt)
        o, lse = _channel_forward(q, kp, vp, c_q, c_k, row_start, q_offset, plan[0][1], scale)
    return plan[0][1], kp, vp, o, lse


def _channel_grads(do, dlse, q, kp, vp, o, lse, c_q, c_k, row_start, q_offset, chunks, scale, hk, v_dim,
                   rebuilt):
    """_SdpaAttention's backward from _channel_attention's results (``rebuilt``: k' and v' are not the forward's):
    the gradients of q, k, v (in q's dtype, summed over a GQA group's query heads), c_q and c_k (in theirs).
    do: [B, Tq, Hq, Dv] or None, dlse: [B, Hq, Tq] or None."""
    B, Tq, Hq, D = q.shape
    with flush_denormals():
        dq, dkp, dvp = _channel_backward(do, dlse, q, kp, vp, o, lse, c_q, c_k, row_start, q_offset, chunks, scale,
                                         v_dim, rebuilt)
    dk, dv, dc_k = dkp[..., :D], dvp[..., :v_dim], -dkp[..., -1]
    if Hq != hk:
        dk, dv = (g.unflatten(2, (hk, Hq // hk)).sum(3) for g in (dk, dv))
    # Row sums of dS are dlse exactly (sum_j p_ij = 1).
    if dlse is None:
        dc_q = torch.zeros(B, Tq, Hq, dtype=c_q.dtype, device=c_q.device)
    else:
        dc_q = dlse.transpose(1, 2).masked_fill(lse.transpose(1, 2) == -math.inf, 0.0).to(c_q.dtype)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), dc_q, dc_k.to(c_k.dtype)


def sdpa_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """(q, scale) to hand SDPA: a scale <= 0 folded into q. SDPA's fused CPU kernel applies its causal mask before
    the scale, so -inf * scale would be NaN (0) or +inf (negative)."""
    return (q * scale, 1.0) if scale <= 0 else (q, scale)


def _bias_attention(q, k, v, c_q, c_k, row_start, scale, q_offset) -> tuple[torch.Tensor, torch.Tensor]:
    """_SdpaAttention's forward where no backward follows (eval, generation, prefill): (o [B, Tq, Hq, Dv],
    lse [B, Hq, Tq]), both in q's dtype promoted to fp32.

    Softmax ignores a row's own c_q, so q, k and v go in as they are (no copies, head dim D instead of D + 2), with
    the bias c_ref - c_k as a broadcast [B, G, 1, keys] attn_mask, and lse gets c_q - c_ref back. Runs of heads may
    get their own chunks (_head_groups), so one fast-forgetting head does not cut the others'.
    """
    cdt = torch.promote_types(q.dtype, torch.float32)
    # a scale folded into q is applied in the compute dtype: rounded to a bf16 or fp16 q's, it cost ~2^-9 relative
    q, scale = sdpa_scale(q.to(cdt) if scale <= 0 else q, scale)
    plan = _plan(c_q, c_k, row_start, q_offset, _rows(q, k), True, functools.partial(_norms, q, k, scale))
    with flush_denormals(_logits(plan, q.shape[0], q.shape[2]) >= _FLUSH_MIN_LOGITS):
        return _mask_forward(q, k, v, c_q, c_k, row_start, scale, q_offset, plan, cdt)


def _q_chunk(q: torch.Tensor, cq: torch.Tensor, c_ref: torch.Tensor, a: int, b: int, scale: float, dp: int,
             dtype: torch.dtype) -> torch.Tensor:
    """The rows [a, b) of q' = [scale * q, 0..., c_q - c_ref, 1]: [B, b - a, Hq, dp] in dtype (cq: [B, Tq, Hq] fp64,
    c_ref: [B, Hq] fp64)."""
    D = q.shape[-1]
    qc = torch.empty(q.shape[0], b - a, q.shape[2], dp, dtype=dtype, device=q.device)
    # scaled in dtype: a bf16 or fp16 q times the scale, rounded back to q's dtype, cost lse and o ~2^-9 relative
    qc[..., :D] = q[:, a:b]
    qc[..., :D].mul_(scale)
    qc[..., D:-2] = 0.0
    qc[..., -2] = cq[:, a:b] - c_ref[:, None]
    qc[..., -1] = 1.0
    return qc


def _kv_channels(k: torch.Tensor, v: torch.Tensor, hq: int, dp: int, dtype: torch.dtype):
    """k' = [k, 1..., 1, c_ref - c_k] and v' = [v, 0...]: [B, Tk, Hq, dp] in dtype (GQA: each query head's k and
    v head); k''s padding is 1 (q''s is 0), and its c channel is written per chunk (_set_bias)."""
    group = hq // k.shape[2]
    k, v = (t if group == 1 else t.repeat_interleave(group, dim=2) for t in (k, v))
    return F.pad(k.to(dtype), (0, dp - k.shape[-1]), value=1.0), F.pad(v.to(dtype), (0, dp - v.shape[-1]))


def _set_bias(kp: torch.Tensor, ck: torch.Tensor, c_ref: torch.Tensor, ks: int, ke: int) -> None:
    """Writes k''s bias channel c_ref - c_k for keys [ks, ke) (in place: chunks run one after another, the forward's
    and the backward's alike, so both see the same bits). ck: [B, Tk, Hq] fp64, c_ref: [B, Hq] fp64."""
    kp[:, ks:ke, :, -1] = c_ref[:, None] - ck[:, ks:ke]


def _lerp(o1: torch.Tensor, o2: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """o1 + weight (o2 - o1) in o1's dtype. CUDA's lerp takes only a weight of o1's dtype; a wider weight (fp32 from
    the lse of a bf16 call, or of SDPA under autocast) is applied in its own dtype, then rounded once."""
    if weight.dtype == o1.dtype:
        return torch.lerp(o1, o2, weight, out=out)
    merged = torch.lerp(o1.to(weight.dtype), o2.to(weight.dtype), weight)
    return merged.to(o1.dtype) if out is None else out.copy_(merged)


def _attend(kernel, qc, kc, vc, calls, row_start, a, b, q_offset, bias, bias_start, scale, dv, out=None):
    """One query chunk against its calls' keys: (o [B, rows, G, dv], lse [B, G, rows]) of the kernel, merged over
    the calls through their lse (-inf where a row sees no key), and written into ``out`` (views of the results) where
    given; None where the chunk has no call."""
    outs = []
    for s, e, kind in calls:
        mask, empty = _mask(kind, row_start, a, b, s, e, q_offset, bias, bias_start, qc.dtype)
        oc, lc = kernel(_heads(qc), _heads(kc[:, s:e]), _heads(vc[:, s:e]), 0.0, kind == "causal", attn_mask=mask,
                        scale=scale)
        # The kernel gives a row that sees no key o = 0 and lse 0, not -inf.
        outs.append((oc.transpose(1, 2)[..., :dv], lc if empty is None else lc.masked_fill(empty, -math.inf)))
    if len(outs) < 2:
        if out is None or not outs:
            return outs[0] if outs else None
        out[0].copy_(outs[0][0])
        out[1].copy_(outs[0][1])
        return out
    # The keys before the chunk and its causal block: every row sees both (finite lse).
    (o1, l1), (o2, l2) = outs
    weight = torch.sigmoid(l2 - l1).transpose(1, 2)[..., None]
    if out is None:
        return _lerp(o1, o2, weight), torch.logaddexp(l1, l2)
    _lerp(o1, o2, weight, out=out[0])
    torch.logaddexp(l1, l2, out=out[1])
    return out


def _channel_forward(q, kp, vp, c_q, c_k, row_start, q_offset, chunks, scale):
    """(o' [B, Tq, Hq, Dp], lse [B, Hq, Tq]) over every chunk (all heads share them) with q', k' and v'."""
    B, Tq, Hq, _ = q.shape
    dp, dtype = kp.shape[-1], kp.dtype
    kernel = _kernel(q.device)[0]
    ck, cq = _f64(c_k), _f64(c_q)
    o = lse = None
    if len(chunks) != 1:  # the chunks cover every row, each written once
        o = torch.empty(B, Tq, Hq, dp, dtype=dtype, device=q.device)
        lse = torch.empty(B, Hq, Tq, dtype=dtype, device=q.device)
    for a, b, c_ref, ks, ke, calls in chunks:
        _set_bias(kp, ck, c_ref, ks, ke)
        qc = _q_chunk(q, cq, c_ref, a, b, scale, dp, dtype)
        res = _attend(kernel, qc, kp, vp, calls, row_start, a, b, q_offset, None, ks, 1.0, dp,
                      None if o is None else (o[:, a:b], lse[:, :, a:b]))
        if o is None and res is not None:  # one chunk: the kernel's outputs are the results
            return res
        if res is None:  # its rows see no key: o = 0, lse = -inf
            if o is None:
                return (torch.zeros(B, Tq, Hq, dp, dtype=dtype, device=q.device),
                        torch.full((B, Hq, Tq), -math.inf, dtype=dtype, device=q.device))
            o[:, a:b], lse[:, :, a:b] = 0.0, -math.inf
    return o, lse


def _channel_backward(do, dlse, q, kp, vp, o, lse, c_q, c_k, row_start, q_offset, chunks, scale, Dv, rebuilt):
    """(dq [B, Tq, Hq, D], dk' and dv' [B, Tk, Hq, Dp]) from the kernel's backward over every chunk of
    _channel_forward, from its o' and lse (do: [B, Tq, Hq, Dv] or None, dlse: [B, Hq, Tq] or None); ``rebuilt``: k'
    is not the forward's."""
    B, Tq, Hq, D = q.shape
    Tk, dp, dtype = kp.shape[1], kp.shape[-1], kp.dtype
    kernel = _kernel(q.device)[1]
    ck, cq = _f64(c_k), _f64(c_q)
    # Where k' is the forward's (saved), its c channel is scratch, rewritten before each chunk's calls: the writes go
    # through .data and leave autograd's version counter (a second backward would otherwise refuse k'), and one
    # chunk needs no write (the forward's is still there).
    scratch = kp if rebuilt else kp.data if len(chunks) > 1 else None
    dq = None if len(chunks) == 1 else q.new_empty(B, Tq, Hq, D, dtype=dtype)
    dk = dv = None
    done = 0  # dk' and dv' hold keys [0, done): written, or zero where no row sees them
    for a, b, c_ref, ks, ke, calls in chunks:
        if scratch is not None:
            _set_bias(scratch, ck, c_ref, ks, ke)
        if not calls:  # its rows see no key: no gradient
            if dq is None:
                dq = q.new_zeros(B, Tq, Hq, D, dtype=dtype)
            else:
                dq[:, a:b] = 0.0
            continue
        qc = _q_chunk(q, cq, c_ref, a, b, scale, dp, dtype)
        # The kernel's backward takes delta = rowsum(dO * O) from its inputs. dO' = [dO, 1...] meets v''s zero
        # padding (dP is unchanged) and o''s padding, which is 0 (v''s) but for the last channel: -dlse there (on a
        # copy: the user's output is a view of o') turns delta into rowsum(dO * O) - dlse, the lse gradient.
        doc = F.pad(o.new_zeros(()).expand(B, b - a, Hq, Dv) if do is None else do[:, a:b].to(dtype), (0, dp - Dv),
                    value=1.0)
        oc = o[:, a:b]
        if dlse is not None:
            oc = oc.clone()
            oc[..., -1] = -dlse[:, :, a:b].transpose(1, 2)
        lc = lse[:, :, a:b]
        if row_start is not None:  # a row may see no key: P = 0 there, not NaN
            lc = lc.masked_fill(lc == -math.inf, math.inf)
        gq_sum = None
        for s, e, kind in calls:
            mask, _ = _mask(kind, row_start, a, b, s, e, q_offset, None, ks, dtype)
            gq, gk, gv = (g.transpose(1, 2) for g in kernel(
                _heads(doc), _heads(qc), _heads(kp[:, s:e]), _heads(vp[:, s:e]), _heads(oc),
                lc, 0.0, kind == "causal", attn_mask=mask, scale=1.0))
            gq_sum = gq if gq_sum is None else gq_sum.add_(gq)
            if (s, e) == (0, Tk) and dk is None:  # the only call that sees every key: its buffers are the result
                dk, dv, done = gk, gv, Tk
                continue
            if dk is None:
                dk, dv = torch.empty_like(kp), torch.empty_like(vp)
            mid = min(max(s, done), e)  # keys [s, mid) were written before: add; [mid, e) are new: copy
            for buf, g in ((dk, gk), (dv, gv)):
                if s > done:
                    buf[:, done:s] = 0.0
                if mid > s:
                    buf[:, s:mid] += g[:, :mid - s]
                if e > mid:
                    buf[:, mid:e] = g[:, mid - s:]
            done = max(done, e)
        if dq is None:  # one chunk
            dq = gq_sum[..., :D].mul_(scale)
        else:
            torch.mul(gq_sum[..., :D], scale, out=dq[:, a:b])
    if dk is None:
        dk, dv = torch.zeros_like(kp), torch.zeros_like(vp)
    elif done < Tk:
        dk[:, done:], dv[:, done:] = 0.0, 0.0
    return dq, dk, dv


def _mask_forward(q, k, v, c_q, c_k, row_start, scale, q_offset, plan, cdt):
    """(o [B, Tq, Hq, Dv], lse [B, Hq, Tq]) with the key bias as a mask, per head group and chunk of ``plan``."""
    B, Tq, Hq, D = q.shape
    Dv = v.shape[-1]
    kernel = _kernel(q.device)[0]
    ckt, cqt = (_f64(c).transpose(1, 2).contiguous() for c in (c_k, c_q))  # [B, Hq, T]
    if len(plan) == 1 and _first_and_rest(plan[0][1], q_offset, k.shape[1]):
        qg, kg, vg = (_group(t, None, Hq, cdt, max(D, Dv)) for t in (q, k, v))
        return _two_chunks(kernel, qg, kg, vg, cqt, ckt, plan[0][1], scale, Dv)
    o = lse = None
    if len(plan) > 1 or len(plan[0][1]) != 1:  # the chunks of each head group cover every row, each written once
        o = torch.empty(B, Tq, Hq, Dv, dtype=cdt, device=q.device)
        lse = torch.empty(B, Hq, Tq, dtype=cdt, device=q.device)
    for heads, chunks in plan:
        qg, kg, vg = (_group(t, heads, Hq, cdt, max(D, Dv)) for t in (q, k, v))
        ckg, cqg = _pick(ckt, heads, 1), _pick(cqt, heads, 1)
        rsg = _pick(row_start, heads, 1)
        for a, b, c_ref, ks, ke, calls in chunks:
            # [B, G, 1, keys], contiguous: the kernel copies a mask with other strides to full size
            bias = (c_ref[:, :, None] - ckg[:, :, ks:ke]).to(cdt)[:, :, None]
            out = None if o is None else (_pick(o, heads)[:, a:b], _pick(lse, heads, 1)[:, :, a:b])
            res = _attend(kernel, qg[:, a:b], kg, vg, calls, rsg, a, b, q_offset, bias, ks, scale, Dv, out)
            shift = (cqg[:, :, a:b] - c_ref[:, :, None]).to(cdt)  # softmax left c_q - c_ref out of lse
            if o is None:  # one chunk of every head: the kernel's outputs are the results
                if res is None:
                    return q.new_zeros(B, Tq, Hq, Dv, dtype=cdt), q.new_full((B, Hq, Tq), -math.inf, dtype=cdt)
                return res[0], res[1] + shift
            if res is None:  # its rows see no key: o = 0, lse = -inf
                out[0][:], out[1][:] = 0.0, -math.inf
            else:
                out[1].add_(shift)
    return o, lse


def _first_and_rest(chunks: list, q_offset: int, tk: int) -> bool:
    """Whether ``chunks`` are two that see every key before them, the queries being the keys (plain causal)."""
    if len(chunks) != 2 or q_offset != 0:
        return False
    (a1, e, _, ks1, ke1, calls1), (a2, t, _, ks2, ke2, calls2) = chunks
    return ((a1, ks1, ke1, a2, ks2, ke2, t) == (0, 0, e, e, 0, tk, tk) and calls1 == [(0, e, "causal")]
            and calls2 == [(0, e, "full"), (e, tk, "causal")])


def _two_chunks(kernel, qg, kg, vg, cqt, ckt, chunks, scale, dv):
    """_mask_forward for two chunks that see every key before them (_first_and_rest), in two kernel calls and no
    copy: all rows against the first chunk's keys (top-left causal is the first chunk's own block, and every later
    row sees all of those keys), then the second chunk's own block, merged into the first call's output. Each call's
    key bias is re-centred on its own chunk, so it stays within +-_C_SPAN / 2; the merge adds the two references'
    difference in fp64. qg, kg, vg: [B, T, H, Dp]; cqt, ckt: [B, H, T] fp64. Returns (o [B, T, H, dv], lse)."""
    (_, e, ref1, _, _, _), (_, _, ref2, _, _, _) = chunks
    cdt = qg.dtype
    bias1, bias2 = ((ref[:, :, None] - keys).to(cdt)[:, :, None] for ref, keys in ((ref1, ckt[:, :, :e]),
                                                                                   (ref2, ckt[:, :, e:])))
    o, l1 = kernel(_heads(qg), _heads(kg[:, :e]), _heads(vg[:, :e]), 0.0, True, attn_mask=bias1, scale=scale)
    o2, l2 = kernel(_heads(qg[:, e:]), _heads(kg[:, e:]), _heads(vg[:, e:]), 0.0, True, attn_mask=bias2, scale=scale)
    o = o.transpose(1, 2)
    lse = l1.double() + (cqt - ref1[:, :, None])  # the first call's share of each row's lse, [B, H, T]
    tail = lse[:, :, e:]
    second = l2.double() + (cqt[:, :, e:] - ref2[:, :, None])
    o[:, e:] = _lerp(o[:, e:], o2.transpose(1, 2), torch.sigmoid(second - tail).to(cdt).transpose(1, 2)[..., None])
    lse[:, :, e:] = torch.logaddexp(tail, second)
    return o[..., :dv], lse.to(cdt)


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
    (o [B, H, M, Dp], lse [B, H, M]); causal is top-left aligned; a row that sees no key gets o = 0, lse = 0.
    In the inputs' dtype whatever autocast says, as the fused kernel: a bf16 autocast (a GPU model's training) made
    the matmuls round the logits, which carry the gate channels, to bf16."""
    with torch.autocast(q.device.type, enabled=False):
        s = _math_logits(q, k, is_causal, attn_mask, scale)
        lse = torch.logsumexp(s, -1)
        lse = lse.masked_fill(lse == -math.inf, 0.0)
        return torch.exp(s - lse[..., None]) @ v, lse


def _math_attention_backward(do, q, k, v, o, lse, dropout_p, is_causal, *, attn_mask=None, scale):
    """The gradients (dq, dk, dv) of _math_attention, from its o and lse (+inf for a row that sees no key); in the
    inputs' dtype whatever autocast says."""
    with torch.autocast(q.device.type, enabled=False):
        p = torch.exp(_math_logits(q, k, is_causal, attn_mask, scale) - lse[..., None])
        ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
        return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do


def _math_logits(q, k, is_causal, attn_mask, scale):
    s = scale * (q @ k.transpose(-1, -2))
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return s if attn_mask is None else s + attn_mask


def _heads(t: torch.Tensor) -> torch.Tensor:
    """[B, T, H, Dp] buffer -> the kernel's [B, H, T, Dp] view."""
    return t.transpose(1, 2)


def _rows(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query rows per chunk: CHUNK_ROWS for the fused kernel; off the CPU, bounded by _math_attention's score matrix."""
    if _fused(q.device):
        return CHUNK_ROWS
    return min(CHUNK_ROWS, max(16, _MATH_ELEMENTS // max(1, q.shape[0] * q.shape[2] * k.shape[1])))


def _group(t: torch.Tensor, heads: tuple[int, int] | None, hq: int, dtype: torch.dtype, dp: int) -> torch.Tensor:
    """t: [B, T, Ht, Dt] -> [B, T, G, dp] in dtype for the query heads [h0, h1) (None: all Hq; GQA: each query
    head's k/v head), zero-padded to dp (the kernel takes one head dim); a view of t where nothing changes."""
    h0, h1 = (0, hq) if heads is None else heads
    group = hq // t.shape[2]
    if group > 1:
        t = t[:, :, h0 // group:(h1 - 1) // group + 1].repeat_interleave(group, dim=2)
        h0, h1 = h0 % group, h0 % group + h1 - h0
    if (h0, h1) != (0, t.shape[2]):
        t = t[:, :, h0:h1]
    t = t if t.dtype == dtype else t.to(dtype)
    if t.shape[-1] != dp:
        return F.pad(t, (0, dp - t.shape[-1]))
    # The fused kernel reads the head dim with stride 1, whatever the view's stride (a strided one reads other values)
    return t if t.stride(-1) == 1 else t.contiguous()


def _pick(c: torch.Tensor, heads: tuple[int, int] | None, dim: int = 2) -> torch.Tensor:
    """c's query heads [h0, h1) along ``dim`` (None: all), a view; None for c None."""
    return c if heads is None or c is None else c.narrow(dim, heads[0], heads[1] - heads[0])


def _head_groups(c: np.ndarray, rows: int, by_head: bool) -> list[tuple[tuple[int, int], list[tuple[int, int]]]]:
    """[((h0, h1), row ranges)]: runs of heads whose gates need the same query chunks, and those chunks [a, b), for
    the gate cumsum c: [B, Tq, H] fp64 (on the host: the plan is host logic, and numpy's small reductions cost a
    fraction of a tensor op's dispatch).

    Chunks have at most ``rows`` rows, are cut where c jumps by more than _C_SPAN from one row to the next (a
    sequence restart, or a gate below e^-64), and are split evenly where one head's gates span more than _C_SPAN
    (strong forgetting), down to 16 rows, so that the re-centred logits stay small (see _cuts for where). ``by_head``:
    one fast-forgetting head does not cut the others' chunks (a group is a run of adjacent heads, so that it is a
    view of q, k and v), where that at least halves the chunks times heads (a head's own calls run less efficiently
    than a share of all heads'); else, and always without ``by_head``, every head gets the shortest chunks any
    needs.
    """
    Tq = c.shape[1]
    jumps = (np.nonzero(np.abs(np.diff(c, axis=1)).max(axis=(0, 2), initial=0.0) > _C_SPAN)[0] + 1).tolist()
    bounds = sorted(set(range(0, Tq, rows)) | set(jumps) | {Tq})
    pieces = list(zip(bounds, bounds[1:]))
    hi, lo = _extremes(c, bounds[:-1])
    spans = (hi - lo).max(0)
    # [pieces][H] chunks each head needs (NaN gates, unchecked, just pass through), in Python: a few small numbers
    splits = [[min(max(1, math.ceil(x / _C_SPAN)) if math.isfinite(x) else 1, max(1, (b - a) // 16)) for x in row]
              for (a, b), row in zip(pieces, spans.tolist())]
    heads = c.shape[2]
    # Runs of heads pay for their smaller kernel calls: worth it only where they save most of the merged chunks.
    if not by_head or sum(map(max, splits)) * heads < 2 * sum(map(sum, splits)):
        splits = [[max(row)] * heads for row in splits]
    runs: list[tuple[list[int], int, int]] = []  # (splits per piece, h0, h1)
    for h in range(heads):
        counts = [row[h] for row in splits]
        if runs and runs[-1][0] == counts:
            runs[-1] = (counts, runs[-1][1], h + 1)
        else:
            runs.append((counts, h, h + 1))
    groups = []
    for counts, h0, h1 in runs:
        ranges = []
        for (a, b), n in zip(pieces, counts):
            edges = _cuts(c[:, :, h0:h1], a, b, n)
            ranges += list(zip(edges, edges[1:]))
        groups.append(((h0, h1), ranges))
    return groups


def _cuts(c: np.ndarray, a: int, b: int, n: int) -> list[int]:
    """The edges of the chunks of rows [a, b), which need n chunks for c's span (c: [B, Tq, G]), each spanning at most
    _C_SPAN (down to chunks of 16 to 31 rows): n even chunks (or one or two more, where the gates' rate is uneven)
    where each has at least _KERNEL_ROWS rows (the kernel's larger query blocks); else the longest runs of
    _Q_BLOCK-row blocks whose span stays within _C_SPAN; else (a single block spans more) n even chunks, each halved
    until it holds the span.
    """
    if n == 1:
        return [a, b]
    for m in range(n, n + 3):
        if (b - a) // m < _KERNEL_ROWS:
            break
        even = [a + (b - a) * i // m for i in range(m + 1)]
        if (_spans(c, even) <= _C_SPAN).all():
            return even
    starts = list(range(a, b, _Q_BLOCK))
    hi, lo = _extremes(c[:, :b], starts)
    hi, lo = hi.max(0), lo.min(0)  # [blocks, G]
    if ((hi - lo) <= _C_SPAN).all():  # (NaN gates, unchecked, go the even way)
        hi, lo = hi.tolist(), lo.tolist()
        edges, top, bottom = [a], hi[0], lo[0]
        for i in range(1, len(starts)):
            up, down = list(map(max, top, hi[i])), list(map(min, bottom, lo[i]))
            if max(map(float.__sub__, up, down)) > _C_SPAN:
                edges.append(starts[i])
                up, down = hi[i], lo[i]
            top, bottom = up, down
        return edges + [b]
    even = [a + (b - a) * i // n for i in range(n + 1)]
    edges = [a]
    todo = list(zip(even[1:], even[:-1]))[::-1]  # (end, start), the next chunk last
    while todo:
        e, s = todo.pop()
        if e - s >= 32 and _spans(c, [s, e])[0] > _C_SPAN:
            todo += [(e, (s + e) // 2), ((s + e) // 2, s)]
            continue
        edges.append(e)
    return edges


def _spans(c: np.ndarray, edges: list[int]) -> np.ndarray:
    """max(c) - min(c) over each of the row ranges between ``edges`` (c: [B, Tq, G]), the largest over batch rows
    and heads: [ranges]."""
    hi, lo = _extremes(c[:, :edges[-1]], edges[:-1])
    return (hi - lo).max((0, 2))


def _extremes(c: np.ndarray, starts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(max, min) of c [B, T, G] over the row ranges from each of ``starts`` (increasing) to the next, the last to
    T: [B, ranges, G] each."""
    a = starts[0]
    rows, idx = c[:, a:], [s - a for s in starts]
    return np.maximum.reduceat(rows, idx, axis=1), np.minimum.reduceat(rows, idx, axis=1)


def _plan(c_q: torch.Tensor, c_k: torch.Tensor, row_start: torch.Tensor | None, q_offset: int, rows: int,
          by_head: bool, norms) -> list:
    """[(heads, chunks)]: query heads [h0, h1) (None: all; see _head_groups for ``by_head``) and their query chunks
    (a, b, c_ref [B, G] fp64, ks, ke, calls): the keys [ks, ke) the chunk's rows compute, and its kernel calls
    (s, e, kind). norms() gives (|scale| * |q| [B, Tq, Hq], |k| [B, Tk, Hq]) for the keys rows may skip (_first_key).

    Kinds: "causal" (the chunk's own block: SDPA's top-left causal mask is right), "full" (every row sees every
    key), "masked" and "masked-per-head" (an explicit mask, where rows start at different keys: varlen, windows,
    ACP; a chunk is split until its mask has at most _MASK_ELEMENTS). A chunk whose rows see no key at all has no
    call: the kernel is never given an empty key range.
    """
    B, Tq, H = c_q.shape
    tk = c_k.shape[1]
    if Tq == 0:
        return [(None, [])]
    c = _f64(c_q).cpu().numpy()
    ck = _f64(c_k)
    groups = _head_groups(c, rows, by_head)
    computed = None
    # ACP: every head has its own row starts
    per_head = row_start is not None and bool((row_start != row_start[:, :1]).any())
    plan = []
    for heads, ranges in groups:
        heads = None if len(groups) == 1 else heads
        cg = c if heads is None else c[:, :, heads[0]:heads[1]]
        rs, ckg = _pick(row_start, heads, 1), _pick(ck, heads)
        chunks = []
        todo = ranges[::-1]
        while todo:
            a, b = todo.pop()
            lo, hi = (0, 0) if rs is None else torch.stack([rs[:, :, a:b].min(), rs[:, :, a:b].max()]).tolist()
            p0, ke = q_offset + a, min(q_offset + b, tk)  # the first row's key position; the end of its visible keys
            skip = lo
            if min(p0, ke) - lo >= _SKIP_MIN_KEYS:  # the check costs about what a few hundred keys' logits do
                computed = norms() if computed is None else computed
                skip = _first_key(ckg, *(_pick(n, heads) for n in computed), a, b, lo, min(p0, ke), q_offset)
            lo, hi = max(lo, skip), max(hi, skip)
            if lo >= ke:
                calls = []
            elif lo == hi == p0:
                calls = [(lo, ke, "causal")]
            elif lo == hi and ke <= p0 + 1:
                calls = [(lo, ke, "full")]
            elif lo == hi < p0:  # the keys before the chunk in full, then its own block: no mask to build
                calls = [(lo, p0, "full"), (p0, ke, "causal")]
            else:
                if B * cg.shape[2] * (b - a) * (ke - lo) > _MASK_ELEMENTS and b - a > 16:
                    todo += [((a + b) // 2, b), (a, (a + b) // 2)]
                    continue
                calls = [(lo, ke, "masked-per-head" if per_head else "masked")]
            chunks.append((a, b, lo, ke, calls))
        # Each chunk's c_ref: the middle of its rows' c, [B, G] fp64 (one reduction over every chunk)
        starts = [a for a, *_ in chunks]
        refs = torch.from_numpy(sum(_extremes(cg, starts)) / 2).to(c_q.device) if chunks else None
        plan.append((heads, [(a, b, refs[:, i], lo, ke, calls) for i, (a, b, lo, ke, calls) in enumerate(chunks)]))
    return plan


def _f64(t: torch.Tensor) -> torch.Tensor:
    """t detached, in fp64 (no dispatch where it is already)."""
    t = t.detach()
    return t if t.dtype == torch.float64 else t.double()


def _logits(plan: list, batch: int, heads: int) -> int:
    """How many logits the kernel calls of ``plan`` compute (a causal block: half of its square)."""
    total = 0
    for group, chunks in plan:
        g = heads if group is None else group[1] - group[0]
        for a, b, _, _, _, calls in chunks:
            total += sum((b - a) * (e - s) // (2 if kind == "causal" else 1) for s, e, kind in calls) * batch * g
    return total


def _norms(q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(|scale| * |q| [B, Tq, Hq], |k| per query head [B, Tk, Hq]) in fp64, for _first_key: a bound on |logits|,
    for a negative scale too."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    qn = torch.linalg.vector_norm(q.detach(), dim=-1, dtype=dtype).double() * abs(scale)
    kn = torch.linalg.vector_norm(k.detach(), dim=-1, dtype=dtype).double()
    return qn, kn.repeat_interleave(q.shape[2] // k.shape[2], dim=2)


def _first_key(ck, qn, kn, a, b, lo, end, q_offset) -> int:
    """The first key in [lo, end) that a query row in [a, b) may give fp32-representable weight (else ``end``).

    A row sees its own key r_i (or the last key), so its lse is at least that logit, and key j's probability is at
    most exp(scale |q_i| (|k_j| + |k_r|) - (c_k[j] - c_k[r_i])). Keys before the first one whose c_k is within
    2 * max(scale |q|) * max|k| + _UNDERFLOW of the rows' largest c_k[r_i] (every one, in every batch row and head)
    have probabilities below e^-110: zero in fp32 (below its smallest denormal, 1.4e-45), so they are not computed,
    as ACP does with a tolerance. ck: [B, Tk, G]; qn: [B, Tq, G]; kn: [B, Tk, G]. NaN norms skip nothing.
    """
    if end <= lo:
        return lo
    refs = torch.arange(q_offset + a, q_offset + b, device=ck.device).clamp(max=ck.shape[1] - 1)
    top = ck[:, refs].amax(1) + 2 * qn[:, a:b].amax(1) * kn.amax(1) + _UNDERFLOW  # [B, G]
    keep = ck[:, lo:end] <= top[:, None]  # [B, keys, G]: the first True is the first key that may count
    first = torch.where(keep.any(1), keep.int().argmax(1), end - lo)
    return lo + int(first.min())


def _mask(kind, row_start, a, b, ks, ke, q_offset, bias, bias_start, dtype):
    """(attn_mask, rows that see no key [B, G, rows]) of a call over keys [ks, ke): the key bias [B, G, 1, keys from
    bias_start] (None where the bias is a channel), with -inf where a masked call's rows do not see a key."""
    bias = None if bias is None else bias[..., ks - bias_start:ke - bias_start]
    if not kind.startswith("masked"):
        return bias, None
    rs = row_start[:, :, a:b, None] if kind == "masked-per-head" else row_start[:, :1, a:b, None]
    keys = torch.arange(ks, ke, device=rs.device)
    qpos = torch.arange(q_offset + a, q_offset + b, device=rs.device)[:, None]
    allowed = (keys >= rs) & (keys <= qpos)
    mask = torch.where(allowed, 0.0 if bias is None else bias, -math.inf).to(dtype)
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
    rows = max(16, _MATH_ELEMENTS // max(1, B * Hq * Tk))
    for a in range(0, Tq, rows):
        b = min(Tq, a + rows)
        s = scale * torch.einsum("bihd,bjhd->bhij", q[:, a:b].detach().to(cdt), kh)
        s = s + (c_q[:, a:b].detach().transpose(1, 2)[..., None] - c_k.detach().transpose(1, 2)[:, :, None]).to(cdt)
        pos = q_offset + torch.arange(a, b, device=q.device)[:, None]
        allowed = (keys <= pos) if row_start is None else (keys >= row_start[:, :, a:b, None]) & (keys <= pos)
        probs[:, :, a:b] = torch.exp(s - lse[:, :, a:b, None].to(cdt)).masked_fill(~allowed, 0.0)
    return probs


def _validate(q, k, v, c_q, c_k, q_offset, window, threshold, cu_seqlens) -> None:
    check_qkv(q, k, v)
    B, Tq, Hq, _ = q.shape
    Tk = k.shape[1]
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


# The chunks are planned on the host (.numpy(), .tolist(), data-dependent shapes), which neither dynamo nor
# torch.export can trace. Under the compiler the op is therefore two torch.library custom ops, opaque to it, whose
# functions plan at run time: one graph (fullgraph=True, torch.export) for every caller (the layers, the caches,
# context parallelism). Eager calls skip the custom ops' dispatch (host time, as on the Triton path) and go through
# _SdpaAttention, on the same functions; the ops' backward rebuilds k' and v' and plans again, the forward's bits.
@torch.library.custom_op("foxlm::attention_from_cumsum", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c_q: torch.Tensor, c_k: torch.Tensor,
    threshold: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float, q_offset: int,
    window: int | None, channels: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse [B, Hq, Tq], row starts): o' [B, Tq, Hq, Dp] of _SdpaAttention with ``channels`` (a backward
    follows), else _bias_attention's o [B, Tq, Hq, Dv]; o and lse in q's dtype promoted to fp32; the row starts
    [B, Hq, Tq] (row_starts), or [0] where every row sees keys from 0."""
    row_start = _row_start(c_q, c_k, q_offset, cu_seqlens, threshold, window)
    if channels:
        o, lse = _channel_attention(q, k, v, c_q, c_k, row_start, scale, q_offset)[3:]
    else:
        o, lse = _bias_attention(q, k, v, c_q, c_k, row_start, scale, q_offset)
    # Contiguous, as the fake's: the kernel's outputs have strides that vary with the plan.
    rs = q.new_empty(0, dtype=torch.long) if row_start is None else row_start
    return o.contiguous(), lse.contiguous(), rs.contiguous()


@_forward_op.register_fake
def _(q, k, v, c_q, c_k, threshold, cu_seqlens, scale, q_offset, window, channels):
    B, Tq, Hq, D = q.shape
    dtype = torch.promote_types(q.dtype, torch.float32)
    width = max(D, v.shape[-1]) + 2 if channels else v.shape[-1]
    plain = cu_seqlens is None and threshold is None and window is None
    return (q.new_empty(B, Tq, Hq, width, dtype=dtype), q.new_empty(B, Hq, Tq, dtype=dtype),
            q.new_empty((0,) if plain else (B, Hq, Tq), dtype=torch.long))


@torch.library.custom_op("foxlm::attention_from_cumsum_backward", mutates_args=())
def _backward_op(
    do: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, c_q: torch.Tensor, c_k: torch.Tensor, row_start: torch.Tensor, scale: float, q_offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v, c_q and c_k from the gradients of _forward_op's o' and lse (with ``channels``)."""
    row_start = None if row_start.dim() == 1 else row_start
    chunks = _plan(c_q, c_k, row_start, q_offset, _rows(q, k), False, functools.partial(_norms, q, k, scale))[0][1]
    kp, vp = _kv_channels(k, v, q.shape[2], o.shape[-1], o.dtype)
    grads = _channel_grads(do[..., :v.shape[-1]], dlse, q, kp, vp, o, lse, c_q, c_k, row_start, q_offset, chunks,
                           scale, k.shape[2], v.shape[-1], True)
    return tuple(g.contiguous() for g in grads)


@_backward_op.register_fake
def _(do, dlse, q, k, v, o, lse, c_q, c_k, row_start, scale, q_offset):
    return tuple(t.new_empty(t.shape) for t in (q, k, v, c_q, c_k))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, c_q, c_k, _, _, scale, q_offset, _, channels = inputs
    o, lse, row_start = output
    if channels:
        ctx.save_for_backward(q, k, v, o, lse, c_q, c_k, row_start)
    ctx.scale, ctx.q_offset, ctx.channels = scale, q_offset, channels


def _backward(ctx, do, dlse, _):
    if not ctx.channels:
        raise RuntimeError("foxlm::attention_from_cumsum: channels=False has no backward (its caller needs none)")
    grads = _backward_op(do, dlse, *ctx.saved_tensors, ctx.scale, ctx.q_offset)
    return *grads, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _row_start(c_q, c_k, q_offset, cu_seqlens, threshold, window) -> torch.Tensor | None:
    """row_starts, or None where every row sees keys from 0 (the plan then needs no mask)."""
    if cu_seqlens is None and threshold is None and window is None:
        return None
    return row_starts(c_q, c_k, q_offset, cu_seqlens, threshold, window)


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
    scale = float(scale)
    o, lse, row_start = _attention(q, k, v, c_q, c_k, scale, q_offset, window, threshold, cu_seqlens)
    lse = lse.float()
    if return_probs:
        return o, lse, _probs(q, k, c_q, c_k, row_start, lse, scale, q_offset)
    return o, lse


def attention_from_cumsum_wide_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c_q: torch.Tensor, c_k: torch.Tensor, *, scale: float,
    q_offset: int | None = None, threshold: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_from_cumsum`` whose lse stays in q's dtype promoted to fp32 (fp64 for fp64 inputs), not rounded
    to fp32: context parallelism merges its blocks through their lse, and an fp32 lse cost an fp64 merge ~1e-8
    relative in o and every gradient where one process's op is exact to ~1e-15."""
    _validate(q, k, v, c_q, c_k, q_offset, None, threshold, None)
    q_offset = k.shape[1] - q.shape[1] if q_offset is None else q_offset
    return _attention(q, k, v, c_q, c_k, float(scale), q_offset, None, threshold, None)[:2]


def _attention(q, k, v, c_q, c_k, scale, q_offset, window, threshold, cu_seqlens):
    """(o in q's dtype, lse in q's dtype promoted to fp32, the row starts or None) of checked arguments."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, c_q, c_k))
    if torch.compiler.is_compiling() or q.is_meta:  # the ops' fakes give meta tensors their shapes
        o, lse, row_start = _forward_op(q, k, v, c_q, c_k, threshold, cu_seqlens, scale, q_offset, window, grad)
        o = o[..., :v.shape[-1]].to(q.dtype).contiguous()
        return o, lse, None if row_start.dim() == 1 else row_start
    row_start = _row_start(c_q, c_k, q_offset, cu_seqlens, threshold, window)
    if grad:
        o, lse = _SdpaAttention.apply(q, k, v, c_q, c_k, row_start, scale, q_offset)
    else:
        o, lse = _bias_attention(q, k, v, c_q, c_k, row_start, scale, q_offset)
        o = o.to(q.dtype).contiguous()  # o: a view where D > Dv
    return o, lse, row_start

"""Context-parallel Forgetting Attention: each rank holds a shard of the sequence; keys and values move by P2P.

The gate needs one small collective: every rank all-gathers the totals of log f over each chunk (B * Hq scalars a
chunk), from which it offsets its local fp64 cumsum, so c_i - c_j is the same as on one device. Step s of P pairs
rank r with ranks r - s (whose keys it receives) and r + s (to which it sends its own), as ring attention's
schedule does, but each chunk goes straight to the rank that needs it, so a chunk is sent only where it is used.
The next step's transfers are posted before the current step's blocks are computed. Partial outputs merge through
their log-sum-exp. The backward receives the keys again, returns each remote block's dK, dV and dc_k to the rank
that owns the keys, and turns dc into the gate gradient with a reverse cumsum whose carry is a second small scan.

ACP: with a logit bound U (all-reduced over the ranks, or given), delta = -(2U + log T) + log(tolerance). Every
rank knows every chunk's total gate, so it knows, without communicating, an upper bound on the decay between any
two chunks. A (query chunk, key chunk, KV head) whose bound is below delta for every batch row and query head of
the group carries less than ``tolerance`` of any row's mass: it is neither sent nor computed, forward or backward.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops.autograd import first_order_only
from ..ops.checks import check_qkv
from ..ops.forgetting_attention.acp import ACP, acp_tile_stats
from ..ops.forgetting_attention.gate import floor_gates, gate_cumsum, reverse_cumsum
from ..ops.forgetting_attention.sdpa import attention_from_cumsum_wide_lse
from .layout import _world, all_gather_single, check_same_on_ranks, chunks_per_rank, gather_sequence, rank_chunks


@dataclass
class Traffic:
    """Bytes and messages this rank's context-parallel attention passed to P2P sends and receives."""

    sent_bytes: int = 0
    recv_bytes: int = 0
    messages: int = 0


_RECORDERS: list[Traffic] = []


@contextmanager
def record_traffic():
    """Count the P2P traffic of ``cp_forgetting_attention`` (forward and backward) on this rank inside the block."""
    traffic = Traffic()
    _RECORDERS.append(traffic)
    try:
        yield traffic
    finally:
        _RECORDERS.remove(traffic)


def _p2p(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group, tag: int) -> list:
    """Post sends and receives of (tensor, group rank) as one batch (NCCL needs a step's pairs grouped)."""
    ops = []
    for i, (t, peer) in enumerate(sends):
        for rec in _RECORDERS:
            rec.sent_bytes += t.numel() * t.element_size()
            rec.messages += 1
        ops.append(_op(dist.isend, t, peer, group, tag + i))
    for i, (t, peer) in enumerate(recvs):
        for rec in _RECORDERS:
            rec.recv_bytes += t.numel() * t.element_size()
        ops.append(_op(dist.irecv, t, peer, group, tag + i))
    return dist.batch_isend_irecv(ops) if ops else []


def _op(fn, t: torch.Tensor, peer: int, group, tag: int) -> dist.P2POp:
    if group is None:
        return dist.P2POp(fn, t, peer=peer, tag=tag)
    return dist.P2POp(fn, t, group=group, group_peer=peer, tag=tag)


@dataclass
class CPAcpStats:
    """What ACP saves in context-parallel attention, counted over the whole group (every rank gets the same).

    flops_*: [Hq] forward FLOPs (2 * (D + Dv) per query-key pair) of the causal blocks, and of those skipped.
    bytes_*: [Hk] forward bytes of K, V and c sent between ranks with ``prune=False``, and those not sent. The
    backward receives the same keys again and returns gradients of the same size, so it saves in proportion.
    """

    flops_skipped: torch.Tensor
    flops_total: torch.Tensor
    bytes_skipped: torch.Tensor
    bytes_total: torch.Tensor

    @property
    def flops_fraction(self) -> torch.Tensor:
        """Per query head, the share of the attention FLOPs skipped."""
        return self.flops_skipped / self.flops_total

    @property
    def bytes_fraction(self) -> torch.Tensor:
        """Per KV head, the share of the bytes not sent (0 where nothing would be sent, as with P == 1)."""
        return self.bytes_skipped / self.bytes_total.clamp_min(1)


class _Plan:
    """Which (query chunk, key chunk, KV head) blocks are computed, and the gate carries; the same on every rank."""

    def __init__(self, q, k, log_fgate, group, layout, scale, acp: ACP | None):
        self.group, self.layout = group, layout
        self.rank, self.world = _world(group)
        self.nloc = chunks_per_rank(layout)
        B, Tl, Hq, _ = q.shape
        Hk = k.shape[2]
        self.L, self.Hk, self.G = Tl // self.nloc, Hk, Hq // Hk
        self.chunks = [rank_chunks(r, self.world, layout) for r in range(self.world)]
        nc = self.nloc * self.world
        log_f = floor_gates(log_fgate.detach().to(torch.float64))  # summed as gate_cumsum sums it
        sums = log_f.reshape(B, self.nloc, self.L, Hq).sum(2).transpose(0, 1)
        gathered = _all_gather(sums, group, self.world)
        totals = torch.empty(nc, B, Hq, dtype=torch.float64, device=q.device)
        for r in range(self.world):
            for a, g in enumerate(self.chunks[r]):
                totals[g] = gathered[r, a]
        # carry[g]: sum of log f over every chunk before g (fp64), so carry[g] is c just before chunk g
        self.carry = torch.cat([totals.new_zeros(1, B, Hq), totals.cumsum(0)[:-1]])
        causal = torch.ones(nc, nc, dtype=torch.bool).tril()
        self.threshold = None
        if acp is not None:
            self.threshold = _threshold(q, k, scale, acp, nc * self.L, group)
            edge = torch.cat([self.carry[1:], self.carry[-1:] + totals[-1:]])  # c at the end of each chunk
            # c_i - c_j <= c before chunk gq - c at the end of chunk gk, for any query i in gq and key j in gk
            bound = self.carry[:, None] - edge[None, :]  # [nc, nc, B, Hq]
            kept = (bound >= self.threshold).any(2).reshape(nc, nc, Hk, self.G).any(-1).cpu()
            self.need = causal[:, :, None] & (kept | torch.eye(nc, dtype=torch.bool)[:, :, None])
        else:
            self.need = causal[:, :, None].expand(nc, nc, Hk).clone()
        self.causal = causal

    def local_c(self, log_fgate: torch.Tensor) -> torch.Tensor:
        """This rank's global gate cumsum c: [B, Tl, Hq] fp64."""
        B, _, Hq = log_fgate.shape
        local = gate_cumsum(log_fgate.detach().reshape(B * self.nloc, self.L, Hq)).view(B, self.nloc, self.L, Hq)
        carry = torch.stack([self.carry[g] for g in self.chunks[self.rank]], 1)  # [B, nloc, Hq]
        return (local + carry[:, :, None]).reshape(B, -1, Hq)

    def units(self, dst: int, src: int) -> list[tuple[int, int]]:
        """src's (local chunk, KV head) units that dst computes with, in a fixed order."""
        return [(a, h) for a, gk in enumerate(self.chunks[src]) for h in range(self.Hk)
                if any(bool(self.need[gq, gk, h]) for gq in self.chunks[dst])]

    def heads(self, gq: int, gk: int) -> list[int]:
        return [h for h in range(self.Hk) if bool(self.need[gq, gk, h])]


def _all_gather(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """Every rank's x, stacked: [P, *x.shape]."""
    out = x.new_empty(world * x.shape[0], *x.shape[1:])
    all_gather_single(out, x.contiguous(), group=group)
    return out.view(world, *x.shape)


def _threshold(q, k, scale, acp: ACP, total, group) -> torch.Tensor:
    """ACP's delta [B, Hq] for the whole sequence: U from all ranks' largest norms (or the ACP's bound), N = T."""
    def reduce_max(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

    return acp.threshold(q, k, scale=scale, num_keys=total, reduce_max=reduce_max)


def _pack(k, v, c, plan: _Plan, units):
    """K and V (one tensor, last dim D + Dv) and c of the given units: [n, B, L, D + Dv] and [n, B, L, G]."""
    B = k.shape[0]
    a = torch.tensor([u[0] for u in units], dtype=torch.long, device=k.device)
    h = torch.tensor([u[1] for u in units], dtype=torch.long, device=k.device)
    k5 = k.reshape(B, plan.nloc, plan.L, plan.Hk, k.shape[-1])
    v5 = v.reshape(B, plan.nloc, plan.L, plan.Hk, v.shape[-1])
    c5 = c.reshape(B, plan.nloc, plan.L, plan.Hk, plan.G)
    return torch.cat([k5[:, a, :, h], v5[:, a, :, h]], -1).contiguous(), c5[:, a, :, h].contiguous()


def _unpack_add(dk, dv, dc, gkv, gc, plan: _Plan, units) -> None:
    """Add the gradients of units ([n, B, L, D + Dv] and [n, B, L, G]) into this rank's dk, dv, dc."""
    B, D = dk.shape[0], dk.shape[-1]
    a = torch.tensor([u[0] for u in units], dtype=torch.long, device=dk.device)
    h = torch.tensor([u[1] for u in units], dtype=torch.long, device=dk.device)
    dk.view(B, plan.nloc, plan.L, plan.Hk, D)[:, a, :, h] += gkv[..., :D].to(dk.dtype)
    dv.view(B, plan.nloc, plan.L, plan.Hk, dv.shape[-1])[:, a, :, h] += gkv[..., D:].to(dv.dtype)
    dc.view(B, plan.nloc, plan.L, plan.Hk, plan.G)[:, a, :, h] += gc.to(dc.dtype)


class _Exchange:
    """The P2P transfers of one step: this rank's units to rank + s, and rank - s's units to this rank."""

    def __init__(self, plan: _Plan, step: int, k, v, c, tag: int):
        P, r = plan.world, plan.rank
        self.src, dst = (r - step) % P, (r + step) % P
        self.units = plan.units(r, self.src)
        send_units = plan.units(dst, r)
        self.keep = list(_pack(k, v, c, plan, send_units)) if send_units else []
        self.kv = self.c = None
        if self.units:
            B, n = k.shape[0], len(self.units)
            self.kv = k.new_empty(n, B, plan.L, k.shape[-1] + v.shape[-1])
            self.c = c.new_empty(n, B, plan.L, plan.G)
        recvs = [(self.kv, self.src), (self.c, self.src)] if self.units else []
        self.handles = _p2p([(t, dst) for t in self.keep], recvs, plan.group, tag)

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
        self.handles, self.keep = [], []


def _steps(plan: _Plan, k, v, c):
    """(source rank, its units, their K|V and c) per step, this rank's own first; each step's transfers are
    posted before the previous step's blocks are computed, so they overlap."""
    local = plan.units(plan.rank, plan.rank)
    nxt = _Exchange(plan, 1, k, v, c, tag=4) if plan.world > 1 else None
    yield (plan.rank, local, *_pack(k, v, c, plan, local))  # a copy of this rank's keys: one code path for all
    for step in range(1, plan.world):
        cur = nxt
        nxt = _Exchange(plan, step + 1, k, v, c, tag=4 * (step + 1)) if step + 1 < plan.world else None
        cur.wait()
        yield cur.src, cur.units, cur.kv, cur.c


def _blocks(plan: _Plan, src: int, units):
    """(local query chunk index, q_offset, query heads, positions in units) of the blocks of src's keys."""
    index = {u: i for i, u in enumerate(units)}
    G = plan.G
    for ia, gq in enumerate(plan.chunks[plan.rank]):
        for a, gk in enumerate(plan.chunks[src]):
            if gk > gq:
                continue
            heads = plan.heads(gq, gk)
            if not heads:
                continue
            qheads = [h * G + g for h in heads for g in range(G)]
            yield ia, 0 if gk == gq else plan.L, qheads, [index[(a, h)] for h in heads]


def _select(x: torch.Tensor, dim: int, idx: list[int], total: int) -> torch.Tensor:
    return x if len(idx) == total else x.index_select(dim, torch.tensor(idx, device=x.device))


def _block_inputs(q, c, plan: _Plan, kv, cc, ia, qheads, pos, D):
    L, Hq = plan.L, plan.Hk * plan.G
    qb = _select(q[:, ia * L:(ia + 1) * L], 2, qheads, Hq)
    cqb = _select(c[:, ia * L:(ia + 1) * L], 2, qheads, Hq)
    p = torch.tensor(pos, device=kv.device)
    kvb, ckb = kv.index_select(0, p), cc.index_select(0, p)
    kb, vb = kvb[..., :D].permute(1, 2, 0, 3), kvb[..., D:].permute(1, 2, 0, 3)  # [B, L, m, D]
    ckb = ckb.permute(1, 2, 0, 3).reshape(q.shape[0], L, -1)  # [B, L, m * G], query head h * G + g
    # The block computes in fp32 at least (attention_from_cumsum's kernel does), but returns o in q's
    # dtype: bf16 inputs would round each block's o before the merge, while the block's backward takes
    # rowsum(dO * O) from its unrounded o. The merge's lse gradient (from the rounded o) then no longer cancels it,
    # and bf16's rounding lands in every dS, whose column sums make the gate gradient (1e-3 relative where one
    # process's is 1e-6). The upcasts are exact.
    cdt = torch.promote_types(q.dtype, torch.float32)
    return qb.to(cdt), kb.to(cdt), vb.to(cdt), cqb, ckb


class _CPForgettingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_fgate, plan: _Plan, scale: float):
        B, Tl, Hq, D = q.shape
        L, Dv = plan.L, v.shape[-1]
        cdt = torch.promote_types(q.dtype, torch.float32)
        c = plan.local_c(log_fgate)
        o = torch.zeros(B, Tl, Hq, Dv, dtype=cdt, device=q.device)
        lse = torch.full((B, Hq, Tl), float("-inf"), dtype=cdt, device=q.device)
        for src, units, kv, cc in _steps(plan, k, v, c):
            for ia, q_offset, qheads, pos in _blocks(plan, src, units):
                qb, kb, vb, cqb, ckb = _block_inputs(q, c, plan, kv, cc, ia, qheads, pos, D)
                thr = None if plan.threshold is None else plan.threshold[:, qheads]
                # the blocks merge through their lse, which must not be rounded to fp32 for fp64 inputs
                ob, lb = attention_from_cumsum_wide_lse(qb, kb, vb, cqb, ckb, scale=scale, q_offset=q_offset,
                                                        threshold=thr)
                _merge(o, lse, ob, lb, ia * L, L, qheads)
        ctx.save_for_backward(q, k, v, c, o, lse)
        ctx.plan, ctx.scale, ctx.gate_dtype = plan, scale, log_fgate.dtype
        return o.to(q.dtype)

    @staticmethod
    @first_order_only("cp_forgetting_attention")  # in-place sums of detached block gradients and received buffers
    def backward(ctx, do):
        q, k, v, c, o, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        B, _, _, D = q.shape
        L, P = plan.L, plan.world
        do = do.to(o.dtype)
        dq, dk, dv = (torch.zeros(t.shape, dtype=o.dtype, device=q.device) for t in (q, k, v))
        dc = torch.zeros_like(c)
        returns = []  # gradient transfers in flight: (handles, buffers, units)
        for step, (src, units, kv, cc) in enumerate(_steps(plan, k, v, c)):
            gkv = torch.zeros(kv.shape, dtype=o.dtype, device=q.device) if units else None
            gc = torch.zeros_like(cc) if units else None
            for ia, q_offset, qheads, pos in _blocks(plan, src, units):
                inputs = _block_inputs(q, c, plan, kv, cc, ia, qheads, pos, D)
                thr = None if plan.threshold is None else plan.threshold[:, qheads]
                grads = _block_backward(inputs, q_offset, thr, scale, o, lse, do, ia * L, L, qheads)
                dqb, dkb, dvb, dcqb, dckb = grads
                rows = slice(ia * L, (ia + 1) * L)
                idx = torch.tensor(qheads, device=q.device)
                dq[:, rows].index_add_(2, idx, dqb.to(dq.dtype))
                dc[:, rows].index_add_(2, idx, dcqb.to(dc.dtype))
                p = torch.tensor(pos, device=q.device)
                m = len(pos)
                gkv.index_add_(0, p, torch.cat([dkb, dvb], -1).permute(2, 0, 1, 3).to(gkv.dtype))
                gc.index_add_(0, p, dckb.reshape(B, L, m, plan.G).permute(2, 0, 1, 3).to(gc.dtype))
            if step == 0:
                if units:
                    _unpack_add(dk, dv, dc, gkv, gc, plan, units)
                continue
            tag = 4 * step + 2
            # this rank's gradients for src's keys go back to src; rank + s returns those of this rank's keys
            owner_units = plan.units((plan.rank + step) % P, plan.rank)
            bufs = None
            if owner_units:
                bufs = (torch.empty(len(owner_units), B, L, D + v.shape[-1], dtype=o.dtype, device=q.device),
                        torch.empty(len(owner_units), B, L, plan.G, dtype=c.dtype, device=q.device))
            sends = [(gkv, src), (gc, src)] if units else []
            recvs = [(t, (plan.rank + step) % P) for t in bufs] if bufs else []
            handles = _p2p(sends, recvs, plan.group, tag)
            returns.append((handles, (gkv, gc), bufs, owner_units))
            if len(returns) > 1:  # the previous step's returns have had a step's compute to arrive
                _finish_return(returns.pop(0), dk, dv, dc, plan)
        for ret in returns:
            _finish_return(ret, dk, dv, dc, plan)
        dlog_f = _reverse_cumsum(dc, plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dlog_f.to(ctx.gate_dtype), None, None


def _finish_return(ret, dk, dv, dc, plan: _Plan) -> None:
    handles, _, bufs, owner_units = ret
    for handle in handles:
        handle.wait()
    if bufs is not None:
        _unpack_add(dk, dv, dc, bufs[0], bufs[1], plan, owner_units)


def _merge(o, lse, ob, lb, start, L, qheads) -> None:
    """Merge a block's (o, lse) into the running ones of query rows [start, start + L) and heads qheads."""
    idx = torch.tensor(qheads, device=o.device)
    old_o, old_l = o[:, start:start + L].index_select(2, idx), lse[:, :, start:start + L].index_select(1, idx)
    lb = lb.to(lse.dtype)
    new_l = torch.logaddexp(old_l, lb)
    safe = new_l.masked_fill(new_l.isinf(), 0.0)  # rows that see no key yet: both weights 0
    w_old, w_new = torch.exp(old_l - safe).transpose(1, 2)[..., None], torch.exp(lb - safe).transpose(1, 2)[..., None]
    o[:, start:start + L].index_copy_(2, idx, old_o * w_old + ob.to(o.dtype) * w_new)
    lse[:, :, start:start + L].index_copy_(1, idx, new_l)


def _block_backward(inputs, q_offset, thr, scale, o, lse, do, start, L, qheads):
    """Gradients of a block's inputs, recomputing it: the merge's weights give its do and dlse."""
    idx = torch.tensor(qheads, device=o.device)
    og = o[:, start:start + L].index_select(2, idx)  # [B, L, h, Dv]
    lg = lse[:, :, start:start + L].index_select(1, idx)  # [B, h, L]
    dog = do[:, start:start + L].index_select(2, idx)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in inputs]
        ob, lb = attention_from_cumsum_wide_lse(*leaves, scale=scale, q_offset=q_offset, threshold=thr)
        w = torch.exp(lb.to(lg.dtype) - lg)  # share of the row's mass in this block: [B, h, L]
        dob = dog * w.transpose(1, 2)[..., None]
        dlb = w * (dog * (ob.to(og.dtype) - og)).sum(-1).transpose(1, 2)
        return torch.autograd.grad((ob, lb), leaves, (dob.to(ob.dtype), dlb.to(lb.dtype)))


def _reverse_cumsum(dc: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """d log f_t = sum over t' >= t of dc_t' on the whole sequence: local reverse cumsums plus a carry of totals."""
    B, _, Hq = dc.shape
    dc4 = dc.reshape(B, plan.nloc, plan.L, Hq)
    totals = dc4.sum(2).transpose(0, 1).contiguous()  # [nloc, B, Hq]
    gathered = _all_gather(totals, plan.group, plan.world)
    nc = plan.nloc * plan.world
    per_chunk = torch.empty(nc, B, Hq, dtype=dc.dtype, device=dc.device)
    for r in range(plan.world):
        for a, g in enumerate(plan.chunks[r]):
            per_chunk[g] = gathered[r, a]
    after = reverse_cumsum(per_chunk, dim=0) - per_chunk  # sum over the chunks after g
    carry = torch.stack([after[g] for g in plan.chunks[plan.rank]], 1)  # [B, nloc, Hq]
    return (reverse_cumsum(dc4, dim=2) + carry[:, :, None]).reshape(B, -1, Hq)


def _validate(q, k, v, log_fgate, layout, group, acp: ACP | None, scale: float) -> None:
    check_qkv(q, k, v, what="a 4-D shard [B, T/P, H, D]")
    B, Tl, Hq, D = q.shape
    if tuple(k.shape[:2]) != (B, Tl):
        raise ValueError(f"k, v: expected shards [B={B}, T/P={Tl}, Hk, D={D}] and [B, T/P, Hk, Dv], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if not isinstance(log_fgate, torch.Tensor) or tuple(log_fgate.shape) != (B, Tl, Hq):
        raise ValueError(f"log_fgate: expected a shard [B, T/P, Hq] = {(B, Tl, Hq)}, got "
                         f"{getattr(log_fgate, 'shape', None)}")
    if log_fgate.dtype not in (torch.float32, torch.float64) or log_fgate.device != q.device:
        raise ValueError(f"log_fgate: expected float32 or float64 on {q.device}, got {log_fgate.dtype} on "
                         f"{log_fgate.device}")
    per = chunks_per_rank(layout)
    gate_ok = not bool((~(log_fgate <= 0) | log_fgate.isinf()).any())
    bound = None if acp is None else acp.logit_bound
    # what may hold on one rank only is compared first, so that every rank raises and none waits in a collective.
    # ACP's settings too: each rank plans the chunk pairs it skips from its own threshold, and a rank whose plan
    # keeps a pair that the keys' owner prunes waits for keys that never come
    check_same_on_ranks(group, q.device, {"q.shape": q.shape, "k.shape": k.shape, "v.shape": v.shape,
                                          "q.dtype": q.dtype, "layout": layout, "prune": acp is not None,
                                          "scale": scale, "tolerance": None if acp is None else float(acp.tolerance),
                                          "logit_bound": bound if bound is None or isinstance(bound, torch.Tensor)
                                          else float(bound),
                                          "log_fgate finite and <= 0": gate_ok})
    if Tl % per:
        raise ValueError(f"q: a {layout} shard holds {per} equal chunks, so T/P={Tl} must be a multiple of {per} "
                         f"(the sequence a multiple of 2P; shard_sequence checks this)")
    if not gate_ok:
        raise ValueError("log_fgate: expected finite log forget gates <= 0, without NaN (use logsigmoid)")


def cp_forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    scale: float | None = None,
    prune: bool | ACP | None = False,
    tolerance: float = math.exp(-10),
    logit_bound: float | torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """This rank's shard of ``forgetting_attention`` on the whole sequence, from every rank's shard of the inputs.

    q: [B, T/P, Hq, D], k: [B, T/P, Hk, D], v: [B, T/P, Hk, Dv], log_fgate: [B, T/P, Hq] fp32, each as
    ``shard_sequence(x, dim=1, group=group, layout=layout)`` makes it; every rank of ``group`` calls this with
    shards of the same shape. prune (an ``ACP`` or a bool with tolerance and logit_bound): ACP as in
    ``forgetting_attention``, with N the whole length T and U all-reduced over the group (a logit bound must be the
    same on every rank). check: compare the shards' shapes and dtype and the settings (layout, scale, prune,
    tolerance, logit_bound) between the ranks and check the gates' values (a collective and a host sync); False for
    a caller that vouches for them, as a foxlm model's layers do (the model compares its input shards once a forward,
    its settings are its config's and its gates are logsigmoids), so that a layer syncs with the host only where ACP
    plans its blocks.
    Returns o: [B, T/P, Hq, Dv] in q's dtype. Differentiable in q, k, v and log_fgate.
    """
    acp = ACP.of(prune, tolerance, logit_bound)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if check:
        _validate(q, k, v, log_fgate, layout, group, acp, scale)
    plan = _Plan(q, k, log_fgate, group, layout, scale, acp)
    return _CPForgettingAttention.apply(q, k, v, log_fgate, plan, scale)


def cp_acp_tile_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    scale: float | None = None,
    tolerance: float = math.exp(-10),
    logit_bound: float | torch.Tensor | None = None,
    block_m: int = 128,
    block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``foxlm.ops.acp_stats`` of the whole sequence from the ranks' shards (a collective; every rank gets the same):
    the share of the causal attention tiles (``block_m`` x ``block_n``) that ACP's delta skips, the number one
    process reports for the same sequence whatever P and the layout. The op itself skips chunk pairs, a coarser
    unit (``cp_acp_stats``)."""
    acp = ACP(tolerance, logit_bound)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    _validate(q, k, k, log_fgate, layout, group, acp, scale)
    threshold = _threshold(q, k, scale, acp, q.shape[1] * dist.get_world_size(group), group)
    with torch.no_grad():
        whole = gather_sequence(log_fgate.detach(), dim=1, group=group, layout=layout)
    return acp_tile_stats(whole, threshold, block_m=block_m, block_n=block_n)


def cp_acp_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    scale: float | None = None,
    tolerance: float = math.exp(-10),
    logit_bound: float | torch.Tensor | None = None,
    value_dim: int | None = None,
) -> CPAcpStats:
    """The FLOPs and bytes that ``cp_forgetting_attention(..., prune=True)`` skips, over the whole group.

    Same shards and arguments as the op (a collective: every rank of ``group`` calls it); value_dim: Dv, by
    default D. Blocks are (chunk of queries x chunk of keys) per head, the op's unit of skipping.
    """
    acp = ACP(tolerance, logit_bound)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    _validate(q, k, k if value_dim is None else k.new_empty(*k.shape[:3], value_dim), log_fgate, layout, group, acp,
              scale)
    plan = _Plan(q, k, log_fgate, group, layout, scale, acp)
    B, _, Hq, D = q.shape
    Dv = D if value_dim is None else value_dim
    L, Hk, G = plan.L, plan.Hk, plan.G
    pairs = plan.causal.double() * L * L
    pairs.diagonal().fill_(L * (L + 1) / 2)
    per_pair = 2.0 * B * (D + Dv)
    skipped = (plan.causal[:, :, None] & ~plan.need).double()  # [nc, nc, Hk]
    flops_total = torch.full((Hq,), float(pairs.sum() * per_pair), dtype=torch.float64)
    flops_skipped = ((skipped * pairs[:, :, None]).sum((0, 1)) * per_pair).repeat_interleave(G)
    unit_bytes = B * L * ((D + Dv) * q.element_size() + G * 8)  # K, V and the fp64 c of a group's query heads
    owner = {g: r for r in range(plan.world) for g in plan.chunks[r]}
    nc = len(owner)
    remote = torch.tensor([[owner[gq] != owner[gk] for gk in range(nc)] for gq in range(nc)])[:, :, None]
    # a key chunk goes to a rank once, for all of its query chunks that use it
    sent = torch.zeros(Hk, dtype=torch.float64)
    total = torch.zeros(Hk, dtype=torch.float64)
    for r in range(plan.world):
        rows = plan.chunks[r]
        sent += (plan.need[rows] & remote[rows]).any(0).double().sum(0)
        total += (plan.causal[rows][:, :, None] & remote[rows]).any(0).double().sum(0)
    return CPAcpStats(flops_skipped, flops_total, (total - sent) * unit_bytes, total * unit_bytes)

"""Fused Triton kernels of Forgetting Attention: forward and a deterministic backward.

Logits are ``scale * q_i . k_j + c_i - c_j`` with ``c`` the gate cumsum, computed in base 2 (exp2 with
log2(e)-prescaled logits). The design follows Triton's fused-attention tutorial (FlashAttention-2):

* forward: one program per (query block, head); key tiles left of the diagonal run without masks, the
  tiles that cross the diagonal (or the end of the sequence) with them; the loop's logits leave out c_i, a
  constant of query i's softmax row, which joins its lse at the end;
* backward: two kernels, each with its own tiles and warps. One program per (key block, key head) computes
  dK/dV, looping over the query heads of its GQA group in a fixed order (deterministic GQA reduction); one per
  (query block, query head) computes dQ. No atomics: the gate gradient is collected as rowsum(dS) beside dQ and
  -colsum(dS) beside dK/dV, then reverse-cumsummed in fp64. The dK/dV loop reads the
  query side's c_rel with -lse already in it (one vector load a tile fewer).
* gate precision: c is an fp64 cumsum, and c_i - c_j keeps its precision even when |c| reaches 1e6 (a
  million tokens): every program takes c relative to an fp64 reference (c at its first query or key). The
  unmasked tiles read no fp64 vectors: they add c_rel, the fp32 offsets of c from an end of its C_BLOCK-long
  block, to one fp64 difference per tile (that position's c minus the reference); see _c_tile. That is faster than
  converting each tile's fp64 c (docs/benchmarks.md). The limit: a logit's error is about an fp32 ulp of the decay
  between its query or key and the program's reference, so a gate that closes hard (log f = -1e4) inside a tile,
  past the reference, costs ~1e-3 in the logits behind it, and several in one C_BLOCK-long block the ulp of their
  sum (tests/ops/forgetting_attention/test_triton.py places such resets at tile starts). Gates below -1e4 are
  floored there (``gate.GATE_FLOOR``).
* ACP: a tile is skipped when its largest decay c_i - c_j is below the threshold delta. c is monotone, so
  the skipped tiles of a query block are a prefix of key blocks (and for a key block, the kept query
  blocks a prefix of those below the diagonal); each program finds its boundary by binary search over c.
* varlen: with ``cu_seqlens`` the grid runs over (sequence, block); no program crosses a sequence.
* launch order: a 1-D grid over groups of (head, sequence) pairs whose tensors fit in L2 together; within a group
  the heads vary fastest and the longest programs come first (the last query blocks in the forward, the first
  key blocks in the backward), so that no long program starts in the last wave.
* sliding window (``WINDOWED``, a constexpr: the full-causal kernels are unchanged): query i sees keys
  j > i - window. Key tiles left of a query block's window are never visited (the first is the later of
  the window's and ACP's boundary); the tiles the window edge crosses are masked. A key block's dK/dV
  loop stops at the query block of its last key + window - 1.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the same kernels run on CPU tensors.
Only the ``@triton.jit`` code lives here; ``triton_op`` tiles, launches and differentiates it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..backend import cast, tile_loop

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _search(c_base, lo, hi, target, STRICT: tl.constexpr):
    """First j in [lo, hi) with c[j] < target (STRICT) or c[j] <= target, else hi; c is non-increasing."""
    while lo < hi:
        mid = (lo + hi) // 2
        cm = tl.load(c_base + mid)
        if STRICT:
            right = cm >= target
        else:
            right = cm > target
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _load_rows(ptrs, rmask, cmask, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Load a [rows, cols] tile, masking rows and/or columns only where needed."""
    if ROWS and COLS:
        x = tl.load(ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0)
    elif ROWS:
        x = tl.load(ptrs, mask=rmask[:, None], other=0.0)
    elif COLS:
        x = tl.load(ptrs, mask=cmask[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """a @ b (+ acc) with fp32 accumulation. Triton 3.6's interpreter multiplies bf16 wrongly: there the
    same (bf16-valued) operands are multiplied in fp32."""
    if INTERPRET:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def _sums(x, acc, DOT_SUMS: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """acc plus the row sums of x [R, C]: acc [R] fp32, or with ``DOT_SUMS`` acc [R, 16] fp32 plus x @ e_0 (ones in
    column 0, zeros elsewhere; 16: the narrowest tensor-core tile), to be summed over its 16 columns once after the
    loop (``_sums_done``). The dot sums x as it stands (rounded to q's dtype, as the dots of dK and dQ see it) and
    costs the loop no ALU work: measured faster under ACP, slower without it (the 128-row dQ tile's extra
    accumulator spills; docs/benchmarks.md). Both sides of the gate gradient must sum alike: the reverse cumsum
    cancels their rounding only when the row and column sums add the same values."""
    if DOT_SUMS:
        e0 = (tl.where(tl.arange(0, 16)[None, :] == 0, 1.0, 0.0) + tl.zeros([x.shape[1], 16], tl.float32))
        out = _dot(x, e0.to(x.dtype), acc, PRECISION, INTERPRET)
    else:
        out = acc + tl.sum(x, 1)
    return out


@triton.jit
def _sums_init(ROWS: tl.constexpr, DOT_SUMS: tl.constexpr):
    """The zero accumulator of ``_sums``."""
    if DOT_SUMS:
        out = tl.zeros([ROWS, 16], dtype=tl.float32)
    else:
        out = tl.zeros([ROWS], dtype=tl.float32)
    return out


@triton.jit
def _sums_done(acc, DOT_SUMS: tl.constexpr):
    """The row sums [R] from a ``_sums`` accumulator."""
    if DOT_SUMS:
        out = tl.sum(acc, 1)
    else:
        out = acc
    return out


@triton.jit
def _visible(pos_q, pos_k, window, WINDOWED: tl.constexpr):
    """Whether query position pos_q sees key position pos_k: causal, and within the window if WINDOWED."""
    ok = pos_q >= pos_k
    if WINDOWED:
        ok = ok & (pos_q - window < pos_k)
    return ok


@triton.jit
def _seq_bounds(CU, b, Tq, Tk, VARLEN: tl.constexpr):
    """(first token, query length, key length, query offset in key positions) of sequence/batch b."""
    if VARLEN:
        tok0 = tl.load(CU + b)
        len_q = tl.load(CU + b + 1) - tok0
        len_k = len_q
        off = len_q * 0
    else:
        tok0 = b * 0
        len_q = tok0 + Tq
        len_k = tok0 + Tk
        off = len_k - len_q
    return tok0, len_q, len_k, off


@triton.jit
def _tensor_batch(b, VARLEN: tl.constexpr):
    """Batch index into the tensors (int64): packed varlen input is one batch row [1, total, ...]."""
    if VARLEN:
        bt = b.to(tl.int64) * 0
    else:
        bt = b.to(tl.int64)
    return bt


@triton.jit
def _grid_position(H, HB, HG, LAST_FIRST: tl.constexpr):
    """(head, sequence, block) of this program in the 1-D grid over HB = heads x sequences and their blocks.
    The (head, sequence) pairs run in groups of HG (whose tensors fit in L2 together); within a group, the heads
    vary fastest and the programs with the most tiles to visit (the last query blocks, the first key blocks
    under the causal mask) come first, so that the short ones fill the last wave."""
    pid = tl.program_id(0)
    n_blocks = tl.num_programs(0) // HB
    in_group = pid % (HG * n_blocks)
    hb = (pid // (HG * n_blocks)) * HG + in_group % HG
    block = in_group // HG
    if LAST_FIRST:
        block = n_blocks - 1 - block
    return hb % H, hb // H, block


@triton.jit
def _key_range(c_base, thr_ptr, c_ref, p0, p_last, window, BLOCK_N: tl.constexpr, C_BLOCK: tl.constexpr,
               PRUNE: tl.constexpr, WINDOWED: tl.constexpr):
    """Key tiles of the query rows at positions [p0, p_last]: (lo, win_hi, mask_lo). Tiles before lo are
    skipped (left of the window, or pruned by ACP), [lo, win_hi) cross the window's edge (masked), [win_hi,
    mask_lo) need no mask, and the tiles from mask_lo to p_last (the diagonal's, and the others in p0's
    C_BLOCK-long block, whose end lies past p0: see _c_tile) are masked."""
    diagonal = (p0 // BLOCK_N) * BLOCK_N
    lo = p0 * 0
    if WINDOWED:
        lo = (tl.maximum(p0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    if PRUNE:  # c is monotone: the first kept key of the block's first row, searched right of lo
        thr = tl.load(thr_ptr).to(tl.float64)
        lo = tl.minimum((_search(c_base, lo, p0 + 1, c_ref - thr, False) // BLOCK_N) * BLOCK_N, diagonal)
    mask_lo = tl.maximum((p0 // C_BLOCK) * C_BLOCK, lo)
    win_hi = lo
    if WINDOWED:  # a tile needs no window mask once its first key is inside the last row's window
        win_hi = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(p_last - window + 1, 0), BLOCK_N) * BLOCK_N, lo), mask_lo)
    return lo, win_hi, mask_lo


@triton.jit
def _c_tile(c_base, cr_base, c_ref, start, offs, valid, MASK: tl.constexpr, C_BLOCK: tl.constexpr,
            END: tl.constexpr):
    """log2(e) * (c[offs] - c_ref) in fp32 for a tile at positions ``offs`` (from ``start``); an unmasked tile also
    carries what else c_rel holds (the query side's -log2(e) lse, see _attn_bwd_preprocess).

    A masked tile converts c[offs] - c_ref from fp64. An unmasked tile, which lies in one C_BLOCK-long block,
    adds c_rel[offs] (fp32, c relative to the block's end if END, else its first position) and the fp64 difference
    of that position's c and c_ref: one conversion per tile. The callers mask the tiles for which that position
    is not between the tile and c_ref's position, so that the two terms share their sign (c is monotone) and the
    sum is as precise as a conversion of the fp64 difference."""
    if MASK:
        ct = (tl.load(c_base + offs, mask=valid, other=0.0) - c_ref).to(tl.float32) * LOG2E
    else:
        b = (start // C_BLOCK) * C_BLOCK
        if END:
            b += C_BLOCK
        ct = tl.load(cr_base + offs) + ((tl.load(c_base + b) - c_ref) * LOG2E).to(tl.float32)
    return ct


@triton.jit
def _fwd_tile(state, start_n, q, pos_m, k_base, v_base, c_base, cr_base, skt, svt, c_ref, qk_scale, len_k, window,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
              C_BLOCK: tl.constexpr, MASK: tl.constexpr, WINDOWED: tl.constexpr, PRECISION: tl.constexpr,
              INTERPRET: tl.constexpr):
    """Key tile [start_n, start_n + BLOCK_N) into the query rows' running (acc, l_i, m_i) (a ``tile_loop`` body)."""
    acc, l_i, m_i = state
    start_n = tl.multiple_of(start_n, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kn = start_n + tl.arange(0, BLOCK_N)
    kvalid = kn < len_k
    k = _load_rows(k_base + kn.to(tl.int64)[:, None] * skt + offs_d[None, :], kvalid, offs_d < D,
                   MASK, BLOCK_D != D)
    ck = _c_tile(c_base, cr_base, c_ref, start_n, kn, kvalid, MASK, C_BLOCK, True)
    # the logits less the query's own c_i (a constant of its softmax row, added to its lse at the end)
    s = _dot(q, tl.trans(k), None, PRECISION, INTERPRET) * qk_scale - ck[None, :]
    if MASK:
        s = tl.where(_visible(pos_m[:, None], kn[None, :], window, WINDOWED) & kvalid[None, :], s, float("-inf"))
    m_ij = tl.maximum(m_i, tl.max(s, 1))
    m_sub = m_ij
    if MASK:
        if WINDOWED:  # a row may have no visible key yet: subtract 0 from its -inf logits, not -inf
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_base + kn.to(tl.int64)[:, None] * svt + offs_dv[None, :], kvalid, offs_dv < DV,
                   MASK, BLOCK_DV != DV)
    acc = _dot(cast(p, v.dtype, INTERPRET), v, acc * alpha[:, None], PRECISION, INTERPRET)
    return acc, l_i, m_ij


@triton.jit
def _attn_fwd_kernel(Q, K, V, C, CR, THR, O, LSE, CU,
                     sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, scb, sch, slb, slh,
                     Tq, Tk, Hq, HB, HG, G: tl.constexpr, qk_scale, window,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C_BLOCK: tl.constexpr,
                     VARLEN: tl.constexpr, PRUNE: tl.constexpr, WINDOWED: tl.constexpr, PRECISION: tl.constexpr,
                     INTERPRET: tl.constexpr, TILES: tl.constexpr, LEN_BUCKET):
    hq, b, pid_m = _grid_position(Hq, HB, HG, True)
    hk = hq // G
    tok0, len_q, len_k, off = _seq_bounds(CU, b, Tq, Tk, VARLEN)
    bt = _tensor_batch(b, VARLEN)
    i0 = pid_m * BLOCK_M
    if i0 >= len_q:
        return
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mvalid = offs_m < len_q
    rows = (tok0 + offs_m).to(tl.int64)
    q = _load_rows(Q + bt * sqb + hq * sqh + rows[:, None] * sqt + offs_d[None, :], mvalid, offs_d < D,
                   True, BLOCK_D != D)
    c_base = C + bt * scb + hq * sch + tok0
    cr_base = CR + bt * scb + hq * sch + tok0
    k_base = K + bt * skb + hk * skh + tok0.to(tl.int64) * skt
    v_base = V + bt * svb + hk * svh + tok0.to(tl.int64) * svt
    p0 = off + i0
    c_ref = tl.load(c_base + p0)
    pos_m = off + offs_m
    p_last = off + tl.minimum(i0 + BLOCK_M, len_q) - 1
    lo, win_hi, mask_lo = _key_range(c_base, THR + b * Hq + hq, c_ref, p0, p_last, window, BLOCK_N, C_BLOCK, PRUNE,
                                     WINDOWED)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    state = (acc, l_i, m_i)
    if WINDOWED:
        state = tile_loop(_fwd_tile, state, lo, win_hi, BLOCK_N, INTERPRET,
                          (q, pos_m, k_base, v_base, c_base, cr_base, skt, svt, c_ref, qk_scale, len_k, window, D, DV,
                           BLOCK_D, BLOCK_DV, BLOCK_N, C_BLOCK, True, WINDOWED, PRECISION, INTERPRET))
    state = tile_loop(_fwd_tile, state, win_hi, mask_lo, BLOCK_N, INTERPRET,
                      (q, pos_m, k_base, v_base, c_base, cr_base, skt, svt, c_ref, qk_scale, len_k, window, D, DV,
                       BLOCK_D, BLOCK_DV, BLOCK_N, C_BLOCK, False, WINDOWED, PRECISION, INTERPRET))
    acc, l_i, m_i = tile_loop(_fwd_tile, state, mask_lo, p_last + 1, BLOCK_N, INTERPRET,
                              (q, pos_m, k_base, v_base, c_base, cr_base, skt, svt, c_ref, qk_scale, len_k, window, D,
                               DV, BLOCK_D, BLOCK_DV, BLOCK_N, C_BLOCK, True, WINDOWED, PRECISION, INTERPRET))
    if WINDOWED:  # padding rows past the sequence's end may see no key
        l_i = tl.where(mvalid, l_i, 1.0)
    acc = acc / l_i[:, None]
    o_ptrs = O + bt * sob + hq * soh + rows[:, None] * sot + offs_dv[None, :]
    if BLOCK_DV != DV:
        tl.store(o_ptrs, cast(acc, O.dtype.element_ty, INTERPRET), mask=mvalid[:, None] & (offs_dv < DV)[None, :])
    else:
        tl.store(o_ptrs, cast(acc, O.dtype.element_ty, INTERPRET), mask=mvalid[:, None])
    cq = (tl.load(c_base + off + offs_m, mask=mvalid, other=0.0) - c_ref).to(tl.float32) * LOG2E
    lse = (m_i + tl.math.log2(l_i) + cq) * LN2
    tl.store(LSE + bt * slb + hq * slh + tok0 + offs_m, lse, mask=mvalid)


@triton.jit
def _relative_c_kernel(C, START, CRK, scb, sch, T, C_BLOCK: tl.constexpr, BLOCK: tl.constexpr, VARLEN: tl.constexpr):
    """The key side's c_rel for BLOCK positions p of one (batch, head): CRK = log2(e) (c_p - c_b) with b the end of p's
    C_BLOCK-long block (blocks from each sequence's start), clamped into the tensor; the kernels never read c_rel where
    b lies outside p's sequence."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    base = tl.program_id(2).to(tl.int64) * scb + tl.program_id(1).to(tl.int64) * sch
    valid = p < T
    if VARLEN:
        s = tl.load(START + p, mask=valid, other=0)
    else:
        s = p * 0
    c = tl.load(C + base + p, mask=valid, other=0.0)
    end = tl.minimum(s + ((p - s) // C_BLOCK + 1) * C_BLOCK, T - 1)
    tl.store(CRK + base + p, ((c - tl.load(C + base + end)) * LOG2E).to(tl.float32), mask=valid)


@triton.jit
def _attn_bwd_preprocess(O, DO, DLSE, LSE, C, START, DELTA, CRQ, sob, sot, soh, slb, slh, scb, sch, T, Tk, off,
                         DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, C_BLOCK: tl.constexpr,
                         HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr):
    """For the queries i of one block and head: delta_i = sum_d o_i * do_i - dlse_i ([B, H, T] fp32), and the query
    side's c_rel at their key positions p = i + off: CRQ_p = log2(e) (c_p - c_b - lse_i) with b the first position of
    p's C_BLOCK-long block (blocks from ``off`` on within p's sequence, b clamped into the tensor: the kernels never
    read c_rel where b lies outside p's sequence). The dK/dV loop reads the two query-side terms as one."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    valid = offs_m < T
    mask = valid[:, None] & (offs_dv < DV)[None, :]
    ptrs = b * sob + h * soh + offs_m.to(tl.int64)[:, None] * sot + offs_dv[None, :]
    o = tl.load(O + ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    lptrs = b * slb + h * slh + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLSE + lptrs, mask=valid, other=0.0)
    tl.store(DELTA + lptrs, delta, mask=valid)
    p = offs_m + off
    if VARLEN:
        s = tl.load(START + p, mask=valid, other=0)
    else:
        s = p * 0
    first = tl.minimum(s + off + ((p - s - off) // C_BLOCK) * C_BLOCK, Tk - 1)
    cb = C + b * scb + h * sch
    c = tl.load(cb + p, mask=valid, other=0.0)
    crq = ((c - tl.load(cb + first, mask=valid, other=0.0)) * LOG2E).to(tl.float32) \
        - tl.load(LSE + lptrs, mask=valid, other=0.0) * LOG2E
    tl.store(CRQ + b * scb + h * sch + p, crq, mask=valid)


@triton.jit
def _bwd_dkdv_tile(state, start_m, k, v, ck, kn, kvalid, q_base, do_base, cq_base, cqr_base, l_base, d_base, sqt,
                   sot, c_ref, qk_scale, len_q, off, window, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, C_BLOCK: tl.constexpr, MASK: tl.constexpr,
                   WINDOWED: tl.constexpr, PRECISION: tl.constexpr, DOT_SUMS: tl.constexpr, INTERPRET: tl.constexpr):
    """Query tile [start_m, start_m + BLOCK_M) into the key block's (dk, dv, dcs) (a ``tile_loop`` body); dcs: the
    column sums of dS so far, [BLOCK_N] or with ``DOT_SUMS`` [BLOCK_N, 16] (dS^T @ e_0, see _sums)."""
    dk, dv, dcs = state
    start_m = tl.multiple_of(start_m, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    mvalid = offs_m < len_q
    rows = offs_m.to(tl.int64)
    q = _load_rows(q_base + rows[:, None] * sqt + offs_d[None, :], mvalid, offs_d < D, MASK, BLOCK_D != D)
    do = _load_rows(do_base + rows[:, None] * sot + offs_dv[None, :], mvalid, offs_dv < DV, MASK, BLOCK_DV != DV)
    if MASK:
        delta = tl.load(d_base + offs_m, mask=mvalid, other=0.0)
        cq = _c_tile(cq_base, cqr_base, c_ref, start_m, offs_m, mvalid, MASK, C_BLOCK, False) \
            - tl.load(l_base + offs_m, mask=mvalid, other=0.0) * LOG2E
    else:  # the query side's c_rel already holds -log2(e) lse (see _attn_bwd_preprocess)
        delta = tl.load(d_base + offs_m)
        cq = _c_tile(cq_base, cqr_base, c_ref, start_m, offs_m, mvalid, MASK, C_BLOCK, False)
    st = _dot(k, tl.trans(q), None, PRECISION, INTERPRET)
    st = st * qk_scale + (cq[None, :] - ck[:, None])
    if MASK:
        st = tl.where(_visible((off + offs_m)[None, :], kn[:, None], window, WINDOWED) & mvalid[None, :]
                      & kvalid[:, None], st, float("-inf"))
    pt = tl.math.exp2(st)
    dv = _dot(cast(pt, do.dtype, INTERPRET), do, dv, PRECISION, INTERPRET)
    dpt = _dot(v, tl.trans(do), None, PRECISION, INTERPRET)
    dst = pt * (dpt - delta[None, :])
    rounded = cast(dst, q.dtype, INTERPRET)  # as the dot sees it, and as _bwd_dq_tile rounds it
    dk = _dot(rounded, q, dk, PRECISION, INTERPRET)
    return dk, dv, _sums(rounded if DOT_SUMS else dst, dcs, DOT_SUMS, PRECISION, INTERPRET)


@triton.jit
def _bwd_dq_tile(state, start_n, q, do, cq, delta, pos_m, mvalid, k_base, v_base, c_base, cr_base, skt, svt, c_ref,
                 qk_scale, len_k, window, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, C_BLOCK: tl.constexpr, MASK: tl.constexpr,
                 WINDOWED: tl.constexpr, PRECISION: tl.constexpr, DOT_SUMS: tl.constexpr, INTERPRET: tl.constexpr):
    """Key tile [start_n, start_n + BLOCK_N) into the query block's (dq, drs) (a ``tile_loop`` body); drs: the row
    sums of dS so far, [BLOCK_M] or with ``DOT_SUMS`` [BLOCK_M, 16] (see _sums)."""
    dq, drs = state
    start_n = tl.multiple_of(start_n, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kn = start_n + tl.arange(0, BLOCK_N)
    kvalid = kn < len_k
    rows = kn.to(tl.int64)
    k = _load_rows(k_base + rows[:, None] * skt + offs_d[None, :], kvalid, offs_d < D, MASK, BLOCK_D != D)
    v = _load_rows(v_base + rows[:, None] * svt + offs_dv[None, :], kvalid, offs_dv < DV, MASK, BLOCK_DV != DV)
    ck = _c_tile(c_base, cr_base, c_ref, start_n, kn, kvalid, MASK, C_BLOCK, True)
    s = _dot(q, tl.trans(k), None, PRECISION, INTERPRET) * qk_scale + (cq[:, None] - ck[None, :])
    if MASK:
        s = tl.where(_visible(pos_m[:, None], kn[None, :], window, WINDOWED) & mvalid[:, None] & kvalid[None, :],
                     s, float("-inf"))
    p = tl.math.exp2(s)
    dp = _dot(do, tl.trans(v), None, PRECISION, INTERPRET)
    ds = p * (dp - delta[:, None])
    rounded = cast(ds, q.dtype, INTERPRET)  # to q's dtype, as _bwd_dkdv_tile rounds it
    dq = _dot(rounded, k, dq, PRECISION, INTERPRET)
    return dq, _sums(rounded if DOT_SUMS else ds, drs, DOT_SUMS, PRECISION, INTERPRET)


@triton.jit
def _bwd_dkdv_block(Q, K, V, C, CRQ, THR, DO, LSE, DELTA, DK, DV_, DCK, b, hk, start_n, tok0, len_q, len_k,
                    off, sqt, sqh, skt, skh, svt, svh, sot, soh, sch, slh, Hq, qk_scale, scale, window,
                    G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, C_BLOCK: tl.constexpr,
                    PRUNE: tl.constexpr, WINDOWED: tl.constexpr, PRECISION: tl.constexpr, DOT_SUMS: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """dK, dV of key block [start_n, start_n + BLOCK_N1), summed over the G query heads of key head hk in a fixed
    order (a deterministic GQA reduction), and -colsum(dS) per query head into DCK."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kn = start_n + tl.arange(0, BLOCK_N1)
    kvalid = kn < len_k
    krows = (tok0 + kn).to(tl.int64)
    k = _load_rows(K + hk * skh + krows[:, None] * skt + offs_d[None, :], kvalid, offs_d < D, True, BLOCK_D != D)
    v = _load_rows(V + hk * svh + krows[:, None] * svt + offs_dv[None, :], kvalid, offs_dv < DV, True, BLOCK_DV != DV)
    dk = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, BLOCK_DV], dtype=tl.float32)
    # Query blocks that see this key block start at the one holding position start_n; those whose rows
    # all lie at or past the block's last key, and whose C_BLOCK-long block starts at or past start_n (see
    # _c_tile), need no causal mask; a partial last block needs a row mask.
    k_last = tl.minimum(start_n + BLOCK_N1, len_k) - 1
    lo = (tl.maximum(start_n - off, 0) // BLOCK_M1) * BLOCK_M1
    unmasked_lo = tl.maximum(tl.maximum(tl.cdiv(start_n + BLOCK_N1 - 1 - off, BLOCK_M1) * BLOCK_M1,
                                        tl.cdiv(start_n - off, C_BLOCK) * C_BLOCK), lo)
    unmasked_hi = tl.maximum((len_q // BLOCK_M1) * BLOCK_M1, unmasked_lo)
    last_q = len_q
    if WINDOWED:  # rows past k_last + window - 1 see none of the block; rows past start_n + window - 1 not all of it
        last_q = tl.minimum(last_q, tl.cdiv(tl.maximum(k_last + window - off, 0), BLOCK_M1) * BLOCK_M1)
        window_hi = (tl.maximum(start_n + window - off, 0) // BLOCK_M1) * BLOCK_M1
        unmasked_hi = tl.minimum(unmasked_hi, tl.maximum(window_hi, unmasked_lo))
    for g in range(G):
        hq = hk * G + g
        c_base = C + hq * sch + tok0
        cqr_base = CRQ + hq * sch + tok0 + off
        l_base = LSE + hq * slh + tok0
        d_base = DELTA + hq * slh + tok0
        q_base = Q + hq * sqh + tok0.to(tl.int64) * sqt
        do_base = DO + hq * soh + tok0.to(tl.int64) * sot
        c_ref = tl.load(c_base + start_n)
        ck = (tl.load(c_base + kn, mask=kvalid, other=0.0) - c_ref).to(tl.float32) * LOG2E
        hi = last_q
        if PRUNE:  # kept query blocks: a prefix, up to the last whose first row decays less than delta
            thr = tl.load(THR + b * Hq + hq).to(tl.float64)
            r = _search(c_base, off + lo, off + len_q, tl.load(c_base + k_last) + thr, True) - off
            hi = tl.minimum(hi, tl.cdiv(r, BLOCK_M1) * BLOCK_M1)
        state = tile_loop(_bwd_dkdv_tile, (dk, dv, _sums_init(BLOCK_N1, DOT_SUMS)), lo, tl.minimum(unmasked_lo, hi),
                          BLOCK_M1, INTERPRET,
                          (k, v, ck, kn, kvalid, q_base, do_base, c_base + off, cqr_base, l_base, d_base, sqt,
                           sot, c_ref, qk_scale, len_q, off, window, D, DV, BLOCK_D, BLOCK_DV,
                           BLOCK_M1, C_BLOCK, True, WINDOWED, PRECISION, DOT_SUMS, INTERPRET))
        state = tile_loop(_bwd_dkdv_tile, state, unmasked_lo, tl.minimum(unmasked_hi, hi), BLOCK_M1, INTERPRET,
                          (k, v, ck, kn, kvalid, q_base, do_base, c_base + off, cqr_base, l_base, d_base, sqt,
                           sot, c_ref, qk_scale, len_q, off, window, D, DV, BLOCK_D, BLOCK_DV,
                           BLOCK_M1, C_BLOCK, False, WINDOWED, PRECISION, DOT_SUMS, INTERPRET))
        dk, dv, dcs = tile_loop(_bwd_dkdv_tile, state, unmasked_hi, hi, BLOCK_M1, INTERPRET,
                                (k, v, ck, kn, kvalid, q_base, do_base, c_base + off, cqr_base, l_base, d_base,
                                 sqt, sot, c_ref, qk_scale, len_q, off, window, D, DV, BLOCK_D,
                                 BLOCK_DV, BLOCK_M1, C_BLOCK, True, WINDOWED, PRECISION, DOT_SUMS, INTERPRET))
        tl.store(DCK + hq * sch + tok0 + kn, -_sums_done(dcs, DOT_SUMS), mask=kvalid)
    tl.store(DK + hk * skh + krows[:, None] * skt + offs_d[None, :], cast(dk * scale, DK.dtype.element_ty, INTERPRET),
             mask=kvalid[:, None] & (offs_d < D)[None, :])
    tl.store(DV_ + hk * svh + krows[:, None] * svt + offs_dv[None, :], cast(dv, DV_.dtype.element_ty, INTERPRET),
             mask=kvalid[:, None] & (offs_dv < DV)[None, :])


@triton.jit
def _bwd_dq_block(Q, K, V, C, CRK, THR, DO, LSE, DELTA, DQ, DCQ, b, hq, hk, start_m, tok0, len_q, len_k, off,
                  sqt, sqh, skt, skh, svt, svh, sot, soh, sch, slh, Hq, qk_scale, scale, window,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, C_BLOCK: tl.constexpr,
                  PRUNE: tl.constexpr, WINDOWED: tl.constexpr, PRECISION: tl.constexpr, DOT_SUMS: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """dQ of query block [start_m, start_m + BLOCK_M2) of query head hq, and rowsum(dS) of its rows into DCQ."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_m = start_m + tl.arange(0, BLOCK_M2)
    mvalid = offs_m < len_q
    mrows = (tok0 + offs_m).to(tl.int64)
    pos_m = off + offs_m
    c_base = C + hq * sch + tok0
    cr_base = CRK + hq * sch + tok0
    q = _load_rows(Q + hq * sqh + mrows[:, None] * sqt + offs_d[None, :], mvalid, offs_d < D, True, BLOCK_D != D)
    do = _load_rows(DO + hq * soh + mrows[:, None] * sot + offs_dv[None, :], mvalid, offs_dv < DV,
                    True, BLOCK_DV != DV)
    p0 = off + start_m
    c_ref = tl.load(c_base + p0)
    lse = tl.load(LSE + hq * slh + tok0 + offs_m, mask=mvalid, other=float("inf"))
    delta = tl.load(DELTA + hq * slh + tok0 + offs_m, mask=mvalid, other=0.0)
    cq = (tl.load(c_base + pos_m, mask=mvalid, other=0.0) - c_ref).to(tl.float32) * LOG2E - lse * LOG2E
    p_last = off + tl.minimum(start_m + BLOCK_M2, len_q) - 1
    lo, win_hi, mask_lo = _key_range(c_base, THR + b * Hq + hq, c_ref, p0, p_last, window, BLOCK_N2, C_BLOCK,
                                     PRUNE, WINDOWED)
    k_base = K + hk * skh + tok0.to(tl.int64) * skt
    v_base = V + hk * svh + tok0.to(tl.int64) * svt
    state = (tl.zeros([BLOCK_M2, BLOCK_D], dtype=tl.float32), _sums_init(BLOCK_M2, DOT_SUMS))
    if WINDOWED:
        state = tile_loop(_bwd_dq_tile, state, lo, win_hi, BLOCK_N2, INTERPRET,
                       (q, do, cq, delta, pos_m, mvalid, k_base, v_base, c_base, cr_base, skt, svt, c_ref, qk_scale,
                        len_k, window, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N2, C_BLOCK, True, WINDOWED, PRECISION,
                        DOT_SUMS, INTERPRET))
    state = tile_loop(_bwd_dq_tile, state, win_hi, mask_lo, BLOCK_N2, INTERPRET,
                   (q, do, cq, delta, pos_m, mvalid, k_base, v_base, c_base, cr_base, skt, svt, c_ref, qk_scale,
                    len_k, window, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N2, C_BLOCK, False, WINDOWED, PRECISION, DOT_SUMS,
                    INTERPRET))
    dq, drs = tile_loop(_bwd_dq_tile, state, mask_lo, p_last + 1, BLOCK_N2, INTERPRET,
                   (q, do, cq, delta, pos_m, mvalid, k_base, v_base, c_base, cr_base, skt, svt, c_ref, qk_scale,
                    len_k, window, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N2, C_BLOCK, True, WINDOWED, PRECISION, DOT_SUMS,
                    INTERPRET))
    tl.store(DQ + hq * sqh + mrows[:, None] * sqt + offs_d[None, :], cast(dq * scale, DQ.dtype.element_ty, INTERPRET),
             mask=mvalid[:, None] & (offs_d < D)[None, :])
    tl.store(DCQ + hq * slh + tok0 + offs_m, _sums_done(drs, DOT_SUMS), mask=mvalid)


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, C, CRQ, THR, DO, LSE, DELTA, DK, DV_, DCK, CU,
                          sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, scb, sch, slb, slh,
                          Tq, Tk, Hq, Hk, HB, HG, G: tl.constexpr, qk_scale, scale, window,
                          D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                          BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, C_BLOCK: tl.constexpr,
                          VARLEN: tl.constexpr, PRUNE: tl.constexpr, WINDOWED: tl.constexpr, PRECISION: tl.constexpr,
                          DOT_SUMS: tl.constexpr, INTERPRET: tl.constexpr, TILES: tl.constexpr, LEN_BUCKET):
    """Program (hk, b, pid): dK, dV of key block ``pid`` of key head hk, and -colsum(dS) of its keys per query head
    into DCK (the key side of the gate gradient).

    In exact arithmetic the query side, rowsum_j(dS_ij), is dlse_i, but delta is computed from the rounded o: each
    row sum carries o's rounding, which the reverse cumsum would add up along the sequence. Taken from the kernels'
    own dS (``_attn_bwd_dq_kernel``), it cancels between the two sides, and what is left is the error of dS on pairs
    across each position. With ``DOT_SUMS`` both sides sum on the tensor cores (see ``_sums``; the host picks it).
    The dQ kernel is separate, so that each loop gets its own tile and warps.
    """
    hk, b, pid = _grid_position(Hk, HB, HG, False)
    tok0, len_q, len_k, off = _seq_bounds(CU, b, Tq, Tk, VARLEN)
    bt = _tensor_batch(b, VARLEN)
    start_n = pid * BLOCK_N1
    if start_n < len_k:
        _bwd_dkdv_block(Q + bt * sqb, K + bt * skb, V + bt * svb, C + bt * scb, CRQ + bt * scb, THR, DO + bt * sob,
                        LSE + bt * slb, DELTA + bt * slb, DK + bt * skb, DV_ + bt * svb, DCK + bt * scb, b, hk,
                        start_n, tok0, len_q, len_k, off, sqt, sqh, skt, skh, svt, svh, sot, soh, sch, slh, Hq,
                        qk_scale, scale, window, G, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M1, BLOCK_N1, C_BLOCK, PRUNE,
                        WINDOWED, PRECISION, DOT_SUMS, INTERPRET)


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, C, CRK, THR, DO, LSE, DELTA, DQ, DCQ, CU,
                        sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, scb, sch, slb, slh,
                        Tq, Tk, Hq, HB, HG, G: tl.constexpr, qk_scale, scale, window,
                        D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                        BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, C_BLOCK: tl.constexpr,
                        VARLEN: tl.constexpr, PRUNE: tl.constexpr, WINDOWED: tl.constexpr, PRECISION: tl.constexpr,
                        DOT_SUMS: tl.constexpr, INTERPRET: tl.constexpr, TILES: tl.constexpr, LEN_BUCKET):
    """Program (hq, b, pid): dQ of query block ``pid`` of query head hq, and rowsum(dS) of its rows into DCQ (the
    query side of the gate gradient, see ``_attn_bwd_dkdv_kernel``)."""
    hq, b, pid = _grid_position(Hq, HB, HG, True)
    tok0, len_q, len_k, off = _seq_bounds(CU, b, Tq, Tk, VARLEN)
    bt = _tensor_batch(b, VARLEN)
    start_m = pid * BLOCK_M2
    if start_m < len_q:
        _bwd_dq_block(Q + bt * sqb, K + bt * skb, V + bt * svb, C + bt * scb, CRK + bt * scb, THR, DO + bt * sob,
                      LSE + bt * slb, DELTA + bt * slb, DQ + bt * sqb, DCQ + bt * slb, b, hq, hq // G, start_m, tok0,
                      len_q, len_k, off, sqt, sqh, skt, skh, svt, svh, sot, soh, sch, slh, Hq, qk_scale, scale,
                      window, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M2, BLOCK_N2, C_BLOCK, PRUNE, WINDOWED, PRECISION,
                      DOT_SUMS, INTERPRET)

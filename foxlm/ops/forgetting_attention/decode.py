"""Forgetting Attention for decoding: a few new queries against a long, paged key/value cache.

Cache layout (per layer). Keys, values and gate cumsums live in pools of fixed-size pages; every page
belongs to one (sequence, kv head), so pages can be freed per head (forget-gate eviction, see
``evictable_pages``):

- ``k_cache``: [num_pages, page_size, D], ``v_cache``: [num_pages, page_size, Dv] (any float dtype);
- ``c_cache``: [num_pages, page_size, G] float64, the running gate cumsum c_j of each of the G query
  heads that share the kv head (fp64, so that c_i - c_j stays exact however large |c| grows);
- ``page_table``: [B, Hk, max_pages] int32, logical page p of (b, kv head) -> pool page;
- ``cache_start``: [B, Hk] int32, the first live logical page (pages before it were evicted);
- ``lengths``: [B] int32, the number of keys of each sequence, the Tq new tokens included (their keys
  are written to the cache before attending): query i of sequence b sits at position lengths[b] - Tq + i.

The Triton path (CUDA; CPU under ``TRITON_INTERPRET=1``; see ``foxlm.ops.use_backend``) is flash-decoding:
the live keys of each (sequence, kv head) are split into ``num_splits`` ranges, one program per range
computes all G*Tq query rows of the kv head at once (GQA: each key tile is read once for its whole group),
and a second kernel combines the partial results in a fixed order (deterministic). The grid depends only
on the shapes, never on the lengths, so a decode step can be captured in a CUDA graph.
``decode_attention_torch`` is the plain PyTorch path (CPU, float64) and the readable statement of the
same math.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..backend import block_dim, interpreted, jit, tile_loop, tl, triton, use_triton
from ..checks import check_dtype
from .acp import prune_threshold
from .interface import check_scale

_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30


@jit
def _decode_tile(
    state, n0, q, c_q, qpos, row_ok, g, pt, K, V, C, scale_log2e, hi, window,
    stride_kp, stride_ks, stride_vp, stride_vs, stride_cp, stride_cs,
    PAGE: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Keys [n0, min(n0 + BLOCK_N, hi)) into the running max m_i, sum l_i and output acc of the query rows."""
    m_i, l_i, acc = state
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    page = tl.load(pt + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
    slot = offs_n % PAGE
    k = tl.load(
        K + page[:, None] * stride_kp + slot[:, None] * stride_ks + offs_d[None, :],
        mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0,
    )
    v = tl.load(
        V + page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_dv[None, :],
        mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
    )
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    c_k = tl.load(
        C + page[None, :] * stride_cp + slot[None, :] * stride_cs + g[:, None],
        mask=row_ok[:, None] & n_ok[None, :], other=0.0,
    )
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale_log2e
    s += ((c_q[:, None] - c_k) * 1.4426950408889634).to(tl.float32)
    ok = row_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= qpos[:, None])
    ok &= offs_n[None, :] > qpos[:, None] - window
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, l_i, acc


@jit
def _decode_split_kernel(
    Q, K, V, C, PT, START, LEN, O_PART, LSE_PART,
    scale_log2e,
    stride_qb, stride_qt, stride_qh,
    stride_kp, stride_ks,
    stride_vp, stride_vs,
    stride_cp, stride_cs,
    stride_ptb, stride_pth,
    Hk, Tq, num_splits, window,
    G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One (sequence, kv head, key range): all G*Tq query rows against keys [lo, hi).

    DOT_FP32 upcasts the dot operands (Triton 3.6's interpreter gets bf16 dots wrong); PRECISION is the dots'
    input precision ("ieee" for fp32 operands: fp32 queries are not rounded to tf32); INTERPRET: the kernel was
    built by the interpreter (see ``tile_loop``).
    """
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // Hk
    hk = pid_bh % Hk
    length = tl.load(LEN + b)
    key_lo = tl.maximum(tl.load(START + b * Hk + hk) * PAGE, length - Tq + 1 - window)
    per_split = tl.cdiv(tl.cdiv(length - key_lo, num_splits), BLOCK_N) * BLOCK_N
    lo = key_lo + split * per_split
    hi = tl.minimum(lo + per_split, length)

    # Row r is query i = r % Tq of query head g = r // Tq of this kv head's group.
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G * Tq
    g = rows // Tq
    qi = rows % Tq
    qpos = length - Tq + qi
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    pt = PT + b * stride_ptb + hk * stride_pth
    q = tl.load(
        Q + b * stride_qb + qi[:, None] * stride_qt + (hk * G + g)[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    q_page = tl.load(pt + qpos // PAGE, mask=row_ok, other=0).to(tl.int64)  # as _decode_tile: a pool past 2^31 slots
    c_q = tl.load(C + q_page * stride_cp + (qpos % PAGE) * stride_cs + g, mask=row_ok, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m_i, l_i, acc = tile_loop(
        _decode_tile, (m_i, l_i, acc), lo, hi, BLOCK_N, INTERPRET,
        (q, c_q, qpos, row_ok, g, pt, K, V, C, scale_log2e, hi, window,
         stride_kp, stride_ks, stride_vp, stride_vs, stride_cp, stride_cs,
         PAGE, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_FP32, PRECISION),
    )

    # Partial results: normalised output and log2-sum-exp2 per (row, split); -inf marks "no key".
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    head = hk * G + g
    part = ((b * Hk * G + head) * Tq + qi) * num_splits + split  # [B, Hq, Tq, S] row-major
    tl.store(LSE_PART + part, lse2, mask=row_ok)
    tl.store(O_PART + part[:, None] * DV + offs_dv[None, :], o, mask=row_ok[:, None] & (offs_dv[None, :] < DV))


@jit
def _decode_combine_kernel(
    O_PART, LSE_PART, OUT, LSE,
    stride_ob, stride_ot, stride_oh,
    Hq, Tq, num_splits,
    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Merge the splits of one (sequence, head, query) row in a fixed order."""
    row = tl.program_id(0)  # (b * Hq + h) * Tq + i
    qi = row % Tq
    bh = row // Tq
    h = bh % Hq
    b = bh // Hq
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < num_splits
    lse2 = tl.load(LSE_PART + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    o = tl.load(
        O_PART + (row * num_splits + offs_s)[:, None] * DV + offs_dv[None, :],
        mask=s_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
    )
    m = tl.max(lse2, axis=0)
    w = tl.exp2(lse2 - m)
    denom = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / denom
    o_ptr = OUT + b * stride_ob + qi * stride_ot + h * stride_oh + offs_dv
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=offs_dv < DV)
    tl.store(LSE + row, (m + tl.log2(denom)) / 1.4426950408889634)


# Kernels built by Triton's interpreter (TRITON_INTERPRET=1 at import) run on CPU tensors.
_INTERPRETED = interpreted(_decode_split_kernel)

# Split kernel launch: key tile, warps, stages (tuned with benchmarks/decode.py --sweep), and the longest key
# range one program takes: short ranges keep programs even when eviction leaves heads of very different lengths.
_TILE = (128, 4, 3)
_SPLIT_KEYS = 2048


def default_num_splits(batch: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Key splits per (sequence, kv head): >= 4 programs per SM, ranges of <= _SPLIT_KEYS and >= 256 keys."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = max(-(-4 * sms // (batch * kv_heads)), -(-max_len // _SPLIT_KEYS))
    return max(1, min(wanted, -(-max_len // 256)))


def _triton_decode(q, k_cache, v_cache, c_cache, page_table, cache_start, lengths, scale, window, num_splits):
    B, Tq, Hq, D = q.shape
    Hk = page_table.shape[1]
    G = Hq // Hk
    page_size, DV = v_cache.shape[1], v_cache.shape[2]
    if num_splits is None:
        num_splits = default_num_splits(B, Hk, page_table.shape[2] * page_size, q.device)
    o_part = torch.empty(B, Hq, Tq, num_splits, DV, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, Hq, Tq, num_splits, dtype=torch.float32, device=q.device)
    o = torch.empty(B, Tq, Hq, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
    block_n, warps, stages = _TILE
    if max(D, DV) > 128:
        block_n = min(block_n, 32)
    _decode_split_kernel[(B * Hk, num_splits)](
        q, k_cache, v_cache, c_cache, page_table, cache_start, lengths, o_part, lse_part,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        c_cache.stride(0), c_cache.stride(1),
        page_table.stride(0), page_table.stride(1),
        Hk, Tq, num_splits, window or _NO_WINDOW,
        G=G, PAGE=page_size, D=D, DV=DV,
        BLOCK_M=max(16, triton.next_power_of_2(G * Tq)), BLOCK_N=block_n,
        BLOCK_D=block_dim(D), BLOCK_DV=block_dim(DV),
        DOT_FP32=not q.is_cuda, PRECISION="ieee" if not q.is_cuda or q.dtype == torch.float32 else "tf32",
        INTERPRET=_INTERPRETED, num_warps=warps, num_stages=stages,
    )
    _decode_combine_kernel[(B * Hq * Tq,)](
        o_part, lse_part, o, lse,
        o.stride(0), o.stride(1), o.stride(2),
        Hq, Tq, num_splits,
        DV=DV, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_DV=block_dim(DV),
    )
    return o, lse


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_start: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch path of ``forgetting_attention_decode``: gathers the live pages and attends in one matmul.

    Same arguments and results; computes in fp32 (fp64 for fp64 inputs) whatever autocast says, as the kernel: a bf16
    autocast made its matmuls round the logits and probabilities to bf16. Memory O(B * Hq * Tq * keys).
    """
    with torch.autocast(q.device.type, enabled=False):
        return _decode_attention_torch(q, k_cache, v_cache, c_cache, page_table, cache_start, lengths, scale, window)


def _decode_attention_torch(q, k_cache, v_cache, c_cache, page_table, cache_start, lengths, scale, window):
    B, Tq, Hq, D = q.shape
    Hk = page_table.shape[1]
    G = Hq // Hk
    page_size = k_cache.shape[1]
    cdt = torch.promote_types(q.dtype, torch.float32)
    first = int(cache_start.min())
    last = -(-int(lengths.max()) // page_size)
    pages = page_table[:, :, first:last].long()  # [B, Hk, P]
    # entries of pages not live in their row (evicted, or past its length) may hold anything, as in the kernel, which
    # never reads them: the gather took them as pool indices, and one past the pool raised an IndexError
    logical = torch.arange(first, last, device=q.device)
    row_pages = -(-lengths.long() // page_size)
    live_page = (logical >= cache_start.long()[..., None]) & (logical < row_pages[:, None, None])
    pages = pages.masked_fill(~live_page, 0)
    keys = pages.shape[2] * page_size
    k = k_cache[pages].reshape(B, Hk, keys, D).to(cdt)
    v = v_cache[pages].reshape(B, Hk, keys, -1).to(cdt)
    c = c_cache[pages].reshape(B, Hk, keys, G).permute(0, 1, 3, 2).reshape(B, Hq, keys)  # fp64
    pos = first * page_size + torch.arange(keys, device=q.device)  # [keys]
    qpos = lengths.long()[:, None] - Tq + torch.arange(Tq, device=q.device)  # [B, Tq]
    qpage = page_table.long().gather(2, (qpos // page_size)[:, None, :].expand(B, Hk, Tq))  # [B, Hk, Tq]
    c_q = c_cache[qpage, (qpos % page_size)[:, None, :]]  # [B, Hk, Tq, G]
    c_q = c_q.permute(0, 1, 3, 2).reshape(B, Hq, Tq)
    qh = q.to(cdt).permute(0, 2, 1, 3)  # [B, Hq, Tq, D]
    kh = k.repeat_interleave(G, dim=1)
    # Slots past a sequence's length or before its start may hold anything (unwritten or reused pages).
    live_kv = (pos >= cache_start.long()[..., None] * page_size) & (pos < lengths.long()[:, None, None])
    vh = v.masked_fill(~live_kv[..., None], 0.0).repeat_interleave(G, dim=1)
    s = scale * qh @ kh.transpose(-1, -2) + (c_q[..., None] - c[:, :, None, :]).to(cdt)
    live = pos >= (cache_start.long() * page_size).repeat_interleave(G, dim=1)[..., None]  # [B, Hq, keys]
    ok = live[:, :, None, :] & (pos <= qpos[:, None, :, None])  # [B, Hq, Tq, keys]
    if window is not None:
        ok &= pos > qpos[:, None, :, None] - window
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1) @ vh
    return o.permute(0, 2, 1, 3).to(q.dtype).contiguous(), lse.float()  # contiguous, as the kernel's o


def _validate(q, k_cache, v_cache, c_cache, page_table, cache_start, lengths) -> None:
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, Tq, Hq, D], got {tuple(q.shape)}")
    check_dtype("q", q)
    B, Tq, Hq, D = q.shape
    if k_cache.dim() != 3 or k_cache.shape[2] != D:
        raise ValueError(f"k_cache: expected [num_pages, page_size, D={D}], got {tuple(k_cache.shape)}")
    if v_cache.dim() != 3 or v_cache.shape[:2] != k_cache.shape[:2]:
        raise ValueError(f"v_cache: expected [{k_cache.shape[0]}, {k_cache.shape[1]}, Dv], got {tuple(v_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache, v_cache: expected q's dtype {q.dtype}, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or q.stride(3) != 1:
        raise ValueError("q, k_cache, v_cache: the head dim must be contiguous")
    # The kernel reads a page table's pages and the lengths with stride 1.
    if (page_table.dim() != 3 or page_table.shape[0] != B or page_table.dtype != torch.int32
            or page_table.stride(2) != 1):
        raise ValueError(f"page_table: expected int32 [B={B}, Hk, max_pages] with contiguous pages, "
                         f"got {page_table.dtype} {tuple(page_table.shape)} strides {page_table.stride()}")
    Hk = page_table.shape[1]
    if 0 in (B, Hq, D, Hk, k_cache.shape[1], v_cache.shape[2]):  # they divide, or size the launch grid
        raise ValueError(f"q, k_cache, v_cache, page_table: expected at least one batch row, head, head dim, kv head "
                         f"and page slot, got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)} and "
                         f"{tuple(page_table.shape)}")
    if Hq % Hk:
        raise ValueError(f"q: its {Hq} heads must be a multiple of the cache's {Hk} kv heads")
    G = Hq // Hk
    if c_cache.dtype != torch.float64 or tuple(c_cache.shape) != (*k_cache.shape[:2], G) or c_cache.stride(2) != 1:
        raise ValueError(f"c_cache: expected contiguous float64 {(*k_cache.shape[:2], G)}, "
                         f"got {c_cache.dtype} {tuple(c_cache.shape)}")
    if cache_start.dtype != torch.int32 or tuple(cache_start.shape) != (B, Hk) or not cache_start.is_contiguous():
        raise ValueError(f"cache_start: expected contiguous int32 [{B}, {Hk}], "
                         f"got {cache_start.dtype} {tuple(cache_start.shape)}")
    if lengths.dtype != torch.int32 or tuple(lengths.shape) != (B,) or not lengths.is_contiguous():
        raise ValueError(f"lengths: expected contiguous int32 [{B}], got {lengths.dtype} {tuple(lengths.shape)} "
                         f"strides {lengths.stride()}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("c_cache", c_cache), ("page_table", page_table),
                    ("cache_start", cache_start), ("lengths", lengths)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_positions(Tq, k_cache.shape[0], k_cache.shape[1], page_table, cache_start, lengths)


def _check_positions(Tq, num_pages, page_size, page_table, cache_start, lengths) -> None:
    """The values the paths index the cache with, on the CPU (where reading them costs no host sync): out of range,
    the PyTorch path raised an IndexError and the kernel read other memory (NaN rows, or other sequences' keys)."""
    capacity = page_table.shape[2] * page_size
    bad = ((lengths < Tq) | (lengths > capacity)).nonzero()
    if len(bad):
        b = int(bad[0, 0])
        raise ValueError(f"lengths: expected each row's keys, its {Tq} new tokens included, between Tq={Tq} and the "
                         f"page table's {capacity} slots, got lengths[{b}] = {int(lengths[b])}")
    first_query_page = (lengths.long() - Tq) // page_size
    bad = ((cache_start < 0) | (cache_start > first_query_page[:, None])).nonzero()
    if len(bad):
        b, h = bad[0].tolist()
        raise ValueError(f"cache_start: expected a first live page between 0 and the page of row {b}'s first new "
                         f"token, {int(first_query_page[b])}, got cache_start[{b}, {h}] = {int(cache_start[b, h])}")
    pages = torch.arange(page_table.shape[2])
    live = (pages >= cache_start[..., None]) & (pages < (-(-lengths.long() // page_size))[:, None, None])
    bad = (live & ((page_table < 0) | (page_table >= num_pages))).nonzero()
    if len(bad):
        b, h, p = bad[0].tolist()
        raise ValueError(f"page_table: expected live pages in [0, {num_pages}) (the pool's pages), got "
                         f"page_table[{b}, {h}, {p}] = {int(page_table[b, h, p])}")


def forgetting_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_start: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Forgetting Attention of Tq new queries per sequence against a paged cache (layout: module docstring).

    Args:
        q: [B, Tq, Hq, D], the queries of positions lengths[b] - Tq .. lengths[b] - 1, causal among themselves.
        k_cache: [num_pages, page_size, D]; v_cache: [num_pages, page_size, Dv]; c_cache: [num_pages,
            page_size, Hq // Hk] float64 gate cumsums; all three already hold the new tokens.
        page_table: [B, Hk, max_pages] int32; cache_start: [B, Hk] int32 first live page; lengths: [B] int32.
        scale: logit scale, default 1/sqrt(D); any finite number.
        window: sliding window: query i sees keys j with i - window < j <= i (None: all).
        num_splits: key splits per (sequence, kv head) on the Triton path; default fills the GPU. Fix it
            (with the shapes) to reuse a captured CUDA graph as the lengths grow.
        return_lse: also return the natural-log row log-sum-exp [B, Hq, Tq] fp32.

    Returns:
        o: [B, Tq, Hq, Dv] in q's dtype (and lse); empty at once for Tq = 0.

    On the CPU, lengths outside [Tq, max_pages * page_size], a cache_start past the page of a row's first new token
    and live page-table entries outside the pool raise a ValueError. On a GPU they are not checked (a check would
    be a host sync every step, and none may happen while a CUDA graph is captured): such rows get undefined values
    (NaN, or other pages' keys), and an entry outside the pool may fault. The entries of pages not live (before
    cache_start, past a row's length) are never read, on either path, and may hold anything (-1, a freed page).
    """
    _validate(q, k_cache, v_cache, c_cache, page_table, cache_start, lengths)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window: expected a positive number of tokens (int) or None, got {window!r}")
    # 0 splits left every row's output NaN, and other non-ints failed deep in the launch
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 1:
            raise ValueError(f"num_splits: expected a positive int or None, got {num_splits!r}")
        num_splits = int(num_splits)  # a NumPy int too: the launch grid takes an int
    check_scale(scale)
    B, Tq, Hq, _ = q.shape
    if Tq == 0:  # nothing to attend, as torch SDPA and flash_attn answer it: the kernel's rows divide by Tq
        o = q.new_empty(B, 0, Hq, v_cache.shape[2])
        return (o, torch.empty(B, Hq, 0, dtype=torch.float32, device=q.device)) if return_lse else o
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    args = (q, k_cache, v_cache, c_cache, page_table, cache_start, lengths, scale, window)
    if use_triton(q):
        o, lse = _triton_decode(*args, num_splits)
    else:
        o, lse = decode_attention_torch(*args)
    return (o, lse) if return_lse else o


def evictable_pages(
    c_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_start: torch.Tensor,
    lengths: torch.Tensor,
    logit_bound: torch.Tensor,
    max_length: int,
    tolerance: float,
) -> torch.Tensor:
    """Pages of each (sequence, kv head) that no present or future query can give more than ``tolerance``.

    With |scale * q . k| <= U for every future query and key, a key j whose decay c_t - c_j at the newest
    position t is below delta = -(2U + log N) + log(tolerance) (N = ``max_length`` >= the final key count)
    carries less than ``tolerance`` in total for every later row, because the decay only grows. As c is
    monotone, such keys form a prefix; a kv head's key goes once all G query heads are past delta.

    logit_bound: U per query head, [Hq] or [B, Hq]. Returns the new ``cache_start`` [B, Hk] int32 (first
    live logical page); the pages between the old and the new start can be freed. The page holding the
    newest key is never evicted.
    """
    B, Hk, _ = page_table.shape
    page_size, G = c_cache.shape[1], c_cache.shape[2]
    delta = prune_threshold(logit_bound.float().expand(B, Hk * G), max_length, tolerance).view(B, Hk, G)
    last = (lengths.long() - 1).clamp_min(0)
    newest_page = page_table.long().gather(2, (last // page_size)[:, None, None].expand(B, Hk, 1))[..., 0]
    c_t = c_cache[newest_page, (last % page_size)[:, None]]  # [B, Hk, G]
    # A page may go iff its last key is past delta for every query head (keys inside are older still).
    pages = torch.arange(page_table.shape[2], device=c_cache.device)
    # only the full live pages before the newest can go; the other entries may hold anything (see the torch path)
    live = pages >= cache_start.long()[..., None]
    full = pages < (last // page_size)[:, None, None]
    last_key = c_cache[page_table.long().masked_fill(~(live & full), 0), page_size - 1]  # [B, Hk, max_pages, G]
    gone = ((c_t[:, :, None] - last_key) < delta[:, :, None].double()).all(-1) & full
    # Prefix length from the current start (gone is a prefix of the live pages, by monotonicity).
    kept_before = (~gone & live).long().cumsum(-1)
    n_gone = ((kept_before == 0) & live).sum(-1)
    return (cache_start.long() + n_gone).to(torch.int32)

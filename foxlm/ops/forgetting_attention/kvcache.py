"""Attention of new tokens over a KV cache, as flash_attn's ``flash_attn_with_kvcache``: the one function both of
foxlm's caches call once they have stored the new tokens, which picks the path itself.

- **prompt** (a row with nothing cached before): the new tokens alone through ``sequence_attention`` (the fused
  op on GPU), with ACP;
- **decode step** (at most ``DECODE_MAX_TQ`` new tokens in every row, no padding, every row cached): a paged cache
  through ``forgetting_attention_decode`` (the flash-decoding kernel, free of host syncs, so a step can be
  captured in a CUDA graph), a contiguous one through ``attention_from_cumsum``; no pruning;
- **chunk** (chunked prefill, or padding in the new tokens): ``attention_from_cumsum`` from the cached gate
  cumsum c (Tq < Tk), with ACP's threshold.

Two layouts, told apart by ``block_table``: contiguous, k_cache [B, N, Hk, D], v_cache [B, N, Hk, Dv], c_cache
[B, N, Hq] fp64, every row the same length; paged (``foxlm.ops.forgetting_attention.decode``'s layout), pools
k [P, page, D], v [P, page, Dv], c [P, page, Hq / Hk] fp64 with a page table per (row, kv head), rows of their
own lengths and a first live page per (row, kv head) after eviction.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

from .acp import ACP
from .decode import forgetting_attention_decode
from .gate import cu_seqlens_of_runs, cu_seqlens_of_starts
from .interface import sequence_attention
from .sdpa import attention_from_cumsum

# New tokens per row up to which a call with every row cached is a decode step rather than a chunk of prefill.
DECODE_MAX_TQ = 16


def forgetting_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c_cache: torch.Tensor,
    *,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor | None,
    cache_seqlens: int | Sequence[int],
    scale: float,
    window: int | None = None,
    prune: ACP | None = None,
    valid: torch.Tensor | None = None,
    seqlens_new: Sequence[int] | None = None,
    block_table: torch.Tensor | None = None,
    cache_start: torch.Tensor | None = None,
    cache_start_host: np.ndarray | None = None,
    cache_lengths: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of T new tokens per row over everything cached, the new tokens included: o [B, T, Hq, Dv] in q's
    dtype.

    q: [B, T, Hq, D]; k: [B, T, Hk, D], v: [B, T, Hk, Dv], log_fgate: [B, T, Hq] fp32 or None (no gate): the new
        tokens, already written to the cache with their gate cumsum (read by the prompt path).
    k_cache, v_cache, c_cache: the cache in either layout (module docstring), holding the new tokens.
    cache_seqlens: tokens each row held before this call (host: the path is picked without a device sync); an int
        for a contiguous cache.
    valid: [B, T] bool, False at padding, before and/or after each row's one run of real tokens (a contiguous cache
        stores padding, with c = +1e30 at it; a paged cache drops it). prune: ACP (``foxlm.ops.ACP``) for the prompt
        and chunks; window: sliding window.
    Paged layout only: seqlens_new, the new tokens stored per row (host; default T); block_table [B, Hk, max_pages]
    int32; cache_start [B, Hk] int32, the first live page, and cache_start_host, its host copy; cache_lengths [B]
    int32, the rows' lengths after this call; num_splits: the decode kernel's key splits.
    """
    B, T = q.shape[:2]
    if block_table is None:
        _check_contiguous(q, k_cache, v_cache, c_cache, k)
        # a float was cut to an int (attention from the wrong position), a list or a value past the cache failed
        # naming nothing or c_q
        if not (isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool)
                and 0 <= cache_seqlens <= k_cache.shape[1] - T):
            raise ValueError(f"cache_seqlens: expected the int number of tokens every row of a contiguous cache held "
                             f"before this call, 0 to {k_cache.shape[1] - T} (the cache's {k_cache.shape[1]} slots "
                             f"less the {T} new tokens), got {cache_seqlens!r}")
        return _contiguous(q, k_cache, v_cache, c_cache, k, v, log_fgate, int(cache_seqlens), scale, window, prune,
                           valid)
    # the paged layout's own arguments: missing, they failed as None deep in a path (which one, by the lengths)
    missing = [name for name, x in (("cache_start", cache_start), ("cache_start_host", cache_start_host),
                                    ("cache_lengths", cache_lengths)) if x is None]
    if missing:
        raise ValueError(f"{', '.join(missing)}: a paged cache (block_table given) needs cache_start, cache_start_host "
                         f"and cache_lengths")
    if np.shape(cache_start_host) != tuple(block_table.shape[:2]):
        raise ValueError(f"cache_start_host: expected the host copy of cache_start, [B, Hk] = "
                         f"{list(block_table.shape[:2])}, got the shape {list(np.shape(cache_start_host))}")
    before = np.asarray(cache_seqlens)
    if before.shape != (B,) or before.dtype.kind not in "iu" or (before < 0).any():
        raise ValueError(f"cache_seqlens: expected the tokens each of the {B} rows of a paged cache held before this "
                         f"call, {B} ints >= 0 (host), got {cache_seqlens!r}")
    if T <= DECODE_MAX_TQ and valid is None and bool(before.min() > 0):
        # in q's dtype, as the other paths' (and flash_attn's): a cache of another dtype gave its own
        return forgetting_attention_decode(q.to(k_cache.dtype), k_cache, v_cache, c_cache, block_table, cache_start,
                                           cache_lengths, scale=scale, window=window, num_splits=num_splits).to(q.dtype)
    new = np.full(B, T) if seqlens_new is None else np.asarray(seqlens_new)
    first = _first_real(valid, new, T)
    o = q.new_zeros(*q.shape[:3], v.shape[-1])
    G = q.shape[2] // k.shape[2]
    page_size = k_cache.shape[1]
    for b in range(B):
        n, total = int(new[b]), int(before[b] + new[b])
        if n == 0:
            continue
        rows = slice(int(first[b]), int(first[b]) + n)  # a paged cache holds real tokens only, in the order they came
        if n == total:  # a fresh row: everything is in hand
            lf = log_fgate[b:b + 1, rows] if log_fgate is not None else None
            o[b:b + 1, rows] = sequence_attention(q[b:b + 1, rows], k[b:b + 1, rows], v[b:b + 1, rows], lf,
                                                  scale=scale, window=window, prune=prune)[0]
            continue
        for h in _same_start(cache_start_host[b]):
            heads = slice(h.start * G, h.stop * G)
            kk, vv, cc = _gather(k_cache, v_cache, c_cache, block_table[b, h],
                                 int(cache_start_host[b, h.start]) * page_size, total)
            qq = q[b:b + 1, rows, heads].to(k_cache.dtype)
            threshold = None if prune is None else prune.for_heads(heads).threshold(qq, kk, scale=scale, window=window)
            o[b:b + 1, rows, heads] = attention_from_cumsum(qq, kk, vv, cc[:, -n:], cc, scale=scale, window=window,
                                                            threshold=threshold)[0]
    return o


def _check_contiguous(q, k_cache, v_cache, c_cache, k) -> None:
    """A contiguous cache's tensors against q and k: a mistaken one failed as the op's internal c_q, k or v."""
    B, _, Hq, D = q.shape
    N, Hk = k_cache.shape[1], k.shape[2]
    for name, x, want, dims in (("k_cache", k_cache, (B, N, Hk, D), "B, N, Hk, D"),
                                ("v_cache", v_cache, (B, N, Hk, v_cache.shape[-1]), "B, N, Hk, Dv"),
                                ("c_cache", c_cache, (B, N, Hq), "B, N, Hq")):
        if tuple(x.shape) != want:
            raise ValueError(f"{name}: expected [{dims}] = {list(want)} (q {list(q.shape)}, k {list(k.shape)}), "
                             f"got {list(x.shape)}")
    if c_cache.dtype != torch.float64:
        raise ValueError(f"c_cache: expected the fp64 gate cumsum, got {c_cache.dtype}")


def _first_real(valid: torch.Tensor | None, new: np.ndarray, T: int) -> np.ndarray:
    """The column of each row's first new real token (host). A row's real tokens in a call are one run, with padding
    before it (left), after it (right) or both, all of which a paged cache drops."""
    if valid is None:
        return T - new
    cols = torch.arange(T, device=valid.device)
    first, last, count = torch.stack([torch.where(valid, cols, T).amin(1), torch.where(valid, cols, -1).amax(1),
                                      valid.sum(1)]).cpu().numpy()
    if not np.array_equal(count, new) or ((count > 0) & (last - first + 1 != count)).any():
        raise ValueError(f"valid: each row's real tokens must be one run of its seqlens_new ({new.tolist()}) tokens, "
                         f"with padding before and/or after it; got {count.tolist()} real tokens a row")
    return np.where(count > 0, first, 0)


def _contiguous(q, k_cache, v_cache, c_cache, k, v, log_fgate, before, scale, window, prune, valid) -> torch.Tensor:
    T = q.shape[1]
    if before == 0:
        cu_seqlens = max_seqlen = None
        if valid is not None and torch.compiler.is_compiling():  # the same sequences, without a host sync
            cu_seqlens, max_seqlen = cu_seqlens_of_runs(valid)
        elif valid is not None and not bool(valid.all()):  # padding: sequences of its own, apart from the real tokens
            cu_seqlens, max_seqlen = cu_seqlens_of_starts(valid != torch.cat([valid[:, :1], valid[:, :-1]], dim=1))
        return sequence_attention(q, k, v, log_fgate, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                  window=window, prune=prune)[0]
    n = before + T
    kk, vv, cc = k_cache[:, :n], v_cache[:, :n], c_cache[:, :n]
    threshold = None
    # a chunk of prefill, not a decode step; compiled, every call gets valid (it cannot ask whether there is padding),
    # so there a call of decode steps' size never prunes, as eager's decode steps
    if prune is not None and (T > DECODE_MAX_TQ or (valid is not None and not torch.compiler.is_compiling())):
        threshold = prune.threshold(q, kk, scale=scale, window=window)
    return attention_from_cumsum(q, kk, vv, cc[:, n - T:], cc, scale=scale, window=window, threshold=threshold)[0]


def _same_start(start: np.ndarray) -> list[slice]:
    """kv heads with the same first live page (one call each; all of them when nothing was evicted)."""
    if (start == start[0]).all():
        return [slice(0, len(start))]
    return [slice(h, h + 1) for h in range(len(start))]


def _gather(k_cache, v_cache, c_cache, table: torch.Tensor, first: int, total: int):
    """Contiguous k, v [1, n, h, D] and c [1, n, h*G] of keys [first, total) from one row's page table [h, pages]."""
    ps = k_cache.shape[1]
    pages = table[:, first // ps: -(-total // ps)].long()  # [h, P]
    lo, n = first % ps, total - first
    kk = k_cache[pages].flatten(1, 2)[:, lo:lo + n].transpose(0, 1)[None]
    vv = v_cache[pages].flatten(1, 2)[:, lo:lo + n].transpose(0, 1)[None]
    cc = c_cache[pages].flatten(1, 2)[:, lo:lo + n].permute(1, 0, 2).reshape(1, n, -1)
    return kk, vv, cc

"""``PagedFoxCache``: the paged KV cache of foxlm's generation path, with forget-gate eviction.

It implements ``foxlm.models.cache.KVCache`` (``attend``, token-shift state, ``get_seq_length``), so
``FoxForCausalLM`` decodes with it unchanged. Layout (see ``foxlm.ops.forgetting_attention.decode``): one pool of
pages shared by all layers, k [P, page_size, D], v [P, page_size, Dv], gate cumsum c [P, page_size, G] fp64;
a page table [L, B, Hk, max_pages] maps every (layer, row, kv head) logical page to a pool page; ``cache_start``
[L, B, Hk] is the first live page. Only real tokens are stored (padding, left or right, is dropped), so rows have
their own lengths.

Steps: the first call of a forward (layer 0) books the new tokens' pages on the host (no device sync when
the batch is unpadded) and moves the device-side ``write_pos`` / ``lengths``; every layer then writes its
k, v, c and attends through ``foxlm.ops.forgetting_attention_with_kvcache``, which picks the path (the
flash-decoding kernel for decode steps; prefill row by row). The cache stores and books pages; it holds no
attention math. A decode step is free of host syncs and fixed in shape, so ``foxlm.generate`` captures it in a
CUDA graph.

Two things free pages, both by moving ``cache_start`` (its host mirror and the device tensor, in ``_release``):
- eviction (``evict()``): with the per-head logit bound U of a QK-norm model, pages whose keys have decayed below
  delta = -(2U + log N) + log(tolerance) for all their query heads are freed (``evictable_pages``);
- the sliding window (``window``): query i sees keys j > i - window, and queries only move forward, so ``begin``
  frees the pages whose keys are all <= length - window before it books the new tokens' pages, which reuse them (the
  pool stays at ceil(window / page_size) + 1 pages a head while decoding). It runs on the host mirrors, as the
  booking does, before a captured step is replayed: the step itself stays free of host syncs and fixed in shape.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..ops import ACP, forgetting_attention_with_kvcache
from ..ops.forgetting_attention.decode import default_num_splits, evictable_pages
from ..ops.forgetting_attention.gate import continue_cumsum

_TRASH_PAGE = 0  # padding is written here and never read


class PagedFoxCache:
    """Paged KV cache with per-row lengths and forget-gate eviction; implements ``foxlm.models.cache.KVCache``.

    Args:
        num_layers, num_heads (Hq), num_kv_heads (Hk), head_dim (D): the model's attention shape.
        batch_size: rows B; max_length: the most tokens any row will hold (N of the eviction bound).
        page_size: tokens per page (the eviction granularity).
        num_pages: initial pool size (default: every page of every row at ``max_length``, i.e. a static
            cache, or with ``window`` the pages a decode step reads; a smaller pool grows on demand, which bumps
            ``version``).
        logit_bounds: per layer, U [Hq] fp32 (``ForgettingAttention.logit_bound(bound_dtype)``), needed by ``evict``.
        bound_dtype: the dtype of q and k whose rounding ``logit_bounds`` allow for (default ``dtype``): ``evict``
            refuses to act on queries of a coarser one (their logits may pass the bound).
        tolerance: attention mass an evicted key may still carry (epsilon of the bound).
        window: the model's sliding window (``attend``'s): the pages no later query can see are freed. None: keep
            every page (``attend`` then takes any window).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        batch_size: int,
        max_length: int,
        device: torch.device | str,
        dtype: torch.dtype,
        page_size: int = 64,
        num_pages: int | None = None,
        logit_bounds: list[torch.Tensor | None] | None = None,
        tolerance: float = math.exp(-10),
        window: int | None = None,
        bound_dtype: torch.dtype | None = None,
    ):
        # sizes of the pool and the tables: another type or 0 failed inside torch.zeros, or made a cache of nothing
        for name, n in (("num_layers", num_layers), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("batch_size", batch_size), ("max_length", max_length),
                        ("page_size", page_size), ("num_pages", num_pages)):
            if (n is not None or name != "num_pages") and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name}: expected a positive int{' or None' if name == 'num_pages' else ''}, "
                                 f"got {n!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window: expected a positive int or None, got {window!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: must divide num_heads={num_heads}, got {num_kv_heads}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating-point dtype for the keys and values, got {dtype}")
        if bound_dtype is not None and not (isinstance(bound_dtype, torch.dtype) and bound_dtype.is_floating_point):
            raise ValueError(f"bound_dtype: expected a floating-point torch.dtype or None, got {bound_dtype!r}")
        if logit_bounds is not None and len(logit_bounds) != num_layers:
            raise ValueError(f"logit_bounds: expected one per layer ({num_layers}) or None, got {len(logit_bounds)}")
        ACP(tolerance)  # the eviction bound's epsilon, validated as ACP's
        self.num_layers, self.batch_size, self.max_length = num_layers, batch_size, max_length
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.page_size, self.tolerance, self.window = page_size, tolerance, window
        self.device, self.dtype = torch.device(device), dtype
        self.logit_bounds = logit_bounds
        self.bound_dtype = dtype if bound_dtype is None else bound_dtype
        self._coarsest_q = self.bound_dtype  # of the queries attended so far, checked by evict
        self.max_pages = math.ceil(max_length / page_size)
        L, B, Hk = num_layers, batch_size, num_kv_heads
        # with a window, what a decode step reads: the pages of keys j > length - window, the new token's included
        per_head = self.max_pages if window is None else min(self.max_pages, -(-window // page_size) + 1)
        full = 1 + L * B * Hk * per_head
        self.version = 0  # bumped whenever the pool tensors are reallocated (a captured graph is stale then)
        self._alloc_pool(full if num_pages is None else max(2, num_pages))
        self.page_table = torch.zeros(L, B, Hk, self.max_pages, dtype=torch.int32, device=self.device)
        self.cache_start = torch.zeros(L, B, Hk, dtype=torch.int32, device=self.device)
        self.lengths = torch.zeros(B, dtype=torch.int32, device=self.device)
        self.write_pos = torch.zeros(B, dtype=torch.int32, device=self.device)
        self.c_last = torch.zeros(L, B, num_heads, dtype=torch.float64, device=self.device)
        self._shift: dict[tuple[int, str], torch.Tensor] = {}
        self._last_output: torch.Tensor | None = None  # filled in place: a captured decode step writes it
        # Host mirrors: what is booked where, so that steps need no device sync.
        self._table = np.zeros((L, B, Hk, self.max_pages), dtype=np.int64)
        self._start = np.zeros((L, B, Hk), dtype=np.int64)
        self._len = np.zeros(B, dtype=np.int64)
        self._len_before = np.zeros(B, dtype=np.int64)
        self._columns = 0
        self._begun = False
        self.num_splits = default_num_splits(B, Hk, max_length, self.device)

    @classmethod
    def from_model(cls, model, batch_size: int, max_length: int, *, compute_dtype: torch.dtype | None = None,
                   **kwargs) -> "PagedFoxCache":
        """A cache shaped for ``model`` (a ``FoxForCausalLM``, or a PEFT model around one), with its layers' QK-norm
        logit bounds.

        compute_dtype: the dtype q and k reach attention in, whose rounding the bounds allow for. Default: autocast's
        where autocast is on for the model's device at this call (it casts the projections of any params but fp64
        ones, and the norm keeps their dtype), else the params'. The keys and values are kept in the params' dtype.
        """
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype: expected a floating-point torch.dtype or None, got {compute_dtype!r}")
        cfg = model.config
        param = next(model.parameters())
        if compute_dtype is None:
            # an fp32 model under bf16 autocast gives bf16 q and k: the fp32 margin was too small for their rounding
            autocast = param.dtype != torch.float64 and torch.is_autocast_enabled(param.device.type)
            compute_dtype = torch.get_autocast_dtype(param.device.type) if autocast else param.dtype
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's: its adapters injected
        bounds = [block.attn.logit_bound(compute_dtype) for block in base.model.layers]
        return cls(
            num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, batch_size=batch_size,
            max_length=max_length, device=param.device, dtype=param.dtype,
            logit_bounds=None if any(b is None for b in bounds) else bounds, bound_dtype=compute_dtype,
            **{"window": getattr(cfg, "window", None), **kwargs},
        )

    # ----------------------------------------------------------------------------------- pool and pages
    def _alloc_pool(self, num_pages: int) -> None:
        old = getattr(self, "k_pool", None)
        ps, D = self.page_size, self.head_dim
        k = torch.zeros(num_pages, ps, D, dtype=self.dtype, device=self.device)
        v = torch.zeros(num_pages, ps, D, dtype=self.dtype, device=self.device)
        c = torch.zeros(num_pages, ps, self.group, dtype=torch.float64, device=self.device)
        if old is None:
            self._free = list(range(num_pages - 1, _TRASH_PAGE, -1))  # pop() hands out low pages first
        else:
            n = old.shape[0]
            k[:n], v[:n], c[:n] = self.k_pool, self.v_pool, self.c_pool
            self._free = list(range(num_pages - 1, n - 1, -1)) + self._free
            self.version += 1
        self.k_pool, self.v_pool, self.c_pool = k, v, c

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            have = self.k_pool.shape[0]
            self._alloc_pool(max(2 * have, have + n - len(self._free)))
        taken = self._free[-n:]
        del self._free[-n:]
        return taken[::-1]

    def begin(self, T: int, valid: torch.Tensor | None = None) -> None:
        """Book pages for a forward of T new tokens per row (``valid`` [B, T]: False at padding).

        The first write of a forward (``set_shift_state`` or ``attend`` at layer 0) does this by itself, before it
        changes anything, so that a refused forward leaves the cache as it was; call it before the forward instead
        when the positions of the new tokens (``write_pos``) must be known first, or before replaying a captured
        decode step (then ``end_step`` after the replay, in which no ``attend`` ran to take the booking).
        """
        n_new = np.full(self.batch_size, T) if valid is None else valid.sum(1).cpu().numpy()
        new_len = self._len + n_new
        if int(new_len.max()) > self.max_length:
            raise ValueError(f"max_length: a row would hold {int(new_len.max())} tokens, "
                             f"the cache was made for {self.max_length}")
        ps = self.page_size
        if self.window is not None:
            # this forward's first query sits at the row's length: keys j <= length - window are out of every later
            # window. The page of a row's newest key stays (evictable_pages reads its c; a row may get no token now).
            gone = np.minimum(np.maximum(self._len - self.window + 1, 0) // ps, np.maximum(self._len - 1, 0) // ps)
            self._release(np.maximum(self._start, gone[None, :, None]))
        idx = []
        for b in range(self.batch_size):
            first, last = -(-int(self._len[b]) // ps), -(-int(new_len[b]) // ps)
            idx.extend((b, p) for p in range(first, last))
        if idx:
            L, Hk = self.num_layers, self.num_kv_heads
            pages = np.asarray(self._take(len(idx) * L * Hk)).reshape(L, len(idx), Hk)
            rows, cols = np.asarray(idx).T
            self._table[:, rows, :, cols] = pages.transpose(1, 0, 2)
            dev = torch.from_numpy(self._table[:, rows, :, cols]).to(self.device, torch.int32)
            self.page_table[:, torch.from_numpy(rows).to(self.device), :, torch.from_numpy(cols).to(self.device)] = dev
        self._len_before = self._len
        self._len = new_len
        self._columns += T
        self.write_pos.copy_(self.lengths)
        self.lengths.add_(T if valid is None else valid.sum(1).to(torch.int32))
        self._begun = True

    def end_step(self) -> None:
        """Close the step ``begin`` booked, where the forward ran without ``attend`` (a CUDA graph's replay):
        the next forward books its own pages."""
        self._begun = False

    def evict(self) -> int:
        """Free the pages no future query can give more than ``tolerance`` (see ``evictable_pages``).

        Needs the logit bounds of a QK-norm model. One device sync. Returns the number of pages freed.
        """
        if self.logit_bounds is None:
            raise ValueError("evict: needs a logit bound for every layer, which only QK-norm models give "
                             "(qk_norm=True)")
        if self._coarsest_q != self.bound_dtype:  # e.g. a cache made outside autocast, attended under it
            raise ValueError(f"evict: the queries came in {self._coarsest_q}, but the logit bounds allow for "
                             f"{self.bound_dtype}'s rounding only, and could free keys above the tolerance; make the "
                             f"cache with PagedFoxCache.from_model(..., compute_dtype={self._coarsest_q})")
        starts = torch.stack([
            evictable_pages(self.c_pool, self.page_table[layer], self.cache_start[layer], self.lengths,
                            self.logit_bounds[layer].to(self.device), self.max_length, self.tolerance)
            for layer in range(self.num_layers)
        ])
        return self._release(starts.cpu().numpy().astype(np.int64))

    def _release(self, start: np.ndarray) -> int:
        """Give the pool the pages before ``start`` [L, B, Hk] (host, >= the current first live pages) and move
        ``cache_start`` there. Returns the number of pages freed."""
        freed = 0
        for layer, b, h in zip(*np.nonzero(start > self._start)):
            pages = self._table[layer, b, h, self._start[layer, b, h]:start[layer, b, h]]
            self._free.extend(int(p) for p in pages[::-1])
            freed += len(pages)
        if freed:
            self._start = start
            self.cache_start.copy_(torch.from_numpy(start))
        return freed

    def stats(self) -> dict:
        """Cache size: live pages against the pages a full cache of the same lengths would hold."""
        full_per_row = -(-self._len // self.page_size)  # [B]
        full = int(full_per_row.sum()) * self.num_layers * self.num_kv_heads
        live = full - int(self._start.sum())
        per_layer = [
            1.0 - float(self._start[layer].sum()) / max(1, int(full_per_row.sum()) * self.num_kv_heads)
            for layer in range(self.num_layers)
        ]
        return dict(live_pages=live, full_pages=full, fraction=live / max(1, full), per_layer=per_layer,
                    pool_pages=int(self.k_pool.shape[0]), page_size=self.page_size)

    # --------------------------------------------------------------------------------- cache protocol
    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        log_fgate: torch.Tensor | None,
        *,
        scale: float,
        valid: torch.Tensor | None = None,
        window: int | None = None,
        prune: ACP | None = None,
    ) -> torch.Tensor:
        """``KVCache.attend``: store the new tokens' k, v and gate cumsum, and return their attention over the cache.

        q: [B, T, Hq, D], k: [B, T, Hk, D], v: [B, T, Hk, Dv], log_fgate: [B, T, Hq] fp32 or None,
        valid: [B, T] bool, False at padding (before and/or after a row's real tokens). Returns o: [B, T, Hq, Dv]
        (zeros at padding).
        """
        self._check_new(q, k, v, log_fgate)  # before begin(): a refused call changes nothing
        if self.window is not None and (window is None or window > self.window):
            raise ValueError(f"window: this cache frees the keys outside window={self.window}, got {window} (which "
                             f"would read them); make it with window={window}")
        if layer_idx == 0:
            if torch.finfo(q.dtype).eps > torch.finfo(self._coarsest_q).eps:  # one dtype a forward
                self._coarsest_q = q.dtype
            if not self._begun:
                self.begin(q.shape[1], valid)
            self.end_step()  # this forward takes the booking
        self._write(layer_idx, k, v, log_fgate, valid)
        return forgetting_attention_with_kvcache(
            q, self.k_pool, self.v_pool, self.c_pool, k=k, v=v, log_fgate=log_fgate, cache_seqlens=self._len_before,
            scale=scale, window=window, prune=prune, valid=valid, seqlens_new=self._len - self._len_before,
            block_table=self.page_table[layer_idx], cache_start=self.cache_start[layer_idx],
            cache_start_host=self._start[layer_idx], cache_lengths=self.lengths, num_splits=self.num_splits,
        )

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, log_fgate: torch.Tensor | None,
              valid: torch.Tensor | None = None) -> torch.Tensor:
        """Write the new tokens of one layer (booked by ``begin``) into their pages, without attending.

        k: [B, T, Hk, D], v: [B, T, Hk, Dv], log_fgate: [B, T, Hq] or None. Returns c [B, T, Hq] fp64.
        """
        self._check_new(None, k, v, log_fgate)
        return self._write(layer, k, v, log_fgate, valid)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, log_fgate: torch.Tensor | None,
               valid: torch.Tensor | None) -> torch.Tensor:
        """``store`` of checked tensors."""
        B, T, Hk, D = k.shape
        offset = torch.arange(T, device=k.device) if valid is None else valid.long().cumsum(1) - 1
        c = continue_cumsum(self.c_last[layer], log_fgate, T, valid)
        self.c_last[layer].copy_(c[:, -1])
        pos = (self.write_pos.long()[:, None] + offset).clamp_min(0)  # [B, T]
        page = self.page_table[layer].long().gather(2, (pos // self.page_size)[:, None].expand(B, Hk, T))
        slot = page * self.page_size + (pos % self.page_size)[:, None]  # [B, Hk, T]
        if valid is not None:
            slot = slot.masked_fill(~valid[:, None], _TRASH_PAGE * self.page_size)
        slot = slot.flatten()
        Dv = v.shape[-1]
        self.k_pool.view(-1, D).index_copy_(0, slot, k.permute(0, 2, 1, 3).reshape(-1, D).to(self.dtype))
        self.v_pool.view(-1, Dv).index_copy_(0, slot, v.permute(0, 2, 1, 3).reshape(-1, Dv).to(self.dtype))
        cg = c.view(B, T, Hk, self.group).permute(0, 2, 1, 3).reshape(-1, self.group)
        self.c_pool.view(-1, self.group).index_copy_(0, slot, cg)
        return c

    def _check_new(self, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                   log_fgate: torch.Tensor | None) -> None:
        """The new tokens' shapes against the cache's: the pools are written through flat views, so a head dim
        other than ``head_dim`` was written across slots (over other tokens' keys) instead of refused."""
        B, D, Hq, Hk = self.batch_size, self.head_dim, self.num_heads, self.num_kv_heads
        T = (q if q is not None else k).shape[1]
        for name, x, want, dims in (("q", q, (B, T, Hq, D), "B, T, Hq, head_dim"),
                                    ("k", k, (B, T, Hk, D), "B, T, Hk, head_dim"),
                                    ("v", v, (B, T, Hk, D), "B, T, Hk, head_dim"),
                                    ("log_fgate", log_fgate, (B, T, Hq), "B, T, Hq")):
            if x is not None and tuple(x.shape) != want:
                raise ValueError(f"{name}: expected [{dims}] = {list(want)} as the cache, got {list(x.shape)}")

    def get_shift_state(self, layer_idx: int, name: str) -> torch.Tensor | None:
        """The pre-shift projection [B, Hk, D] of stream ``name`` at each row's last token, or None."""
        buf = self._shift.get((layer_idx, name))
        return None if buf is None else buf.clone()  # the layer overwrites the state before using it

    def set_shift_state(self, layer_idx: int, name: str, x: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep each row's pre-shift projection of its last real token among x: [B, T, Hk, D] (valid [B, T]: False
        at padding); a row with none in this call (right padding after its prompt) keeps the state it had."""
        if x.shape[0] != self.batch_size or x.shape[2] != self.num_kv_heads:
            raise ValueError(f"x: expected B={self.batch_size}, Hk={self.num_kv_heads}, got {tuple(x.shape)}")
        if layer_idx == 0 and not self._begun:  # a forward's first write: book (checks max_length) before any change
            self.begin(x.shape[1], valid)
        buf = self._shift.get((layer_idx, name))
        if valid is None:
            last = x[:, -1]
        else:
            cols = torch.arange(x.shape[1], device=x.device)
            at = torch.where(valid, cols, -1).amax(1)  # [B]; -1: no real token in this call
            last = x.gather(1, at.clamp_min(0)[:, None, None, None].expand(-1, 1, *x.shape[2:]))[:, 0]
            before = buf if buf is not None else torch.zeros_like(last)
            last = torch.where((at >= 0)[:, None, None], last, before)
        if buf is None:
            self._shift[(layer_idx, name)] = last.detach().clone()
        else:
            buf.copy_(last)

    def get_last_output(self) -> torch.Tensor | None:
        """The model's output [B, C] at each row's last real token (``KVCache``), or None before any forward."""
        return self._last_output

    def set_last_output(self, x: torch.Tensor) -> None:
        if self._last_output is None:
            self._last_output = x.detach().clone()
        else:
            self._last_output.copy_(x)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns fed so far (left padding included), as ``FoxForCausalLM`` expects of ``attention_mask``."""
        return self._columns

    def __len__(self) -> int:
        return self.num_layers

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PagedFoxCache(layers={self.num_layers}, batch={self.batch_size}, lengths={self._len.tolist()}, "
                f"live_pages={s['live_pages']}/{s['full_pages']})")

"""KV caches for decoding FoX models: the ``KVCache`` protocol every cache implements, and ``FoxCache``.

``ForgettingAttention`` never touches cache tensors; it talks to a cache only through ``KVCache``, so a different
implementation (e.g. ``foxlm.generate``'s paged cache with forget-gate eviction and a Triton decode kernel) plugs
in without changing the layer or the model. Caches store; the attention itself is one function of the op,
``foxlm.ops.forgetting_attention_with_kvcache``, which picks the prompt, chunk or decode-step path.

FoxCache, the default implementation, is a contiguous per-layer cache.
"""

from __future__ import annotations

import operator
from typing import Protocol, runtime_checkable

import torch
from transformers.cache_utils import Cache

from ..ops import ACP, forgetting_attention_with_kvcache
from ..ops.forgetting_attention.gate import continue_cumsum


@runtime_checkable
class KVCache(Protocol):
    """What a KV cache offers ``ForgettingAttention``. Caches for HF ``generate`` with beams or several sequences
    per prompt also have ``reorder_cache(beam_idx)``, ``batch_select_indices(indices)``,
    ``batch_repeat_interleave(repeats)`` and ``reset()``. A cache may also keep the model's output at each row's
    last real token, ``get_last_output()`` / ``set_last_output(x)`` ([B, C], None before any call), which
    ``FoxModel`` returns at a padded position with no real token before it in its own call (a right-padded row's
    chunk of padding only: generate reads the next token off the last position); both of foxlm's caches do."""

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
        """Append the new tokens and return their attention over everything cached: o [B, T, Hq, Dv].

        q: [B, T, Hq, D] queries of T new tokens; k: [B, T, Hk, D], v: [B, T, Hk, Dv] their keys and values,
        already token-shifted, QK-normed and rotated (exactly what is to be cached); log_fgate: [B, T, Hq] fp32
        log forget gates, or None for a model without a gate (attention without decay). The cache appends k, v
        and the gate cumsum c of the new tokens, c_t = c_{t-1} + log f_t, a running fp64 sum per (row, head)
        (``foxlm.ops.forgetting_attention.gate.continue_cumsum``). Query i sees the cached keys j <= i with logits
        ``scale * q_i . k_j + c_i - c_j`` (T > 1 with a non-empty cache is chunked prefill: Tq < Tk).
        valid: [B, T] bool, False at padding: before a row's real tokens (left padding) or after them (right padding,
        which later calls' tokens follow). A padded key must never be seen by a real query, adds no decay, and
        leaves the token-shift state as it was; outputs at padded queries are finite but meaningless.
        window: sliding-window attention (keys j > i - window). prune: the layer's ACP setting (``foxlm.ops.ACP``),
        or None; its ``logit_bound`` ([Hq] fp32, from the QK-norm weights; None without QK-norm) bounds
        |scale * q . k| for every token now and later, which is what makes evicting a key safe once
        c_t - c_j < delta = -(2U + log N) + log(tolerance) (``ACP.delta``): decay only grows.
        """
        ...

    def get_shift_state(self, layer_idx: int, name: str) -> torch.Tensor | None:
        """The token-shift state of stream ``name`` ("k" or "v"): the pre-shift projection [B, Hk, D] of the last
        real token seen (zeros before any), or None before the first token."""
        ...

    def set_shift_state(self, layer_idx: int, name: str, x: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Hand over the new tokens' pre-shift projections x: [B, T, Hk, D] (zeros at padding); the layer reads
        the state before shifting them. valid: [B, T] bool, False at padding, as ``attend``'s. A cache keeps at least
        each row's last real one (its state before the call where the row has none: right padding keeps it)."""
        ...

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached so far (padding included), as HF ``generate`` expects."""
        ...


# Gate cumsum stored for padded keys: every real query has c_i - c_j <= -1e30 against them.
PAD_DECAY = 1e30
# Pre-shift projections FoxCache keeps per layer and stream: how far back ``crop`` can go in a model with
# token shift, unless the cache records its past for a rollback (``FoxCache.activate_past_recording``).
SHIFT_HISTORY = 256


class _LayerCache:
    """Keys, values and gate cumsum of one layer, in buffers that double when full. ``record_past``: whether the
    token-shift history is kept whole until the next crop (``FoxCache.activate_past_recording``); transformers turns
    it off on each of ``cache.layers``, as on its own layers, and that trims the history back."""

    def __init__(self, record_past: bool = False):
        self.length = 0
        self.k = self.v = self.c = self.c_last = None
        self.shift: dict[str, torch.Tensor] = {}
        self._record_past = record_past

    @property
    def record_past(self) -> bool:
        return self._record_past

    @record_past.setter
    def record_past(self, on: bool) -> None:
        self._record_past = on
        if not on:  # back to what a cache that never recorded keeps
            self.trim_shift()

    def append(self, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor) -> None:
        n = self.length + k.shape[1]
        if self.k is None or n > self.k.shape[1]:
            cap = max(n, 2 * (0 if self.k is None else self.k.shape[1]), 64)
            self.k, self.v, self.c = (self._grow(old, new, cap) for old, new in ((self.k, k), (self.v, v), (self.c, c)))
        self.k[:, self.length:n] = k
        self.v[:, self.length:n] = v
        self.c[:, self.length:n] = c
        self.length = n

    def _grow(self, old: torch.Tensor | None, new: torch.Tensor, cap: int) -> torch.Tensor:
        buf = new.new_empty(new.shape[0], cap, *new.shape[2:])
        if old is not None:
            buf[:, : self.length] = old[:, : self.length]
        return buf

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (0 < length < self.length)."""
        dropped = self.length - length
        for name, hist in self.shift.items():
            if hist.shape[1] <= dropped:
                raise ValueError(f"max_length: FoxCache can crop at most {hist.shape[1] - 1} tokens of a model "
                                 f"with token shift (it keeps the last {SHIFT_HISTORY}), asked for {dropped}")
        self.shift = {name: hist[:, :-dropped] for name, hist in self.shift.items()}
        c = self.c[:, :length]
        last = torch.where(c[..., 0] != PAD_DECAY, torch.arange(length, device=c.device), -1).amax(1)  # last real
        kept = c.gather(1, last.clamp_min(0)[:, None, None].expand(-1, 1, c.shape[2]))[:, 0]
        self.c_last = torch.where(last[:, None] >= 0, kept, 0.0)  # only padding so far: sum 0
        self.length = length

    def carry_shift(self, T: int, valid: torch.Tensor | None, trim: bool = True) -> None:
        """Settle the token-shift history of the T tokens just handed over: a padded position keeps the state
        before it (the last real token's projection, zeros before any), so that the token after right padding
        shifts from the last real token; then keep the last ``SHIFT_HISTORY`` (all of it without ``trim``)."""
        for name, hist in self.shift.items():
            if valid is not None:
                new, before = hist[:, -T:], hist[:, -T - 1:-T] if hist.shape[1] > T else torch.zeros_like(hist[:, :1])
                steps = torch.arange(1, T + 1, device=valid.device)
                source = torch.where(valid, steps, 0).cummax(1).values  # 0: the state before this call
                both = torch.cat([before, new], 1)
                new = both.gather(1, source.view(*source.shape, 1, 1).expand(-1, -1, *new.shape[2:]))
                hist = torch.cat([hist[:, :-T], new], 1)
            self.shift[name] = hist
        if trim:
            self.trim_shift()

    def trim_shift(self) -> None:
        """Keep the last ``SHIFT_HISTORY`` of the token-shift history."""
        self.shift = {name: hist[:, -SHIFT_HISTORY:] for name, hist in self.shift.items()}

    def apply(self, fn) -> None:
        """Apply ``fn`` to every batch-major tensor (beam reordering and friends)."""
        for name in ("k", "v", "c", "c_last"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
        self.shift = {key: fn(x) for key, x in self.shift.items()}


class FoxCache(Cache):
    """The default, contiguous KV cache of FoX models; implements ``KVCache``.

    Created by ``FoxForCausalLM`` when ``use_cache=True`` (HF ``generate`` does this), or by hand:
    ``cache = FoxCache(); out = model(ids, cache=cache, use_cache=True)``.
    """

    def __init__(self, num_layers: int | None = None):
        # the layers are transformers' ``cache.layers``: it switches recording off through their ``record_past``
        super().__init__(layers=[_LayerCache() for _ in range(num_layers or 0)])
        self._last_output: torch.Tensor | None = None
        self._record_past = False  # for layers made before any exists (FoxCache() fills its layers at the first call)

    def activate_past_recording(self, **kwargs) -> None:
        """Keep the whole token-shift history from now to each ``crop``, so that a crop can drop any number of
        tokens (transformers' hook, called before assisted decoding: its drafts can be longer than
        ``SHIFT_HISTORY``). Each crop, ``crop(0)`` included, trims the history back to ``SHIFT_HISTORY``, and so does
        switching recording off (transformers sets ``record_past = False`` on each of ``layers``)."""
        self._record_past = True
        for layer in self.layers:
            layer.record_past = True

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """0: no layer keeps recurrent states to roll back (transformers asks before it records the past, e.g. for
        the deferred stop check of ``generate`` on Apple GPUs; the token shift's history is kept whole instead)."""
        return 0

    def _layer(self, layer_idx: int) -> _LayerCache:
        while len(self.layers) <= layer_idx:  # a new layer records as its siblings do
            self.layers.append(_LayerCache(self.layers[0].record_past if self.layers else self._record_past))
        return self.layers[layer_idx]

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
        """``KVCache.attend``: store k, v and c (padded keys get c = +PAD_DECAY, so that c_i - c_j = -1e30 cuts them
        out of every real query's row exactly), then attend through ``forgetting_attention_with_kvcache``.

        q: [B, T, Hq, D], k: [B, T, Hk, D], v: [B, T, Hk, Dv], log_fgate: [B, T, Hq] fp32 or None,
        valid: [B, T] bool (False at left padding). Returns o: [B, T, Hq, Dv].
        """
        layer = self._layer(layer_idx)
        B, T, Hq, _ = q.shape
        if layer.c_last is None:
            layer.c_last = q.new_zeros(B, Hq, dtype=torch.float64)
        c = continue_cumsum(layer.c_last, log_fgate, T, valid)
        layer.c_last = c[:, -1]
        if valid is not None:
            c = c.masked_fill(~valid[..., None], PAD_DECAY)
        layer.carry_shift(T, valid, trim=not layer.record_past)
        before = layer.length
        layer.append(k, v, c)
        return forgetting_attention_with_kvcache(q, layer.k, layer.v, layer.c, k=k, v=v, log_fgate=log_fgate,
                                                 cache_seqlens=before, scale=scale, window=window, prune=prune,
                                                 valid=valid)

    def get_shift_state(self, layer_idx: int, name: str) -> torch.Tensor | None:
        """The pre-shift projection [B, Hk, D] of stream ``name`` at the last cached token, or None."""
        hist = self._layer(layer_idx).shift.get(name)
        return None if hist is None else hist[:, -1]

    def set_shift_state(self, layer_idx: int, name: str, x: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Store the pre-shift projections x: [B, T, Hk, D] of the new tokens for stream ``name`` (``attend`` then
        carries the state over this call's padding, from the ``valid`` it gets)."""
        layer = self._layer(layer_idx)
        old = layer.shift.get(name)
        # kept whole until attend() has carried the state over this call's padding and trims it
        layer.shift[name] = x.detach() if old is None else torch.cat([old, x.detach()], dim=1)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(kv_length, kv_offset) of a mask for ``query_length`` new tokens, as transformers' ``create_causal_mask``
        asks: every cached token and the new ones from offset 0 (a FoxCache keeps all tokens, sliding window too)."""
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_last_output(self) -> torch.Tensor | None:
        """The model's output [B, C] at each row's last real token (see ``KVCache``), or None (none kept)."""
        return self._last_output

    def set_last_output(self, x: torch.Tensor) -> None:
        self._last_output = x.detach().clone()  # a copy: x is a view into the forward's whole [B, T, C] output

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows without bound

    def reset(self) -> None:
        self.layers = [_LayerCache(layer.record_past) for layer in self.layers]
        self._last_output = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def _apply(self, fn) -> None:
        for layer in self.layers:
            layer.apply(fn)
        if self._last_output is not None:
            self._last_output = fn(self._last_output)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda x: x.repeat_interleave(repeats, dim=0))

    def crop(self, max_length: int) -> None:
        """Drop rejected tokens, as HF's assisted decoding does: ``-n`` drops the last n tokens (transformers
        >= 5.24 passes only these, and 0 for nothing), a positive value keeps that many (earlier versions).
        In a model with token shift, at most ``SHIFT_HISTORY - 1`` tokens can go, any number while the cache records
        its past (``activate_past_recording``). The kept last real output goes (None until the next call): padding
        before the next call's first real token has a meaningless output. ``max_length`` may be a 0-d integer
        tensor: transformers 5.17's assisted decoding passes ``-(candidates - matches)`` as one."""
        try:
            max_length = operator.index(max_length)
        except TypeError:
            raise TypeError(f"max_length: expected an int (or a 0-d integer tensor), got {max_length!r}") from None
        length = self.get_seq_length()
        keep = length + max_length if max_length < 0 else max_length if max_length > 0 else length
        if keep <= 0:
            self.reset()
        elif keep < length:
            for layer in self.layers:
                layer.crop(keep)
            self._last_output = None
        for layer in self.layers:
            if layer.record_past:  # the history a crop could reach is the tokens since this one
                layer.trim_shift()

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return f"FoxCache(layers={len(self.layers)}, length={self.get_seq_length()})"

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return any(layer.length for layer in self.layers)

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def batch_size(self) -> int:
        return next((layer.k.shape[0] for layer in self.layers if layer.k is not None), -1)

"""The host side of Forgetting Attention's Triton kernels (the kernels are in ``triton_kernels``).

Tile tables and autotuning, the launchers (``_forward_impl``, ``_backward_impl``; the forward hands the calls it was
tested on to the Gluon forward, ``gluon_fwd``), the ``torch.library`` custom ops that torch.compile traces, the eager
``autograd.Function`` over the same launchers, and the entry point ``triton_forgetting_attention`` that
``forgetting_attention`` calls.
"""

from __future__ import annotations

import torch
import triton

from ..autograd import first_order_only
from ..backend import block_dim, interpreted, require_runnable
from .gate import gate_cumsum, reverse_cumsum, segment_ids
from .triton_kernels import (
    LOG2E,
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _attn_bwd_preprocess,
    _attn_fwd_kernel,
    _relative_c_kernel,
)

# Interpreter (CPU) tiles: small, so that tests at small sizes cross many tiles and ACP boundaries, and
# the same 16 x 16 in all three loops, so that ACP skips exactly the same tiles in each (tests compare that).
INTERPRET_TILE = 16
# c_rel's block (see the kernels' _c_tile): a multiple of every loop's tile; on the CPU two tiles, so that small tests
# see tiles on both sides of the rule that masks the tiles in the block of c_ref's position.
C_BLOCK = 128
INTERPRET_C_BLOCK = 2 * INTERPRET_TILE
_INTERPRET_FWD = {"BLOCK_M": INTERPRET_TILE, "BLOCK_N": INTERPRET_TILE, "TILES": 0}
_INTERPRET_DKDV = {"BLOCK_M1": INTERPRET_TILE, "BLOCK_N1": INTERPRET_TILE, "TILES": 0}
_INTERPRET_DQ = {"BLOCK_M2": INTERPRET_TILE, "BLOCK_N2": INTERPRET_TILE, "TILES": 0}
# Tests' switch: the interpreter's tiles (and c_rel block) for the compiled kernels on the GPU too, so that the tests
# written for them (tile counts, gate resets at tile starts, many tiles at small sizes) run the real kernels there.
SMALL_TILES = False


def _small_tiles() -> bool:
    return _INTERPRETED or SMALL_TILES


# Autotuned tiles per padded head dim (the larger of D and Dv): FWD (BLOCK_M, BLOCK_N, warps, stages), the backward's
# DKDV (BLOCK_M1, BLOCK_N1, warps, stages) and DQ (BLOCK_M2, BLOCK_N2, warps, stages). Chosen by timing
# (docs/benchmarks.md) and ptxas register reports (no spills where the tile allows); the first of each list is the
# usual winner.
_FWD_TILES = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3)],
    256: [(64, 64, 4, 2), (64, 32, 4, 2)],
}
_DKDV_TILES = {
    64: [(64, 64, 4, 3), (64, 64, 4, 2)],
    128: [(64, 64, 4, 2), (32, 128, 8, 3)],
    256: [(16, 64, 4, 2), (32, 64, 8, 1)],
}
_DQ_TILES = {
    64: [(128, 64, 4, 3), (64, 64, 4, 3)],
    128: [(64, 64, 4, 2), (128, 32, 8, 3)],
    256: [(64, 16, 4, 2), (64, 32, 8, 1)],
}


def _tiles_bucket(args: dict) -> int:
    d = max(args["BLOCK_D"], args["BLOCK_DV"])
    return 64 if d <= 64 else (128 if d <= 128 else 256)


def _configs(tiles: dict, names: tuple[str, ...]) -> list[triton.Config]:
    return [
        triton.Config(dict(zip(names, t[:-2]), TILES=d), num_warps=t[-2], num_stages=t[-1])
        for d, ts in tiles.items() for t in ts
    ]


def _prune_configs(configs, named_args, **kwargs):
    """Keep the tiles listed for this head dim."""
    d = _tiles_bucket({**named_args, **kwargs})
    return [c for c in configs if c.kwargs["TILES"] == d]


# Kernels built by Triton's interpreter (TRITON_INTERPRET=1 at import) run on CPU tensors.
_INTERPRETED = interpreted(_attn_fwd_kernel)
_TUNE_KEY = ["LEN_BUCKET", "BLOCK_D", "BLOCK_DV", "VARLEN", "PRUNE", "WINDOWED"]


def _autotuned(kernel, tiles: dict, names: tuple[str, ...]):
    """The kernel autotuned over its tile table, keeping the head dim's tiles."""
    prune = {"early_config_prune": _prune_configs}
    return triton.autotune(_configs(tiles, names), key=_TUNE_KEY, prune_configs_by=prune)(kernel)


_fwd = _autotuned(_attn_fwd_kernel, _FWD_TILES, ("BLOCK_M", "BLOCK_N"))
_bwd_dkdv = _autotuned(_attn_bwd_dkdv_kernel, _DKDV_TILES, ("BLOCK_M1", "BLOCK_N1"))
_bwd_dq = _autotuned(_attn_bwd_dq_kernel, _DQ_TILES, ("BLOCK_M2", "BLOCK_N2"))


# The config that the autotuner chose per (kernel, device, dtype, tuning key): once it has chosen, the kernel is
# launched with it directly, without the autotuner's per-call work (it builds its key from every argument, in host
# time that eager training steps feel: docs/benchmarks.md, "Host time").
_TUNED: dict[tuple, triton.Config] = {}


def _launch(kernel, grid, interpret_meta: dict, q: torch.Tensor, *args, **kwargs) -> None:
    """Autotuned launch on the GPU; fixed small tiles under the interpreter (no timing there) or SMALL_TILES."""
    if _small_tiles():
        kernel.fn[grid](q, *args, **kwargs, **interpret_meta)
        return
    key = (kernel.fn, q.device.index, q.dtype, *(kwargs[k] for k in kernel.keys))
    config = _TUNED.get(key)
    # not tuned yet, or the configs were replaced (by identity: Config's == rebuilds both kwargs dicts)
    if config is None or not any(config is listed for listed in kernel.configs):
        kernel[grid](q, *args, **kwargs)
        _TUNED[key] = kernel.best_config
    else:
        kernel.fn[grid](q, *args, **kwargs, **config.all_kwargs())


# The Gluon forward (``gluon_fwd``, GPU only) runs where tests/ops/forgetting_attention/test_gluon.py passed on the
# device: this GPU architecture, Triton release (Gluon's API changes between releases), head dims and dtypes; the Triton
# forward everywhere else. GLUON_FORWARD switches it off (tests compare the two).
GLUON_TESTED = dict(capability=(9, 0), triton="3.6.0", head_dims=(128,), dtypes=(torch.bfloat16, torch.float16))
GLUON_FORWARD = True


# The Gluon dK/dV (``gluon_bwd``, GPU only) likewise, where that file's backward tests passed; the Triton dK/dV
# kernel elsewhere. GLUON_BACKWARD switches it off.
GLUON_BWD_TESTED = dict(capability=(9, 0), triton="3.6.0", head_dims=(128,), dtypes=(torch.bfloat16, torch.float16))
GLUON_BACKWARD = True


def _gluon_case(tested: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, window,
                capability: tuple[int, int] | None, triton_version: str, *tma: torch.Tensor) -> bool:
    """The tested GPU and Triton (``capability``: the device's, None off CUDA), dtype and head dim; Tq == Tk without
    packed sequences or a window; q, k, v and ``tma`` contiguous and 16-byte aligned (TMA reads them as
    [B * T, H * D] matrices)."""
    return (capability == tested["capability"] and triton_version == tested["triton"]
            and q.dtype in tested["dtypes"] and k.dtype == v.dtype == q.dtype and q.shape[-1] == v.shape[-1]
            and q.shape[-1] in tested["head_dims"] and q.shape[1] == k.shape[1]
            and cu_seqlens is None and window is None
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v, *tma)))


def _gluon_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, window, threshold,
                    capability: tuple[int, int] | None, triton_version: str) -> bool:
    """Whether the Gluon forward takes this call: ``_gluon_case`` without ACP."""
    return (GLUON_FORWARD and threshold is None
            and _gluon_case(GLUON_TESTED, q, k, v, cu_seqlens, window, capability, triton_version))


def _gluon_bwd_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, cu_seqlens, window,
                        capability: tuple[int, int] | None, triton_version: str) -> bool:
    """Whether the Gluon dK/dV takes this backward: ``_gluon_case``, ACP or not, dO read by TMA too."""
    return (GLUON_BACKWARD and do.shape == q.shape
            and _gluon_case(GLUON_BWD_TESTED, q, k, v, cu_seqlens, window, capability, triton_version, do))


# Bytes of the streamed tensors (K and V in the forward, Q and dO in the backward) that the programs in flight may
# share: None is half the GPU's L2 (smaller shares timed alike: docs/benchmarks.md, "launch order"), and 24 MiB for the
# interpreter's CPU tensors.
L2_SHARE: int | None = None


def _l2_share(device: torch.device) -> int:
    if L2_SHARE is not None:
        return L2_SHARE
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size // 2
    return 24 << 20


def _head_group(n: int, length: int, q: torch.Tensor, v: torch.Tensor) -> int:
    """(Head, sequence) pairs scheduled together: the largest divisor of n whose K/V (or Q/dO) fit in the L2 share."""
    per_pair = max(1, length * (q.shape[-1] + v.shape[-1]) * q.element_size())
    g = max(1, min(n, _l2_share(q.device) // per_pair))
    while n % g:
        g -= 1
    return g


def _segment_starts(cu_seqlens: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """The first token of each position's sequence [T] int32 (packed input), else None."""
    return None if cu_seqlens is None else cu_seqlens[:-1].int()[segment_ids(cu_seqlens, T)]


def _relative_c(c: torch.Tensor, cu_seqlens: torch.Tensor | None, c_block: int) -> torch.Tensor:
    """The key side's c_rel of the loops (see _c_tile): c [B, H, Tk] fp64 -> [B, H, Tk] fp32."""
    B, H, T = c.shape
    crk = torch.empty_like(c, dtype=torch.float32)
    start = _segment_starts(cu_seqlens, T)
    block = 1024 if not _INTERPRETED else 64
    # crk stands in for START where this specialization does not read it
    _relative_c_kernel[(triton.cdiv(T, block), H, B)](c, crk if start is None else start, crk, *c.stride()[:2], T,
                                                        C_BLOCK=c_block, BLOCK=block, VARLEN=start is not None)
    return crk


def _bwd_preprocess(o: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor | None, lse: torch.Tensor, c: torch.Tensor,
                    cu_seqlens: torch.Tensor | None, c_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """o, do [B, Tq, H, Dv] (same strides), dlse/lse [B, H, Tq] fp32, c [B, H, Tk] fp64 -> delta [B, H, Tq] fp32 and the
    query side's c_rel [B, H, Tk] fp32, written at the queries' key positions Tk - Tq on."""
    B, Tq, H, Dv = o.shape
    Tk = c.shape[-1]
    delta = torch.empty_like(lse)
    crq = torch.empty_like(c, dtype=torch.float32)
    start = _segment_starts(cu_seqlens, Tk)
    block = 64
    # lse stands in for DLSE and START where this specialization does not read them
    _attn_bwd_preprocess[(triton.cdiv(Tq, block), H, B)](
        o, do, lse if dlse is None else dlse, lse, c, lse if start is None else start, delta, crq, *o.stride()[:3],
        *lse.stride()[:2], *c.stride()[:2], Tq, Tk, Tk - Tq, DV=Dv, BLOCK_M=block,
        BLOCK_DV=block_dim(Dv), C_BLOCK=c_block, HAS_DLSE=dlse is not None,
        VARLEN=start is not None)
    return delta, crq


# Whether the backward takes the gate gradient's row and column sums as dS @ e_0 dots (``_sums`` in the kernels)
# rather than fp32 reductions, without ACP and with it: chosen by timing (docs/benchmarks.md).
DOT_SUMS = {"plain": False, "acp": True}


def _len_bucket(n: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), 1 << 15)


def _meta(q: torch.Tensor, v: torch.Tensor, cu_seqlens, threshold, window) -> dict:
    D, Dv = q.shape[-1], v.shape[-1]
    return dict(
        D=D, DV=Dv, BLOCK_D=block_dim(D), BLOCK_DV=block_dim(Dv),
        VARLEN=cu_seqlens is not None, PRUNE=threshold is not None, WINDOWED=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", INTERPRET=_INTERPRETED,
        C_BLOCK=INTERPRET_C_BLOCK if _small_tiles() else C_BLOCK,
    )


def _dims(q, k, cu_seqlens, max_seqlen) -> tuple[int, int, int]:
    """(programs' sequences, query length, key length) of the grid."""
    if cu_seqlens is not None:
        return cu_seqlens.numel() - 1, max_seqlen, max_seqlen
    return q.shape[0], q.shape[1], k.shape[1]


# The two launchers below are wrapped as torch.library custom ops with autograd registered on them: torch.compile
# sees them as opaque (no graph break, no attempt to re-trace the Triton code). Eager calls go through _EagerAttention,
# a torch.autograd.Function over the same two functions: the custom ops' dispatch and autograd wrappers cost host time
# that eager training steps feel (docs/benchmarks.md, "Host time").
def _forward_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_fgate: torch.Tensor, scale: float,
    cu_seqlens: torch.Tensor | None, max_seqlen: int | None, window: int | None, threshold: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> o [B, Tq, Hq, Dv], lse [B, Hq, Tq] fp32, and for the backward c [B, Hq, Tk] fp64 (the gate cumsum) and
    its key side's c_rel [B, Hq, Tk] fp32."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    B, Tq, Hq, _ = q.shape
    Tk, Hk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    c = gate_cumsum(log_fgate).transpose(1, 2)  # [B, H, T] contiguous; only differences within a sequence are used
    n_seq, len_q, len_k = _dims(q, k, cu_seqlens, max_seqlen)
    o = q.new_empty(B, Tq, Hq, Dv)
    lse = torch.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
    thr = threshold.float().contiguous() if threshold is not None else lse  # lse: unused placeholder
    cu = cu_seqlens if cu_seqlens is not None else lse

    def grid(m):
        return (triton.cdiv(len_q, m["BLOCK_M"]) * Hq * n_seq,)

    meta = _meta(q, v, cu_seqlens, threshold, window)
    crk = _relative_c(c, cu_seqlens, meta["C_BLOCK"])
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    if not _small_tiles() and _gluon_eligible(q, k, v, cu_seqlens, window, threshold, capability, triton.__version__):
        from .gluon_fwd import gluon_forward  # imports Gluon, which only the tested Triton release is known to have

        o, lse = gluon_forward(q, k, v, c, scale, _head_group(Hq * n_seq, len_k, q, v))
        return o, lse, c, crk
    _launch(_fwd, grid, _INTERPRET_FWD, q, k, v, c, crk, thr, o, lse, cu,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *c.stride()[:2],
            *lse.stride()[:2], Tq, Tk, Hq, Hq * n_seq, _head_group(Hq * n_seq, len_k, q, v), Hq // Hk,
            scale * LOG2E.value, window or 0, LEN_BUCKET=_len_bucket(len_k), **meta)
    return o, lse, c, crk


_fwd_op = torch.library.custom_op("foxlm::forgetting_attention_fwd", mutates_args=())(_forward_impl)


@_fwd_op.register_fake
def _(q, k, v, log_fgate, scale, cu_seqlens, max_seqlen, window, threshold):
    B, Tq, Hq, _ = q.shape
    o = q.new_empty(B, Tq, Hq, v.shape[-1])
    lse = q.new_empty(B, Hq, Tq, dtype=torch.float32)
    return o, lse, q.new_empty(B, Hq, k.shape[1], dtype=torch.float64), q.new_empty(B, Hq, k.shape[1],
                                                                                 dtype=torch.float32)


def _grad_keeps_strides(x: torch.Tensor) -> bool:
    """Whether empty_like(x), the gradient's buffer, has x's strides, with which the kernel writes it: not so for a
    view with gaps (k and v split from one fused projection), which is copied first. Contiguous inputs, the usual
    case, need no check (no meta tensor a call)."""
    return x.is_contiguous() or (x.stride(-1) == 1 and torch.empty_like(x, device="meta").stride() == x.stride())


def _backward_impl(
    do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    o: torch.Tensor, lse: torch.Tensor, c: torch.Tensor, crk: torch.Tensor, scale: float,
    cu_seqlens: torch.Tensor | None, max_seqlen: int | None, window: int | None, threshold: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dq, dk, dv, dlog_fgate [B, Tk, Hq] fp32, deterministic (no atomics)."""
    q, k, v = (x if _grad_keeps_strides(x) else x.contiguous() for x in (q, k, v))
    n_seq, len_q, len_k = _dims(q, k, cu_seqlens, max_seqlen)
    Tq, Hq = q.shape[1:3]
    Tk, Hk = k.shape[1], k.shape[2]
    do = do.contiguous() if do.stride() != o.stride() else do
    if dlse is not None and dlse.stride() != lse.stride():  # e.g. the stride-0 gradient of lse.sum()
        dlse = dlse.contiguous()
    meta = _meta(q, v, cu_seqlens, threshold, window)
    thr = threshold.float().contiguous() if threshold is not None else lse
    cu = cu_seqlens if cu_seqlens is not None else lse
    delta, crq = _bwd_preprocess(o, do, dlse, lse, c, cu_seqlens, meta["C_BLOCK"])
    dq = torch.empty_like(q)
    dcq = torch.empty_like(lse)  # rowsum(dS) [B, Hq, Tq], lse's layout

    dot_sums = DOT_SUMS["acp" if threshold is not None else "plain"]
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *c.stride()[:2], *lse.stride()[:2])
    tail = dict(LEN_BUCKET=_len_bucket(len_k), DOT_SUMS=dot_sums, **meta)
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    if not _small_tiles() and _gluon_bwd_eligible(q, k, v, do, cu_seqlens, window, capability, triton.__version__):
        from .gluon_bwd import gluon_dkdv  # imports Gluon, which only the tested Triton release is known to have

        dk, dv, dck = gluon_dkdv(q, k, v, do, c, crq, lse, delta, threshold, scale, meta["C_BLOCK"], dot_sums)
    else:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dck = torch.empty(c.shape, dtype=torch.float32, device=c.device)
        _launch(_bwd_dkdv, lambda m: (triton.cdiv(len_k, m["BLOCK_N1"]) * Hk * n_seq,), _INTERPRET_DKDV, q, k, v, c,
                crq, thr, do, lse, delta, dk, dv, dck, cu, *strides, Tq, Tk, Hq, Hk, Hk * n_seq,
                _head_group(Hk * n_seq, len_q, q, v), Hq // Hk, scale * LOG2E.value, scale, window or 0, **tail)
    _launch(_bwd_dq, lambda m: (triton.cdiv(len_q, m["BLOCK_M2"]) * Hq * n_seq,), _INTERPRET_DQ, q, k, v, c, crk,
            thr, do, lse, delta, dq, dcq, cu, *strides, Tq, Tk, Hq, Hq * n_seq, _head_group(Hq * n_seq, len_k, q, v),
            Hq // Hk, scale * LOG2E.value, scale, window or 0, **tail)
    dc = dck.double()
    dc[..., Tk - Tq:] += dcq  # the query side of the gate gradient (dlse is in it, through delta)
    dlog_fgate = reverse_cumsum(dc, cu_seqlens).transpose(1, 2).float().contiguous()  # the fake's layout
    return dq, dk, dv, dlog_fgate


_bwd_op = torch.library.custom_op("foxlm::forgetting_attention_bwd", mutates_args=())(_backward_impl)


@_bwd_op.register_fake
def _(do, dlse, q, k, v, o, lse, c, crk, scale, cu_seqlens, max_seqlen, window, threshold):
    B, Tk, Hq = k.shape[0], k.shape[1], q.shape[2]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(B, Tk, Hq, dtype=torch.float32))


def _setup_context(ctx, inputs, output) -> None:
    """Save what the backward needs: the inputs, o, lse and the gate cumsum c with its key side's c_rel."""
    q, k, v, _, scale, cu_seqlens, max_seqlen, window, threshold = inputs
    o, lse, c, crk = output
    ctx.save_for_backward(q, k, v, o, lse, c, crk, cu_seqlens, threshold)
    ctx.scale, ctx.max_seqlen, ctx.window = scale, max_seqlen, window


def _saved_backward(ctx, do, dlse, backward) -> tuple:
    """The gradients of the nine inputs, by ``backward`` (the custom op or its function) from what was saved."""
    q, k, v, o, lse, c, crk, cu_seqlens, threshold = ctx.saved_tensors
    dq, dk, dv, dlog_fgate = backward(do, dlse, q, k, v, o, lse, c, crk, ctx.scale, cu_seqlens, ctx.max_seqlen,
                                      ctx.window, threshold)
    return dq, dk, dv, dlog_fgate, None, None, None, None, None


def _backward(ctx, do, dlse, _dc, _crk):
    return _saved_backward(ctx, do, dlse, _bwd_op)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager path: the custom ops' two functions under a plain autograd.Function (see above)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward_impl(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)  # an unused lse gets no zero gradient to read
        return output[:2]  # o, lse

    @staticmethod
    @first_order_only("forgetting_attention")  # the kernels write the gradients without a graph
    def backward(ctx, do, dlse):
        if do is None:  # a loss of lse alone
            do = torch.zeros_like(ctx.saved_tensors[3])  # o's
        return _saved_backward(ctx, do, dlse, _backward_impl)


def triton_forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int | None,
    window: int | None = None,
    threshold: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Forgetting Attention (inputs validated by ``forgetting_attention``), differentiable in all four.

    q: [B, Tq, Hq, D], k: [B, Tk, Hk, D], v: [B, Tk, Hk, Dv], log_fgate: [B, Tk, Hq] fp32.
    cu_seqlens: [N+1] int32 (B == 1) or None; window: query i sees keys j > i - window, or None;
    threshold: ACP delta [B or N, Hq] fp32, or None. The backward is deterministic (no atomics).
    Returns o: [B, Tq, Hq, Dv] in q's dtype and lse: [B, Hq, Tq] fp32.
    """
    require_runnable(_attn_fwd_kernel, q, "q")
    if cu_seqlens is not None and max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    args = (q, k, v, log_fgate, scale, cu_seqlens, max_seqlen, window, threshold)
    if torch.compiler.is_compiling():
        o, lse, *_ = _fwd_op(*args)
        return o, lse
    return _EagerAttention.apply(*args)

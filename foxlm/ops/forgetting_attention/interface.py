"""``forgetting_attention``: the one entry point of Forgetting Attention, on every device, and
``sequence_attention``, the dispatch a model layer needs around it (no gate, padded batches, probabilities)."""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from ..backend import use_triton
from ..checks import DTYPES, check_qkv
from .acp import ACP
from .gate import gate_cumsum
from .sdpa import attention_from_cumsum, sdpa_scale


def _checking_values(x: torch.Tensor) -> bool:
    """Value checks (gate sign, cu_seqlens order) need a host sync: skip them while compiling or capturing. Only a
    CUDA tensor asks CUDA about capture: a CPU process forked from one that used CUDA cannot initialize it."""
    if torch.compiler.is_compiling() or x.is_meta:  # a meta tensor has no values to check
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _bad_gates(log_fgate: torch.Tensor) -> torch.Tensor:
    """Whether any log gate is positive, infinite or NaN: a bool tensor, from the gates' extremes in one reduction
    (NaN propagates to the maximum)."""
    lo, hi = torch.aminmax(log_fgate)
    return ~((hi <= 0) & (lo > -math.inf))


def check_scale(scale: float | None) -> None:
    """``scale`` is a finite number (any sign) or None (1/sqrt(D))."""
    # compiled, a float module attribute may arrive symbolic (dynamo's automatic dynamic shapes), where
    # math.isfinite would break the graph: the eager call has checked it
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or (not torch.compiler.is_compiling() and not math.isfinite(scale))):
        raise ValueError(f"scale: expected a finite number (any sign) or None, got {scale!r}")


def _validate(q, k, v, log_fgate, scale, cu_seqlens, max_seqlen, window, acp, check_gates) -> None:
    check_scale(scale)
    check_qkv(q, k, v)
    if not isinstance(log_fgate, torch.Tensor) or log_fgate.device != q.device:
        raise ValueError(f"log_fgate: expected a tensor on q's device {q.device}, got "
                         f"{getattr(log_fgate, 'device', type(log_fgate))}")
    B, Tq, Hq, _ = q.shape
    Tk = k.shape[1]
    if Tq > Tk:
        raise ValueError(f"q: {Tq} queries but only {Tk} keys; queries are the last Tq <= Tk positions")
    if tuple(log_fgate.shape) != (B, Tk, Hq):
        raise ValueError(f"log_fgate: expected shape [B, Tk, Hq] = {(B, Tk, Hq)}, got {tuple(log_fgate.shape)}")
    if log_fgate.dtype not in DTYPES:
        raise ValueError(f"log_fgate: expected a float dtype (computed in float32 or float64), got {log_fgate.dtype}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(f"window: expected a positive number of tokens (int) or None, got {window!r}")
    logit_bound = None if acp is None else acp.logit_bound
    bound_tensor = isinstance(logit_bound, torch.Tensor)
    if bound_tensor and logit_bound.device != q.device:
        raise ValueError(f"logit_bound: on {logit_bound.device}, but q is on {q.device}")
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError("max_seqlen: only meaningful together with cu_seqlens")
    else:
        # compiled, an int argument may arrive as a SymInt (a Python int when dynamo specializes it)
        if max_seqlen is not None and (isinstance(max_seqlen, bool)
                                       or not isinstance(max_seqlen, (numbers.Integral, torch.SymInt))):
            raise ValueError(f"max_seqlen: expected an int (the longest sequence's length) or None, got {max_seqlen!r}")
        if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64)
                or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2):
            got = f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens))} {tuple(getattr(cu_seqlens, 'shape', ()))}"
            raise ValueError(f"cu_seqlens: expected a 1-D int32 or int64 tensor [N+1], got {got}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens: on {cu_seqlens.device}, but q is on {q.device}")
        if B != 1 or Tq != Tk:
            raise ValueError(f"cu_seqlens: packed input needs B == 1 and Tq == Tk, got B={B}, Tq={Tq}, Tk={Tk}")
        if Tk >= 2**31:
            raise ValueError(f"cu_seqlens: offsets up to 2^31 - 1 are supported, got {Tk} tokens")
    if bound_tensor:  # ACP.threshold expands it to one bound per (sequence, head)
        rows = B if cu_seqlens is None else cu_seqlens.numel() - 1
        try:
            fits = torch.broadcast_shapes(logit_bound.shape, (rows, Hq)) == (rows, Hq)
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"logit_bound: expected a tensor broadcastable to [{'B' if cu_seqlens is None else 'N'}="
                             f"{rows}, Hq={Hq}], got shape {tuple(logit_bound.shape)}")
    if not _checking_values(q) or (cu_seqlens is None and not check_gates):
        return
    # Every value check in one device tensor, read back with a single host sync.
    no = torch.zeros((), dtype=torch.bool, device=q.device)
    flags = [_bad_gates(log_fgate) if check_gates and log_fgate.numel() else no,
             (~(logit_bound >= 0) | logit_bound.isinf()).any() if bound_tensor else no]
    if cu_seqlens is not None:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        flags.append((cu_seqlens[0] != 0) | (cu_seqlens[-1] != Tk) | (lengths < 0).any())
        if max_seqlen is not None:
            flags.append(lengths.max() > max_seqlen)
    bad = torch.stack(flags).tolist()
    if bad[0]:
        raise ValueError("log_fgate: expected finite log forget gates <= 0, without NaN (use logsigmoid)")
    if bad[1]:
        raise ValueError("logit_bound: expected finite bounds >= 0 on |scale * q . k|, without NaN")
    if len(bad) > 2 and bad[2]:
        raise ValueError(f"cu_seqlens: expected sorted offsets from 0 to T={Tk}, got {cu_seqlens.tolist()}")
    if len(bad) > 3 and bad[3]:
        raise ValueError(f"max_seqlen: {max_seqlen} is below the longest sequence, {int(lengths.max())}")


def _window(window: int | None, window_size: tuple[int, int] | None) -> int | None:
    """``window`` from FlashAttention's ``window_size=(left, right)``: left + 1 keys (left -1: unbounded), causal
    attention only (right 0 or -1)."""
    if window_size is None:
        return window
    if window is not None:
        raise ValueError(f"window_size: give window={window} or window_size={window_size!r}, not both")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in window_size)):
        raise ValueError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if right not in (0, -1) or left < -1:
        raise ValueError(f"window_size: attention is causal, so right must be 0 (or -1) and left >= -1, "
                         f"got {window_size!r}")
    return None if left == -1 else left + 1


def forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    window: int | None = None,
    window_size: tuple[int, int] | None = None,
    prune: bool | ACP = False,
    tolerance: float = math.exp(-10),
    logit_bound: float | torch.Tensor | None = None,
    deterministic: bool = False,
    check_gates: bool = True,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention with a forget gate: logits ``scale * q_i . k_j + c_i - c_j``.

    Args:
        q: [B, Tq, Hq, D] queries, the last Tq positions of the sequence (Tq < Tk: chunked prefill); with
            ``cu_seqlens`` also FlashAttention's unbatched varlen layout [total, Hq, D] (then k, v, log_fgate and
            the outputs drop the batch dim too).
        k: [B, Tk, Hk, D] keys; Hq must be a multiple of Hk (GQA / MQA).
        v: [B, Tk, Hk, Dv] values.
        log_fgate: [B, Tk, Hq] log forget gates (<= 0); c is their cumsum, in fp64. Computed in fp32 (fp64 for
            fp64): fp16 and bf16 gates are upcast, and their gradient comes back in their dtype. A gate below -1e4
            (``gate.GATE_FLOOR``) closes as -1e4 does: no key before it keeps any weight, and its gradient is 0 (up to
            rounding).
        scale: logit scale, default 1/sqrt(D); any finite number (zero or negative too).
        cu_seqlens: [N+1] int32 or int64 sequence offsets of packed input (B == 1): sequences never see each
            other and the gate cumsum restarts at every sequence.
        max_seqlen: longest sequence in ``cu_seqlens`` (saves a host sync on GPU).
        window: sliding-window attention: query i sees only keys j with i - window < j <= i; None: all of its
            past.
        window_size: FlashAttention's name for it: (left, 0) is window = left + 1, (-1, 0) no window.
        prune: Adaptive Computation Pruning: True, or an ``ACP`` (its tolerance and logit bound): skip the
            attention whose decay c_i - c_j is below delta = -(2U + log N) + log(tolerance), which carries less
            than ``tolerance`` of any row's mass.
        tolerance, logit_bound: the ``ACP`` of ``prune=True``: the largest attention mass ACP may drop from a row,
            and U, a bound on |scale * q_i . k_j| (a float, or a tensor broadcastable to [B or N, Hq], e.g. from
            QK-norm weights); by default |scale| * max||q|| * max||k|| per (sequence, head).
        deterministic: FlashAttention's flag, accepted for its signature: every backward here is deterministic
            (bitwise reproducible, no atomics; with the gate gradient's row sums in the kernel, the atomic-dQ
            backward was no longer the faster: docs/benchmarks.md).
        check_gates: raise a ValueError for log gates that are positive, infinite or NaN (and for a tensor
            ``logit_bound`` that is negative, infinite or NaN); on CUDA this reads a flag back (a host sync).
            Callers whose gates are a logsigmoid by construction (the FoX layers, through ``sequence_attention``)
            turn it off: a NaN then reaches the loss, where the trainer counts and skips the step.
        return_lse: also return the row log-sum-exp [B, Hq, Tq] (fp32; [Hq, total] in the unbatched layout).

    Returns:
        o: [B, Tq, Hq, Dv] in q's dtype, and lse when ``return_lse``.

    CUDA tensors go through the fused Triton kernels, CPU tensors through a memory-bounded PyTorch
    path (or through the Triton kernels under ``TRITON_INTERPRET=1``); float64 always takes the PyTorch path.
    ``foxlm.ops.use_backend`` overrides the choice for a block of code.
    """
    if cu_seqlens is not None and isinstance(q, torch.Tensor) and q.dim() == 3:  # flash_attn's varlen layout
        if not all(isinstance(t, torch.Tensor) for t in (k, v, log_fgate)) or (k.dim(), v.dim(), log_fgate.dim()) != (
                3, 3, 2):
            raise ValueError(f"k, v, log_fgate: with q [total, Hq, D], expected [total, Hk, D], [total, Hk, Dv] and "
                             f"[total, Hq], got {[tuple(getattr(t, 'shape', ())) for t in (k, v, log_fgate)]}")
        out = forgetting_attention(
            q[None], k[None], v[None], log_fgate[None], scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            window=window, window_size=window_size, prune=prune, tolerance=tolerance, logit_bound=logit_bound,
            deterministic=deterministic, check_gates=check_gates, return_lse=return_lse)
        return (out[0][0], out[1][0]) if return_lse else out[0]
    acp = ACP.of(prune, tolerance, logit_bound)
    window = _window(window, window_size)
    _validate(q, k, v, log_fgate, scale, cu_seqlens, max_seqlen, window, acp, check_gates)
    if log_fgate.dtype not in (torch.float32, torch.float64):  # the gate math is fp32; autograd casts the gradient
        log_fgate = log_fgate.float()
    if cu_seqlens is not None:  # fla's int64 offsets (checked above); the kernels read them with stride 1
        cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    if isinstance(max_seqlen, numbers.Integral):  # a NumPy int too: the kernels' grid and custom op take an int
        max_seqlen = int(max_seqlen)
    if window is not None:  # likewise
        window = int(window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if window is not None and window >= k.shape[1]:
        window = None  # the window holds every key: plain causal attention
    threshold = None
    if acp is not None and q.shape[1]:  # no queries, nothing to prune (the data's bound would be a max over none)
        threshold = acp.threshold(q, k, scale=scale, cu_seqlens=cu_seqlens, window=window)
    if use_triton(q):
        from .triton_op import triton_forgetting_attention

        o, lse = triton_forgetting_attention(
            q, k, v, log_fgate, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, window=window,
            threshold=threshold,
        )
    else:
        c = gate_cumsum(log_fgate)  # not restarted per sequence: differences within a sequence are what matter
        o, lse = attention_from_cumsum(
            q, k, v, c[:, k.shape[1] - q.shape[1]:], c, scale=scale, window=window, threshold=threshold,
            cu_seqlens=cu_seqlens,
        )
    return (o, lse) if return_lse else o


def sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor | None,
    *,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    window: int | None = None,
    prune: ACP | None = None,
    deterministic: bool = False,
    return_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of the whole sequences of a batch, as a model layer needs it, choosing the path:
    ``forgetting_attention``, SDPA (no gate, no packing, no window), or ``attention_from_cumsum`` to return the
    probabilities.

    q: [B, T, Hq, D], k: [B, T, Hk, D], v: [B, T, Hk, Dv]; log_fgate: [B, T, Hq] fp32 log gates that are
    logsigmoids (or fixed negative slopes) by construction, so not value-checked (no host sync; a NaN from the
    data reaches the loss), or None: plain softmax attention. cu_seqlens: [N+1] int32 offsets of the segments
    (packed documents, padding) in the flattened B * T tokens, each row starting one; no token sees another
    segment. The other arguments are ``forgetting_attention``'s.
    Returns o: [B, T, Hq, Dv] and, with ``return_probs``, the probabilities [B, Hq, T, T] fp32 (else None).
    """
    B, T, Hq, _ = q.shape
    if return_probs:
        return _o_and_probs(q, k, v, log_fgate, scale=scale, cu_seqlens=cu_seqlens, window=window)
    if log_fgate is None and cu_seqlens is None and window is None:
        q, scale = sdpa_scale(q, scale)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=k.shape[2] != Hq,
        )
        return o.transpose(1, 2), None
    if log_fgate is None:
        log_fgate = q.new_zeros(B, T, Hq, dtype=torch.promote_types(q.dtype, torch.float32))
    kwargs = dict(scale=scale, window=window, prune=prune, deterministic=deterministic, check_gates=False)
    if cu_seqlens is None:
        return forgetting_attention(q, k, v, log_fgate, **kwargs), None
    q, k, v, log_fgate = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, log_fgate))
    o = forgetting_attention(q, k, v, log_fgate, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **kwargs)
    return o.reshape(B, T, *o.shape[2:]), None


def _o_and_probs(q, k, v, log_fgate, *, scale, cu_seqlens, window) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_attention`` with the probabilities, row by row: [B, Hq, T, T], not [1, Hq, B*T, B*T]."""
    B, T, Hq, _ = q.shape
    c = q.new_zeros(B, T, Hq, dtype=torch.float64) if log_fgate is None else gate_cumsum(log_fgate)
    window = None if window is not None and window >= T else window
    bounds = None if cu_seqlens is None else cu_seqlens.tolist()  # host sync: for inspection only
    outs, probs = [], []
    for b in range(B):
        cu = None
        if bounds is not None:  # the row's segment offsets, shifted to the row's start
            cu = torch.tensor([x - b * T for x in bounds if b * T <= x <= (b + 1) * T], dtype=torch.int32,
                              device=q.device)
        o, _, p = attention_from_cumsum(q[b:b + 1], k[b:b + 1], v[b:b + 1], c[b:b + 1], c[b:b + 1], scale=scale,
                                        window=window, cu_seqlens=cu, return_probs=True)
        outs.append(o)
        probs.append(p)
    return torch.cat(outs), torch.cat(probs)

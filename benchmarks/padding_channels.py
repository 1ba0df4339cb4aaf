"""The gate gradient from padding channels: d(log_fgate) out of the extra channels of dQ and dK alone.

With c_i = sum_{l<=i} log f_l the logits are s_ij = scale q_i.k_j + c_i - c_j, so dc_t = rowsum_t(dS) - colsum_t(dS)
and d(log f_l) = sum_{t>=l} dc_t. A kernel whose epilogue cannot be changed (a GPU-only kernel taking the gate as a
score_mod) still returns dQ and dK: padded channels make them carry both sums of its own dS without touching the
logits. For GQA groups of G query heads, q' = [q, alpha e_g, 0] (g: the head's place in its group) and
k' = [k, 0 (G channels), beta]: every extra product is alpha * 0 or 0 * beta, so the logits are unchanged;
channel D + g of dK' is scale alpha colsum(dS) of query head g of the group, channel D + G of dQ' scale beta
rowsum(dS).

In bf16 both sums must come from the same rounded dS: the row sums are zero only in exact arithmetic (delta comes
from the rounded o), and the column sums carry the same rounding. ``rows=False`` takes the row sums as zero, as the
old kernels took them as dlse, to show what that costs. The channels leave a kernel rounded to q's dtype as dQ and
dK do, and the reverse cumsum adds that rounding up along the sequence: ``kernel_attention(fp32_dk=True)`` runs
foxlm's kernel with dK stored in fp32, ``emulated_attention`` a dense model of a bf16 flash kernel with the extra
channels kept in fp32 or not, to show what a kernel needs.

    PYTHONPATH=. python benchmarks/padding_channels.py [--seqlens 256 512] [--head-dim 48] [--heads 2 2]
    PYTHONPATH=. python benchmarks/padding_channels.py --emulated-only --seqlens 1024 4096

prints the relative (Frobenius) error against the fp64 reference of d(log_fgate): the op's own, and from the channels
(columns only; rows and columns with dK in fp32; with dK in bf16) for foxlm's Triton kernels in Triton's interpreter
(16 x 16 tiles), its PyTorch path and the emulation; and whether alpha = 2^-6, beta = 2^6 give the bits of
alpha = beta = 1.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

# (q', k', v, log_fgate, do, scale) -> (o, dq', dk', dv): an attention and its backward at one cotangent do.
Attention = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def autograd_attention(fn: Callable[..., torch.Tensor]) -> Attention:
    """An ``Attention`` from a differentiable ``fn(q, k, v, log_fgate, scale=...) -> o`` (e.g. forgetting_attention):
    its gradients as autograd returns them, in the inputs' dtype."""
    def run(q, k, v, log_fgate, do, scale):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        o = fn(q, k, v, log_fgate.detach(), scale=scale)
        return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))
    return run


def pad(q: torch.Tensor, k: torch.Tensor, alpha: float = 1.0, beta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q' = [q, alpha e_g, 0] [B, Tq, Hq, D + G + 1] and k' = [k, 0 (G channels), beta] [B, Tk, Hk, D + G + 1], for
    GQA groups of G = Hq / Hk query heads (g: a query head's place in its group): q'.k' = q.k exactly."""
    for name, x in (("alpha", alpha), ("beta", beta)):
        if x == 0 or torch.tensor(x, dtype=q.dtype).item() != x:
            raise ValueError(f"{name}: expected a nonzero value exact in {q.dtype} (e.g. a power of two), got {x!r}")
    B, Tq, Hq, _ = q.shape
    Hk = k.shape[2]
    G = Hq // Hk
    qx = q.new_zeros(B, Tq, Hq, G + 1)
    qx[:, :, torch.arange(Hq), torch.arange(Hq) % G] = alpha
    kx = k.new_zeros(B, k.shape[1], Hk, G + 1)
    kx[..., G] = beta
    return torch.cat([q, qx], -1), torch.cat([k, kx], -1)


def gate_gradient_from_channels(dq: torch.Tensor, dk: torch.Tensor, D: int, *, scale: float, alpha: float = 1.0,
                                beta: float = 1.0, rows: bool = True) -> torch.Tensor:
    """d(log_fgate) [B, Tk, Hq] fp64 from the extra channels of dq' [B, Tq, Hq, D + G + 1] and dk' [B, Tk, Hk,
    D + G + 1] of an attention run on ``pad(q, k, alpha, beta)`` (D: the unpadded head dim). ``rows=False``: the row
    sums taken as zero (their exact value for a loss of o alone), not read from dq'."""
    Tq, Hq = dq.shape[1:3]
    Tk, Hk = dk.shape[1:3]
    G = Hq // Hk
    dc = -dk[..., D:D + G].double().flatten(2) / (scale * alpha)  # [B, Tk, Hk * G]: query head hk * G + g
    if rows:
        dc[:, Tk - Tq:] += dq[..., D + G].double() / (scale * beta)
    return dc.flip(1).cumsum(1).flip(1)


def gate_gradient_from_padding(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    do: torch.Tensor,
    attention: Attention,
    *,
    scale: float | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """o, dq, dk, dv of ``attention`` run on padded q and k (their original channels), and d(log_fgate) [B, Tk, Hq]
    fp64 from the extra channels of its dq and dk only (the kernel's own gate gradient is never read).

    q: [B, Tq, Hq, D], k: [B, Tk, Hk, D], v: [B, Tk, Hk, Dv], log_fgate: [B, Tk, Hq], do: [B, Tq, Hq, Dv].
    scale: the logits' scale, default 1/sqrt(D) of the unpadded q (padding must not change it); nonzero.
    alpha, beta, rows: see ``pad`` and ``gate_gradient_from_channels``.
    """
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if scale == 0.0:
        raise ValueError("scale: expected a nonzero scale (the channels' sums are divided by it)")
    o, dq, dk, dv = attention(*pad(q, k, alpha, beta), v, log_fgate, do, scale)
    dlog_fgate = gate_gradient_from_channels(dq, dk, D, scale=scale, alpha=alpha, beta=beta, rows=rows)
    return o, dq[..., :D], dk[..., :D], dv, dlog_fgate


def kernel_attention(prune: bool = False, fp32_dk: bool = False) -> Attention:
    """foxlm's Triton kernels as an ``Attention`` (CPU tensors: Triton's interpreter). ``prune``: the ACP kernels
    (a threshold of -inf: every tile kept), whose gate-gradient sums run on the tensor cores. ``fp32_dk``: k goes in
    as fp32 (its values are q's dtype's, so the logits are the same), which makes the kernel store dK unrounded, in
    fp32: the extra channels as a kernel would keep them in a side buffer. Interpreter only (on a GPU the kernel's
    dots take one dtype); both of the backward's loops round dS to q's dtype, as with a bf16 k."""
    from foxlm.ops.forgetting_attention.triton_op import triton_forgetting_attention

    def run(q, k, v, log_fgate, do, scale):
        q, v = q.detach().requires_grad_(), v.detach().requires_grad_()
        k = (k.float() if fp32_dk else k).detach().requires_grad_()
        threshold = torch.full((q.shape[0], q.shape[2]), -math.inf) if prune else None
        o, _ = triton_forgetting_attention(q, k, v, log_fgate.detach(), scale=scale, cu_seqlens=None,
                                           max_seqlen=None, threshold=threshold)
        return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))
    return run


def emulated_attention(fp32_channels: int = 0) -> Attention:
    """An ``Attention`` that rounds as a bf16 flash kernel does, densely in fp32: logits, P and sums in fp32, o
    rounded to q's dtype, delta = rowsum(dO o) from that rounded o, dS = P (dP - delta) rounded to q's dtype before the
    dots of dQ and dK (fp32 accumulation), dQ, dK, dV rounded to q's dtype, but for their last ``fp32_channels``
    channels, which stay fp32: what a kernel would write to a side buffer."""
    def run(q, k, v, log_fgate, do, scale):
        dtype = q.dtype
        qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        G = q.shape[2] // k.shape[2]
        kf, vf = (t.repeat_interleave(G, dim=1) for t in (kf, vf))
        c = torch.cumsum(log_fgate.double(), 1).transpose(1, 2)  # [B, H, Tk]
        Tq, Tk = q.shape[1], k.shape[1]
        s = scale * qf @ kf.transpose(-1, -2) + (c[..., Tk - Tq:, None] - c[..., None, :]).float()
        causal = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
        p = torch.softmax(s.masked_fill(~causal, -math.inf), -1)
        o = (p @ vf).to(dtype)
        dof = do.float().transpose(1, 2)
        delta = (dof * o.float()).sum(-1, keepdim=True)
        ds = (p * (dof @ vf.transpose(-1, -2) - delta)).to(dtype).float()
        dq = scale * ds @ kf
        dk = scale * ds.transpose(-1, -2) @ qf
        dv = p.to(dtype).float().transpose(-1, -2) @ dof
        dk, dv = (t.unflatten(1, (k.shape[2], G)).sum(2) for t in (dk, dv))
        dv = dv.transpose(1, 2).to(dtype)

        def out(t):  # [B, H, T, D] fp32 -> [B, T, H, D], rounded but for the last fp32_channels
            t = t.transpose(1, 2)
            n = t.shape[-1] - fp32_channels
            return torch.cat([t[..., :n].to(dtype).float(), t[..., n:]], -1)

        return o.transpose(1, 2), out(dq), out(dk), dv
    return run


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (Frobenius), in fp64."""
    return ((actual.double() - expected).norm() / expected.norm()).item()


def inputs(B: int, T: int, Hq: int, Hk: int, D: int, dtype: torch.dtype = torch.bfloat16, seed: int | None = None):
    """Fresh random q, k, v, do in ``dtype`` and fp32 log gates logsigmoid(2 randn + 2) (about -0.3 a token)."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())) if seed is None else seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k, v = (torch.randn(B, T, Hk, D, generator=g).to(dtype) for _ in range(2))
    log_fgate = F.logsigmoid(2 * torch.randn(B, T, Hq, generator=g) + 2)
    return q, k, v, log_fgate, torch.randn(B, T, Hq, D, generator=g).to(dtype)


def reference(q, k, v, log_fgate, do, scale: float | None = None):
    """o, dq, dk, dv and d(log_fgate) of the fp64 reference, ``foxlm.ops.forgetting_attention_reference``."""
    from foxlm.ops import forgetting_attention_reference

    leaves = [t.double().requires_grad_() for t in (q, k, v, log_fgate)]
    o = forgetting_attention_reference(*leaves, scale=scale)
    return (o.detach(), *torch.autograd.grad(o, leaves, do.double()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[256, 512], help="sequence lengths")
    parser.add_argument("--head-dim", type=int, default=48, help="head dim D (before the extra channels)")
    parser.add_argument("--heads", type=int, nargs=2, default=[2, 2], metavar=("HQ", "HK"),
                        help="query and key heads (GQA groups of HQ / HK)")
    parser.add_argument("--seed", type=int, default=0, help="inputs' seed (plus T)")
    parser.add_argument("--emulated-only", action="store_true", help="the dense model alone (fast at 4k tokens)")
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # before foxlm's kernels are imported
    from foxlm.ops import forgetting_attention, use_backend
    from foxlm.ops.forgetting_attention import triton_op as ta

    ta.SMALL_TILES = True
    D, (Hq, Hk) = args.head_dim, args.heads
    scale = 1.0 / math.sqrt(D)
    paths = {  # name: (backend, the unpadded op's arguments or None, padded Attentions with fp32 / bf16 channels)
        "kernel": ("triton", {}, kernel_attention(fp32_dk=True), kernel_attention()),
        "kernel, ACP": ("triton", dict(prune=True), kernel_attention(True, fp32_dk=True), kernel_attention(True)),
        "torch path": ("torch", {}, None, autograd_attention(forgetting_attention)),
        "emulated": ("torch", None, emulated_attention(fp32_channels=Hq // Hk + 1), emulated_attention()),
    }
    print("relative error of d(log_fgate) against fp64; own: the op's own gate gradient; the rest from the channels")
    print(f"{'T':>5} {'path':<22} {'own':>8} {'cols only':>10} {'fp32 channels':>14} {'bf16 channels':>14}")
    for T in args.seqlens:
        x = inputs(1, T, Hq, Hk, D, seed=args.seed + T)
        expected = reference(*x)[-1]

        runs = {}

        def gate(attention, rows=True):  # from the channels of one padded run per Attention
            if attention not in runs:
                runs[attention] = attention(*pad(*x[:2]), *x[2:], scale)[1:3]
            return gate_gradient_from_channels(*runs[attention], D, scale=scale, rows=rows)

        def error(attention, rows=True):
            return relative_error(gate(attention, rows), expected)

        for name, (backend, kwargs, fp32, bf16) in paths.items():
            if args.emulated_only and name != "emulated":
                continue
            with use_backend(backend):
                own = "-"
                if kwargs is not None:
                    leaves = [t.detach().requires_grad_() for t in x[:4]]
                    o = forgetting_attention(*leaves, **kwargs)
                    own = f"{relative_error(torch.autograd.grad(o, leaves[3], x[4])[0], expected):8.1e}"
                errs = [error(fp32 or bf16, rows=False), f"{error(fp32):8.1e}" if fp32 else "-", error(bf16)]
            print(f"{T:>5} {name:<22} {own:>8} {errs[0]:10.1e} {errs[1]:>14} {errs[2]:14.1e}", flush=True)
        if args.emulated_only:
            continue
        # powers of two commute with every rounding: the same bits
        kernel = paths["kernel"][3]
        same = torch.equal(gate_gradient_from_padding(*x, kernel, alpha=2.0 ** -6, beta=2.0 ** 6)[-1], gate(kernel))
        print(f"{T:>5} kernel, bf16 dK: alpha = 2^-6, beta = 2^6 give alpha = beta = 1's bits: {same}")


if __name__ == "__main__":
    main()

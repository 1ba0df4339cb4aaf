"""flash-attn-4 (CuTe DSL, Hopper / Blackwell) as a Forgetting Attention peer: the gate as a ``score_mod``.

FA4 adds ``c_i - c_j`` (c: the gate's cumulative log, an fp32 auxiliary tensor [B, H, T]) to each scaled score,
and its backward passes dS through unchanged. It returns no gradient for an auxiliary tensor, so the gate gradient
comes from padding channels (see padding_channels.py): q' = [q, alpha, 0, 0...], k' = [k, 0, beta, 0...] (head
dim rounded up to a multiple of 8), v unpadded; channel D of dK' is scale alpha colsum(dS), channel D + 1 of dQ'
scale beta rowsum(dS), and d(log f) is the reverse cumsum of their difference. Both channels leave the kernel in
q's dtype.

"fa4+ch" puts the gate itself in channels, so that FA4 runs its plain kernel: with x = c / scale split into three
bf16 parts (h + m + l = x to fp32's precision), q' = [q, h, m, l, 1, 1, 1, 0...] and k' = [k, 1, 1, 1, -h, -m, -l,
0...] give scale q'.k' = scale q.k + c_i - c_j, the products exact and summed in the MMA's fp32 accumulator. The
channels where k' is 1 return scale rowsum(dS) in dQ', those where q' is 1 scale colsum(dS) in dK': the gate
gradient without extra channels.

Imported by attention.py where ``flash_attn.cute`` is importable (a CUDA machine with flash-attn-4 and
nvidia-cutlass-dsl); nothing here runs on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALPHA = BETA = 1.0
PAD_V = [False]  # set where FA4 refuses a head dim of v unlike q's (v then padded too, o sliced)


def load() -> dict:
    """{name: fn(q, k, v, log_fgate) -> o}, q, k, v: [B, T, H, D], log_fgate: [B, T, H] fp32; o: [B, T, H, D].

    "fa4": plain causal attention (no gate); "fa4+gate": the gate as a score_mod, no gate gradient;
    "fa4+gate+dg": the same with padding channels, the gate gradient included. Raises ImportError without FA4.
    """
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.interface import flash_attn_func

    @cute.jit
    def gate_mod(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        c = aux_tensors[0]
        b = cute.make_rmem_tensor(1, cutlass.Int32)
        b.store(b_idx)
        h = cute.make_rmem_tensor(1, cutlass.Int32)
        h.store(h_idx)
        qi = cute.make_rmem_tensor(1, cutlass.Int32)
        qi.store(q_idx)
        ki = cute.make_rmem_tensor(1, cutlass.Int32)
        ki.store(kv_idx)
        bias = cute.make_rmem_tensor(1, cutlass.Float32)
        bias[0] = c[b[0], h[0], qi[0]] - c[b[0], h[0], ki[0]]
        return score + bias.load()

    @cute.jit
    def gate_mod_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    def cumulative(log_fgate: torch.Tensor) -> torch.Tensor:
        return log_fgate.float().cumsum(1).transpose(1, 2).contiguous()  # [B, H, T]

    def plain(q, k, v, log_fgate):
        return flash_attn_func(q, k, v, causal=True)[0]

    def gated(q, k, v, log_fgate):
        c = cumulative(log_fgate.detach())
        return flash_attn_func(q, k, v, causal=True, score_mod=gate_mod, score_mod_bwd=gate_mod_bwd,
                               aux_tensors=[c])[0]

    class GatedWithGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, log_fgate):
            D = q.shape[-1]
            pad = -(-(D + 2) // 8) * 8 - D
            qp = F.pad(q, (0, pad)).contiguous()
            kp = F.pad(k, (0, pad)).contiguous()
            qp[..., D] = ALPHA
            kp[..., D + 1] = BETA
            c = cumulative(log_fgate)
            with torch.enable_grad():
                qp.requires_grad_()
                kp.requires_grad_()
                vv = v.detach().requires_grad_()

                def run():
                    vp = F.pad(vv, (0, pad)) if PAD_V[0] else vv
                    o = flash_attn_func(qp, kp, vp, causal=True, softmax_scale=D ** -0.5, score_mod=gate_mod,
                                        score_mod_bwd=gate_mod_bwd, aux_tensors=[c])[0]
                    return o[..., :D]
                try:
                    o = run()
                except Exception as e:
                    if PAD_V[0]:
                        raise
                    print(f"fa4: v padded as well ({e!r:.200})", flush=True)
                    PAD_V[0] = True
                    o = run()
            ctx.graph = (o, qp, kp, vv)
            ctx.D = D
            return o.detach()

        @staticmethod
        def backward(ctx, do):
            o, qp, kp, vv = ctx.graph
            D, scale = ctx.D, ctx.D ** -0.5
            dqp, dkp, dv = torch.autograd.grad(o, (qp, kp, vv), do)
            dc = dqp[..., D + 1].float() / (scale * BETA) - dkp[..., D].float() / (scale * ALPHA)  # [B, T, H]
            dg = dc.flip(1).cumsum(1).flip(1)
            del ctx.graph
            return dqp[..., :D], dkp[..., :D], dv, dg

    class ChannelGate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, log_fgate, pad_v):
            D = q.shape[-1]
            scale = D**-0.5
            width = -(-(D + 6) // 8) * 8
            x = (log_fgate.double().cumsum(1) / scale).unsqueeze(-1)  # [B, T, H, 1]
            parts = []
            for _ in range(3):
                parts.append(x.to(q.dtype))
                x = x - parts[-1].double()
            h = torch.cat(parts, -1)
            one = torch.ones_like(h)
            qp = F.pad(torch.cat([q, h, one], -1), (0, width - D - 6)).contiguous()
            kp = F.pad(torch.cat([k, one, -h], -1), (0, width - D - 6)).contiguous()
            with torch.enable_grad():
                qp.requires_grad_()
                kp.requires_grad_()
                vv = v.detach().requires_grad_()
                vp = F.pad(vv, (0, width - D)) if pad_v else vv
                o = flash_attn_func(qp, kp, vp, causal=True, softmax_scale=scale)[0][..., :D]
            ctx.graph = (o, qp, kp, vv)
            ctx.D = D
            return o.detach()

        @staticmethod
        def backward(ctx, do):
            o, qp, kp, vv = ctx.graph
            D, scale = ctx.D, ctx.D**-0.5
            dqp, dkp, dv = torch.autograd.grad(o, (qp, kp, vv), do)
            dc = (dqp[..., D].float() - dkp[..., D + 3].float()) / scale  # [B, T, H]
            dg = dc.flip(1).cumsum(1).flip(1)
            del ctx.graph
            return dqp[..., :D], dkp[..., :D], dv, dg, None

    return {
        "fa4": plain,
        "fa4+gate": gated,
        "fa4+gate+dg": GatedWithGrad.apply,
        "fa4+ch": lambda q, k, v, g: ChannelGate.apply(q, k, v, g, False),
        "fa4+ch(v padded)": lambda q, k, v, g: ChannelGate.apply(q, k, v, g, True),
    }

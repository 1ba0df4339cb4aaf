"""flash-attn-4 (CuTe DSL, Hopper / Blackwell) as a Forgetting Attention peer: the gate as a ``score_mod``.

FA4 adds ``c_i - c_j`` (c: the gate's cumulative log, an fp32 auxiliary tensor [B, H, T]) to each scaled score,
and its backward passes dS through unchanged. It returns no gradient for an auxiliary tensor, so the gate gradient
comes from padding channels (see padding_channels.py): q' = [q, 1, 0, 0...], k' = [k, 0, 1, 0...] (head dim
rounded up to a multiple of 8), v unpadded; channel D of dK' is scale colsum(dS), channel D + 1 of dQ' scale
rowsum(dS), and d(log f) is the reverse cumsum of their difference. Both channels leave the kernel in
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


def load() -> dict:
    """{name: fn(q, k, v, log_fgate) -> o}, q, k, v: [B, T, H, D], log_fgate: [B, T, H] fp32; o: [B, T, H, D].

    "fa4": plain causal attention (no gate); "fa4+gate": the gate as a score_mod, no gate gradient;
    "fa4+gate+dg": the same with padding channels, the gate gradient included; "fa4+ch" (v padded or not): the
    gate as channels (see the module docstring). Raises ImportError without FA4.
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

    def rounded(width: int) -> int:  # FA4 takes head dims that are multiples of 8
        return -(-width // 8) * 8

    def score_mod_layout(q, k, log_fgate):
        """q' = [q, 1, 0, 0...], k' = [k, 0, 1, 0...] and the gate as a score_mod: (q', k', the row-sum channel of
        dQ', the column-sum channel of dK', FA4's extra arguments)."""
        D = q.shape[-1]
        qp = F.pad(q, (0, rounded(D + 2) - D))
        kp = F.pad(k, (0, rounded(D + 2) - D))
        qp[..., D] = 1
        kp[..., D + 1] = 1
        return qp, kp, D + 1, D, dict(score_mod=gate_mod, score_mod_bwd=gate_mod_bwd,
                                      aux_tensors=[cumulative(log_fgate)])

    def channel_layout(q, k, log_fgate):
        """q' = [q, h, m, l, 1, 1, 1, 0...], k' = [k, 1, 1, 1, -h, -m, -l, 0...] (see the module docstring)."""
        D = q.shape[-1]
        x = (log_fgate.double().cumsum(1) * D**0.5).unsqueeze(-1)  # c / scale: [B, T, H, 1]
        parts = []
        for _ in range(3):
            parts.append(x.to(q.dtype))
            x = x - parts[-1].double()
        h = torch.cat(parts, -1)
        one = torch.ones_like(h)
        qp = F.pad(torch.cat([q, h, one], -1), (0, rounded(D + 6) - D - 6))
        kp = F.pad(torch.cat([k, one, -h], -1), (0, rounded(D + 6) - D - 6))
        return qp, kp, D, D + 3, {}

    class ChannelAttention(torch.autograd.Function):
        """FA4 on padded q', k' (``layout``): o, dq, dk, dv as the unpadded attention's, and the gate gradient from
        the row- and column-sum channels of dQ' and dK'."""

        @staticmethod
        def forward(ctx, q, k, v, log_fgate, layout, pad_v):
            D = q.shape[-1]
            qp, kp, ctx.row, ctx.col, extra = layout(q, k, log_fgate)
            with torch.enable_grad():
                qp = qp.contiguous().requires_grad_()
                kp = kp.contiguous().requires_grad_()
                vv = v.detach().requires_grad_()
                vp = F.pad(vv, (0, qp.shape[-1] - D)) if pad_v else vv
                o = flash_attn_func(qp, kp, vp, causal=True, softmax_scale=D**-0.5, **extra)[0][..., :D]
            ctx.graph = (o, qp, kp, vv)
            return o.detach()

        @staticmethod
        def backward(ctx, do):
            o, qp, kp, vv = ctx.graph
            D = vv.shape[-1]
            dqp, dkp, dv = torch.autograd.grad(o, (qp, kp, vv), do)
            dc = (dqp[..., ctx.row].float() - dkp[..., ctx.col].float()) * D**0.5  # [B, T, H]: rowsum - colsum
            del ctx.graph
            return dqp[..., :D], dkp[..., :D], dv, dc.flip(1).cumsum(1).flip(1), None, None

    return {
        "fa4": plain,
        "fa4+gate": gated,
        "fa4+gate+dg": lambda q, k, v, g: ChannelAttention.apply(q, k, v, g, score_mod_layout, False),
        "fa4+ch": lambda q, k, v, g: ChannelAttention.apply(q, k, v, g, channel_layout, False),
        "fa4+ch(v padded)": lambda q, k, v, g: ChannelAttention.apply(q, k, v, g, channel_layout, True),
    }

"""``swiglu``: the fused gated activation of the SwiGLU MLP, h = silu(gate) * up, computed in fp32.

The Triton path (CUDA; CPU under ``TRITON_INTERPRET=1``; see ``foxlm.ops.use_backend``) is one elementwise kernel
forward and one backward; the backward recomputes silu from the saved inputs (two tensors saved where the unfused
ops save three). ``_swiglu_torch`` is the PyTorch path (CPU, float64, ``torch.compile``) and the readable
statement of the same math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .autograd import first_order_only
from .backend import cast, interpreted, jit, require_runnable, tl, triton, use_triton
from .checks import DTYPES

_BLOCK = 2048


@jit
def _swiglu_fwd_kernel(G, U, H, N, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(H + offs, cast(g * tl.sigmoid(g) * u, H.dtype.element_ty, INTERPRET), mask=mask)


@jit
def _swiglu_bwd_kernel(G, U, DH, DG, DU, N, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DG + offs, cast(dh * u * (sig + silu * (1.0 - sig)), DG.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(DU + offs, cast(dh * silu, DU.dtype.element_ty, INTERPRET), mask=mask)


# Built by Triton's interpreter (TRITON_INTERPRET=1 at import): CPU tensors, and ``cast``'s rounding to bf16.
_INTERPRETED = interpreted(_swiglu_fwd_kernel)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        h = torch.empty_like(gate)
        N = gate.numel()
        _swiglu_fwd_kernel[(triton.cdiv(N, _BLOCK),)](gate, up, h, N, BLOCK=_BLOCK, INTERPRET=_INTERPRETED)
        ctx.save_for_backward(gate, up)
        return h

    @staticmethod
    @first_order_only("swiglu")  # the kernel writes the gradients without a graph
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        N = gate.numel()
        _swiglu_bwd_kernel[(triton.cdiv(N, _BLOCK),)](gate, up, dh.contiguous(), dg, du, N, BLOCK=_BLOCK,
                                                     INTERPRET=_INTERPRETED)
        return dg, du


def _swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The PyTorch path: silu(gate) * up in fp32 (fp64 for fp64 inputs), returned in gate's dtype."""
    dtype = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(dtype)) * up.to(dtype)).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) * up (the SwiGLU MLP's activation), fused.

    Args:
        gate, up: [...] tensors of one shape, dtype (float16, bfloat16, float32 or float64) and device.

    Returns:
        h: gate's shape and dtype, computed in fp32 (fp64 for fp64 inputs). Differentiable in both.
    """
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise ValueError("gate, up: expected tensors")
    if gate.dtype not in DTYPES:
        raise ValueError(f"gate: expected float16, bfloat16, float32 or float64, got {gate.dtype}")
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"up: expected gate's shape {tuple(gate.shape)}, dtype {gate.dtype} and device "
                         f"{gate.device}, got {tuple(up.shape)}, {up.dtype}, {up.device}")
    if use_triton(gate) and not torch.compiler.is_compiling():  # compiled: the compiler fuses the PyTorch path
        require_runnable(_swiglu_fwd_kernel, gate, "gate")
        return _SwiGLU.apply(gate, up)
    return _swiglu_torch(gate, up)

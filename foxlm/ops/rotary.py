"""``apply_rotary``: the fused rotary position embedding of the Transformer baselines ("rotate half" layout).

y = [x1 cos - x2 sin, x2 cos + x1 sin] for x = [x1, x2] split in halves, per (token, head), with cos and sin
[B or 1, T, D/2] given by the caller (``foxlm.layers.RotaryEmbedding`` computes them in fp32 from the positions).
The backward is the same rotation by the opposite angle.

The Triton path (CUDA; CPU under ``TRITON_INTERPRET=1``; see ``foxlm.ops.use_backend``) is one kernel forward and
one backward, each program a block of (token, head) rows, reading x through its strides; it replaces the ~10
elementwise kernels of the PyTorch path, ``_rotary_torch``, which is also its readable statement (and what
``torch.compile`` fuses).
"""

from __future__ import annotations

import torch

from .backend import cast, interpreted, jit, require_runnable, tl, triton, use_triton
from .checks import DTYPES

_BLOCK_ELEMENTS = 2048  # half-rows' elements per program: BLOCK_R = _BLOCK_ELEMENTS // BLOCK_HALF rows


@jit
def _rotary_kernel(X, COS, SIN, Y, N, T, H, sxb, sxt, sxh, scb, sct, ssb, sst, SIGN: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows r = (b*T + t)*H + h of x [B, T, H, 2*HALF] (last dim contiguous) into the contiguous y; cos and sin
    through their own batch and token strides (a batch stride of 0 broadcasts one row)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = tl.arange(0, BLOCK_HALF)
    rmask = r < N
    mask = rmask[:, None] & (i < HALF)[None, :]
    h = r % H
    bt = r // H
    t = bt % T
    b = bt // T
    x_row = X + (b * sxb + t * sxt + h * sxh)[:, None] + i[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(COS + (b * scb + t * sct)[:, None] + i[None, :], mask=mask, other=0.0)
    s = tl.load(SIN + (b * ssb + t * sst)[:, None] + i[None, :], mask=mask, other=0.0) * SIGN
    y_row = Y + r[:, None] * (2 * HALF) + i[None, :]
    tl.store(y_row, cast(x1 * c - x2 * s, Y.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(y_row + HALF, cast(x2 * c + x1 * s, Y.dtype.element_ty, INTERPRET), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    B, T, H, D = x.shape
    y = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
    block_half = max(1, triton.next_power_of_2(D // 2))  # next_power_of_2(0) is 0
    block_r = max(1, _BLOCK_ELEMENTS // block_half)
    N = B * T * H

    def strides(t):  # cos and sin may each be shared by the batch ([1, T, D/2]) or not
        return t.stride(0) if t.shape[0] > 1 else 0, t.stride(1)

    _rotary_kernel[(triton.cdiv(N, block_r),)](
        x, cos, sin, y, N, T, H, *x.stride()[:3], *strides(cos), *strides(sin), SIGN=sign, HALF=D // 2,
        BLOCK_R=block_r, BLOCK_HALF=block_half, INTERPRET=interpreted(_rotary_kernel), num_warps=4,
    )
    return y


class _Rotary(torch.autograd.Function):
    """The rotation by ``sign`` times the angles. Its backward, the rotation the other way, is a _Rotary too: the op
    is linear in x, so that makes every higher derivative exact (a gradient penalty through it, create_graph=True)."""

    @staticmethod
    def forward(ctx, x, cos, sin, sign=1):
        ctx.save_for_backward(cos, sin)
        ctx.sign = sign
        return _rotate(x, cos, sin, sign)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _Rotary.apply(dy, cos, sin, -ctx.sign), None, None, None


def _rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The PyTorch path: the same math in differentiable torch ops, in cos's dtype."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B or 1, T, 1, D/2]
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _validate(x, cos, sin) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"x: expected a 4-D tensor [B, T, H, D] with an even D, got {getattr(x, 'shape', type(x))}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x: expected float16, bfloat16, float32 or float64, got {x.dtype}")
    B, T, _, D = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        shape = tuple(getattr(t, "shape", ()))
        if not isinstance(t, torch.Tensor) or len(shape) != 3 or shape[0] not in (1, B) or shape[1:] != (T, D // 2):
            raise ValueError(f"{name}: expected shape [B or 1, T, D/2] = [{B} or 1, {T}, {D // 2}], got "
                             f"{getattr(t, 'shape', type(t))}")
        if t.dtype not in (torch.float32, torch.float64) or t.device != x.device:
            raise ValueError(f"{name}: expected float32 or float64 on {x.device}, got {t.dtype} on {t.device}")
    if cos.dtype != sin.dtype:
        raise ValueError(f"sin: expected cos's dtype {cos.dtype}, got {sin.dtype}")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, "rotate half" layout (LLaMA, HF): [x1, x2] -> [x1 c - x2 s, x2 c + x1 s].

    Args:
        x: [B, T, H, D] (float16, bfloat16, float32 or float64), D even; any strides with a contiguous last dim
            is read in place.
        cos, sin: [B or 1, T, D/2] fp32 (fp64 for the fp64 reference) cosines and sines of each token's angles.

    Returns:
        y: [B, T, H, D] contiguous, in x's dtype, computed in cos's dtype. Differentiable in x, and in cos and sin
        where they require grad (learned angles: the PyTorch path then runs, the kernel has no gradient for them).
    """
    _validate(x, cos, sin)
    angles_grad = torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    if use_triton(x) and cos.dtype == torch.float32 and not angles_grad and not torch.compiler.is_compiling():
        require_runnable(_rotary_kernel, x, "x")
        return _Rotary.apply(x, cos.contiguous(), sin.contiguous())
    return _rotary_torch(x, cos, sin)

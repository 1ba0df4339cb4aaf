"""``token_shift``: the fused data-dependent token shift of FoX Pro ("KV-shift").

y_t = a_t * x_{t-1} + (1 - a_t) * x_t per (token, head), a_t = sigmoid(alpha_logit_t), computed in fp32.
x_{t-1} is ``prev`` (the decode state; zeros when None) at t = 0, and zero wherever ``reset`` is set.

The Triton path (CUDA; CPU under ``TRITON_INTERPRET=1``; see ``foxlm.ops.use_backend``) is one kernel
forward and one backward, each program a block of (token, head) rows of the contiguous [B*T*H, D] view;
the backward saves only the inputs. ``_token_shift_torch`` is the PyTorch path (CPU, float64) and the
readable statement of the same math.
"""

from __future__ import annotations

import torch

from .autograd import first_order_only
from .backend import cast, interpreted, jit, require_runnable, tl, triton, use_triton
from .checks import DTYPES

_BLOCK_ELEMENTS = 4096  # elements per program: BLOCK_R = _BLOCK_ELEMENTS // BLOCK_D rows


@jit
def _rows(X, A, R, PREV, pid, N, T, H, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
          HAS_PREV: tl.constexpr, HAS_RESET: tl.constexpr):
    """The program's rows r = (b*T + t)*H + h of the [N = B*T*H, D] view, with a_t, x_t and x_{t-1} in fp32.

    Returns (r, d, row mask, element mask, t, b*T + t, b*H + h, whether x_{t-1} is prev, a, x, x_prev)."""
    r = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    rmask = r < N
    mask = rmask[:, None] & (d < D)[None, :]
    bt = r // H
    t = bt % T
    bh = (bt // T) * H + r % H
    keep = rmask
    if HAS_RESET:
        keep = keep & (tl.load(R + bt, mask=rmask, other=1) == 0)
    a = tl.sigmoid(tl.load(A + r, mask=rmask, other=0.0).to(tl.float32))
    x = tl.load(X + r[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    look = keep & (t > 0)
    xp = tl.load(X + (r - H)[:, None] * D + d[None, :], mask=mask & look[:, None], other=0.0).to(tl.float32)
    first = keep & (t == 0)
    if HAS_PREV:
        xp += tl.load(PREV + bh[:, None] * D + d[None, :], mask=mask & first[:, None], other=0.0).to(tl.float32)
    return r, d, rmask, mask, t, bt, bh, first, a, x, xp


@jit
def _token_shift_fwd_kernel(X, A, PREV, R, Y, N, T, H, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                            HAS_PREV: tl.constexpr, HAS_RESET: tl.constexpr, INTERPRET: tl.constexpr):
    r, d, _, mask, _, _, _, _, a, x, xp = _rows(
        X, A, R, PREV, tl.program_id(0), N, T, H, D, BLOCK_R, BLOCK_D, HAS_PREV, HAS_RESET
    )
    y = a[:, None] * xp + (1.0 - a[:, None]) * x
    tl.store(Y + r[:, None] * D + d[None, :], cast(y, Y.dtype.element_ty, INTERPRET), mask=mask)


@jit
def _token_shift_bwd_kernel(X, A, PREV, R, DY, DX, DA, DPREV, N, T, H, D: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_D: tl.constexpr, HAS_PREV: tl.constexpr, HAS_RESET: tl.constexpr,
                            NEED_DPREV: tl.constexpr, INTERPRET: tl.constexpr):
    r, d, rmask, mask, t, bt, bh, first, a, x, xp = _rows(
        X, A, R, PREV, tl.program_id(0), N, T, H, D, BLOCK_R, BLOCK_D, HAS_PREV, HAS_RESET
    )
    dy = tl.load(DY + r[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    da = a * (1.0 - a) * tl.sum(dy * (xp - x), 1)
    tl.store(DA + r, cast(da, DA.dtype.element_ty, INTERPRET), mask=rmask)
    # x_t is also the x_{t-1} of token t+1, unless t is the last token or token t+1 resets
    fed = rmask & (t + 1 < T)
    if HAS_RESET:
        fed = fed & (tl.load(R + bt + 1, mask=fed, other=1) == 0)
    a_next = tl.where(fed, tl.sigmoid(tl.load(A + r + H, mask=fed, other=0.0).to(tl.float32)), 0.0)
    dy_next = tl.load(DY + (r + H)[:, None] * D + d[None, :], mask=mask & fed[:, None], other=0.0).to(tl.float32)
    dx = (1.0 - a[:, None]) * dy + a_next[:, None] * dy_next
    tl.store(DX + r[:, None] * D + d[None, :], cast(dx, DX.dtype.element_ty, INTERPRET), mask=mask)
    if NEED_DPREV:  # prev is x_{-1}: zero gradient where token 0 resets
        dprev = tl.where(first[:, None], a[:, None] * dy, 0.0)
        tl.store(DPREV + bh[:, None] * D + d[None, :], cast(dprev, DPREV.dtype.element_ty, INTERPRET),
                 mask=mask & (t == 0)[:, None])


# Kernels built by Triton's interpreter (TRITON_INTERPRET=1 at import) run on CPU tensors.


def _meta(x: torch.Tensor, prev: torch.Tensor | None, reset: torch.Tensor | None) -> tuple[tuple, dict]:
    """Grid and compile-time arguments of both kernels for x: [B, T, H, D]."""
    B, T, H, D = x.shape
    n = B * T * H
    # at least 1 (next_power_of_2(0) is 0): an empty x launches an empty grid
    block_d = max(1, triton.next_power_of_2(D))
    block_r = min(max(1, _BLOCK_ELEMENTS // block_d), max(1, triton.next_power_of_2(n)))
    meta = dict(D=D, BLOCK_R=block_r, BLOCK_D=block_d, HAS_PREV=prev is not None, HAS_RESET=reset is not None,
                INTERPRET=interpreted(_token_shift_fwd_kernel))
    return (triton.cdiv(n, block_r),), meta


class _TokenShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha_logit, prev, reset):
        x, alpha_logit = x.contiguous(), alpha_logit.contiguous()
        prev = prev.contiguous() if prev is not None else None
        reset = reset.contiguous().view(torch.uint8) if reset is not None else None
        B, T, H, _ = x.shape
        y = torch.empty_like(x)
        grid, meta = _meta(x, prev, reset)
        _token_shift_fwd_kernel[grid](x, alpha_logit, x if prev is None else prev, x if reset is None else reset, y,
                                      B * T * H, T, H, **meta)
        ctx.save_for_backward(x, alpha_logit, prev, reset)
        return y

    @staticmethod
    @first_order_only("token_shift")  # the kernel writes the gradients without a graph
    def backward(ctx, dy):
        x, alpha_logit, prev, reset = ctx.saved_tensors
        B, T, H, _ = x.shape
        dx, dalpha = torch.empty_like(x), torch.empty_like(alpha_logit)
        # zeros: with T = 0 no row (token 0) writes it
        dprev = torch.zeros_like(prev) if prev is not None and ctx.needs_input_grad[2] else None
        grid, meta = _meta(x, prev, reset)
        _token_shift_bwd_kernel[grid](x, alpha_logit, x if prev is None else prev, x if reset is None else reset,
                                      dy.contiguous(), dx, dalpha, x if dprev is None else dprev, B * T * H, T, H,
                                      NEED_DPREV=dprev is not None, **meta)
        return dx, dalpha, dprev, None


def _token_shift_torch(x, alpha_logit, prev, reset) -> torch.Tensor:
    """The PyTorch path: the same math in differentiable torch ops (fp32, or fp64 for fp64 inputs)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    a = torch.sigmoid(alpha_logit.to(dtype))[..., None]  # [B, T, H, 1]
    first = xf.new_zeros(x.shape[0], 1, *x.shape[2:]) if prev is None else prev[:, None].to(dtype)
    x_prev = torch.cat([first, xf[:, :-1]], dim=1)
    if reset is not None:
        x_prev = x_prev.masked_fill(reset[..., None, None], 0.0)
    return (a * x_prev + (1 - a) * xf).to(x.dtype)


def _validate(x, alpha_logit, prev, reset) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"x: expected a 4-D tensor [B, T, H, D], got {getattr(x, 'shape', type(x))}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x: expected float16, bfloat16, float32 or float64, got {x.dtype}")
    B, T, H, D = x.shape
    if not isinstance(alpha_logit, torch.Tensor) or tuple(alpha_logit.shape) != (B, T, H):
        raise ValueError(
            f"alpha_logit: expected shape [B, T, H] = {(B, T, H)}, got {getattr(alpha_logit, 'shape', None)}"
        )
    if not alpha_logit.is_floating_point():
        raise ValueError(f"alpha_logit: expected a float tensor, got {alpha_logit.dtype}")
    if prev is not None:
        if not isinstance(prev, torch.Tensor) or tuple(prev.shape) != (B, H, D):
            raise ValueError(
                f"prev: expected shape [B, H, D] = {(B, H, D)} or None, got {getattr(prev, 'shape', None)}"
            )
        if not prev.is_floating_point():
            raise ValueError(f"prev: expected a float tensor, got {prev.dtype}")
    if reset is not None and (
        not isinstance(reset, torch.Tensor) or reset.dtype != torch.bool or tuple(reset.shape) != (B, T)
    ):
        raise ValueError(
            f"reset: expected a bool tensor [B, T] = {(B, T)} or None, got "
            f"{getattr(reset, 'dtype', type(reset))} {tuple(getattr(reset, 'shape', ()))}"
        )
    for name, t in (("alpha_logit", alpha_logit), ("prev", prev), ("reset", reset)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but x is on {x.device}; all inputs must share a device")


def token_shift(
    x: torch.Tensor,
    alpha_logit: torch.Tensor,
    *,
    prev: torch.Tensor | None = None,
    reset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Data-dependent token shift: y_t = a_t * x_{t-1} + (1 - a_t) * x_t, a_t = sigmoid(alpha_logit_t).

    Args:
        x: [B, T, H, D] (float16, bfloat16, float32 or float64) the projections to shift.
        alpha_logit: [B, T, H] pre-sigmoid mixing logits, any float dtype (the sigmoid runs in fp32).
        prev: [B, H, D] the x of the token before x[:, 0] (decoding with a cache); None: zeros.
        reset: [B, T] bool, True where token t must not see token t-1 (x_{t-1} = 0 there); None: no resets.

    Returns:
        y: [B, T, H, D] in x's dtype, computed in fp32 (fp64 for fp64 x). Differentiable in x,
        alpha_logit and prev.
    """
    _validate(x, alpha_logit, prev, reset)
    if use_triton(x) and not torch.compiler.is_compiling():  # compiled: the compiler fuses the PyTorch path
        require_runnable(_token_shift_fwd_kernel, x, "x")
        return _TokenShift.apply(x, alpha_logit, prev, reset)
    return _token_shift_torch(x, alpha_logit, prev, reset)

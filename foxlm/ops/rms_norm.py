"""``rms_norm``: RMSNorm with an optional fused pre-norm residual add and a fused sigmoid output gate.

Rows are normalised over their last dimension D; a weight [D] serves the residual stream, a weight [H, D]
per-head norms (QK-norm, the output norm), each head with its own weight vector. The Triton path sees x as
[N, H, D] (H = 1 for a weight [D]):

* forward: one program per (block of rows, head) writes y, the rows' 1/rms (fp32, the only thing saved
  beside the inputs) and, with a residual, s = x + residual;
* backward: a fixed number of programs per head, each looping over a strided set of row blocks, writes dx
  (and d residual, d gate) and its partial sum of the weight gradient into an fp32 buffer, summed in
  torch afterwards: deterministic, no atomics.

``_rms_norm_torch`` is the PyTorch path (CPU, float64, ``use_backend("torch")``, D > MAX_DIM) and the
readable statement of the same math.
"""

from __future__ import annotations

import functools

import torch

from .autograd import first_order_only
from .backend import cast, interpreted, jit, require_runnable, tl, triton, use_triton
from .checks import DTYPES

# Largest D the Triton kernels take (one row block must fit in registers); wider rows take the PyTorch path.
MAX_DIM = 8192


@jit
def _rms_norm_fwd_kernel(X, R, G, W, Y, S, RSTD, N, H, D, eps,
                         HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """Rows [pid * BLOCK_R, +BLOCK_R) of head h; all tensors [N, H, D] contiguous, RSTD [N, H]."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < N
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    head_rows = rows.to(tl.int64) * H + h
    offs = head_rows[:, None] * D + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        s = cast(x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32), S.dtype.element_ty, INTERPRET)
        tl.store(S + offs, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    tl.store(RSTD + head_rows, rstd, mask=rmask)
    w = tl.load(W + h * D + cols, mask=cmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    if HAS_GATE:
        y = y * tl.sigmoid(tl.load(G + offs, mask=mask, other=0.0).to(tl.float32))
    tl.store(Y + offs, cast(y, Y.dtype.element_ty, INTERPRET), mask=mask)


@jit
def _rms_norm_bwd_kernel(X, G, W, RSTD, DY, DS, DX, DR, DG, DW, N, H, D,
                         HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                         INTERPRET: tl.constexpr):
    """Row blocks pid, pid + P, ... of head h (P programs per head): dx (+ upstream ds; written to DX and,
    with a residual, DR), dgate, and this program's weight-gradient partial sum DW[pid, h] (fp32)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    step = tl.num_programs(0) * BLOCK_R
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(W + h * D + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    start = pid * BLOCK_R
    while start < N:
        rows = start + tl.arange(0, BLOCK_R)
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        head_rows = rows.to(tl.int64) * H + h
        offs = head_rows[:, None] * D + cols[None, :]
        rstd = tl.load(RSTD + head_rows, mask=rmask, other=0.0)
        xhat = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            g = tl.sigmoid(tl.load(G + offs, mask=mask, other=0.0).to(tl.float32))
            tl.store(DG + offs, cast(dy * xhat * w[None, :] * g * (1.0 - g), DG.dtype.element_ty, INTERPRET), mask=mask)
            dy = dy * g
        dw += dy * xhat
        dyw = dy * w[None, :]
        dx = (dyw - xhat * (tl.sum(dyw * xhat, axis=1) / D)[:, None]) * rstd[:, None]
        if HAS_RES:
            dx += tl.load(DS + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(DR + offs, cast(dx, DR.dtype.element_ty, INTERPRET), mask=mask)
        tl.store(DX + offs, cast(dx, DX.dtype.element_ty, INTERPRET), mask=mask)
        start += step
    tl.store(DW + (pid * H + h) * D + cols, tl.sum(dw, axis=0), mask=cmask)


# Built by Triton's interpreter (TRITON_INTERPRET=1 at import): CPU tensors, small blocks, ``cast``'s bf16 rounding.
_INTERPRETED = interpreted(_rms_norm_fwd_kernel)


@functools.cache
def _programs(device: torch.device) -> int:
    """Backward programs over all heads: a few per SM on a GPU; two under the interpreter (exercises the loop)."""
    if device.type != "cuda":
        return 2
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _blocks(N: int, D: int, interpreter: bool) -> tuple[int, int, int]:
    """BLOCK_R, BLOCK_D and num_warps: a row block of about 4096 elements (512 under the interpreter)."""
    block_d = triton.next_power_of_2(D)
    block_r = min(max(1, (512 if interpreter else 4096) // block_d), triton.next_power_of_2(N))
    return block_r, block_d, min(16, max(1, block_r * block_d // 512))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, gate, eps, out_dtype):
        N, H, D = x.shape
        block_r, block_d, warps = _blocks(N, D, _INTERPRETED)
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(N, H, dtype=torch.float32, device=x.device)
        s = None if residual is None else torch.empty_like(x, dtype=torch.promote_types(x.dtype, residual.dtype))
        _rms_norm_fwd_kernel[(triton.cdiv(N, block_r), H)](
            x, residual, gate, weight, y, s, rstd, N, H, D, eps, HAS_RES=residual is not None,
            HAS_GATE=gate is not None, BLOCK_R=block_r, BLOCK_D=block_d, INTERPRET=_INTERPRETED,
            num_warps=warps,
        )
        ctx.save_for_backward(x if s is None else s, weight, gate, rstd)
        ctx.dtypes = (x.dtype, None if residual is None else residual.dtype)
        ctx.blocks = (block_r, block_d, warps)
        return y if s is None else (y, s)

    @staticmethod
    @first_order_only("rms_norm")  # the kernel writes the gradients without a graph
    def backward(ctx, dy, ds=None):
        x, weight, gate, rstd = ctx.saved_tensors
        N, H, D = x.shape
        x_dtype, res_dtype = ctx.dtypes
        block_r, block_d, warps = ctx.blocks
        programs = min(triton.cdiv(N, block_r), max(1, _programs(x.device) // H))
        dx = torch.empty(x.shape, dtype=x_dtype, device=x.device)
        dres = None if res_dtype is None else torch.empty(x.shape, dtype=res_dtype, device=x.device)
        dgate = None if gate is None else torch.empty_like(gate)
        dw = torch.empty(programs, H, D, dtype=torch.float32, device=x.device)
        _rms_norm_bwd_kernel[(programs, H)](
            x, gate, weight, rstd, dy.contiguous(), None if ds is None else ds.contiguous(), dx, dres, dgate, dw,
            N, H, D, HAS_RES=dres is not None, HAS_GATE=gate is not None, BLOCK_R=block_r, BLOCK_D=block_d,
            INTERPRET=_INTERPRETED, num_warps=warps,
        )
        return dx, dw.sum(0).to(weight.dtype), dres, dgate, None, None


def _rms_norm_torch(x, weight, eps, residual, gate, out_dtype):
    s = x if residual is None else x + residual  # type promotion: the wider of the two dtypes
    dt = torch.promote_types(s.dtype, torch.float32)
    sf = s.to(dt)
    y = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dt)
    if gate is not None:
        y = y * torch.sigmoid(gate.to(dt))
    y = y.to(out_dtype)
    return y if residual is None else (y, s)


def _validate(x, weight, eps, residual, gate, out_dtype) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES:
        got = getattr(x, "dtype", type(x))
        raise ValueError(f"x: expected a float16, bfloat16, float32 or float64 tensor, got {got}")
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dim() not in (1, 2)
        or x.dim() < weight.dim()
        or tuple(x.shape[x.dim() - weight.dim():]) != tuple(weight.shape)
    ):
        raise ValueError(
            f"weight: expected [D] or [H, D] matching the trailing dims of x {tuple(x.shape)}, "
            f"got {tuple(getattr(weight, 'shape', ()))}"
        )
    gate_shapes = [tuple(x.shape)]
    if weight.dim() == 2:
        gate_shapes.append((*x.shape[:-2], x.shape[-2] * x.shape[-1]))
    checks = (("weight", weight, None), ("residual", residual, [tuple(x.shape)]), ("gate", gate, gate_shapes))
    for name, t, shapes in checks:
        if t is None:
            continue
        if shapes is not None and tuple(t.shape) not in shapes:
            raise ValueError(f"{name}: expected shape {' or '.join(map(str, shapes))}, got {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: expected float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but x is on {x.device}; all inputs must share a device")
    if out_dtype is not None and out_dtype not in DTYPES:
        raise ValueError(f"out_dtype: expected float16, bfloat16, float32 or float64, got {out_dtype}")
    # a negative or NaN eps gives NaN rows; a string ran on the kernels (float()) and failed on the PyTorch path
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = x / sqrt(mean(x^2) + eps) * weight (* sigmoid(gate)), over the last dim, in fp32 (fp64 for fp64).

    Args:
        x: [..., D] with weight [D] (residual stream), or [..., H, D] with weight [H, D] (per-head norm,
            every head its own weight vector).
        weight: [D] or [H, D].
        eps: added to the mean square (a finite number >= 0).
        residual: same shape as x: the pre-norm residual add, s = x + residual in the wider of the two
            dtypes, is normalised instead of x and returned too.
        gate: same shape as x (or [..., H * D] for a per-head norm): the output is multiplied by sigmoid(gate).
        out_dtype: the dtype of y, default x's.

    Returns:
        y: x's shape in ``out_dtype``; with ``residual`` the pair (y, s).

    CUDA tensors go through the Triton kernels (CPU tensors under ``TRITON_INTERPRET=1``), float64 and
    rows wider than ``MAX_DIM`` through the PyTorch path; ``foxlm.ops.use_backend`` overrides the choice.
    Gradients reach x, weight, residual and gate.
    """
    _validate(x, weight, eps, residual, gate, out_dtype)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if gate is not None:
        gate = gate.reshape(x.shape)
    s_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    D = x.shape[-1]
    # Under torch.compile the PyTorch path: the compiler fuses it with its neighbours itself.
    fused = use_triton(x) and s_dtype != torch.float64 and 0 < x.numel() and D <= MAX_DIM
    if torch.compiler.is_compiling() or not fused:
        return _rms_norm_torch(x, weight, eps, residual, gate, out_dtype)
    require_runnable(_rms_norm_fwd_kernel, x, "x")
    H = 1 if weight.dim() == 1 else weight.shape[0]

    def rows(t):
        return None if t is None else t.reshape(-1, H, D).contiguous()

    out = _RMSNorm.apply(rows(x), weight.reshape(H, D).contiguous(), rows(residual), rows(gate), float(eps), out_dtype)
    if residual is None:
        return out.view(x.shape)
    return out[0].view(x.shape), out[1].view(x.shape)

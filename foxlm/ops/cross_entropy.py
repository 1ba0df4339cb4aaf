"""``linear_cross_entropy``: the LM head and the cross-entropy loss in one op, a chunk of rows at a time, so the
[N, V] logits (and their gradient) never exist at once.

With reduction "mean" or "sum" the gradients are computed during the forward, chunk by chunk (as in
Liger-Kernel's fused linear cross-entropy), and only scaled by the incoming gradient in the backward; with
"none" the backward recomputes each chunk's logits. The forward's logits gradient is softmax - onehot, unscaled:
the 1/count of "mean" and the incoming gradient (an fp16 loss scale) multiply dh and dW in fp32 in the backward, so
that fp16 does not flush its small entries to zero before the loss scale reaches them.

Per chunk, the logits come from one matmul; on the Triton path (CUDA; CPU under ``TRITON_INTERPRET=1``;
see ``foxlm.ops.use_backend``) one kernel then reads them as the matmul wrote them (no fp32 copy), one
program per row: the row's logsumexp in one online pass over V, its loss, and, when gradients are wanted,
a second pass that overwrites the row in place with its logits gradient, which the two gradient matmuls
read. ``_softmax_rows_torch`` is the PyTorch path (CPU, float64) and the readable statement of that math.
"""

from __future__ import annotations

import torch

from .autograd import first_order_only
from .backend import cast, interpreted, jit, require_runnable, tl, triton, use_triton
from .checks import DTYPES

REDUCTIONS = ("mean", "sum", "none")
# Rows per chunk by default: one chunk's fp32 logits take about 2**26 * 4 bytes = 256 MB.
_CHUNK_ELEMENTS = 2**26


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk so that a chunk's fp32 logits stay around 256 MB (a multiple of 128 rows when that big)."""
    rows = max(1, _CHUNK_ELEMENTS // vocab_size)
    return rows - rows % 128 if rows >= 128 else rows


def check_label_values(labels: torch.Tensor, vocab_size: int, ignore_index: int = -100, name: str = "labels") -> None:
    """Refuse, naming ``name``, labels that are not int64 or hold a value outside [0, vocab_size) other than
    ``ignore_index``. No host sync on CUDA or compiled: there the range check is an assertion (as ``F.cross_entropy``'s,
    with a message), on the CPU eagerly a ValueError."""
    if labels.dtype != torch.int64:
        raise ValueError(f"{name}: expected int64 class indices, got {labels.dtype}")
    in_range = ((labels >= 0) & (labels < vocab_size)) | (labels == ignore_index)
    # Compiled, the check stays in the graph as an assertion (bool() would break it at a host sync).
    if labels.is_cuda or torch.compiler.is_compiling():
        torch._assert_async(in_range.all(), f"{name}: expected values in [0, V) or ignore_index")
    elif not bool(in_range.all()):
        raise ValueError(f"{name}: expected values in [0, {vocab_size}) or ignore_index={ignore_index}")


def _validate(hidden, weight, labels, ignore_index, reduction, chunk_size) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden: expected a 2-D tensor [N, C], got {getattr(hidden, 'shape', type(hidden))}")
    N, C = hidden.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != C or weight.shape[0] < 1:
        got = getattr(weight, "shape", type(weight))
        raise ValueError(f"weight: expected a 2-D tensor [V, C={C}] with V >= 1, got {got}")
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: expected float16, bfloat16, float32 or float64, got {t.dtype}")
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (N,):
        raise ValueError(f"labels: expected a 1-D tensor [N={N}], got {getattr(labels, 'shape', type(labels))}")
    if labels.dtype != torch.int64:
        raise ValueError(f"labels: expected int64 class indices, got {labels.dtype}")
    for name, t in (("weight", weight), ("labels", labels)):
        if t.device != hidden.device:
            raise ValueError(f"{name}: on {t.device}, but hidden is on {hidden.device}; all inputs must share a device")
    # a float compared with the labels silently; the kernel takes it as an integer
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index: expected an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive number of rows (int) or None, got {chunk_size!r}")


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype: autocast's for the device when it is on (float64 inputs stay float64, as under
    autocast), else the inputs' own dtype, which must then match."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (hidden.dtype, weight.dtype):
        return torch.get_autocast_dtype(device)
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: expected hidden's dtype {hidden.dtype} (outside autocast), got {weight.dtype}")
    return hidden.dtype


@jit
def _softmax_rows_kernel(LOGITS, stride, LABELS, SCALE, scale_stride, LOSSES, ignore_index,
                         V: tl.constexpr, HAS_GRAD: tl.constexpr, BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr):
    """Row r of the logits [n, V] (row stride ``stride``): LOSSES[r] = lse - logit[label] (fp32, 0 for an
    ignored row) and, with HAS_GRAD, the row overwritten by (softmax - onehot(label)) * SCALE[r * scale_stride]
    (times 0 for an ignored row). Math in fp32, exponentials in base 2."""
    LOG2E: tl.constexpr = 1.4426950408889634
    r = tl.program_id(0).to(tl.int64)
    row = LOGITS + r * stride
    label = tl.load(LABELS + r)
    counted = label != ignore_index
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")  # running max and sum of exp2(x * LOG2E - m) over the blocks seen
    s = 0.0
    for start in range(0, V, BLOCK_V):
        x = tl.load(row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32) * LOG2E
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(x - m_new), 0)
        m = m_new
    lse2 = m + tl.log2(s)
    # a label outside [0, V) is not checked here (no host sync): it reads logit 0 and gets no onehot
    x_label = tl.load(row + label, mask=counted & (label >= 0) & (label < V), other=0.0).to(tl.float32)
    tl.store(LOSSES + r, tl.where(counted, lse2 / LOG2E - x_label, 0.0))
    if HAS_GRAD:
        scale = tl.where(counted, tl.load(SCALE + r * scale_stride).to(tl.float32), 0.0)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            x = tl.load(row + offs, mask=offs < V, other=0.0).to(tl.float32)
            g = tl.exp2(x * LOG2E - lse2) - tl.where(offs == label, 1.0, 0.0)
            tl.store(row + offs, cast(g * scale, LOGITS.dtype.element_ty, INTERPRET), mask=offs < V)


# Kernels built by Triton's interpreter (TRITON_INTERPRET=1 at import) run on CPU tensors.
_INTERPRETED = interpreted(_softmax_rows_kernel)
# Logits per block of the kernel's loops over V: large on a GPU (tuned at GPT-2's V), small under the
# interpreter so that tests with a small V still loop over several blocks and a partial one.
BLOCK_V = 8192
BLOCK_V_INTERPRETED = 256


def _softmax_rows_triton(logits, labels, ignore_index, losses, row_scale):
    n, V = logits.shape
    block_v = min(triton.next_power_of_2(V), BLOCK_V_INTERPRETED if _INTERPRETED else BLOCK_V)
    _softmax_rows_kernel[(n,)](
        logits, logits.stride(0), labels, logits if row_scale is None else row_scale,
        0 if row_scale is None else row_scale.stride(0), losses, ignore_index,
        V=V, HAS_GRAD=row_scale is not None, BLOCK_V=block_v, INTERPRET=_INTERPRETED,
        num_warps=min(8, max(1, block_v // 512)),
    )
    return None if row_scale is None else logits


def _softmax_rows_torch(logits, labels, ignore_index, losses, row_scale):
    acc = torch.promote_types(logits.dtype, torch.float32)
    counted = labels != ignore_index
    target = torch.where(counted, labels, 0)[:, None]
    z = logits.to(acc)
    lse = torch.logsumexp(z, dim=-1)
    losses.copy_(torch.where(counted, lse - z.gather(1, target)[:, 0], 0))
    if row_scale is None:
        return None
    g = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
    g.scatter_add_(1, target, torch.full_like(target, -1, dtype=acc))
    return g.mul_(torch.where(counted, row_scale.to(acc), 0)[:, None]).to(logits.dtype)


def _softmax_rows(logits, labels, ignore_index, losses, row_scale=None):
    """For one chunk's logits [n, V] and labels [n]: writes the rows' losses (lse - logit[label], 0 for
    ignored rows) into ``losses`` [n] (fp32, fp64 for fp64 logits) and, given ``row_scale`` [n], returns
    G = (softmax - onehot(label)) * row_scale (0 at ignored rows) in the logits' dtype, on the Triton path
    written over the logits."""
    if use_triton(logits) and not torch.compiler.is_compiling():
        require_runnable(_softmax_rows_kernel, logits, "hidden")
        return _softmax_rows_triton(logits, labels, ignore_index, losses, row_scale)
    return _softmax_rows_torch(logits, labels, ignore_index, losses, row_scale)


def _sweep(hidden, weight, labels, ignore_index, chunk_size, dtype, row_scale=None, need_dh=False, need_dw=False):
    """One pass over chunks of rows: per-row losses [N] (fp32, fp64 for fp64 matmuls; 0 at ignored rows) and,
    given ``row_scale`` [N], dh = G @ W (in hidden's dtype) and dW = G^T @ hidden (summed over chunks in fp32 or
    wider, and returned so) for G = (softmax - onehot) * row_scale (None where not needed)."""
    acc = torch.promote_types(dtype, torch.float32)
    N = hidden.shape[0]
    w = weight.to(dtype)
    labels = labels.contiguous()
    losses = torch.empty(N, dtype=acc, device=hidden.device)
    dh = torch.empty_like(hidden) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_dw else None
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, N, chunk_size):
            rows = slice(start, start + chunk_size)
            x = hidden[rows].to(dtype)
            g = _softmax_rows(x @ w.T, labels[rows], ignore_index, losses[rows],
                              None if row_scale is None else row_scale[rows])
            if g is None:
                continue
            if need_dh:
                dh[rows] = g @ w
            if need_dw:
                if dtype == acc:
                    dw.addmm_(g.T, x)
                elif dw.is_cuda:  # the matmul sums into fp32 dW itself (out_dtype: CUDA only in torch)
                    torch.addmm(dw, g.T, x, out_dtype=acc, out=dw)
                else:
                    dw += g.T @ x
    return losses, dh, dw


def _reduce(losses: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    total = losses.sum()
    return total / count.clamp_min(1) if reduction == "mean" else total


def _scaled(t: torch.Tensor, factor: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """t * factor (a 0-dim tensor) in ``dtype``, multiplied in fp32 or wider, ``chunk_size`` rows at a time: a 16-bit
    multiplication would round the factor (1/count times a loss scale) to 8 or 11 bits."""
    acc = torch.promote_types(factor.dtype, torch.float32)
    if t.dtype == acc:
        return (t * factor).to(dtype)
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    for start in range(0, t.shape[0], chunk_size):
        out[start:start + chunk_size] = t[start:start + chunk_size].to(acc) * factor
    return out


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, chunk_size, dtype):
        ctx.args = ignore_index, chunk_size, dtype
        ctx.reduction = reduction
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, labels)
            return _sweep(hidden, weight, labels, ignore_index, chunk_size, dtype)[0]
        count = (labels != ignore_index).sum()
        scale = torch.ones((), dtype=torch.promote_types(dtype, torch.float32), device=hidden.device)
        losses, dh, dw = _sweep(hidden, weight, labels, ignore_index, chunk_size, dtype, scale.expand(labels.shape),
                                *ctx.needs_input_grad[:2])
        if reduction == "mean":
            scale = scale / count.clamp_min(1)
        # dW (kept in fp32 or wider until the backward scales it) is a sum over all rows, which could overflow fp16
        ctx.save_for_backward(dh, None if dw is None else dw.mul_(scale), scale)  # in place: dW is [V, C]
        ctx.dtypes = hidden.dtype, weight.dtype
        return _reduce(losses, count, reduction)

    @staticmethod
    @first_order_only("linear_cross_entropy")  # gradients from the forward's sweep, or a sweep's in-place math
    def backward(ctx, grad):
        if ctx.reduction == "none":
            hidden, weight, labels = ctx.saved_tensors
            _, dh, dw = _sweep(hidden, weight, labels, *ctx.args, grad, *ctx.needs_input_grad[:2])
            dw = None if dw is None else dw.to(weight.dtype)
        else:
            dh, dw, scale = ctx.saved_tensors
            chunk_size, dtypes = ctx.args[1], ctx.dtypes
            dh = None if dh is None else _scaled(dh, grad * scale, chunk_size, dtypes[0])
            dw = None if dw is None else _scaled(dw, grad, dw.shape[0], dtypes[1])
        return dh, dw, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T`` against ``labels``, ``chunk_size`` rows at a time.

    hidden: [N, C]; weight: [V, C] (an LM head without bias); labels: [N] int64, in [0, V) or ``ignore_index``
    (such rows count nothing). Row i's loss is logsumexp(z_i) - z_i[labels_i] with z_i = hidden_i @ weight.T,
    the softmax math in fp32 (fp64 for fp64 inputs). Under autocast the matmuls run in autocast's dtype.
    reduction: "mean" over counted rows (0 when none), "sum", or "none": [N] per-row losses (0 at ignored rows).
    chunk_size: rows per chunk (default: ``default_chunk_size(V)``, about 256 MB of fp32 logits).
    Gradients come back in the dtypes of hidden and weight. With "mean"/"sum" and grad enabled, the forward
    already computes them (keeping a [N, C] tensor in hidden's dtype and a [V, C] one in fp32 until the backward).
    CUDA tensors take the Triton kernel per chunk (CPU tensors under ``TRITON_INTERPRET=1``), float64 the
    PyTorch path; ``foxlm.ops.use_backend`` overrides the choice. No host syncs: on CUDA (and compiled) a label
    outside [0, V) other than ``ignore_index`` fails an assertion (like ``F.cross_entropy``), on the CPU eagerly it
    raises a ValueError.
    """
    _validate(hidden, weight, labels, ignore_index, reduction, chunk_size)
    check_label_values(labels, weight.shape[0], ignore_index)
    dtype = _compute_dtype(hidden, weight)
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, reduction, chunk_size, dtype)
    losses = _sweep(hidden, weight, labels, ignore_index, chunk_size, dtype)[0]
    return losses if reduction == "none" else _reduce(losses, (labels != ignore_index).sum(), reduction)

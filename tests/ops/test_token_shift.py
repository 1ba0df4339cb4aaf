"""token_shift: the Triton kernels (interpreter on CPU) and the PyTorch path against an fp64 reference."""

import pytest
import torch

from foxlm.ops import token_shift, use_backend  # the public name the README lists

F64 = torch.float64
B, T, H = 2, 13, 3


def reference(x, alpha_logit, prev, reset):
    """Token by token, in fp64."""
    a = torch.sigmoid(alpha_logit)[..., None]
    rows = []
    for t in range(x.shape[1]):
        before = (prev if prev is not None else torch.zeros_like(x[:, 0])) if t == 0 else x[:, t - 1]
        before = before * ~reset[:, t, None, None]
        rows.append(a[:, t] * before + (1 - a[:, t]) * x[:, t])
    return torch.stack(rows, 1)


def inputs(D, with_prev, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, D, dtype=F64, generator=g)
    alpha_logit = 2 * torch.randn(B, T, H, dtype=F64, generator=g)
    prev = torch.randn(B, H, D, dtype=F64, generator=g) if with_prev else None
    reset = torch.rand(B, T, generator=g) < 0.25
    reset[0, 0] = True  # reset at t = 0 (prev must not leak) ...
    reset[1, 0] = False
    reset[1, 5:7] = True  # ... and consecutive resets
    return tuple(None if t is None else t.to(device) for t in (x, alpha_logit, prev, reset))


def check(dtype, D, with_prev, atol, rtol, device):
    x, alpha_logit, prev, reset = inputs(D, with_prev, device=device)
    leaves = [x, alpha_logit] + ([prev] if with_prev else [])
    ref_leaves = [t.clone().requires_grad_() for t in leaves]
    expected = reference(ref_leaves[0], ref_leaves[1], ref_leaves[2] if with_prev else None, reset)
    dy = torch.randn(expected.shape, dtype=F64, generator=torch.Generator().manual_seed(1)).to(device)
    expected_grads = torch.autograd.grad(expected, ref_leaves, dy)

    low = [t.to(dtype).requires_grad_() for t in leaves]
    y = token_shift(low[0], low[1], prev=low[2] if with_prev else None, reset=reset)
    assert y.dtype == dtype and y.shape == x.shape
    grads = torch.autograd.grad(y, low, dy.to(dtype))
    torch.testing.assert_close(y.double(), expected, atol=atol, rtol=rtol)
    for name, got, want in zip(("x", "alpha_logit", "prev"), grads, expected_grads):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol, msg=lambda m, n=name: f"d{n}: {m}")


TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 2.5e-3),
       torch.bfloat16: (3e-2, 2e-2)}


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [48, 64])
@pytest.mark.parametrize("with_prev", [False, True])
def test_triton_matches_reference(dtype, D, with_prev, device):
    check(dtype, D, with_prev, *TOL[dtype], device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_prev", [False, True])
def test_torch_path_matches_reference(dtype, with_prev, device):
    check(dtype, 48, with_prev, *TOL[dtype], device)


@pytest.mark.triton
def test_triton_without_reset_and_prev_needing_no_grad(device):
    x, alpha_logit, prev, _ = inputs(48, True, device=device)
    xf, af = x.float().requires_grad_(), alpha_logit.float().requires_grad_()
    y = token_shift(xf, af, prev=prev.float())
    with use_backend("torch"):
        expected = token_shift(x, alpha_logit, prev=prev)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(xf)
    dx, da = torch.autograd.grad(y, (xf, af), dy)
    x64, a64 = x.clone().requires_grad_(), alpha_logit.clone().requires_grad_()
    with use_backend("torch"):
        want = torch.autograd.grad(token_shift(x64, a64, prev=prev), (x64, a64), dy.double())
    torch.testing.assert_close(dx.double(), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(da.double(), want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(x=torch.randn(B, T, H * 4)), "x"),
        (dict(x=torch.randn(B, T, H, 4).int()), "x"),
        (dict(alpha_logit=torch.randn(B, T)), "alpha_logit"),
        (dict(alpha_logit=torch.zeros(B, T, H, dtype=torch.int64)), "alpha_logit"),
        (dict(prev=torch.randn(B, H, 5)), "prev"),
        (dict(prev=torch.zeros(B, H, 4, dtype=torch.int32)), "prev"),
        (dict(reset=torch.zeros(B, T)), "reset"),
        (dict(reset=torch.zeros(B, T + 1, dtype=torch.bool)), "reset"),
        (dict(alpha_logit=torch.randn(B, T, H, device="meta")), "alpha_logit"),
    ],
)
def test_rejects_bad_inputs(change, match):
    args = dict(x=torch.randn(B, T, H, 4), alpha_logit=torch.randn(B, T, H), prev=None, reset=None) | change
    with pytest.raises(ValueError, match=match):
        token_shift(args["x"], args["alpha_logit"], prev=args["prev"], reset=args["reset"])


def test_torch_path_has_a_second_derivative():
    """The PyTorch path is plain torch ops: gradgradcheck proves its second derivative (x, alpha_logit, prev)."""
    x, alpha_logit, prev, reset = inputs(4, True)
    leaves = [t.requires_grad_() for t in (x, alpha_logit, prev)]
    assert torch.autograd.gradgradcheck(lambda x, a, p: token_shift(x, a, prev=p, reset=reset), leaves)


@pytest.mark.triton
def test_double_backward_raises(device):
    """The kernel's backward has no graph: a penalty on its gradient (even under y.sum()'s constant incoming
    gradient) raised nothing and silently lost its dependence on the inputs. It must raise, first order unchanged."""
    x, alpha_logit, prev, reset = (None if t is None else t.float() if t.is_floating_point() else t
                                   for t in inputs(16, True, device=device))
    leaves = [t.requires_grad_() for t in (x, alpha_logit, prev)]
    y = token_shift(x, alpha_logit, prev=prev, reset=reset)
    grads = torch.autograd.grad(y.sum(), leaves, create_graph=True)
    want = torch.autograd.grad(token_shift(x, alpha_logit, prev=prev, reset=reset).sum(), leaves)
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="token_shift: cannot differentiate twice"):
        (y.sum() + sum(g.square().sum() for g in grads)).backward()


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "torch"])
@pytest.mark.parametrize("shape", [(0, 4, 3, 5), (2, 0, 3, 5), (2, 4, 0, 5), (2, 4, 3, 0)])
def test_empty_inputs(backend, shape, device):
    """An empty batch, sequence, head or head dim: an empty y and gradients of the inputs' shapes (alpha_logit's zero
    where x's rows are empty), as on the PyTorch path; the kernels' block sizes divided by zero."""
    B, T, H, D = shape
    x = torch.randn(shape, device=device, requires_grad=True)
    alpha_logit = torch.randn(B, T, H, device=device, requires_grad=True)
    prev = torch.randn(B, H, D, device=device, requires_grad=True)
    reset = torch.zeros(B, T, dtype=torch.bool, device=device)
    with use_backend(backend):
        y = token_shift(x, alpha_logit, prev=prev, reset=reset)
        grads = torch.autograd.grad(y, (x, alpha_logit, prev), torch.randn_like(y))
    assert y.shape == shape
    for g, t in zip(grads, (x, alpha_logit, prev)):
        assert g.shape == t.shape and torch.equal(g, torch.zeros_like(g))


@pytest.mark.triton
def test_bf16_rounds_to_nearest(device):
    """In bf16 the kernels' y and gradients are the PyTorch path's (the same fp32 math, rounded to nearest) but for
    rare last-bit differences; Triton's interpreter truncated fp32 to bf16 (half the elements one bit off, biased
    towards zero), so the CPU tests measured a kernel less accurate than the GPU's."""
    x, alpha_logit, prev, reset = (t if t.dtype == torch.bool else t.bfloat16()
                                   for t in inputs(32, True, device=device))
    dy = torch.randn(x.shape, device=device).bfloat16()
    results = []
    for backend in ("triton", "torch"):
        leaves = [t.clone().requires_grad_() for t in (x, alpha_logit, prev)]
        with use_backend(backend):
            y = token_shift(leaves[0], leaves[1], prev=leaves[2], reset=reset)
            results.append((y, *torch.autograd.grad(y, leaves, dy)))
    for name, got, want in zip(("y", "dx", "dalpha_logit", "dprev"), *results):
        assert (got != want).float().mean() < 0.05, name

"""swiglu: the Triton kernels (interpreter on CPU, the real ones on a GPU machine) and the PyTorch path against
fp64, for the output and both gradients."""

import pytest
import torch
import torch.nn.functional as F

from foxlm.ops import swiglu, use_backend

F64 = torch.float64


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "torch"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1.5e-3), (torch.bfloat16, 1e-2)])
def test_swiglu_matches_fp64(backend, dtype, tol, device):
    shape = (3, 7, 2 * 1111)  # not a multiple of the block: a masked tail
    gate = (3 * torch.randn(shape, dtype=dtype, device=device)).requires_grad_()
    up = torch.randn(shape[::-1], dtype=dtype, device=device).transpose(0, 2).detach().requires_grad_()  # strided
    dh = torch.randn(shape, dtype=dtype, device=device)
    with use_backend(backend):
        h = swiglu(gate, up)
        dg, du = torch.autograd.grad(h, (gate, up), dh)
    g64, u64 = (t.detach().to(F64).requires_grad_() for t in (gate, up))
    expected = F.silu(g64) * u64
    dg64, du64 = torch.autograd.grad(expected, (g64, u64), dh.to(F64))
    assert h.dtype == dg.dtype == du.dtype == dtype
    for got, want in ((h, expected), (dg, dg64), (du, du64)):
        torch.testing.assert_close(got.to(F64), want, atol=tol * want.abs().max().item(), rtol=tol)


def test_swiglu_rejects_bad_inputs():
    gate = torch.randn(4, 6)
    with pytest.raises(ValueError, match="up: expected gate's shape"):
        swiglu(gate, torch.randn(4, 5))
    with pytest.raises(ValueError, match="up: expected gate's shape"):
        swiglu(gate, gate.half())
    with pytest.raises(ValueError, match="gate: expected float16"):
        swiglu(gate.int(), gate.int())


def test_swiglu_torch_path_has_a_second_derivative():
    """The PyTorch path is plain torch ops: a gradient penalty through it is exact."""
    gate, up = (torch.randn(2, 6, dtype=F64).requires_grad_() for _ in range(2))
    with use_backend("torch"):
        assert torch.autograd.gradgradcheck(swiglu, (gate, up))


@pytest.mark.triton
def test_swiglu_double_backward_raises(device):
    """The kernel's backward has no graph: a penalty on its gradient (even under h.sum()'s constant incoming
    gradient) raised nothing and silently lost its dependence on the inputs. It must raise, first order unchanged."""
    gate, up = (torch.randn(3, 40, device=device).requires_grad_() for _ in range(2))
    h = swiglu(gate, up)
    dg, du = torch.autograd.grad(h.sum(), (gate, up), create_graph=True)
    want = torch.autograd.grad(swiglu(gate, up).sum(), (gate, up))
    for got, w in zip((dg, du), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="swiglu: cannot differentiate twice"):
        (h.sum() + dg.square().sum()).backward()


@pytest.mark.triton
def test_swiglu_bf16_rounds_to_nearest(device):
    """In bf16 the kernels' h, dgate and dup are the PyTorch path's (the same fp32 math, rounded to nearest) but for
    rare last-bit differences; Triton's interpreter truncated fp32 to bf16 (half the elements one bit off, biased
    towards zero), so the CPU tests measured a kernel less accurate than the GPU's."""
    gate, up, dh = (torch.randn(8, 300, device=device).bfloat16() for _ in range(3))
    results = []
    for backend in ("triton", "torch"):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        with use_backend(backend):
            h = swiglu(g, u)
            results.append((h, *torch.autograd.grad(h, (g, u), dh)))
    for name, got, want in zip(("h", "dgate", "dup"), *results):
        assert (got != want).float().mean() < 0.05, name

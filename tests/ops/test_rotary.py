"""apply_rotary: the Triton kernels (interpreter on CPU) and the PyTorch path against an fp64 reference, and the
RoPE layer's relative-position property."""

import pytest
import torch

from foxlm.layers import RotaryEmbedding
from foxlm.ops import apply_rotary, use_backend

F64 = torch.float64


def reference(x, cos, sin):
    """Pairs (x_i, x_{i + D/2}) rotated by each token's angles, in fp64."""
    half = x.shape[-1] // 2
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def angles(B, T, D):
    """cos, sin [B, T, D/2] fp32 of random positions up to 5000 (B = 1: shared by every row)."""
    positions = torch.randint(0, 5000, (B, T)).float()
    inv_freq = 10000.0 ** (-torch.arange(D // 2) / (D // 2))
    a = positions[..., None] * inv_freq
    return a.cos(), a.sin()


def _run_and_fp64(backend: str, x, cos, sin, dy):
    """(y, dx) of apply_rotary on ``backend`` and (y, dx) of the fp64 reference, for the cotangent ``dy``."""
    with use_backend(backend):
        y = apply_rotary(x, cos, sin)
        (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().to(F64).requires_grad_()
    expected = reference(x64, cos.to(F64), sin.to(F64))
    (dx64,) = torch.autograd.grad(expected, x64, dy.to(F64))
    return y, dx, expected, dx64


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "torch"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float16, 1.5e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("cs_batch", [1, 2], ids=["shared-angles", "per-row-angles"])
def test_apply_rotary_matches_fp64(backend, dtype, tol, cs_batch, device):
    B, T, H, D = 2, 23, 3, 20  # D/2 = 10: a padded half-row tile; 138 rows: two programs of 128
    cos, sin = (t.to(device) for t in angles(cs_batch, T, D))
    base = torch.randn(B, T, H + 2, D + 4, dtype=dtype, device=device)
    x = base[:, :, 1:H + 1, 2:D + 2].detach().requires_grad_()  # strided: read in place, last dim contiguous
    dy = torch.randn(B, T, H, D, dtype=dtype, device=device)
    y, dx, expected, dx64 = _run_and_fp64(backend, x, cos, sin, dy)
    assert y.dtype == dx.dtype == dtype and y.is_contiguous()
    scale = expected.abs().max().item()
    torch.testing.assert_close(y.to(F64), expected, atol=tol * scale, rtol=tol)
    torch.testing.assert_close(dx.to(F64), dx64, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "torch"])
@pytest.mark.parametrize("cos_batch, sin_batch", [(1, 2), (2, 1)])
def test_cos_and_sin_of_different_batch_sizes(backend, cos_batch, sin_batch, device):
    """cos [1, T, D/2] shared with sin [B, T, D/2] (or the other way), each broadcast on its own: the kernel read sin
    through cos's strides, giving every row sin's row 0, silently."""
    B, T, H, D = 2, 5, 3, 8
    cos, sin = angles(cos_batch, T, D)[0].to(device), angles(sin_batch, T, D)[1].to(device)
    x = torch.randn(B, T, H, D, device=device, requires_grad=True)
    dy = torch.randn(B, T, H, D, device=device)
    y, dx, expected, dx64 = _run_and_fp64(backend, x, cos, sin, dy)
    torch.testing.assert_close(y.to(F64), expected, atol=2e-6 * expected.abs().max().item(), rtol=2e-6)
    torch.testing.assert_close(dx.to(F64), dx64, atol=2e-6 * dx64.abs().max().item(), rtol=2e-6)


@pytest.mark.triton
def test_rope_depends_on_relative_position_only(device):
    """q_m . k_n after RoPE is the same for (m, n) and (m + s, n + s), on the Triton path; norms are kept."""
    D = 16
    rope = RotaryEmbedding(D)
    q, k = torch.randn(1, 1, 2, D, device=device), torch.randn(1, 1, 2, D, device=device)
    m, n, s = 37, 5, int(torch.randint(1, 3000, ()))

    def score(pm, pn):
        qr = apply_rotary(q, *rope(torch.tensor([[pm]], device=device)))
        kr = apply_rotary(k, *rope(torch.tensor([[pn]], device=device)))
        return (qr * kr).sum(-1), qr.norm(dim=-1)

    (a, qn), (b, _) = score(m, n), score(m + s, n + s)
    torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(qn, q.norm(dim=-1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(score(m, n)[0], score(m + s, n)[0], atol=1e-3)  # absolute shifts do change it


def test_apply_rotary_rejects_bad_inputs():
    x = torch.randn(2, 5, 3, 8)
    cos, sin = angles(2, 5, 8)
    with pytest.raises(ValueError, match="x: expected a 4-D tensor"):
        apply_rotary(torch.randn(2, 5, 3, 7), cos, sin)
    with pytest.raises(ValueError, match=r"cos: expected shape \[B or 1, T, D/2\]"):
        apply_rotary(x, cos[:, :4], sin)
    with pytest.raises(ValueError, match="sin: expected float32 or float64"):
        apply_rotary(x, cos, sin.half())
    with pytest.raises(ValueError, match="x: expected float16"):
        apply_rotary(x.int(), cos, sin)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "torch"])
def test_gradient_penalty_matches_fp64(backend, device):
    """A gradient penalty differentiates the backward: the kernel's came back without a graph, so the penalty
    silently lost its dependence on x. Both paths must give the fp64 reference's second-order gradient."""
    cos, sin = (t.to(device) for t in angles(2, 7, 8))
    x = torch.randn(2, 7, 3, 8, device=device, requires_grad=True)
    w = torch.randn(2, 7, 3, 8, device=device)

    def penalised(f, x, cos, sin):
        y = f(x, cos, sin)
        (dx,) = torch.autograd.grad((w.to(y.dtype) * y.square()).sum(), x, create_graph=True)
        (g,) = torch.autograd.grad(y.sum() + dx.square().sum(), x)
        return g

    with use_backend(backend):
        got = penalised(apply_rotary, x, cos, sin)
    x64 = x.detach().to(F64).requires_grad_()
    want = penalised(reference, x64, cos.to(F64), sin.to(F64))
    torch.testing.assert_close(got.to(F64), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])  # no kernel runs: learned angles take the PyTorch path
def test_learned_angles_get_their_gradient(backend, device):
    """cos and sin that require grad (learned angles) get the fp64 reference's gradient on every backend: the
    kernel's backward returned none for them, silently, where the PyTorch path gave one."""
    cos, sin = (t.to(device).requires_grad_() for t in angles(2, 7, 8))
    x = torch.randn(2, 7, 3, 8, device=device, requires_grad=True)
    dy = torch.randn(2, 7, 3, 8, device=device)
    with use_backend(backend):
        got = torch.autograd.grad(apply_rotary(x, cos, sin), (x, cos, sin), dy)
    ref = [t.detach().to(F64).requires_grad_() for t in (x, cos, sin)]
    want = torch.autograd.grad(reference(*ref), ref, dy.to(F64))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.to(F64), w, atol=1e-5 * w.abs().max().item(), rtol=1e-5)


def test_torch_path_has_a_second_derivative():
    """The PyTorch path is plain torch ops (fp64 takes it): gradgradcheck proves its second derivative."""
    cos, sin = (t.to(F64) for t in angles(1, 3, 4))
    x = torch.randn(1, 3, 2, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x: apply_rotary(x, cos, sin), (x,))


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "torch"])
@pytest.mark.parametrize("shape", [(0, 5, 3, 8), (2, 5, 0, 8), (2, 5, 3, 0)])
def test_empty_inputs(backend, shape, device):
    """An empty batch, head count or head dim gives an empty y and dx, as on the PyTorch path (the kernel's block
    size divided by zero for D = 0)."""
    B, T, _, D = shape
    cos, sin = (t.to(device) for t in angles(1, T, D))
    x = torch.randn(shape, device=device, requires_grad=True)
    with use_backend(backend):
        y = apply_rotary(x, cos, sin)
        (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert y.shape == dx.shape == shape


@pytest.mark.triton
def test_bf16_rounds_to_nearest(device):
    """In bf16 the kernel's y and dx are the PyTorch path's (the same fp32 math, rounded to nearest) but for rare
    last-bit differences; Triton's interpreter truncated fp32 to bf16 (half the elements one bit off, biased towards
    zero), so the CPU tests measured a kernel less accurate than the GPU's."""
    cos, sin = (t.to(device) for t in angles(2, 9, 32))
    x, dy = (torch.randn(2, 9, 3, 32, device=device).bfloat16() for _ in range(2))
    results = []
    for backend in ("triton", "torch"):
        xx = x.clone().requires_grad_()
        with use_backend(backend):
            y = apply_rotary(xx, cos, sin)
            results.append((y, *torch.autograd.grad(y, xx, dy)))
    for name, got, want in zip(("y", "dx"), *results):
        assert (got != want).float().mean() < 0.05, name

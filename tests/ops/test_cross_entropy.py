"""linear_cross_entropy against plain logits + F.cross_entropy in fp64 (the PyTorch path, and the Triton kernel:
compiled on a GPU, else in Triton's interpreter), and the fused loss in FoxForCausalLM."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from foxlm.models import FoxConfig, FoxForCausalLM
from foxlm.ops import linear_cross_entropy, use_backend  # the public name the README lists
from foxlm.ops.cross_entropy import (
    BLOCK_V_INTERPRETED,
    _softmax_rows,
    default_chunk_size,
)

N, C, V = 37, 24, 101  # 37 rows: chunks of 8 leave a partial one; V not a power of two
BACKENDS = [pytest.param("triton", marks=pytest.mark.triton), "torch"]


def _inputs(dtype, seed=0, n=N, v=V, c=C, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, c, generator=gen, dtype=torch.float64) / c**0.5
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.3] = -100
    return (hidden.to(device, dtype).requires_grad_(), weight.to(device, dtype).requires_grad_(),
            labels.to(device))


def _loss_and_grads(fn, hidden, weight, labels, reduction, upstream):
    loss = fn(hidden, weight, labels, reduction=reduction)
    grads = torch.autograd.grad(loss, (hidden, weight), upstream.to(loss.dtype))
    return loss, grads


def _reference(hidden, weight, labels, reduction="mean"):
    logits = hidden.double() @ weight.double().T
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction=reduction)
    return torch.nan_to_num(loss)  # "mean" of no counted rows is 0/0 in F.cross_entropy


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_size", [8, None])
def test_loss_and_grads_match_fp64_reference(reduction, dtype, tol, chunk_size):
    hidden, weight, labels = _inputs(dtype)
    upstream = torch.randn(N if reduction == "none" else (), generator=torch.Generator().manual_seed(5))
    exact = [x.detach().double().requires_grad_() for x in (hidden, weight)]
    ref, ref_grads = _loss_and_grads(_reference, *exact, labels, reduction, upstream)
    fused = partial(linear_cross_entropy, chunk_size=chunk_size)
    out, grads = _loss_and_grads(fused, hidden, weight, labels, reduction, upstream)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for g, r, x in zip(grads, ref_grads, (hidden, weight)):
        assert g.dtype == x.dtype
        torch.testing.assert_close(g.double(), r, rtol=tol, atol=tol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_grad_gives_the_same_loss(reduction):
    hidden, weight, labels = _inputs(torch.float64)
    with_grad = linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_size=8)
    with torch.no_grad():
        without = linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_size=8)
    assert not without.requires_grad
    torch.testing.assert_close(without, with_grad.detach(), rtol=0, atol=0)
    detached = linear_cross_entropy(hidden.detach(), weight.detach(), labels, reduction=reduction, chunk_size=8)
    torch.testing.assert_close(detached, with_grad.detach(), rtol=0, atol=0)


def test_grad_of_one_input_only():
    hidden, weight, labels = _inputs(torch.float64)
    ref = torch.autograd.grad(_reference(hidden, weight, labels, "mean"), weight)[0]
    got = torch.autograd.grad(linear_cross_entropy(hidden.detach(), weight, labels, chunk_size=8), weight)[0]
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_zero_grads(backend, reduction, device):
    hidden, weight, labels = _inputs(torch.float32, device=device)
    labels = torch.full_like(labels, -100)
    loss = linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_size=8)
    assert torch.equal(loss, torch.zeros_like(loss))
    grads = torch.autograd.grad(loss.sum(), (hidden, weight))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_other_ignore_index_and_empty_input():
    hidden, weight, labels = _inputs(torch.float64)
    relabeled = torch.where(labels == -100, 7777, labels)
    torch.testing.assert_close(linear_cross_entropy(hidden, weight, relabeled, ignore_index=7777, chunk_size=8),
                               _reference(hidden, weight, labels, "mean"), rtol=1e-12, atol=1e-12)
    hidden, weight, labels = _inputs(torch.float64, n=0)
    loss = linear_cross_entropy(hidden, weight, labels)
    assert loss.item() == 0
    assert torch.autograd.grad(loss, weight)[0].abs().sum() == 0


def test_autocast_runs_the_matmuls_in_bf16():
    """Under CPU bf16 autocast: the loss of bf16 logits (softmax in fp32), grads in the inputs' fp32."""
    hidden, weight, labels = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((hidden @ weight.T).float(), labels)
        out = linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    grads = torch.autograd.grad(out, (hidden, weight))
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2 * r.abs().max().item())


def test_fp16_mean_gradients_survive_until_the_loss_scale():
    """fp16 autocast with a loss scale (GradScaler's 2**16), reduction "mean" over many rows: the forward's logits
    gradient must not carry the 1/count, whose product with the small softmax entries is below fp16's range. The
    peer, F.cross_entropy on the same fp16 logits, reaches a relative error of 4e-4 here (3e-3 with the 1/count
    folded into the fp16 gradient). The PyTorch path only (the rows are too many for Triton's interpreter): both
    paths write the same scaled gradient in the logits' dtype."""
    n, v, c, loss_scale = 4096, 2000, 16, 2.0**16
    hidden, weight, labels = _inputs(torch.float32, seed=7, n=n, v=v, c=c)
    exact = [x.detach().double().requires_grad_() for x in (hidden, weight)]
    ref_grads = torch.autograd.grad(_reference(*exact, labels), exact)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=1000)
    grads = torch.autograd.grad(loss * loss_scale, (hidden, weight))
    for name, g, r in zip(("d hidden", "d weight"), grads, ref_grads):
        err = ((g.double() / loss_scale - r).norm() / r.norm()).item()
        assert err < 1e-3, f"{name}: relative error {err:.1e}"


def test_default_chunk_size():
    assert default_chunk_size(50304) == 1280  # 2**26 // 50304 = 1334 rows, down to a multiple of 128
    assert default_chunk_size(2**30) == 1
    assert default_chunk_size(97) == 2**26 // 97 - (2**26 // 97) % 128


def test_bad_inputs_raise_naming_the_argument():
    hidden, weight, labels = _inputs(torch.float32)
    cases = [
        (dict(hidden=hidden[None]), "hidden"),
        (dict(hidden=hidden.long()), "hidden"),
        (dict(weight=weight[:, :-1]), "weight"),
        (dict(weight=weight.double()), "weight"),
        (dict(weight=weight.to("meta")), "weight"),
        (dict(labels=labels[:-1]), "labels"),
        (dict(labels=labels.int()), "labels"),
        (dict(labels=labels.to("meta")), "labels"),
        (dict(reduction="avg"), "reduction"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(chunk_size=2.0), "chunk_size"),
        (dict(ignore_index=-100.0), "ignore_index"),  # no error: a float compared with the labels
        (dict(ignore_index=None), "ignore_index"),  # the labels' range error
        (dict(ignore_index=True), "ignore_index"),
    ]
    for overrides, name in cases:
        args = {**dict(hidden=hidden, weight=weight, labels=labels), **overrides}
        with pytest.raises(ValueError, match=f"^{name}:"):
            linear_cross_entropy(**args)


# --- the Triton kernel (on the GPU, else Triton's interpreter on CPU) -------------------------------------------------
TN, TC, TV = 40, 32, 1000  # V: several blocks of BLOCK_V_INTERPRETED and a partial one


@pytest.mark.triton
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_triton_loss_and_grads_match_fp64_reference(reduction, dtype, tol, device):
    assert TV % BLOCK_V_INTERPRETED and TV > 2 * BLOCK_V_INTERPRETED
    hidden, weight, labels = _inputs(dtype, seed=3, n=TN, v=TV, c=TC, device=device)
    upstream = torch.randn(TN if reduction == "none" else (), generator=torch.Generator().manual_seed(5)).to(device)
    exact = [x.detach().double().requires_grad_() for x in (hidden, weight)]
    ref, ref_grads = _loss_and_grads(_reference, *exact, labels, reduction, upstream)
    fused = partial(linear_cross_entropy, chunk_size=16)  # 40 rows: two chunks of 16 and one of 8
    out, grads = _loss_and_grads(fused, hidden, weight, labels, reduction, upstream)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    for name, a, r in zip(("loss", "d hidden", "d weight"), (out, *grads), (ref, *ref_grads)):
        err = ((a.double() - r).norm() / r.norm()).item()
        assert err < tol, f"{name}: relative error {err:.1e}"
    assert [g.dtype for g in grads] == [dtype, dtype]
    if reduction == "none":
        assert torch.equal(out[labels == -100], torch.zeros_like(out[labels == -100]))


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [TV, 101])  # 101: a single partial block
def test_triton_rows_equal_the_torch_path_in_place(dtype, v, device):
    gen = torch.Generator().manual_seed(7)
    logits = (4 * torch.randn(TN, v, generator=gen)).to(device, dtype)
    labels = torch.randint(0, v, (TN,), generator=gen).to(device)
    labels[::3] = -100
    for row_scale in ((torch.rand(TN, generator=gen) + 0.5).to(device), torch.tensor(0.1, device=device).expand(TN),
                      None):
        results = []
        for backend in ("torch", "triton"):
            buffer, losses = logits.clone(), torch.full((TN,), float("nan"), device=device)
            with use_backend(backend):
                g = _softmax_rows(buffer, labels, -100, losses, row_scale)
            results.append((g, losses))
            if backend == "triton":
                assert g is (None if row_scale is None else buffer)  # the gradient overwrote the logits
                if row_scale is None:
                    assert torch.equal(buffer, logits)
        (g_torch, loss_torch), (g_triton, loss_triton) = results
        torch.testing.assert_close(loss_triton, loss_torch, rtol=1e-5, atol=1e-5)
        if row_scale is not None:
            assert g_triton.dtype == dtype
            assert torch.equal(g_triton[labels == -100], torch.zeros_like(g_triton[labels == -100]))
            torch.testing.assert_close(g_triton, g_torch, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_double_backward_raises(backend, reduction, device):
    """The backward's gradients come from the forward's sweep ("mean", "sum") or a sweep's in-place math ("none"),
    without a graph: a penalty on them silently lost its dependence on hidden and weight (under the loss's own
    constant incoming gradient, torch's once_differentiable would not have caught it). It must raise, first order
    unchanged."""
    hidden, weight, labels = _inputs(torch.float32, n=9, v=13, c=8, device=device)
    with use_backend(backend):
        loss = linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_size=4).sum()
        dh, dw = torch.autograd.grad(loss, (hidden, weight), create_graph=True)
        want = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, reduction=reduction,
                                                        chunk_size=4).sum(), (hidden, weight))
    for got, w in zip((dh, dw), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="linear_cross_entropy: cannot differentiate twice"):
        (loss + dh.square().sum() + dw.square().sum()).backward()


# --- FoxForCausalLM ------------------------------------------------------------------------------------------
SMALL = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
             bos_token_id=None, eos_token_id=None)


def _model(fuse: bool) -> FoxForCausalLM:
    torch.manual_seed(0)
    return FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", **SMALL, fuse_cross_entropy=fuse)).double().train()


def test_model_fused_loss_equals_unfused():
    ids = torch.randint(1, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :4] = -100
    labels[2, 7:] = -100
    results = []
    for fuse in (True, False):
        model = _model(fuse)
        out = model(ids, labels=labels)
        assert (out.logits is None) == fuse
        out.loss.backward()
        results.append((out.loss, [p.grad for p in model.parameters()]))
    (fused, fused_grads), (plain, plain_grads) = results
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    for a, b in zip(fused_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_model_keeps_logits_outside_fused_training():
    model = _model(True)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    fused = model(ids, labels=ids).loss
    per_token = model(ids, labels=ids, return_per_token_loss=True)  # per-token losses: the plain path
    assert per_token.logits.shape == (2, 9, 97) and per_token.per_token_loss.shape == (2, 8)
    torch.testing.assert_close(per_token.loss, fused, rtol=1e-12, atol=1e-12)
    model.eval()
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 9, 97)
    torch.testing.assert_close(out.loss, fused, rtol=1e-12, atol=1e-12)
    assert model.train()(ids).logits.shape == (2, 9, 97)  # no labels: logits


def test_fuse_cross_entropy_config_field(tmp_path):
    assert FoxConfig().fuse_cross_entropy is True
    config = FoxConfig.preset("fox-llama", "tiny", fuse_cross_entropy=False)
    config.save_pretrained(tmp_path)
    assert FoxConfig.from_pretrained(tmp_path).fuse_cross_entropy is False
    with pytest.raises(ValueError, match="fuse_cross_entropy"):
        FoxConfig(fuse_cross_entropy="yes")


@pytest.mark.parametrize("bad", [-5, 1000])
def test_labels_out_of_range_raise(bad):
    hidden, weight = torch.randn(6, 8), torch.randn(1000, 8)
    labels = torch.tensor([1, 2, bad, 3, -100, 4])
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(hidden, weight, labels)


@pytest.mark.parametrize("fuse", [True, False])
def test_model_gradient_penalty_is_exact_or_raises(fuse):
    """A gradient-norm penalty (torch.autograd.grad(..., create_graph=True), then a backward through it) on the
    default CPU path. On the LM head's gradient alone the unfused loss is plain torch ops, so exact; the fused loss
    silently dropped the penalty's dependence (its gradient had no graph) and must raise instead. On every
    parameter's gradient the attention's backward is differentiated too, which has no derivative: it raises."""
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    model = _model(fuse)
    for params in ([model.lm_head.weight], list(model.parameters())):
        loss = model(ids, labels=ids).loss
        grads = torch.autograd.grad(loss, params, create_graph=True)
        penalised = loss + sum(g.square().sum() for g in grads)
        if fuse or len(params) > 1:
            with pytest.raises(RuntimeError, match="cannot differentiate twice"):
                penalised.backward()
        else:  # the penalty's own term reaches the head: its gradient is not the loss's alone
            (plain,) = torch.autograd.grad(loss, params, retain_graph=True)
            penalised.backward()
            assert not torch.allclose(model.lm_head.weight.grad, plain)


@pytest.mark.triton
def test_triton_bf16_gradient_rounds_to_nearest(device):
    """In bf16 the kernel's logits gradient is the PyTorch path's (fp32 math, rounded to nearest) but for rare
    last-bit differences; Triton's interpreter truncated fp32 to bf16 (half the elements one bit off, biased
    towards zero), so the CPU tests measured a kernel less accurate than the GPU's."""
    gen = torch.Generator().manual_seed(8)
    logits = (4 * torch.randn(TN, TV, generator=gen)).to(device, torch.bfloat16)
    labels = torch.randint(0, TV, (TN,), generator=gen).to(device)
    scale = (torch.rand(TN, generator=gen) + 0.5).to(device)
    results = []
    for backend in ("triton", "torch"):
        with use_backend(backend):
            results.append(_softmax_rows(logits.clone(), labels, -100, torch.empty(TN, device=device), scale))
    assert (results[0] != results[1]).float().mean() < 0.05

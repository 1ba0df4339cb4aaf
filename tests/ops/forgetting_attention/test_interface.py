"""The public op on the CPU path (SDPA's CPU kernel, chunked), its validation, ACP threshold and gate precision."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from foxlm.ops import ACP, forgetting_attention, forgetting_attention_reference, gate_cumsum
from foxlm.ops.forgetting_attention import sdpa as sdpa_path
from foxlm.ops.forgetting_attention.acp import data_logit_bound, prune_threshold


def _inputs(B, Tq, Tk, Hq, Hk, D, Dv=None, dtype=torch.float64, gate_scale=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, Hq, D, generator=g, dtype=dtype)
    k = torch.randn(B, Tk, Hk, D, generator=g, dtype=dtype)
    v = torch.randn(B, Tk, Hk, Dv or D, generator=g, dtype=dtype)
    log_f = F.logsigmoid(gate_scale * torch.randn(B, Tk, Hq, generator=g, dtype=torch.float64) + 2.0)
    return q, k, v, log_f


def _grads(o, lse, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g, dtype=o.dtype)
    dl = torch.randn(lse.shape, generator=g, dtype=lse.dtype)
    return torch.autograd.grad((o * do).sum() + (lse * dl).sum(), inputs)


@pytest.fixture
def small_chunks(monkeypatch):
    """Force many query chunks so the chunk loop, not one big matrix, is what gets tested."""
    monkeypatch.setattr(sdpa_path, "CHUNK_ROWS", 16)


@pytest.mark.parametrize("chunks", ["one", "many"])
@pytest.mark.parametrize("Hq,Hk", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("Tq,Tk,D,Dv", [(77, 77, 16, 16), (23, 77, 32, 24)])
def test_chunked_matches_reference(monkeypatch, chunks, Hq, Hk, Tq, Tk, D, Dv):
    if chunks == "many":
        monkeypatch.setattr(sdpa_path, "CHUNK_ROWS", 16)
    q, k, v, log_f = _inputs(2, Tq, Tk, Hq, Hk, D, Dv)
    plan = sdpa_path._plan(gate_cumsum(log_f)[:, Tk - Tq:], gate_cumsum(log_f), None, Tk - Tq, sdpa_path.CHUNK_ROWS,
                           False, None)
    assert (len(plan[0][1]) == 1) == (chunks == "one")
    inputs = [t.requires_grad_() for t in (q, k, v, log_f)]
    o, lse = forgetting_attention(q, k, v, log_f, return_lse=True)
    ro, rlse = forgetting_attention_reference(q, k, v, log_f, return_lse=True)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), rlse, rtol=1e-6, atol=1e-6)  # lse is returned in fp32
    for got, want in zip(_grads(o, lse.double(), inputs), _grads(ro, rlse, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunks", ["one", "many"])
def test_a_second_backward_through_the_graph_gives_the_same_gradients(monkeypatch, chunks):
    """The backward reuses the forward's k' buffer as scratch: a retained graph's second backward (gradcheck does
    one) must neither be refused nor differ, with and without the lse gradient."""
    if chunks == "many":
        monkeypatch.setattr(sdpa_path, "CHUNK_ROWS", 16)
    q, k, v, log_f = _inputs(1, 60, 60, 2, 2, 16)
    inputs = [t.requires_grad_() for t in (q, k, v, log_f)]
    o, lse = forgetting_attention(q, k, v, log_f, return_lse=True)
    for loss in (o.square().sum(), o.square().sum() + lse.sum()):
        first = torch.autograd.grad(loss, inputs, retain_graph=True)
        second = torch.autograd.grad(loss, inputs, retain_graph=True)
        for a, b in zip(first, second):
            assert torch.equal(a, b)


def test_chunked_varlen_matches_reference(small_chunks):
    cu = torch.tensor([0, 1, 30, 31, 31, 90], dtype=torch.int32)
    q, k, v, log_f = _inputs(1, 90, 90, 4, 2, 16)
    inputs = [t.requires_grad_() for t in (q, k, v, log_f)]
    o = forgetting_attention(q, k, v, log_f, cu_seqlens=cu)
    ro = forgetting_attention_reference(q, k, v, log_f, cu_seqlens=cu)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(o)
    for got, want in zip(torch.autograd.grad((o * g).sum(), inputs), torch.autograd.grad((ro * g).sum(), inputs)):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8)
    # Each packed sequence equals the sequence run alone.
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            alone = forgetting_attention_reference(q[:, a:b], k[:, a:b], v[:, a:b], log_f[:, a:b])
            torch.testing.assert_close(o[:, a:b], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [1, 7, 30, 200])
@pytest.mark.parametrize("varlen", [False, True])
def test_chunked_sliding_window_matches_reference(small_chunks, window, varlen):
    """Query i sees keys j with i - window < j <= i; with GQA, and Tq < Tk or packed sequences."""
    if varlen:
        cu = torch.tensor([0, 1, 30, 31, 31, 90], dtype=torch.int32)
        q, k, v, log_f = _inputs(1, 90, 90, 4, 2, 16)
    else:
        cu = None
        q, k, v, log_f = _inputs(2, 50, 77, 4, 2, 16, 24)
    inputs = [t.requires_grad_() for t in (q, k, v, log_f)]
    o, lse = forgetting_attention(q, k, v, log_f, cu_seqlens=cu, window=window, return_lse=True)
    ro, rlse = forgetting_attention_reference(q, k, v, log_f, cu_seqlens=cu, window=window, return_lse=True)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), rlse, rtol=1e-6, atol=1e-6)
    for got, want in zip(_grads(o, lse.double(), inputs), _grads(ro, rlse, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if window == 1:  # every query sees only itself
        torch.testing.assert_close(o, v.repeat_interleave(2, dim=2)[:, -o.shape[1]:], rtol=0, atol=1e-12)
    if window >= 90:  # the window holds every key: plain causal attention
        torch.testing.assert_close(o, forgetting_attention(q, k, v, log_f, cu_seqlens=cu), rtol=0, atol=0)
    else:  # the window really cut something
        full = forgetting_attention_reference(q, k, v, log_f, cu_seqlens=cu)
        assert (o - full).abs().max() > 1e-6


def test_sliding_window_with_acp(small_chunks):
    """ACP and the window both move a row's first key; the later of the two wins. Slow gates (head 1): the
    window binds; fast gates (head 0): ACP does. Outputs stay within ACP's tolerance of the windowed reference."""
    tol, window = 1e-4, 40
    q, k, v, log_f = _inputs(1, 200, 200, 2, 2, 16)
    log_f = F.logsigmoid(torch.randn(1, 200, 2, dtype=torch.float64) + torch.tensor([-1.0, 6.0], dtype=torch.float64))
    o = forgetting_attention(q, k, v, log_f, window=window, prune=True, tolerance=tol)
    ro = forgetting_attention_reference(q, k, v, log_f, window=window)
    assert (o - ro).abs().max() < 2 * tol * v.abs().max()
    threshold = prune_threshold(data_logit_bound(q, k, 0.25), 200, tol)
    c = torch.cumsum(log_f, 1)
    starts = sdpa_path.row_starts(c, c, 0, None, threshold, window)
    pos = torch.arange(200)
    assert (starts[0, 1] == (pos - window + 1).clamp_min(0)).all()  # the window binds
    assert (starts[0, 0, 100:] > pos[100:] - window + 1).all()  # ACP binds
    assert torch.equal(starts, torch.maximum(sdpa_path.row_starts(c, c, 0, None, threshold), pos - window + 1))


def test_bf16_inputs_compute_in_fp32():
    q, k, v, log_f = _inputs(1, 40, 40, 2, 2, 32, dtype=torch.bfloat16)
    o = forgetting_attention(q, k, v, log_f.float())
    assert o.dtype == torch.bfloat16
    ro = forgetting_attention_reference(q.double(), k.double(), v.double(), log_f)
    assert (o.double() - ro).norm() / ro.norm() < 1e-2


@pytest.mark.parametrize("scale", [None, -0.3])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_lse_is_fp32_precise(dtype, grad, scale):
    """lse of bf16 / fp16 inputs is as precise as fp32 allows, as the Triton path's is: scale * q was rounded to q's
    dtype (with a backward to follow, and for a scale <= 0 without), an error of ~2^-9 relative in every logit."""
    q, k, v, log_f = _inputs(1, 40, 90, 2, 1, 32, dtype=dtype)
    _, lse = forgetting_attention(q.requires_grad_(grad), k, v, log_f, scale=scale, return_lse=True)
    _, want = forgetting_attention_reference(q.double(), k.double(), v.double(), log_f, scale=scale, return_lse=True)
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=1e-5)


def test_gate_one_is_plain_causal_attention():
    q, k, v, _ = _inputs(2, 50, 50, 3, 3, 16)
    zero_log_f = torch.zeros(2, 50, 3, dtype=torch.float64)  # f = 1: no forgetting
    o = forgetting_attention(q, k, v, zero_log_f)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    torch.testing.assert_close(o, sdpa.transpose(1, 2), rtol=1e-10, atol=1e-10)


def test_gate_near_zero_sees_only_itself():
    q, k, v, _ = _inputs(1, 30, 30, 2, 2, 16)
    log_f = torch.full((1, 30, 2), -30.0, dtype=torch.float64)
    o = forgetting_attention(q, k, v, log_f)
    torch.testing.assert_close(o, v, rtol=0, atol=1e-7)


@pytest.mark.parametrize("varlen", [False, True])
def test_acp_pruned_mass_below_tolerance(small_chunks, varlen):
    """Pruning drops < tolerance of each row's mass, so outputs move by < 2 * tolerance * max|v|."""
    tol = 1e-4
    q, k, v, log_f = _inputs(1, 200, 200, 4, 2, 16, gate_scale=3.0)
    log_f = log_f - 0.3  # fast forgetting: most of the matrix is prunable
    cu = torch.tensor([0, 37, 38, 200], dtype=torch.int32) if varlen else None
    o = forgetting_attention(q, k, v, log_f, cu_seqlens=cu, prune=True, tolerance=tol)
    ro = forgetting_attention_reference(q, k, v, log_f, cu_seqlens=cu)
    assert (o - ro).abs().max() < 2 * tol * v.abs().max()
    # The pruning really happened: the first kept key of late rows is well past their sequence start.
    bound = data_logit_bound(q, k, 0.25, cu)
    n = 200 if cu is None else cu[1:] - cu[:-1]
    c = torch.cumsum(log_f, 1)
    starts = sdpa_path.row_starts(c, c, 0, cu, prune_threshold(bound, n, tol))
    assert (starts[..., -1] > 100).all()


def test_acp_with_caller_bound_is_safe_and_tighter_bound_prunes_more():
    q, k, v, log_f = _inputs(2, 120, 120, 2, 2, 16)
    q = F.normalize(q, dim=-1)
    k = F.normalize(k, dim=-1)
    scale = 0.25
    o = forgetting_attention(q, k, v, log_f - 0.5, scale=scale, prune=True, logit_bound=scale, tolerance=1e-5)
    ro = forgetting_attention_reference(q, k, v, log_f - 0.5, scale=scale)
    assert (o - ro).abs().max() < 2e-5 * v.abs().max()


@pytest.mark.parametrize("reset", [-1.0e12, torch.finfo(torch.float32).min], ids=["-1e12", "fp32-min"])
@pytest.mark.parametrize("varlen", [False, True])
def test_gates_that_close_harder_than_the_floor_are_exact(small_chunks, reset, varlen):
    """A finite gate far below -1e4 passes the gate check and must close the gate: no key before it is seen, as if a
    sequence started there. An fp64 c of 1e12 keeps its differences only to ~1e-4 (fp32's min: not at all), so the
    oracle is the reference cut into those sequences, where a sequence's first gate is never used: there it is 0 (so
    is its gradient, as exp(-1e12) makes it)."""
    q, k, v, log_f = _inputs(1, 60, 60, 2, 2, 16)
    cu, resets = ([0, 7, 60], [3, 29, 41]) if varlen else ([0, 60], [5, 29, 41])
    log_f[:, resets] = reset
    inputs = tuple(x.requires_grad_() for x in (q, k, v, log_f))
    cu_seqlens = torch.tensor(cu, dtype=torch.int32) if varlen else None
    o, lse = forgetting_attention(*inputs, cu_seqlens=cu_seqlens, return_lse=True)
    cut = torch.tensor(sorted(set(cu + resets)), dtype=torch.int32)
    opened = torch.where(torch.isin(torch.arange(60), torch.tensor(resets))[None, :, None], 0.0, inputs[3])
    o_ref, lse_ref = forgetting_attention_reference(*inputs[:3], opened, cu_seqlens=cut, return_lse=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-6, atol=1e-6)  # lse is returned in fp32
    for got, want in zip(_grads(o, lse.double(), inputs), _grads(o_ref, lse_ref, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_caches_cumsum_keeps_its_differences_past_a_gate_below_the_floor():
    """continue_cumsum (the decode caches' c) floors the gates as the prefill does: after a gate of -1e30 the
    differences of c are still the later gates, which the decode kernels' logits are made of."""
    from foxlm.ops.forgetting_attention.gate import continue_cumsum

    log_f = F.logsigmoid(torch.randn(2, 12, 3, generator=torch.Generator().manual_seed(0)) + 2.0)
    log_f[:, 4] = -1.0e30
    c = continue_cumsum(torch.full((2, 3), -7.0, dtype=torch.float64), log_f, 12)
    torch.testing.assert_close(c[:, 5:].diff(dim=1), log_f[:, 6:].double(), rtol=0, atol=1e-12)


def test_gate_cumsum_precise_over_a_million_tokens():
    """fp32 cumsum loses c_i - c_j at 1M tokens; the fp64 cumsum the op uses keeps it to ~1e-9."""
    T = 1 << 20
    g = torch.Generator().manual_seed(3)
    log_f = F.logsigmoid(torch.randn(1, T, 1, generator=g) + 4.0)  # mean decay ~0.02/token: |c| ~ 2e4 at the end
    c = gate_cumsum(log_f)[0, :, 0]
    c32 = torch.cumsum(log_f, dim=1)[0, :, 0]
    i = torch.arange(T - 4096, T)
    j = i - torch.randint(1, 64, (4096,), generator=g)
    exact = torch.tensor([math.fsum(log_f[0, jj + 1:ii + 1, 0].double().tolist())
                          for ii, jj in zip(i.tolist(), j.tolist())], dtype=torch.float64)
    err64 = ((c[i] - c[j]) - exact).abs().max().item()
    err32 = ((c32[i] - c32[j]).double() - exact).abs().max().item()
    print(f"max |error of c_i - c_j| at 1M tokens: fp64 cumsum {err64:.2e}, fp32 cumsum {err32:.2e}")
    assert err64 < 1e-9
    assert err32 > 1e-4  # the failure the fp64 sum exists to prevent


def _rel_errors(got, want):
    return [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)]


def _fp32_vs_fp64(fn, ref_fn, inputs):
    """Outputs, lse and the gradients of every input (through both) of fn on fp32 q, k, v (the gate tensors stay
    fp64) and of ref_fn on the same values in fp64."""
    runs = []
    for f, dtype in ((fn, torch.float32), (ref_fn, torch.float64)):
        xs = [t.to(dtype if i < 3 else torch.float64).requires_grad_() for i, t in enumerate(inputs)]
        o, lse = f(*xs)
        g = torch.Generator().manual_seed(1)
        do = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)
        dl = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
        runs.append([o, lse, *torch.autograd.grad((o * do).sum() + (lse * dl).sum(), xs)])
    return runs


def _op(q, k, v, log_f):
    return forgetting_attention(q, k, v, log_f.float(), return_lse=True)


def _oracle(q, k, v, log_f):
    return forgetting_attention_reference(q, k, v, log_f, return_lse=True)


def test_fp32_strong_forgetting_is_as_precise_as_fp32_allows(small_chunks):
    """Gates of ~e^-4 per token: |c| reaches 4e3 and a chunk's gates span far more than a chunk's fp32 channel
    may hold, so chunks are split and re-centred; outputs, lse and every gradient stay at fp32 precision."""
    q, k, v, _ = _inputs(1, 1024, 1024, 2, 1, 32)
    log_f = F.logsigmoid(torch.randn(1, 1024, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64) - 4.0)
    assert gate_cumsum(log_f).abs().max() > 4e3
    got, want = _fp32_vs_fp64(_op, _oracle, (q, k, v, log_f))
    for name, err in zip(("o", "lse", "dq", "dk", "dv", "dlog_f"), _rel_errors(got, want)):
        assert err < 1e-5, f"{name}: relative error {err:.1e}"


def test_fp32_long_sequence_with_large_gate_cumsum_is_precise():
    """|c| > 1e4 over 40k keys (chunked prefill of the last 64 queries): c is re-centred per chunk, so the
    fp32 channels stay small and the result keeps fp32 precision; the fp32 cumsum alone would lose ~1e-3."""
    Tq, Tk = 64, 40000
    q, k, v, _ = _inputs(1, Tq, Tk, 2, 2, 32)
    log_f = F.logsigmoid(torch.randn(1, Tk, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 1.0)
    assert gate_cumsum(log_f).abs().max() > 1e4
    got, want = _fp32_vs_fp64(_op, _oracle, (q, k, v, log_f))
    for name, err in zip(("o", "lse", "dq", "dk", "dv", "dlog_f"), _rel_errors(got, want)):
        assert err < 1e-5, f"{name}: relative error {err:.1e}"


def test_fp32_precise_where_c_restarts_at_a_packed_sequence():
    """A c that restarts at a packed sequence jumps by 4e3 inside one query chunk: the chunk is cut there, so the
    second sequence's rows are not re-centred on the first one's c (that cost ~1e-4); fp32 precision everywhere,
    also with a threshold (row_starts searches each sequence apart)."""
    from foxlm.ops import attention_from_cumsum
    from foxlm.ops.forgetting_attention.reference import attention_from_cumsum_reference

    cu = torch.tensor([0, 1000, 1200], dtype=torch.int32)
    q, k, v, _ = _inputs(1, 1200, 1200, 2, 2, 32)
    g = torch.Generator().manual_seed(6)
    log_f = F.logsigmoid(torch.randn(1, 1200, 2, generator=g, dtype=torch.float64) + torch.where(
        torch.arange(1200) < 1000, -4.0, 2.0)[None, :, None])
    c = gate_cumsum(log_f, cu)
    assert c[0, 999].max() < -3.5e3 and c[0, 1000].min() > -1
    for threshold in (None, torch.full((2, 2), -12.0, dtype=torch.float64)):
        kw = dict(scale=32 ** -0.5, cu_seqlens=cu, threshold=threshold)
        got, want = _fp32_vs_fp64(lambda *x: attention_from_cumsum(*x, **kw),
                                  lambda *x: attention_from_cumsum_reference(*x, **kw), (q, k, v, c, c.clone()))
        for name, err in zip(("o", "lse", "dq", "dk", "dv", "dc_q", "dc_k"), _rel_errors(got, want)):
            assert err < 1e-5, f"{name} (threshold {threshold is not None}): relative error {err:.1e}"


@pytest.mark.parametrize("heads", [[0, 1, 2, 3], [0, 1, 2, 0]], ids=["one-fast-head", "half-fast"])
def test_heads_that_forget_at_different_rates_keep_fp32_precision(heads):
    """One fast-forgetting head beside slow ones (its own chunks, across a GQA group's boundary), or half of the heads
    fast (one shared chunking): every output and gradient keeps fp32 precision against the fp64 oracle, with and
    without a backward (the two paths chunk heads differently)."""
    q, k, v, _ = _inputs(1, 1024, 1024, 4, 2, 32)
    bias = torch.tensor([-4.0, 5.0, 5.0, 5.0], dtype=torch.float64)
    log_f = F.logsigmoid(torch.randn(1, 1024, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
                         + bias)[..., heads]
    got, want = _fp32_vs_fp64(_op, _oracle, (q, k, v, log_f))
    for name, err in zip(("o", "lse", "dq", "dk", "dv", "dlog_f"), _rel_errors(got, want)):
        assert err < 1e-5, f"{name}: relative error {err:.1e}"
    with torch.no_grad():  # without gradients each group gets its own chunks (views of q, k, v; GQA across groups)
        got = _op(q.float(), k.float(), v.float(), log_f)
    for name, err in zip(("o", "lse"), _rel_errors(got, want[:2])):
        assert err < 1e-5, f"{name} (no backward): relative error {err:.1e}"


@pytest.mark.parametrize("by_head", [True, False])
@pytest.mark.parametrize("rate", [0.02, 0.07, 0.3, 5.0])
def test_every_chunk_keeps_its_gates_within_the_span_the_precision_needs(by_head, rate):
    """Whatever the cuts (even, or along the kernel's 256-row query blocks), each chunk's c spans at most _C_SPAN
    in every head of its group (but at the floor: a piece split evenly into chunks of 16 to 31 rows), and the chunks
    of a group tile the rows."""
    g = torch.Generator().manual_seed(int(rate * 100))
    T, H = 3000, 4
    log_f = -rate * torch.rand(2, T, H, generator=g, dtype=torch.float64) * torch.tensor([2.0, 1.0, 0.1, 0.01])
    log_f[:, 1700] -= 70.0  # a jump: a cut of its own
    c = gate_cumsum(log_f).numpy()
    for (h0, h1), ranges in sdpa_path._head_groups(c, 2048, by_head):
        assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]] and ranges[-1][1] == T
        for a, b in ranges:
            span = (c[:, a:b, h0:h1].max(1) - c[:, a:b, h0:h1].min(1)).max()
            assert span <= sdpa_path._C_SPAN or b - a < 32, (rate, a, b, span)
            assert b - a <= 2048


def test_two_chunks_without_a_backward_take_two_kernel_calls_and_keep_fp32_precision(monkeypatch):
    """One head whose gates span a little over _C_SPAN: two chunks for every head, and without a backward all rows
    go against the first chunk's keys in one call, then the second chunk's own block (no third call, no copy); o and
    lse keep fp32 precision against the fp64 oracle (GQA, a head dim padded for v, two batch rows)."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 1024, 4, 32, generator=g, dtype=torch.float64)
    k = torch.randn(2, 1024, 2, 32, generator=g, dtype=torch.float64)
    v = torch.randn(2, 1024, 2, 24, generator=g, dtype=torch.float64)
    rate = torch.tensor([70.0 / 1024, 0.01, 0.001, 0.0001], dtype=torch.float64)
    log_f = -rate * (1 + 0.3 * torch.rand(2, 1024, 4, generator=g, dtype=torch.float64))
    calls = []
    forward, backward = sdpa_path._kernel(torch.device("cpu"))
    monkeypatch.setattr(sdpa_path, "_kernel", lambda device: (lambda *a, **kw: calls.append(1) or forward(*a, **kw),
                                                            backward))
    with torch.no_grad():
        o, lse = forgetting_attention(q.float(), k.float(), v.float(), log_f.float(), return_lse=True)
    assert len(calls) == 2
    ro, rlse = forgetting_attention_reference(q, k, v, log_f, return_lse=True)
    for name, err in zip(("o", "lse"), _rel_errors((o, lse), (ro, rlse))):
        assert err < 2e-6, f"{name}: relative error {err:.1e}"


@pytest.mark.parametrize("qk_scale", [1.0, 6.0])
def test_keys_that_underflow_for_every_row_are_not_computed(monkeypatch, qk_scale):
    """Keys whose weight is below fp32's smallest denormal for every row of a chunk are skipped: the result is that
    of computing them, also where large dot products (q, k scaled up) keep far keys in play and fewer are skipped."""
    from foxlm.ops.forgetting_attention import sdpa as sdpa_path

    monkeypatch.setattr(sdpa_path, "_SKIP_MIN_KEYS", 1)  # look for the skip before every chunk
    q, k, v, _ = _inputs(1, 1024, 1024, 2, 2, 32, dtype=torch.float32)
    q, k = q * qk_scale, k * qk_scale
    log_f = F.logsigmoid(torch.randn(1, 1024, 2, generator=torch.Generator().manual_seed(8)) - 2.0)
    c = gate_cumsum(log_f)
    plan = sdpa_path._plan(c, c, None, 0, 1 << 16, True, lambda: sdpa_path._norms(q, k, 32 ** -0.5))
    first_keys = [calls[0][0] for _, chunks in plan for *_, calls in chunks if calls]
    assert max(first_keys) > 0, "nothing was skipped"
    got = forgetting_attention(q, k, v, log_f, return_lse=True)
    monkeypatch.setattr(sdpa_path, "_UNDERFLOW", math.inf)
    want = forgetting_attention(q, k, v, log_f, return_lse=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
    ref = _oracle(q.double(), k.double(), v.double(), log_f.double())
    for a, b, r in zip(got, want, ref):  # against the fp64 oracle, skipping costs no accuracy
        assert (a.double() - r).norm() <= 1.01 * (b.double() - r).norm() + 1e-7 * r.norm()


@pytest.mark.parametrize("prune", [False, True])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("scale", [-1.0, 0.0, -0.1, -4.0])
def test_zero_or_negative_scale_matches_reference(monkeypatch, scale, grad, prune):
    """A scale <= 0 is softmax attention like any other: the key-bias forward (no gradient), the gate channels (with
    one), the skip of underflowing keys and ACP give the fp64 reference's o, lse and gradients, not NaN."""
    monkeypatch.setattr(sdpa_path, "_SKIP_MIN_KEYS", 1)  # look for keys to skip before every chunk
    T, H, D = 256, 2, 16
    q, k, v = (torch.randn(1, T, H, D, requires_grad=grad) for _ in range(3))
    log_f = F.logsigmoid(torch.randn(1, T, H) - 1.0).requires_grad_(grad)
    o, lse = forgetting_attention(q, k, v, log_f, scale=scale, prune=prune, return_lse=True)
    ref_inputs = [t.detach().double().requires_grad_(grad) for t in (q, k, v, log_f)]
    ro, rlse = forgetting_attention_reference(*ref_inputs, scale=scale, return_lse=True)
    tol = 2e-4 if prune else 2e-5  # ACP drops less than tolerance (e^-10) of each row's mass
    assert (o.double() - ro).abs().max() < tol * v.abs().max()
    assert (lse.double() - rlse).abs().max() < tol
    if grad:
        got = _grads(o.double(), lse.double(), (q, k, v, log_f))
        for name, a, e in zip(("dq", "dk", "dv", "dlog_fgate"), got, _grads(ro, rlse, ref_inputs)):
            assert (a.double() - e).norm() < 10 * tol * e.norm().clamp_min(1.0), name  # dq = dk = 0 at scale 0


def test_acp_bounds_logits_by_the_scales_magnitude():
    """|scale * q . k| <= |scale| |q| |k|: a negative scale prunes as its magnitude does (not nothing)."""
    q, k, _, _ = _inputs(2, 30, 30, 4, 2, 16)
    torch.testing.assert_close(data_logit_bound(q, k, -0.5), data_logit_bound(q, k, 0.5))


@pytest.mark.parametrize("scale", [-1.0, 0.0])
def test_sequence_attention_without_a_gate_takes_a_negative_scale(scale):
    """The no-gate path (SDPA) gives the reference's plain causal attention for a scale <= 0 too."""
    from foxlm.ops import sequence_attention

    q, k, v = (torch.randn(2, 40, 2, 16) for _ in range(3))
    o, _ = sequence_attention(q, k, v, None, scale=scale)
    ref = forgetting_attention_reference(q.double(), k.double(), v.double(), torch.zeros(2, 40, 2), scale=scale)
    assert (o.double() - ref).abs().max() < 1e-5


def test_denormals_are_flushed_on_every_intra_op_thread_and_restored():
    """The kernels' worker threads flush denormals during the calls (torch's own setting reaches only the calling
    thread), and every thread has its mode back afterwards."""
    from foxlm.ops.forgetting_attention.denormals import _omp_parallel, flush_denormals

    if _omp_parallel() is None:
        pytest.skip("torch's OpenMP runtime was not found: only the calling thread flushes")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tiny = torch.full((1 << 22,), 1e-39, dtype=torch.float32)  # large enough to be split over both threads
        with flush_denormals():
            assert (tiny.mul(1.0) == 0).all()
        assert (tiny.mul(1.0) != 0).all()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("flush", [False, True])
def test_callers_denormal_mode_is_restored(flush):
    """The CPU path flushes denormals during its kernel calls and leaves the caller's mode as it found it."""
    q, k, v, log_f = _inputs(1, 20, 20, 2, 2, 8, dtype=torch.float32)
    q.requires_grad_()
    torch.set_flush_denormal(flush)
    try:
        forgetting_attention(q, k, v, log_f.float()).sum().backward()
        tiny = torch.tensor(1e-39, dtype=torch.float32).mul(1.0).item()
    finally:
        torch.set_flush_denormal(False)
    assert (tiny == 0.0) == flush


@pytest.mark.parametrize("power", [1, 2])
def test_double_backward_raises_a_clear_error(power):
    """A gradient penalty differentiates the op's backward, which is not differentiable: the first-order gradient
    with create_graph=True is the plain one, and differentiating it raises, rather than failing inside the backward
    with an error about out= arguments, or (power 1: o.sum()'s constant incoming gradient) coming back without a
    graph, so that the penalty silently lost its dependence on the inputs."""
    q, k, v, log_f = (t.requires_grad_() for t in _inputs(1, 20, 20, 2, 1, 8))
    o = forgetting_attention(q, k, v, log_f)
    (dq,) = torch.autograd.grad(o.pow(power).sum(), q, create_graph=True)
    (want,) = torch.autograd.grad(forgetting_attention(q, k, v, log_f).pow(power).sum(), q)
    torch.testing.assert_close(dq, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="forgetting_attention: cannot differentiate twice"):
        (o.sum() + dq.square().sum()).backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_output_is_contiguous_as_flash_attn_s(dtype, grad):
    """o is contiguous, as flash_attn_func's and fla's are, with or without a backward to follow: a port's
    o.view(B, T, -1) worked in eval but raised in training, where o was a view of the wider q/k channel buffer."""
    q, k, v, log_f = (t.to(dtype) for t in _inputs(1, 12, 12, 2, 1, 16, 8))
    q.requires_grad_(grad)
    o = forgetting_attention(q, k, v, log_f)
    assert o.is_contiguous()
    o.view(1, 12, -1)


@pytest.mark.parametrize("layout", ["head-dim-stride-2", "expanded"])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["q", "k", "v"])
def test_views_with_a_strided_head_dim_match_reference(which, layout):
    """A q, k or v whose head dim is not stride 1 (every other channel, or a broadcast) gives the reference's result:
    without a backward to follow, such views went into SDPA's fused CPU kernel as they were, which read the head dim
    with stride 1 and returned a silently wrong o (errors of order 1)."""
    q, k, v, log_f = _inputs(2, 24, 24, 2, 2, 8, dtype=torch.float32)
    x = (q, k, v)[which]
    if layout == "expanded":
        view = x[..., :1].expand_as(x)
    else:
        view = torch.cat([x, torch.randn_like(x)], -1)[..., ::2]
    assert view.stride(-1) != 1
    args = [q, k, v]
    args[which] = view
    o = forgetting_attention(*args, log_f)
    want = forgetting_attention_reference(*(t.double() for t in args), log_f)
    torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-5)


def test_compiled_ops_double_backward_raises():
    """Under the compiler the op is the custom op foxlm::attention_from_cumsum, whose backward is a custom op with no
    autograd of its own: a second derivative through it raises (torch.library's error), even from o.sum()."""
    q, k, v, log_f = (t.requires_grad_() for t in _inputs(1, 12, 12, 2, 2, 8))
    c = log_f.cumsum(1)
    o = torch.ops.foxlm.attention_from_cumsum(q, k, v, c, c, None, None, 0.5, 0, None, True)[0]
    (dq,) = torch.autograd.grad(o[..., :8].sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        dq.square().sum().backward()


def test_lse_gradient_flows():
    q, k, v, log_f = _inputs(1, 20, 20, 2, 2, 8)
    log_f.requires_grad_()
    _, lse = forgetting_attention(q, k, v, log_f, return_lse=True)
    (g,) = torch.autograd.grad(lse.sum(), log_f)
    assert g.abs().sum() > 0


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(q=a["q"][0]), "q"),
        (lambda a: a.update(k=torch.randn(1, 16, 3, 8, dtype=torch.float64),
                            v=torch.randn(1, 16, 3, 8, dtype=torch.float64)), "multiple"),
        (lambda a: a.update(log_fgate=a["log_fgate"].int()), "log_fgate"),
        (lambda a: a.update(log_fgate=-a["log_fgate"] + 0.1), "log_fgate"),
        (lambda a: a.update(log_fgate=a["log_fgate"].masked_fill(torch.rand(1, 16, 4) < 0.1, float("nan"))),
         "log_fgate"),
        (lambda a: a.update(log_fgate=a["log_fgate"][:, :8]), "log_fgate"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 9, 4, 16], dtype=torch.int32)), "cu_seqlens"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 4, 16], dtype=torch.int16)), "cu_seqlens"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 2**32 + 4, 16], dtype=torch.int64)), "cu_seqlens"),
        (lambda a: a.update(window=4, window_size=(3, 0)), "window_size"),
        (lambda a: a.update(window_size=(3, 2)), "window_size"),
        (lambda a: a.update(window_size=3), "window_size"),
        (lambda a: a.update(prune="yes"), "prune"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 4, 15], dtype=torch.int32)), "cu_seqlens"),
        (lambda a: a.update(v=a["v"].float()), "dtype"),
        (lambda a: a.update(q=a["q"][:, :, :, :4]), "k"),
        (lambda a: a.update(tolerance=2.0), "tolerance"),
        (lambda a: a.update(q=torch.randn(1, 17, 4, 8, dtype=torch.float64)), "q"),
        (lambda a: a.update(max_seqlen=16), "max_seqlen"),
        *[(lambda a, m=m: a.update(cu_seqlens=torch.tensor([0, 4, 16], dtype=torch.int32), max_seqlen=m),
           "max_seqlen: expected an int") for m in ("16", 16.0, True, torch.tensor(16))],
        (lambda a: a.update(window=0), "window"),
        (lambda a: a.update(window=2.5), "window"),
        (lambda a: a.update(window=True), "window"),
        (lambda a: a.update(scale=float("nan")), "scale"),
        (lambda a: a.update(scale=float("-inf")), "scale"),
        (lambda a: a.update(scale="0.5"), "scale"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(change, match):
    q, k, v, log_f = _inputs(1, 16, 16, 4, 2, 8)
    args = dict(q=q, k=k, v=v, log_fgate=log_f)
    change(args)
    with pytest.raises(ValueError, match=match):
        forgetting_attention(**args)


def test_differing_devices_raise():
    meta_k = torch.empty(1, 16, 2, 8, dtype=torch.float64, device="meta")
    q, _, v, log_f = _inputs(1, 16, 16, 2, 2, 8)
    with pytest.raises(ValueError, match="device"):
        forgetting_attention(q, meta_k, v, log_f)


@pytest.mark.parametrize("kwargs", [{}, {"window": 3, "prune": True}, {"cu": [0, 0, 1, 7, 9]}],
                         ids=["plain", "window-acp", "varlen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_inputs_give_the_shapes_and_dtypes_of_a_real_call(dtype, kwargs):
    """Meta tensors (a model traced without memory) have no values to check or plan chunks from: the op still
    answers with o, lse and every gradient shaped and typed as on the CPU."""
    kwargs = dict(kwargs)
    cu = kwargs.pop("cu", None)
    results = []
    for device in ("cpu", "meta"):
        inputs = [t.to(device, dtype if t.dim() == 4 else torch.float32).requires_grad_()
                  for t in _inputs(1, 9, 9, 4, 2, 8, Dv=6)]
        if cu is not None:
            kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
        o, lse = forgetting_attention(*inputs, return_lse=True, **kwargs)
        grads = torch.autograd.grad(o.float().sum() + lse.sum(), inputs)
        results.append([(tuple(t.shape), t.dtype, t.device.type) for t in (o, lse, *grads)])
    assert [(s, d) for s, d, _ in results[1]] == [(s, d) for s, d, _ in results[0]]
    assert {dev for _, _, dev in results[1]} == {"meta"}


def test_acp_threshold_tightens_with_a_window():
    """A row sees at most `window` keys, so N = window in delta: a higher threshold, still within tolerance."""
    from foxlm.ops import acp_threshold

    q, k, v, log_f = _inputs(1, 300, 300, 2, 2, 16)
    log_f = log_f - 0.3
    wide = acp_threshold(q, k, scale=0.25, tolerance=1e-4)
    narrow = acp_threshold(q, k, scale=0.25, tolerance=1e-4, window=16)
    torch.testing.assert_close(narrow - wide, torch.full_like(wide, math.log(300 / 16)))
    o = forgetting_attention(q, k, v, log_f, window=16, prune=True, tolerance=1e-4)
    ro = forgetting_attention_reference(q, k, v, log_f, window=16)
    assert (o - ro).abs().max() < 2e-4 * v.abs().max()


def test_acp_threshold_from_host_numbers_equals_tensors():
    """Key counts and bounds given as host numbers (kept on the host: no copy to the device, a sync on CUDA) give
    the same delta as the same values as tensors, with and without a window or packed sequences."""
    from foxlm.ops import acp_threshold

    q, k, _, _ = _inputs(2, 50, 50, 4, 2, 16)
    bound = torch.rand(2, 4) * 5
    torch.testing.assert_close(prune_threshold(bound, 50, 1e-3), prune_threshold(bound, torch.tensor([50, 50]), 1e-3))
    torch.testing.assert_close(prune_threshold(bound, 0, 1e-3), prune_threshold(bound, torch.tensor([1, 1]), 1e-3))
    for window in (None, 20):
        from_float = acp_threshold(q, k, scale=0.25, logit_bound=3.5, window=window)
        from_tensor = acp_threshold(q, k, scale=0.25, logit_bound=torch.full((4,), 3.5), window=window)
        torch.testing.assert_close(from_float, from_tensor)
        torch.testing.assert_close(from_float, torch.full((2, 4), -7.0 - math.log(window or 50) - 10.0))
    cu = torch.tensor([0, 10, 50], dtype=torch.int32)
    packed = acp_threshold(q[:1], k[:1], scale=0.25, logit_bound=1.0, cu_seqlens=cu, window=20)
    torch.testing.assert_close(packed, -2.0 - torch.log(torch.tensor([[10.0], [20.0]])).expand(2, 4) - 10.0)


def test_unchecked_gates_pass_nan_through_and_cu_seqlens_are_still_checked():
    """check_gates=False (the layers' setting: no host sync on CUDA) lets a NaN gate reach the output, where a
    loss shows it; the other value checks stay."""
    q, k, v, log_f = _inputs(1, 16, 16, 4, 2, 8)
    log_f = log_f.detach().clone()
    log_f[0, 5, 1] = float("nan")
    o = forgetting_attention(q, k, v, log_f, check_gates=False)
    assert o[:, 5:, 1].isnan().all() and not o[:, :, 0].isnan().any()
    with pytest.raises(ValueError, match="cu_seqlens"):
        forgetting_attention(q, k, v, log_f, check_gates=False,
                             cu_seqlens=torch.tensor([0, 9, 4, 16], dtype=torch.int32))


def _cumsum_case(B, Tq, Tk, Hq, q_offset, seed, cu_seqlens=None):
    """Random monotone gate cumsums c_q [B, Tq, Hq], c_k [B, Tk, Hq] (fp64) for queries at q_offset (default
    Tk - Tq), with a common offset (only differences matter) and, with cu_seqlens, restarted per sequence."""
    from foxlm.ops import gate_cumsum

    g = torch.Generator().manual_seed(seed)
    q_offset = Tk - Tq if q_offset is None else q_offset
    n = max(Tk, q_offset + Tq)
    log_f = F.logsigmoid(2.0 * torch.randn(B, n, Hq, generator=g, dtype=torch.float64) + 1.0)
    c = gate_cumsum(log_f, cu_seqlens) + 123.0
    return c[:, q_offset:q_offset + Tq].clone(), c[:, :Tk].clone()


_CASES = {  # name: (B, Tq, Tk, Hq, Hk, q_offset, window, threshold, packed)
    "gqa": (2, 37, 37, 4, 2, None, None, None, False),
    "prefill": (2, 13, 41, 4, 1, None, None, None, False),
    "offset_past_keys": (1, 19, 29, 2, 2, 35, None, None, False),
    "offset_at_keys_end": (1, 40, 50, 4, 2, 50, None, None, False),
    "offset_before_last_keys": (1, 40, 50, 4, 2, 10, None, None, False),
    "offset_window_empty_rows": (1, 19, 29, 2, 2, 25, 8, None, False),
    "window": (2, 41, 41, 2, 1, None, 7, None, False),
    "threshold": (2, 41, 41, 4, 2, None, None, -2.0, False),
    "threshold_prefill_window": (1, 17, 45, 2, 2, None, 20, -1.5, False),
    "packed": (1, 50, 50, 4, 2, None, None, None, True),
    "packed_threshold_window": (1, 50, 50, 2, 2, None, 9, -2.0, True),
}


@pytest.mark.parametrize("backward", [True, False], ids=["gate-channels", "key-bias-mask"])
@pytest.mark.parametrize("fused", [True, False], ids=["cpu-kernel", "math-kernel"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(_CASES))
def test_attention_from_cumsum_matches_reference(small_chunks, monkeypatch, case, dtype, fused, backward):
    """Outputs, lse and the gradients of q, k, v, c_q and c_k (through o and lse) against the fp64 oracle, through
    SDPA's fused CPU kernel and through the plain-matmul kernel that GPU tensors take (here on the CPU); without
    gradients (the key-bias mask, heads chunked apart), outputs and lse."""
    from foxlm.ops import attention_from_cumsum
    from foxlm.ops.forgetting_attention.reference import attention_from_cumsum_reference

    monkeypatch.setattr(sdpa_path, "CHUNK_ROWS", 8)  # several chunks, some with no visible key
    monkeypatch.setattr(sdpa_path, "_fused", lambda device: fused)
    B, Tq, Tk, Hq, Hk, q_offset, window, thr, packed = _CASES[case]
    cu = torch.tensor([0, 11, 12, 30, 50], dtype=torch.int32) if packed else None
    q, k, v, _ = _inputs(B, Tq, Tk, Hq, Hk, 16, 12, dtype=dtype, seed=len(case))
    c_q, c_k = _cumsum_case(B, Tq, Tk, Hq, q_offset, seed=len(case), cu_seqlens=cu)
    rows = B if cu is None else len(cu) - 1
    threshold = None if thr is None else thr - torch.rand(rows, Hq, generator=torch.Generator().manual_seed(2))
    kw = dict(scale=0.3, q_offset=q_offset, window=window, threshold=threshold, cu_seqlens=cu)
    inputs = [t.requires_grad_() for t in (q, k, v, c_q, c_k)]
    with torch.set_grad_enabled(backward):
        o, lse = attention_from_cumsum(q, k, v, c_q, c_k, **kw)
    ref = [t.detach().double().requires_grad_() for t in inputs]
    ro, rlse = attention_from_cumsum_reference(*ref, **kw)
    assert o.dtype == dtype and lse.dtype == torch.float32 and o.shape == (B, Tq, Hq, 12)
    assert torch.equal(lse.isinf(), rlse.isinf())
    if case == "offset_window_empty_rows":
        assert lse.isinf().any() and (o[lse.transpose(1, 2).isinf()] == 0).all()
    tol = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(o.double(), ro, rtol=tol, atol=tol)
    finite = ~rlse.isinf()
    torch.testing.assert_close(lse.double()[finite], rlse[finite], rtol=max(tol, 1e-6), atol=max(tol, 1e-6))
    if not backward:
        assert o.grad_fn is None
        return
    g = torch.Generator().manual_seed(3)
    do, dl = torch.randn(ro.shape, generator=g, dtype=torch.float64), torch.randn(rlse.shape, generator=g).double()
    dl = dl.masked_fill(~finite, 0.0)
    got = torch.autograd.grad((o.double() * do).sum() + (lse.double() * dl).sum(), inputs)
    want = torch.autograd.grad((ro * do).sum() + (rlse.masked_fill(~finite, 0.0) * dl).sum(), ref)
    for name, a, b in zip(("q", "k", "v", "c_q", "c_k"), got, want):
        assert a.dtype == b.dtype if name.startswith("c") else a.dtype == dtype
        scale = 10 if dtype == torch.bfloat16 else 1  # bf16 gradients: a few ulps of bf16 over the row
        torch.testing.assert_close(a.double(), b, rtol=scale * tol, atol=scale * tol, msg=lambda m: f"{name}: {m}")


def test_attention_from_cumsum_returns_probabilities():
    """probs [B, Hq, Tq, Tk] fp32: the rows of the softmax (summing to 1), zero outside the visible keys."""
    from foxlm.ops import attention_from_cumsum

    q, k, v, _ = _inputs(2, 9, 21, 4, 2, 8)
    c_q, c_k = _cumsum_case(2, 9, 21, 4, None, seed=4)
    o, lse, probs = attention_from_cumsum(q, k, v, c_q, c_k, scale=0.5, window=5, return_probs=True)
    assert probs.shape == (2, 4, 9, 21) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 9))
    pos, keys = torch.arange(12, 21)[:, None], torch.arange(21)[None, :]
    assert (probs[..., (keys > pos) | (keys <= pos - 5)] == 0).all()
    vh = v.repeat_interleave(2, dim=2).transpose(1, 2)
    torch.testing.assert_close(o, (probs.double() @ vh).transpose(1, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(c_q=torch.zeros(1, 5, 2)), "c_q"),
        (dict(c_k=torch.zeros(1, 8, 2, dtype=torch.float16)), "c_k"),
        (dict(q_offset=1.5), "q_offset"),
        (dict(window=0), "window"),
        (dict(threshold=torch.zeros(2, 2)), "threshold"),
        (dict(cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32)), "cu_seqlens"),
        (dict(k=torch.zeros(1, 8, 0, 4), v=torch.zeros(1, 8, 0, 4)), "head"),
    ],
)
def test_attention_from_cumsum_bad_input_names_the_argument(change, match):
    from foxlm.ops import attention_from_cumsum

    args = dict(q=torch.zeros(1, 4, 2, 4), k=torch.zeros(1, 8, 1, 4), v=torch.zeros(1, 8, 1, 4),
                c_q=torch.zeros(1, 4, 2), c_k=torch.zeros(1, 8, 2), scale=0.5)
    with pytest.raises(ValueError, match=match):
        attention_from_cumsum(**{**args, **change})


def test_reference_agrees_with_the_production_gate_cumsum():
    """The oracle sums the gates itself; fed the production gate_cumsum's c it gives the same attention."""
    from foxlm.ops.forgetting_attention.reference import attention_from_cumsum_reference

    cu = torch.tensor([0, 7, 30, 40], dtype=torch.int32)
    q, k, v, log_f = _inputs(1, 40, 40, 2, 2, 8)
    c = gate_cumsum(log_f, cu)
    want = attention_from_cumsum_reference(q, k, v, c, c, scale=0.25, cu_seqlens=cu)[0]
    torch.testing.assert_close(forgetting_attention_reference(q, k, v, log_f, scale=0.25, cu_seqlens=cu), want,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bound", [float("nan"), float("-inf"), -1.0, float("inf")])
def test_prune_rejects_a_bad_logit_bound(bound):
    """Issue 23: a NaN, infinite or negative bound gives no valid delta; it used to prune silently and wrongly."""
    q, k, v, log_f = _inputs(1, 16, 16, 2, 2, 8)
    with pytest.raises(ValueError, match="logit_bound"):
        forgetting_attention(q, k, v, log_f, prune=True, logit_bound=bound)
    with pytest.raises(ValueError, match="logit_bound"):
        forgetting_attention(q, k, v, log_f, prune=True, logit_bound=torch.full((1, 2), bound, dtype=torch.float64))


@pytest.mark.parametrize("bound,cu", [("1.0", None), (True, None), (torch.ones(3), None), (torch.ones(2, 2), None),
                                      (torch.ones(3, 2), [0, 5, 16]), (torch.ones(2, 1), [0, 3, 9, 16])])
def test_prune_rejects_a_logit_bound_of_the_wrong_type_or_shape(bound, cu):
    """A bound that is no number, or a tensor that does not broadcast to [B or N, Hq], is named: a string raised
    an unnamed TypeError, a bool was taken as 0 or 1, a tensor raised expand()'s RuntimeError."""
    q, k, v, log_f = _inputs(1, 16, 16, 2, 2, 8)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(ValueError, match="logit_bound: expected"):
        forgetting_attention(q, k, v, log_f, prune=True, logit_bound=bound, cu_seqlens=cu)


def test_prune_with_a_nan_key_leaves_earlier_rows_as_without_prune():
    """Issue 23: a NaN in k at position 5 must not reach rows 0-4, which cannot see it, through the data's bound."""
    q, k, v, log_f = _inputs(1, 32, 32, 2, 2, 8)
    k[0, 5, 1, 3] = float("nan")
    plain = forgetting_attention(q, k, v, log_f)
    pruned = forgetting_attention(q, k, v, log_f, prune=True)
    assert plain[0, :5].isfinite().all()
    torch.testing.assert_close(pruned, plain, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("Tq,Tk", [(0, 0), (0, 5)])
def test_prune_without_queries_is_the_empty_result(Tq, Tk):
    """No queries (an empty sequence, or an empty chunk of prefill) give empty o and lse and zero gradients without
    ACP; prune=True took the data's logit bound, a max over no queries, and raised an IndexError from amax."""
    inputs = [t.requires_grad_() for t in _inputs(1, Tq, Tk, 2, 1, 8)]
    o, lse = forgetting_attention(*inputs, prune=True, return_lse=True)
    assert o.shape == (1, 0, 2, 8) and lse.shape == (1, 2, 0)
    for g in torch.autograd.grad(o.sum() + lse.sum(), inputs):
        assert not g.any()


@pytest.mark.parametrize("dim", [0, 2, 3])
def test_empty_batch_heads_or_head_dim_raise_value_error(dim):
    """Issue 23: B, H or D of 0 used to end in a RuntimeError or ZeroDivisionError."""
    q, k, v, log_f = _inputs(2, 8, 8, 2, 2, 4)
    shape = list(q.shape)
    shape[dim] = 0
    empty = torch.zeros(shape, dtype=q.dtype)
    log_f = log_f[:, :, :0] if dim == 2 else log_f[:0] if dim == 0 else log_f
    with pytest.raises(ValueError, match="q, k, v"):
        forgetting_attention(empty, empty, empty, log_f)


def test_reverse_cumsum_restarts_per_sequence():
    """The gate gradient's reverse cumsum, the one the Triton backward and context parallelism share."""
    from foxlm.ops.forgetting_attention.gate import reverse_cumsum, segment_ids

    dc = torch.randn(2, 3, 50, dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 7, 8, 50], dtype=torch.int32)
    seg = segment_ids(cu_seqlens, 50)
    expected = torch.stack([(dc * (seg == seg[t]) * (torch.arange(50) >= t)).sum(-1) for t in range(50)], dim=-1)
    torch.testing.assert_close(reverse_cumsum(dc, cu_seqlens), expected)
    # along another dim (context parallelism's [B, chunks, L, H]): the same sums
    torch.testing.assert_close(reverse_cumsum(dc.transpose(1, 2), dim=1), reverse_cumsum(dc).transpose(1, 2))


# The conventions of flash_attn and fla that a user porting code meets, each against the fp64 reference.
def _reference_and_grads(q, k, v, log_f, **kwargs):
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, log_f)]
    o = forgetting_attention_reference(*leaves, **kwargs)
    return o, torch.autograd.grad(o.sum(), leaves)


def test_int64_cu_seqlens_as_fla_passes_them():
    """fla's varlen offsets are int64 (they used to be refused); they attend exactly as the int32 ones."""
    q, k, v, log_f = (x.requires_grad_() for x in _inputs(1, 40, 40, 2, 1, 8))
    cu = torch.tensor([0, 9, 25, 40], dtype=torch.int64)
    o = forgetting_attention(q, k, v, log_f, cu_seqlens=cu)
    want, want_grads = _reference_and_grads(q, k, v, log_f, cu_seqlens=cu.int())
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)
    for got, ref in zip(torch.autograd.grad(o.sum(), (q, k, v, log_f)), want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


def test_flash_attn_unbatched_varlen_layout():
    """flash_attn_varlen_func's q [total, H, D] with cu_seqlens (it used to be refused): o [total, H, Dv] and lse
    [H, total], as flash_attn returns them."""
    q, k, v, log_f = _inputs(1, 40, 40, 4, 2, 8, Dv=6)
    q, k, v, log_f = (x[0].requires_grad_() for x in (q, k, v, log_f))  # [total, H, D], log_f [total, H]
    cu = torch.tensor([0, 13, 40], dtype=torch.int32)
    o, lse = forgetting_attention(q, k, v, log_f, cu_seqlens=cu, return_lse=True)
    assert o.shape == (40, 4, 6) and lse.shape == (4, 40)
    leaves = [x.detach().double()[None].requires_grad_() for x in (q, k, v, log_f)]
    want, want_lse = forgetting_attention_reference(*leaves, cu_seqlens=cu, return_lse=True)
    torch.testing.assert_close(o, want[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), want_lse[0], rtol=1e-6, atol=1e-6)  # lse is fp32
    got = torch.autograd.grad(o.sum(), (q, k, v, log_f))
    for g, ref in zip(got, torch.autograd.grad(want.sum(), leaves)):
        torch.testing.assert_close(g, ref[0], rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="k, v, log_fgate"):
        forgetting_attention(q, k[None], v, log_f, cu_seqlens=cu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_log_gates_are_upcast(dtype):
    """A bf16 or fp16 log_fgate (a model's gate projection under autocast) is computed in fp32, as its fp32 copy
    would be (it used to be refused), and its gradient comes back in its own dtype."""
    q, k, v, log_f = _inputs(2, 24, 24, 2, 2, 8, dtype=torch.float32)
    log_f = log_f.to(dtype).requires_grad_()
    o = forgetting_attention(q, k, v, log_f)
    (g,) = torch.autograd.grad(o.sum(), log_f)
    assert o.dtype == torch.float32 and g.dtype == dtype
    want, want_grads = _reference_and_grads(q, k, v, log_f)
    torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g.double(), want_grads[3].to(dtype).double(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("left", [-1, 0, 6, 100])
def test_flash_attn_window_size_is_window(left):
    """flash_attn's window_size=(left, 0) sees keys i - left <= j <= i: window = left + 1; (-1, 0) sees all."""
    q, k, v, log_f = _inputs(1, 30, 30, 2, 2, 8)
    o = forgetting_attention(q, k, v, log_f, window_size=(left, 0))
    want = forgetting_attention_reference(q, k, v, log_f, window=None if left == -1 else left + 1)
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [np.int64(7), np.int32(40)], ids=["np.int64", "np.int32-over-T"])
def test_window_takes_numpy_ints_as_max_seqlen_does(window):
    """A NumPy int window (e.g. from a config array) is a window, as a NumPy max_seqlen is a length: it was refused
    ("expected a positive number of tokens")."""
    q, k, v, log_f = _inputs(1, 30, 30, 2, 2, 8)
    o = forgetting_attention(q, k, v, log_f, window=window)
    want = forgetting_attention_reference(q, k, v, log_f, window=int(window))
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)


def test_acp_object_is_prune_true_with_its_fields():
    """prune=ACP(tolerance, logit_bound), the value a model passes down, prunes as prune=True with the same two,
    validated once, when made."""
    q, k, v, log_f = _inputs(2, 64, 64, 2, 1, 8, gate_scale=4.0)
    bound = torch.tensor([3.0, 5.0], dtype=torch.float64)
    want = forgetting_attention(q, k, v, log_f, prune=True, tolerance=1e-3, logit_bound=bound)
    assert torch.equal(forgetting_attention(q, k, v, log_f, prune=ACP(1e-3, bound)), want)
    assert not torch.equal(want, forgetting_attention(q, k, v, log_f))  # it does prune here
    for bad, match in ((dict(tolerance=2.0), "tolerance"), (dict(logit_bound=-1.0), "logit_bound")):
        with pytest.raises(ValueError, match=match):
            ACP(**bad)
    with pytest.raises(ValueError, match="tolerance, logit_bound"):
        forgetting_attention(q, k, v, log_f, prune=ACP(1e-3), tolerance=1e-2)

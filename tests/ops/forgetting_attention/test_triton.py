"""The fused Triton kernels of Forgetting Attention: compiled on a GPU, else run on the CPU by Triton's interpreter.

Without a GPU conftest.py sets TRITON_INTERPRET=1 before any kernel is imported, and the ``triton`` mark makes
``forgetting_attention`` dispatch CPU tensors to the kernels. The tests build their tensors on DEVICE and run the
kernels with the interpreter's 16 x 16 tiles on either (``SMALL_TILES``), which their sizes and tile counts assume;
on a GPU the autotuned tiles are also checked, at sizes that cross many of them. Everything is checked against the
fp64 reference on fresh random inputs.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from foxlm.ops import acp_stats, acp_threshold, forgetting_attention
from foxlm.ops.forgetting_attention import triton_op as ta
from foxlm.ops.forgetting_attention.gate import gate_cumsum, segment_ids
from foxlm.ops.forgetting_attention.reference import forgetting_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(DEVICE == "cpu" and not ta._INTERPRETED,
                       reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)"),
]


@pytest.fixture(autouse=True)
def _small_tiles_on_device(monkeypatch):
    monkeypatch.setattr(ta, "SMALL_TILES", True)
    with torch.device(DEVICE):
        yield


def _inputs(B, Tq, Tk, Hq, Hk, D, Dv, dtype=torch.float32):
    """Fresh random q, k, v and log gates (about -0.13 per token) that require grad."""
    q = torch.randn(B, Tq, Hq, D).to(dtype).requires_grad_()
    k = torch.randn(B, Tk, Hk, D).to(dtype).requires_grad_()
    v = torch.randn(B, Tk, Hk, Dv).to(dtype).requires_grad_()
    log_fgate = F.logsigmoid(torch.randn(B, Tk, Hq) + 2.0).requires_grad_()
    return q, k, v, log_fgate


def _cotangents(o: torch.Tensor, lse: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp64 cotangents of o and lse; do's values are o's dtype's, so that the kernels (which take it in o's
    dtype) and the reference see the same input."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    return (torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype).double(),
            torch.randn(lse.shape, generator=g, dtype=torch.float64))


def _run(q, k, v, log_fgate, seed=0, reference=False, **kwargs):
    """o, lse and the four gradients of a loss using both outputs (so the lse gradient path runs too),
    from the kernels or (``reference``) from the fp64 reference; ``seed`` picks the random cotangents."""
    if reference:
        q, k, v, log_fgate = (t.detach().double().requires_grad_() for t in (q, k, v, log_fgate))
        o, lse = forgetting_attention_reference(q, k, v, log_fgate, return_lse=True, **kwargs)
    else:
        o, lse = forgetting_attention(q, k, v, log_fgate, return_lse=True, **kwargs)
    do, dlse = _cotangents(o, lse, seed)
    loss = (o.double() * do).sum() + (lse.double() * dlse).sum()
    return (o, lse, *torch.autograd.grad(loss, (q, k, v, log_fgate)))


NAMES = ("o", "lse", "dq", "dk", "dv", "dlog_fgate")


def _assert_close(actual, expected, rel: float | dict[str, float]):
    """Relative (norm) error of each output below ``rel``, one for all or per name."""
    for name, a, e in zip(NAMES, actual, expected):
        assert torch.isfinite(a).all(), name
        err = ((a.double() - e).norm() / e.norm().clamp_min(1e-30)).item()
        bound = rel[name] if isinstance(rel, dict) else rel
        assert err < bound, f"{name}: relative error {err:.2e} >= {bound:.0e}"


def _check(inputs, rel, **kwargs):
    seed = int(torch.randint(1 << 30, ()))
    _assert_close(_run(*inputs, seed=seed, **kwargs), _run(*inputs, seed=seed, reference=True, **kwargs), rel)


CASES = {
    # name: (B, Tq, Tk, Hq, Hk, D, Dv, cu_seqlens)
    "d16": (2, 45, 45, 2, 2, 16, 16, None),
    "d64-gqa2": (2, 37, 37, 4, 2, 64, 64, None),
    "d96-gqa4": (1, 40, 40, 4, 1, 96, 96, None),
    "d128": (1, 34, 34, 2, 2, 128, 128, None),
    "d48-dv80-gqa2": (1, 33, 33, 4, 2, 48, 80, None),
    "tq<tk": (2, 21, 50, 2, 1, 32, 32, None),
    "varlen": (1, 58, 58, 4, 2, 32, 32, [0, 1, 18, 19, 20, 57, 58]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_fp64_reference(name):
    B, Tq, Tk, Hq, Hk, D, Dv, cu = CASES[name]
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    _check(_inputs(B, Tq, Tk, Hq, Hk, D, Dv), rel=2e-5, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("name", ["d64-gqa2", "tq<tk", "varlen", "window+acp"])
def test_acp_backward_matches_fp64_reference(name):
    """With ACP (nothing skipped at these sizes but the kernels' PRUNE paths run) the backward sums the gate gradient's
    two sides on the tensor cores (``_sums``' DOT_SUMS): the same gradients."""
    if name == "window+acp":
        inputs, kwargs, ref_kwargs = _inputs(2, 50, 50, 4, 2, 32, 32), dict(window=19, prune=True), dict(window=19)
    else:
        B, Tq, Tk, Hq, Hk, D, Dv, cu = CASES[name]
        inputs = _inputs(B, Tq, Tk, Hq, Hk, D, Dv)
        ref_kwargs = dict(cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32))
        kwargs = dict(ref_kwargs, prune=True)
    seed = int(torch.randint(1 << 30, ()))
    out = _run(*inputs, seed=seed, **kwargs)
    _assert_close(out, _run(*inputs, seed=seed, reference=True, **ref_kwargs), rel=2e-5)


AUTOTUNED_CASES = {
    # name: (B, Tq, Tk, Hq, Hk, D, cu_seqlens, kwargs); lengths of several 64- and 128-token tiles, some partial
    "d64": (2, 700, 700, 4, 4, 64, None, {}),
    "d64-gqa2-varlen": (1, 1100, 1100, 4, 2, 64, [0, 3, 300, 301, 1100], {}),
    "d64-window": (1, 900, 900, 2, 2, 64, None, dict(window=200)),
    "d64-acp": (1, 1100, 1100, 4, 4, 64, None, dict(prune=True)),
    "d128-tq<tk": (1, 300, 650, 2, 1, 128, None, {}),
}


@pytest.mark.skipif(DEVICE == "cpu", reason="the autotuned tiles are compiled for a GPU")
@pytest.mark.parametrize("name", list(AUTOTUNED_CASES))
def test_autotuned_tiles_match_fp64_reference(monkeypatch, name):
    """The tiles training runs with (bf16, autotuned per head dim) at sizes that cross many of them. bf16 keeps 8
    bits: ~3e-3 relative error on o, the gradients and the gate gradient, as the peers' kernels (FoX's authors',
    fla's) reach on the same inputs."""
    monkeypatch.setattr(ta, "SMALL_TILES", False)
    B, Tq, Tk, Hq, Hk, D, cu, kwargs = AUTOTUNED_CASES[name]
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    inputs = _inputs(B, Tq, Tk, Hq, Hk, D, D, dtype=torch.bfloat16)
    if kwargs.get("prune"):  # ACP skips tiles of the forward's shape (the backward's tiles hold two of them)
        block_m, block_n = ta._FWD_TILES[64][0][:2]
        assert acp_stats(*inputs[:2], inputs[3], block_m=block_m, block_n=block_n)[1] > 0.1
    seed = int(torch.randint(1 << 30, ()))
    out = _run(*inputs, seed=seed, cu_seqlens=cu_seqlens, **kwargs)
    ref_kwargs = {key: value for key, value in kwargs.items() if key != "prune"}  # what ACP skips is < e^-10
    expected = _run(*inputs, seed=seed, reference=True, cu_seqlens=cu_seqlens, **ref_kwargs)
    _assert_close(out, expected, dict(o=5e-3, lse=1e-4, dq=5e-3, dk=5e-3, dv=5e-3, dlog_fgate=5e-3))


@pytest.mark.parametrize("prune", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_grouped_launch_order_matches_fp64_reference(monkeypatch, prune, varlen):
    """The grid runs (head, sequence) pairs in groups that fit in L2: with a tiny L2 budget each pair is its own
    group (3 x 2 pairs of 4 and 2 query blocks), and every program still finds its head, sequence and block."""
    x = torch.empty(1, 1, 1, 32, device="cpu")  # the CPU's L2 share: 24 MiB
    assert ta._head_group(6, 50, x, x) == 6 and ta._head_group(6, 1 << 15, x, x) == 3  # 24 MiB: 3 pairs of 8 MiB
    monkeypatch.setattr(ta, "L2_SHARE", 1)
    assert ta._head_group(6, 50, x, x) == 1
    if varlen:
        inputs, cu = _inputs(1, 61, 61, 4, 2, 32, 32), torch.tensor([0, 30, 31, 61], dtype=torch.int32)
    else:
        inputs, cu = _inputs(3, 50, 50, 4, 2, 32, 32), None
    seed = int(torch.randint(1 << 30, ()))
    out = _run(*inputs, seed=seed, cu_seqlens=cu, prune=prune)
    _assert_close(out, _run(*inputs, seed=seed, reference=True, cu_seqlens=cu), rel=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    inputs = _inputs(2, 40, 40, 2, 1, 64, 64, dtype=dtype)
    out = _run(*inputs, seed=1)
    assert out[0].dtype == dtype and out[1].dtype == torch.float32
    # bf16 keeps 8 bits: ~3e-3 on o and every gradient (the peers' kernels reach the same); fp16 keeps 11
    _assert_close(out, _run(*inputs, seed=1, reference=True), rel=1e-3 if dtype == torch.float16 else 5e-3)


GATE_CASES = {
    # name: (B, Tq, Tk, Hq, Hk, D, dtype, kwargs): a few hundred tokens, where the gate gradient's old error showed
    # (4.6e-2 at 256 tokens, 1e-1 at 512: the host's dlse in place of the row sums, in a reverse cumsum)
    "plain": (1, 256, 256, 2, 2, 64, torch.bfloat16, {}),
    "acp-d64": (1, 256, 256, 2, 2, 64, torch.bfloat16, dict(prune=True)),
    "fp16": (1, 256, 256, 2, 2, 64, torch.float16, {}),
    "gqa2": (1, 256, 256, 4, 2, 32, torch.bfloat16, {}),
    "varlen": (1, 256, 256, 2, 1, 32, torch.bfloat16, dict(cu_seqlens=[0, 90, 91, 256])),
    "window": (1, 256, 256, 2, 2, 32, torch.bfloat16, dict(window=96)),
    "acp": (1, 256, 256, 2, 2, 32, torch.bfloat16, dict(prune=True)),
    "tq<tk": (1, 128, 256, 2, 1, 32, torch.bfloat16, {}),
    "window+acp": (1, 256, 256, 2, 2, 32, torch.bfloat16, dict(window=96, prune=True)),
}


@pytest.mark.parametrize("name", list(GATE_CASES))
def test_half_precision_gate_gradient(name):
    """bf16/fp16 over a few hundred tokens on every backward: the gate gradient within 5e-3 of fp64, as the peers'
    kernels reach (2.5e-3 on a GPU). Its two sides, rowsum(dS) - colsum(dS), must come from the kernel's own dS."""
    B, Tq, Tk, Hq, Hk, D, dtype, kwargs = GATE_CASES[name]
    kwargs = dict(kwargs)
    if "cu_seqlens" in kwargs:
        kwargs["cu_seqlens"] = torch.tensor(kwargs["cu_seqlens"], dtype=torch.int32)
    q, k, v, _ = _inputs(B, Tq, Tk, Hq, Hk, D, D, dtype=dtype)
    log_fgate = F.logsigmoid(2 * torch.randn(B, Tk, Hq) + 2).requires_grad_()  # -0.3 per token on average
    if kwargs.get("prune"):
        assert acp_stats(q, k, log_fgate, block_m=ta.INTERPRET_TILE, block_n=ta.INTERPRET_TILE)[1] > 0.1
    seed = int(torch.randint(1 << 30, ()))
    out = _run(q, k, v, log_fgate, seed=seed, **kwargs)
    ref_kwargs = {key: value for key, value in kwargs.items() if key != "prune"}
    expected = _run(q, k, v, log_fgate, seed=seed, reference=True, **ref_kwargs)
    _assert_close(out, expected, dict(o=5e-3, lse=1e-4, dq=5e-3, dk=5e-3, dv=5e-3, dlog_fgate=5e-3))


def test_no_gate_equals_sdpa_causal():
    """log f = 0: plain causal softmax attention, as torch's SDPA computes it."""
    q, k, v, _ = _inputs(2, 40, 40, 2, 2, 32, 32)
    log_fgate = torch.zeros(2, 40, 2, requires_grad=True)
    o = forgetting_attention(q, k, v, log_fgate)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, log_fgate), do)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    o_sdpa = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    grads_sdpa = torch.autograd.grad(o_sdpa, (qt, kt, vt), do.transpose(1, 2))
    torch.testing.assert_close(o, o_sdpa.transpose(1, 2), rtol=1e-5, atol=1e-5)
    for a, e in zip(grads, grads_sdpa):
        torch.testing.assert_close(a, e.transpose(1, 2), rtol=1e-4, atol=1e-5)
    _check((q, k, v, log_fgate), rel=2e-5)


def test_fast_forgetting_sees_only_itself():
    """log f ~ -30: every query attends to itself alone, so o_i = v_i."""
    q, k, v, _ = _inputs(1, 40, 40, 2, 1, 32, 32)
    log_fgate = (-30.0 - torch.rand(1, 40, 2)).requires_grad_()
    out, ref = _run(q, k, v, log_fgate, seed=2), _run(q, k, v, log_fgate, seed=2, reference=True)
    torch.testing.assert_close(out[0], v.detach().expand(-1, -1, 2, -1), rtol=0, atol=1e-5)
    _assert_close(out[:5], ref[:5], rel=1e-4)
    # The exact gate gradient is ~e^-30: the fp32 row and column sums of dS cancel, and the reverse
    # cumsum adds up 40 such fp32 roundings of terms up to |do| |v|: compare absolutely.
    do, _ = _cotangents(out[0], out[1], seed=2)
    atol = 4 * 40 * 6e-8 * do.norm(dim=-1).max().item() * v.detach().norm(dim=-1).max().item()
    torch.testing.assert_close(out[5].double(), ref[5], rtol=0, atol=atol)


def test_gate_precision_at_large_cumsum():
    """|c| ~ 1e6 (a million tokens of gates): fp32 c would be off by ulp(1e6) = 0.06 in every logit."""
    q, k, v, _ = _inputs(1, 48, 48, 2, 2, 32, 32)
    lf = F.logsigmoid(torch.randn(1, 48, 2) + 3.0)
    lf[:, 0] = -1.0e6
    _check((q, k, v, lf.requires_grad_()), rel=2e-5)


@pytest.mark.parametrize("case", ["aligned", "tq<tk", "varlen"])
def test_relative_c_matches_its_definition(case):
    """The key side's c_rel (_relative_c_kernel) is log2(e) (c_p - c_b) in fp32 with b the end of p's C_BLOCK-long block
    within its sequence; the query side's (written by the backward's preprocess kernel beside delta) is that with b the
    first position (blocks from Tk - Tq on), less log2(e) times the lse of query p - (Tk - Tq); wherever b lies in that
    sequence. The preprocess kernel's delta is sum_d o * do - dlse."""
    T, H, block = 150, 3, ta.INTERPRET_C_BLOCK
    off, cu = {"aligned": (0, None), "tq<tk": (45, None), "varlen": (0, [0, 7, 8, 100, 150])}[case]
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    B, Dv = (2 if cu is None else 1), 24
    c = torch.randn(B, H, T, dtype=torch.float64).mul(3).cumsum(-1) - 1e5
    lse, dlse = torch.randn(B, H, T - off) * 5, torch.randn(B, H, T - off)
    o, do = torch.randn(B, T - off, H, Dv), torch.randn(B, T - off, H, Dv)
    crk = ta._relative_c(c, cu, block)
    delta, crq = ta._bwd_preprocess(o, do, dlse, lse, c, cu, block)
    torch.testing.assert_close(delta, (o * do).sum(-1).transpose(1, 2) - dlse, rtol=1e-5, atol=1e-5)
    bounds = [0, T] if cu is None else cu.tolist()
    checked = 0
    for s, e in zip(bounds[:-1], bounds[1:]):
        for p in range(s, e):
            end, first = s + ((p - s) // block + 1) * block, s + off + (p - s - off) // block * block
            if s <= end < e:
                expected = ((c[..., p] - c[..., end]) * math.log2(math.e)).float()
                torch.testing.assert_close(crk[..., p], expected, rtol=1e-6, atol=0)
                checked += 1
            if s <= first < e and p >= s + off:
                expected = ((c[..., p] - c[..., first]) * math.log2(math.e)).float() \
                    - lse[..., p - off] * math.log2(math.e)
                torch.testing.assert_close(crq[..., p], expected, rtol=1e-6, atol=1e-5)
                checked += 1
    assert checked > T


def test_loop_tiles_fit_in_c_rel_blocks():
    """An unmasked tile adds c_rel of one C_BLOCK-long block to one per-tile difference (_c_tile): every loop's tile
    (the forward's and dQ's key tiles, dK/dV's query tiles) must divide the block, on the GPU and the CPU."""
    tiles = [(ta.C_BLOCK, t[1]) for ts in ta._FWD_TILES.values() for t in ts]
    tiles += [(ta.C_BLOCK, t[0]) for ts in ta._DKDV_TILES.values() for t in ts]
    tiles += [(ta.C_BLOCK, t[1]) for ts in ta._DQ_TILES.values() for t in ts]
    tiles += [(ta.INTERPRET_C_BLOCK, ta.INTERPRET_TILE)]
    assert all(block % tile == 0 for block, tile in tiles), tiles


@pytest.mark.parametrize("name", ["causal", "tq<tk", "varlen", "window"])
@pytest.mark.parametrize("prune", [False, True])
def test_gate_precision_across_hard_resets(name, prune):
    """Gates that close hard (log f = -1e4) in the middle of c_rel's blocks. The loops add c_rel (fp32 offsets from a
    block's end or start) to one fp64 difference per tile; a block position on the far side of a reset from the tile
    would cancel two terms of 1e4 into logits off by ulp(1e4) ~ 1e-3. The resets sit at tile starts (the kernels'
    references), where the fp32 differences to those references are exact."""
    T, Tq, cu, window, resets = 110, 110, None, None, [16, 48, 80]
    if name == "tq<tk":
        Tq = 62  # query tiles start at key position 48 + 16 m, and their c_rel blocks at 48 + 32 m
    elif name == "varlen":
        cu, resets = torch.tensor([0, 3, 60, 110], dtype=torch.int32), [19, 51, 76, 108]  # tiles start at 3 + 16 m...
    elif name == "window":
        window = 40
    assert ta.INTERPRET_TILE == 16 and ta.INTERPRET_C_BLOCK == 32
    q, k, v, _ = _inputs(1, Tq, T, 2, 2, 16, 16)
    lf = F.logsigmoid(torch.randn(1, T, 2) + 3.0)
    lf[:, resets] = -1.0e4
    inputs, seed, kwargs = (q, k, v, lf.requires_grad_()), int(torch.randint(1 << 30, ())), dict(cu_seqlens=cu,
                                                                                                window=window)
    # with ACP the resets' tiles carry no mass: nothing changes, but the PRUNE kernels' sums run
    out = _run(*inputs, seed=seed, prune=prune, **kwargs)
    _assert_close(out, _run(*inputs, seed=seed, reference=True, **kwargs), rel=2e-5)



@pytest.mark.parametrize("reset", [-1.0e12, torch.finfo(torch.float32).min], ids=["-1e12", "fp32-min"])
@pytest.mark.parametrize("name", ["causal", "varlen"])
@pytest.mark.parametrize("prune", [False, True])
def test_gates_that_close_harder_than_the_floor_are_exact(reset, name, prune):
    """A finite gate far below -1e4 (a caller's "closed" sentinel, or logsigmoid of a huge negative) passes the gate
    check and must close the gate: no key before it is seen, as if a sequence started there. An fp64 c of 1e12 keeps
    its differences only to ~1e-4 (fp32's min: not at all), so the oracle is the reference cut into those sequences,
    where a sequence's first gate is never used: there it is 0 (so is its gradient, as exp(-1e12) makes it). Resets sit
    at tile starts, where -1e4 is exact."""
    T, cu, resets = 110, [0, 110], [16, 48, 80]
    if name == "varlen":
        cu, resets = [0, 3, 60, 110], [19, 51, 76, 108]
    q, k, v, _ = _inputs(1, T, T, 2, 2, 16, 16)
    lf = F.logsigmoid(torch.randn(1, T, 2) + 3.0)
    lf[:, resets] = reset
    inputs, seed = (q, k, v, lf.requires_grad_()), int(torch.randint(1 << 30, ()))
    cu_seqlens = None if name == "causal" else torch.tensor(cu, dtype=torch.int32)
    out = _run(*inputs, seed=seed, prune=prune, cu_seqlens=cu_seqlens)
    cut = torch.tensor(sorted(set(cu + resets)), dtype=torch.int32)
    opened = lf.detach().clone()
    opened[:, resets] = 0.0
    _assert_close(out, _run(q, k, v, opened, seed=seed, reference=True, cu_seqlens=cut), rel=2e-5)


def _skipped_tiles(c, delta, cu_seqlens, tile):
    """[B, H, T, T] bool: entries of the tile x tile blocks (aligned to each sequence's start) that ACP skips:
    left of the query block, and whose largest decay c[first query] - c[last key] is below delta.
    c: [B, H, T] gate cumsum; delta: [B or N, H]."""
    T = c.shape[-1]
    pos = torch.arange(T)
    if cu_seqlens is None:
        start, end, d = torch.zeros_like(pos), torch.full_like(pos, T), delta[:, :, None]  # [B, H, 1]
    else:
        seg = segment_ids(cu_seqlens, T)
        start, end, d = cu_seqlens.long()[seg], cu_seqlens.long()[seg + 1], delta[seg].T[None]  # [1, H, T]
    first = start + (pos - start) // tile * tile  # first row of each query's block
    last = torch.minimum(first + tile, end) - 1  # last key of each key's block
    largest = c[..., first, None] - c[..., None, last]
    return (largest < d[..., None]) & (last[None, :] < first[:, None])


def _amax(x: torch.Tensor) -> float:
    return x.detach().abs().max().item()


def _masked_reference(q, k, v, log_fgate, skip, seed, cu_seqlens=None, window=None):
    """fp64 Forgetting Attention with the ``skip`` entries [B, Hq, Tq, Tk] left out (and keys outside the
    ``window``): o, lse and the four gradients of the same loss as ``_run``."""
    q, k, v, log_fgate = (t.detach().double().requires_grad_() for t in (q, k, v, log_fgate))
    T, group = q.shape[1], q.shape[2] // k.shape[2]
    c = gate_cumsum(log_fgate, cu_seqlens).transpose(1, 2)
    logits = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(group, 2)) * q.shape[-1] ** -0.5
    logits = logits + c[..., :, None] - c[..., None, :]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if window is not None:
        allowed = allowed & ~torch.ones(T, T, dtype=torch.bool).tril(-window)
    if cu_seqlens is not None:
        seg = segment_ids(cu_seqlens, T)
        allowed = allowed & (seg[:, None] == seg[None, :])
    logits = logits.masked_fill(~allowed | skip, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    o = torch.einsum("bhij,bjhd->bihd", torch.exp(logits - lse[..., None]), v.repeat_interleave(group, 2))
    do, dlse = _cotangents(o, lse, seed)
    return (o, lse, *torch.autograd.grad((o * do).sum() + (lse * dlse).sum(), (q, k, v, log_fgate)))


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("bias", [1.0, -6.0])
def test_acp_skips_exactly_the_tiles_below_delta(varlen, bias):
    """With a (deliberately too small) logit bound the skipped tiles carry real mass: the forward and both
    backward loops must skip exactly the tiles whose largest decay is below delta, no more, no fewer. Gates of
    about -0.4 per token skip tiles a tile or more left of the diagonal; about -6 per token, also the tile next to
    it (which may share c_rel's block with the diagonal, see _key_range)."""
    B, T, Hq, Hk = (1, 70, 4, 2) if varlen else (2, 64, 2, 1)
    cu_seqlens = torch.tensor([0, 1, 40, 41, 70], dtype=torch.int32) if varlen else None
    q, k, v, _ = _inputs(B, T, T, Hq, Hk, 16, 16)
    q = (3 * q).detach().requires_grad_()  # logits spread over +-10: skipped tiles can hold most of a row
    log_fgate = F.logsigmoid(torch.randn(B, T, Hq) + bias).requires_grad_()
    kwargs = dict(cu_seqlens=cu_seqlens, logit_bound=0.0, tolerance=0.5)
    out = _run(q, k, v, log_fgate, seed=5, prune=True, **kwargs)
    delta = acp_threshold(q, k, scale=0.25, **kwargs).double()
    c = gate_cumsum(log_fgate.detach(), cu_seqlens).transpose(1, 2)
    skip = _skipped_tiles(c, delta, cu_seqlens, ta.INTERPRET_TILE)
    assert skip.any()
    # at -6 per token the gate gradient's reverse cumsum cancels terms of ~1e2 (fp32: up to ~2.3e-5 seen in 25 draws)
    _assert_close(out, _masked_reference(q, k, v, log_fgate, skip, seed=5, cu_seqlens=cu_seqlens),
                  rel=2e-5 if bias > 0 else 1e-4)
    unpruned = _run(q, k, v, log_fgate, seed=5, cu_seqlens=cu_seqlens, reference=True)
    assert (out[0].double() - unpruned[0]).abs().max() > 1e-3  # the skipped tiles did matter
    per_head, _ = acp_stats(q, k, log_fgate, block_m=ta.INTERPRET_TILE, block_n=ta.INTERPRET_TILE, **kwargs)
    expected = _acp_stats_brute_force(log_fgate.detach(), delta, cu_seqlens, ta.INTERPRET_TILE, ta.INTERPRET_TILE)
    torch.testing.assert_close(per_head.double(), expected, rtol=1e-6, atol=1e-6)  # the stats count these tiles
    assert per_head.sum() > 0


WINDOW_CASES = {
    # name: (B, Tq, Tk, Hq, Hk, D, cu_seqlens, window); tiles are 16: windows inside a tile and across several
    "w1": (2, 40, 40, 2, 1, 16, None, 1),
    "w5-gqa2": (1, 40, 40, 4, 2, 16, None, 5),
    "w20-tq<tk": (2, 21, 50, 2, 1, 32, None, 20),
    "w9-varlen": (1, 58, 58, 2, 1, 16, [0, 1, 18, 19, 20, 57, 58], 9),
    "w>=seqlen-varlen": (1, 58, 58, 2, 1, 16, [0, 1, 18, 19, 20, 57, 58], 40),  # wider than every sequence
    "w>=T": (1, 40, 40, 2, 2, 16, None, 64),
}


@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_sliding_window_matches_fp64_reference(name):
    B, Tq, Tk, Hq, Hk, D, cu, window = WINDOW_CASES[name]
    kwargs = dict(cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32), window=window)
    inputs = _inputs(B, Tq, Tk, Hq, Hk, D, D)
    seed = int(torch.randint(1 << 30, ()))
    out, ref = _run(*inputs, seed=seed, **kwargs), _run(*inputs, seed=seed, reference=True, **kwargs)
    if window > 1:
        _assert_close(out, ref, rel=2e-5)
        return
    # Every query sees only itself: o_i = v_i, and the exact gate gradient is 0 (c_i - c_i), which the kernels
    # leave as the fp32 cancellation of rowsum(dS) against colsum(dS), summed over T positions: compare absolutely.
    v = inputs[2].detach()
    torch.testing.assert_close(out[0], v.repeat_interleave(Hq // Hk, dim=2), rtol=0, atol=1e-6)
    _assert_close(out[:5], ref[:5], rel=2e-5)
    do, _ = _cotangents(out[0], out[1], seed)
    atol = 4 * Tk * 6e-8 * do.norm(dim=-1).max().item() * v.norm(dim=-1).max().item()
    assert ref[5].abs().max() == 0 and out[5].abs().max() < atol


def test_acp_and_window_skip_exactly_their_tiles():
    """A query block's first key tile is the later of ACP's and the window's: with a (deliberately too small)
    logit bound, the forward and both backward loops leave out exactly the ACP-skipped tiles and the keys
    outside the window. Head 0 forgets fast (ACP binds), head 1 slowly (the window binds)."""
    T, window = 64, 24
    q, k, v, _ = _inputs(1, T, T, 2, 2, 16, 16)
    q = (3 * q).detach().requires_grad_()
    log_fgate = F.logsigmoid(torch.randn(1, T, 2) + torch.tensor([1.0, 5.0])).requires_grad_()
    kwargs = dict(logit_bound=0.0, tolerance=0.5)
    out = _run(q, k, v, log_fgate, seed=6, prune=True, window=window, **kwargs)
    delta = acp_threshold(q, k, scale=0.25, window=window, **kwargs).double()  # N = the window's keys
    skip = _skipped_tiles(gate_cumsum(log_fgate.detach()).transpose(1, 2), delta, None, ta.INTERPRET_TILE)
    inside = ~torch.ones(T, T, dtype=torch.bool).tril(-window)
    assert (skip[0, 0] & inside).any() and not skip[0, 1].any()  # ACP cuts inside head 0's window only
    _assert_close(out, _masked_reference(q, k, v, log_fgate, skip, seed=6, window=window), rel=2e-5)


def test_acp_pruned_mass_below_tolerance():
    """With the data's logit bound, the mass of any row on the keys ACP may skip (decay below delta) stays
    below ``tolerance`` (checked on the fp64 reference probabilities), and the kernels' outputs and
    gradients stay within the error that mass implies."""
    tol = 1e-4
    B, T, H, D = 2, 96, 2, 16
    q, k, v, _ = _inputs(B, T, T, H, H, D, D)
    log_fgate = F.logsigmoid(torch.randn(B, T, H) - 2.0).requires_grad_()  # about -2.1 per token
    pruned = _run(q, k, v, log_fgate, seed=3, prune=True, tolerance=tol)
    ref = _run(q, k, v, log_fgate, seed=3, reference=True)
    _, overall = acp_stats(q, k, log_fgate, tolerance=tol, block_m=ta.INTERPRET_TILE, block_n=ta.INTERPRET_TILE)
    assert overall > 0.3
    scale = D**-0.5
    delta = acp_threshold(q, k, scale=scale, tolerance=tol).double()  # [B, H]
    c = gate_cumsum(log_fgate.detach()).transpose(1, 2)  # [B, H, T]
    decay = c[..., :, None] - c[..., None, :]
    logits = scale * torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) + decay
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)
    mass = (p * ((decay < delta[:, :, None, None]) & causal)).sum(-1).max().item()
    assert 0 < mass < tol
    # Dropping mass mu from a row moves its probabilities by at most 2 mu (L1): o by 2 mu max|v|; dS by
    # 4 mu (|dP| + |dlse|) with |dP_ij| <= |do_i| |v_j|; the key-side gradients add up to T rows of that.
    do, dlse = _cotangents(pruned[0], pruned[1], seed=3)
    ds = 4 * mass * (do.norm(dim=-1).max().item() * v.detach().norm(dim=-1).max().item() + _amax(dlse))
    bounds = {
        "o": 2 * mass * _amax(v), "lse": 2 * mass, "dq": ds * scale * _amax(k), "dk": T * ds * scale * _amax(q),
        "dv": T * 2 * mass * _amax(do), "dlog_fgate": T * ds,
    }
    for name, a, e in zip(NAMES, pruned, ref):
        err, rounding = (a.double() - e).abs().max().item(), 2e-5 * max(1.0, _amax(e))  # + fp32 rounding
        assert err < bounds[name] + rounding, f"{name}: {err:.1e} above the implied {bounds[name]:.1e}"


@pytest.mark.parametrize("prune", [False, True])
def test_backward_is_deterministic(prune):
    cu_seqlens = torch.tensor([0, 23, 24, 60], dtype=torch.int32)
    inputs = _inputs(1, 60, 60, 4, 2, 32, 32)
    kwargs = dict(cu_seqlens=cu_seqlens, prune=prune)
    first, second = _run(*inputs, **kwargs), _run(*inputs, **kwargs)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def _acp_stats_brute_force(log_fgate, threshold, cu_seqlens, block_m, block_n):
    """Per head: skipped / total tiles, walking every (query block, key block) tile of every sequence."""
    c = gate_cumsum(log_fgate.double(), cu_seqlens)  # [B, T, H]
    B, T, H = c.shape
    bounds = [(0, T)] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    skipped, total = torch.zeros(H, dtype=torch.float64), torch.zeros(H, dtype=torch.float64)
    for b in range(B):
        for s, (start, end) in enumerate(bounds):
            row = b if cu_seqlens is None else s
            for m0 in range(start, end, block_m):
                m1 = min(m0 + block_m, end)
                for n0 in range(start, m1, block_n):
                    total += 1
                    n1 = min(n0 + block_n, end)
                    below = c[b, m0] - c[b, n1 - 1] < threshold[row].double()  # largest decay of the tile
                    skipped += below & (n1 - 1 < m0)  # the diagonal is always computed
    # the kernel skips a prefix; tiles past a kept one are never skipped (c is monotone)
    return skipped / total


@pytest.mark.parametrize("varlen", [False, True])
def test_acp_stats_counts_skipped_tiles(varlen):
    torch.manual_seed(0)
    T, H = 200, 3
    cu_seqlens = torch.tensor([0, 1, 77, 78, 200], dtype=torch.int32) if varlen else None
    B = 1 if varlen else 2
    q, k = torch.randn(B, T, H, 16), torch.randn(B, T, H, 16)
    log_fgate = F.logsigmoid(torch.randn(B, T, H) + torch.tensor([-1.0, 0.0, 6.0]))
    per_head, overall = acp_stats(q, k, log_fgate, cu_seqlens=cu_seqlens, tolerance=1e-3, block_m=32, block_n=16)
    threshold = acp_threshold(q, k, scale=0.25, cu_seqlens=cu_seqlens, tolerance=1e-3)
    expected = _acp_stats_brute_force(log_fgate, threshold, cu_seqlens, 32, 16)
    torch.testing.assert_close(per_head.double(), expected, rtol=1e-6, atol=1e-6)
    assert per_head[0] > per_head[1] > 0 and per_head[2] == 0  # slow gates prune nothing here
    assert 0 < overall < 1


@pytest.mark.parametrize("prune", [False, True])
def test_torch_compile_traces_the_kernels_as_one_graph(prune):
    """The kernels are custom ops: torch.compile(fullgraph=True) traces through them (no graph break, no
    re-tracing of the Triton code) and gives the eager output and gradients, which match the fp64 reference.
    The loss sums lse, whose gradient arrives as a stride-0 expanded tensor."""
    q, k, v, log_fgate = _inputs(2, 40, 40, 4, 2, 16, 16)

    def loss(q, k, v, log_fgate, attend=forgetting_attention, **kwargs):
        o, lse = attend(q, k, v, log_fgate, return_lse=True, **kwargs)
        return (o * o).sum() + lse.sum()

    inputs = (q, k, v, log_fgate)
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = compiled(*inputs, prune=prune)
    got_grads = torch.autograd.grad(got, inputs)
    want = loss(*inputs, prune=prune)
    want_grads = torch.autograd.grad(want, inputs)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)
    ref_inputs = tuple(t.detach().double().requires_grad_() for t in inputs)
    ref_grads = torch.autograd.grad(loss(*ref_inputs, attend=forgetting_attention_reference), ref_inputs)
    _assert_close((want.detach(), want.detach(), *want_grads), (want.detach().double(),) * 2 + ref_grads, 1e-4)


def test_custom_ops_pass_opcheck():
    """The fake (meta) kernels the compiler plans with give the real ops' shapes, dtypes and strides."""
    q, k, v, log_fgate = _inputs(2, 40, 40, 4, 2, 16, 16)
    cu = torch.tensor([0, 7, 40], dtype=torch.int32)
    utils = ("test_schema", "test_faketensor")
    for args in ((q, k, v, log_fgate, 0.25, None, None, None, None),
                 (q[:1], k[:1], v[:1], log_fgate[:1], 0.25, cu, 33, 9, None)):
        torch.library.opcheck(ta._fwd_op, args, test_utils=utils)
        o, lse, c, crk = ta._fwd_op(*args)
        torch.library.opcheck(ta._bwd_op, (torch.randn_like(o), torch.randn_like(lse), *args[:3], o, lse, c, crk,
                                           *args[4:]), test_utils=utils)


def test_kernels_compile_for_hopper_with_tensor_core_dots():
    """benchmarks/kernel_resources.py compiles every shipped d64 tile for sm_90a without a GPU (a subprocess: the
    kernels here are interpreted): each reports registers, spills and whether ptxas serialized its wgmma, its dots
    lower to Hopper's wgmma, and its tile loops (at least one per kernel, each with tensor-core instructions; ACP's
    binary searches are loops without) spill nothing, but for the dQ loops of a 128-row tile with 4 warps: that tile
    spills there (15 loads in the masked loop) and was faster than the tiles that do not (docs/benchmarks.md, kernel
    resources)."""
    root = Path(__file__).parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "kernel_resources.py"), "--head-dim", "64",
                          "--kernels", "triton"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if "warps" in line]
    expected = len(ta._FWD_TILES[64]) + 2 * len(ta._DKDV_TILES[64]) + 2 * len(ta._DQ_TILES[64])
    assert len(rows) == expected, out.stdout
    for row in rows:
        assert "registers" in row and "spill_stores" in row and "wgmma.mma_async" in row, row
        assert "mma.sync" not in row and "wgmma_serialized" in row, row
    names = [line.split(" warps")[0] for line in rows]
    kernels = out.stdout.split("warps")[1:]
    for name, kernel in zip(names, kernels):
        loops = re.findall(r"loop \d+: instructions (\d+), HGMMA (\d+), MUFU (\d+), LDL (\d+), STL (\d+)", kernel)
        tile_loops = [loop for loop in loops if int(loop[1]) > 0]
        assert tile_loops, kernel
        # a 128-row dQ tile spills in its loops with 4 warps (docs/benchmarks.md, kernel resources)
        if not (name.startswith("backward dQ") and " 128x" in name and kernel.startswith(" 4 ")):
            assert all(ldl == stl == "0" for *_, ldl, stl in tile_loops), name + kernel


def test_gradients_of_views_with_gaps():
    """k and v split from one fused projection along the head dim (views whose last dim is contiguous but which
    leave gaps): the backward writes each gradient with its input's strides, so it must not get a buffer laid out
    otherwise (it wrote out of bounds). Gradients equal the fp64 reference's."""
    q, _, _, log_fgate = _inputs(1, 37, 37, 4, 2, 16, 16)
    kv = torch.randn(1, 37, 2, 32, requires_grad=True)
    k, v = kv[..., :16], kv[..., 16:]
    do = torch.randn(1, 37, 4, 16)
    o = forgetting_attention(q, k, v, log_fgate)
    grads = torch.autograd.grad(o, (q, kv, log_fgate), do)
    ref_q, ref_kv, ref_f = (t.detach().double().requires_grad_() for t in (q, kv, log_fgate))
    ref = forgetting_attention_reference(ref_q, ref_kv[..., :16], ref_kv[..., 16:], ref_f)
    expected = torch.autograd.grad(ref, (ref_q, ref_kv, ref_f), do.double())
    for name, a, e in zip(("dq", "dkv", "dlog_fgate"), grads, expected):
        err = ((a.double() - e).norm() / e.norm()).item()
        assert err < 2e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("used", ["o", "lse"])
def test_gradients_when_one_output_is_unused(used):
    """A loss of o alone (no lse gradient reaches the backward) or of lse alone (no o gradient): the kernels' gradients
    match the fp64 reference's for that loss."""
    q, k, v, log_fgate = _inputs(1, 37, 37, 4, 2, 32, 32)
    grads = []
    for attend, inputs in ((forgetting_attention, (q, k, v, log_fgate)),
                           (forgetting_attention_reference,
                            tuple(t.detach().double().requires_grad_() for t in (q, k, v, log_fgate)))):
        o, lse = attend(*inputs, return_lse=True)
        out = o if used == "o" else lse
        w = torch.randn(out.shape, generator=torch.Generator(DEVICE).manual_seed(3), dtype=torch.float64)
        grads.append(torch.autograd.grad((out.double() * w).sum(), inputs, allow_unused=True))
    for name, a, e in zip(NAMES[2:], *grads):
        if e is None:  # lse does not depend on v
            assert a is None or not a.any(), name
            continue
        err = ((a.double() - e).norm() / e.norm()).item()
        assert err < 2e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("power", [1, 2])
def test_double_backward_raises_instead_of_dropping_the_second_order_term(power):
    """A gradient penalty differentiates the kernels' backward, which is not differentiable: its gradient came back
    without a graph, so a loss of o plus the penalty silently lost the penalty's dependence on the inputs. It must
    raise instead, with the first-order gradient unchanged, also under o.sum()'s constant incoming gradient."""
    q, k, v, log_fgate = _inputs(1, 20, 20, 2, 1, 16, 16)
    o = forgetting_attention(q, k, v, log_fgate)
    (dq,) = torch.autograd.grad(o.pow(power).sum(), q, create_graph=True)
    (want,) = torch.autograd.grad(forgetting_attention(q, k, v, log_fgate).pow(power).sum(), q)
    torch.testing.assert_close(dq, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="forgetting_attention: cannot differentiate twice"):
        (o.sum() + dq.square().sum()).backward()


def test_compiled_ops_double_backward_raises():
    """Under the compiler the op is the custom op foxlm::forgetting_attention_fwd, whose backward is a custom op with
    no autograd of its own: a second derivative through it raises (torch.library's error), even from o.sum()."""
    q, k, v, log_fgate = _inputs(1, 20, 20, 2, 1, 16, 16)
    o = torch.ops.foxlm.forgetting_attention_fwd(q, k, v, log_fgate, 0.25, None, None, None, None)[0]
    (dq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        dq.square().sum().backward()


@pytest.mark.parametrize("scale", [-1.0, 0.0])
def test_zero_or_negative_scale_matches_fp64_reference(scale):
    """A scale <= 0 is plain softmax attention: the kernels match the fp64 reference, with and without a gradient
    and with ACP (whose logit bound is |scale| * max|q| * max|k|)."""
    inputs = _inputs(1, 37, 37, 4, 2, 32, 32)
    _check(inputs, rel=2e-5, scale=scale)
    ref = forgetting_attention_reference(*(t.detach().double() for t in inputs), scale=scale)
    with torch.no_grad():
        for prune in (False, True):
            o = forgetting_attention(*inputs, scale=scale, prune=prune)
            assert ((o.double() - ref).norm() / ref.norm()).item() < 2e-5, f"prune={prune}"


def test_flash_attn_and_fla_conventions_on_the_kernels():
    """The kernels take what a port from flash_attn or fla passes: int64 cu_seqlens, the unbatched [total, H, D]
    layout, a bf16 log_fgate and window_size=(left, 0); against the fp64 reference on the same values."""
    q, k, v, log_fgate = (x[0].detach().requires_grad_() for x in _inputs(1, 50, 50, 4, 2, 16, 16))
    gate = log_fgate.detach().bfloat16().requires_grad_()
    cu = torch.tensor([0, 17, 50], dtype=torch.int64)
    o, lse = forgetting_attention(q, k, v, gate, cu_seqlens=cu, window_size=(20, 0), return_lse=True)
    assert o.shape == (50, 4, 16) and lse.shape == (4, 50)
    grads = torch.autograd.grad(o.sum(), (q, k, v, gate))
    assert grads[3].dtype == torch.bfloat16
    leaves = [x.detach().double()[None].requires_grad_() for x in (q, k, v, gate)]
    want, want_lse = forgetting_attention_reference(*leaves, cu_seqlens=cu.int(), window=21, return_lse=True)
    torch.testing.assert_close(o.double(), want[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse[0], rtol=2e-5, atol=2e-5)
    for got, ref in zip(grads, torch.autograd.grad(want.sum(), leaves)):
        torch.testing.assert_close(got.double(), ref[0].to(got.dtype).double(), rtol=2e-2, atol=2e-3)


def test_strided_cu_seqlens_are_read_as_their_values():
    """An int32 cu_seqlens view with a stride (every other element of a buffer) went to the kernels as it was; they
    read it with stride 1, so offsets came from the wrong elements and o and the gradients were garbage."""
    cu = torch.tensor([0, 7, 17, 7, 40, 7], dtype=torch.int32)[::2]
    assert not cu.is_contiguous()
    _check(_inputs(1, 40, 40, 2, 1, 16, 16), rel=2e-5, cu_seqlens=cu)

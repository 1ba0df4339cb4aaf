"""The Gluon forward (``gluon_fwd``, Hopper only): where dispatch sends a call, and, on the GPU it was tested on, its
outputs and the gradients through it (the Triton backward reads its o and lse) against the fp64 reference.

``triton_op.GLUON_TESTED`` names what this file passed on (architecture, Triton release, head dims, dtypes); run it
with ``pytest -m gpu`` on the device each time the kernel changes. Elsewhere the GPU tests skip, and dispatch keeps
the Triton forward, tested by test_triton.py.
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
import triton

from foxlm.ops import ACP, forgetting_attention
from foxlm.ops.forgetting_attention import triton_op as ta
from foxlm.ops.forgetting_attention.gate import gate_cumsum
from foxlm.ops.forgetting_attention.reference import forgetting_attention_reference

TESTED = ta.GLUON_TESTED["capability"], ta.GLUON_TESTED["triton"]


def _eligible(q, k, v, cu_seqlens=None, window=None, threshold=None, capability=TESTED[0], version=TESTED[1]):
    return ta._gluon_eligible(q, k, v, cu_seqlens, window, threshold, capability, version)


def test_dispatch_takes_only_the_tested_case():
    """The plain causal call at a tested head dim and dtype on the tested GPU and Triton goes to Gluon; any other
    GPU, Triton release, dtype, head dim, layout or feature keeps the Triton forward."""
    q = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16)
    k = v = torch.empty(2, 300, 2, 128, dtype=torch.bfloat16)
    assert _eligible(q, k, v) and _eligible(q.half(), k.half(), v.half())
    assert not _eligible(q, k, v, capability=None) and not _eligible(q, k, v, capability=(10, 0))
    assert not _eligible(q, k, v, version="3.7.0")
    assert not _eligible(q.float(), k.float(), v.float())
    assert not _eligible(q, k.half(), v)
    d64 = torch.empty(2, 300, 2, 64, dtype=torch.bfloat16)
    assert not _eligible(d64, d64, d64) and not _eligible(q, k, torch.empty(2, 300, 2, 64, dtype=torch.bfloat16))
    assert not _eligible(q[:, :200], k, v)  # Tq < Tk (also not contiguous)
    assert not _eligible(q, k, v, cu_seqlens=torch.tensor([0, 300], dtype=torch.int32))
    assert not _eligible(q, k, v, window=64) and not _eligible(q, k, v, threshold=torch.zeros(2, 4))
    assert not _eligible(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)  # strided view
    flat = torch.empty(2 * 300 * 4 * 128 + 1, dtype=torch.bfloat16)
    assert not _eligible(flat[1:].view(2, 300, 4, 128), k, v)  # not 16-byte aligned for TMA


def test_gluon_forward_switch(monkeypatch):
    q = k = v = torch.empty(1, 64, 2, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(ta, "GLUON_FORWARD", False)
    assert not _eligible(q, k, v)


@pytest.mark.skipif(triton.__version__ != TESTED[1] or triton.__version__ != ta.GLUON_BWD_TESTED["triton"],
                    reason=f"the Gluon kernels were tested with Triton {TESTED[1]}")
def test_gluon_kernels_compile_for_hopper_without_spills():
    """Offline (no GPU): the forward and the dK/dV (with ACP and without) compile for sm_90a at every head dim they
    have tiles for, their wgmma run asynchronously (ptxas did not serialize them), their tile loops spill nothing,
    and their partitions trade registers (producer 24, consumer warpgroups 240)."""
    from foxlm.ops.forgetting_attention import gluon_bwd, gluon_fwd  # Gluon itself imports on the CPU

    root = Path(__file__).parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    for d in sorted(set(gluon_fwd.TILES) | set(gluon_bwd.TILES)):
        out = subprocess.run([sys.executable, str(root / "benchmarks" / "kernel_resources.py"), "--head-dim", str(d),
                              "--kernels", "gluon"], capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        kernels = re.split(r"\n(?=gluon )", out.stdout)[1:]
        expected = (["gluon forward"] if d in gluon_fwd.TILES else []) + ["gluon dK/dV"] * 2 * (d in gluon_bwd.TILES)
        assert [x.split(" ", 2)[0] + " " + x.split(" ", 2)[1].rstrip(",") for x in kernels] == expected, out.stdout
        for kernel in kernels:
            head, *loops = kernel.splitlines()
            assert "spill_stores 0, spill_loads 0" in head and "wgmma_serialized False" in head, head
            budgets = re.search(r"setmaxnreg \[([\d, ]+)\]", head).group(1).split(", ")
            assert {"24", "240"} <= set(budgets), head
            tile_loops = [m for m in (re.search(r"HGMMA (\d+), MUFU \d+, LDL (\d+), STL (\d+)", x) for x in loops)
                          if m and int(m.group(1))]
            assert tile_loops and all(m.group(2) == m.group(3) == "0" for m in tile_loops), kernel


gpu_tested = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != TESTED[0] or triton.__version__ != TESTED[1],
    reason=f"the Gluon forward runs on sm_{TESTED[0][0]}{TESTED[0][1]} with Triton {TESTED[1]}")

NAMES = ("o", "lse", "dq", "dk", "dv", "dlog_fgate")


@pytest.mark.gpu
@pytest.mark.triton  # the op on its kernels (conftest's backend), not the PyTorch path
@gpu_tested
@pytest.mark.parametrize("B, T, Hq, Hk, dtype", [
    (2, 1000, 4, 2, torch.bfloat16),  # GQA, T not a multiple of the 128-query block
    (1, 1034, 2, 2, torch.float16),  # the last block's second warpgroup past T: it frees the tiles unread
    (2, 333, 2, 1, torch.bfloat16),
    (1, 17, 2, 2, torch.bfloat16),  # shorter than one tile
])
def test_gluon_forward_matches_fp64_reference(B, T, Hq, Hk, dtype):
    """Outputs and all four gradients (o and lse from Gluon, the backward Triton's) against fp64, to the bf16/fp16
    tolerances the Triton kernels meet (test_triton.py); the op's output is the Gluon kernel's, bit for bit."""
    torch.manual_seed(T)
    D = 128
    q = torch.randn(B, T, Hq, D, device="cuda").to(dtype).requires_grad_()
    k = torch.randn(B, T, Hk, D, device="cuda").to(dtype).requires_grad_()
    v = torch.randn(B, T, Hk, D, device="cuda").to(dtype).requires_grad_()
    log_fgate = F.logsigmoid(2 * torch.randn(B, T, Hq, device="cuda") + 2).requires_grad_()
    assert _eligible(q, k, v, capability=torch.cuda.get_device_capability(), version=triton.__version__)
    o, lse = forgetting_attention(q, k, v, log_fgate, return_lse=True)
    from foxlm.ops.forgetting_attention.gluon_fwd import gluon_forward

    c = gate_cumsum(log_fgate.detach()).transpose(1, 2)
    direct = gluon_forward(q.detach(), k.detach(), v.detach(), c, D ** -0.5, ta._head_group(B * Hq, T, q, v))
    assert torch.equal(o, direct[0]) and torch.equal(lse, direct[1])
    g = torch.Generator("cuda").manual_seed(1)
    do = torch.randn(o.shape, generator=g, device="cuda", dtype=torch.float64).to(dtype).double()
    dlse = torch.randn(lse.shape, generator=g, device="cuda", dtype=torch.float64)
    out = (o, lse, *torch.autograd.grad((o.double() * do).sum() + (lse.double() * dlse).sum(), (q, k, v, log_fgate)))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, log_fgate)]
    ro, rlse = forgetting_attention_reference(*ref_in, return_lse=True)
    ref = (ro, rlse, *torch.autograd.grad((ro * do).sum() + (rlse * dlse).sum(), ref_in))
    bounds = dict(o=5e-3, lse=1e-4, dq=5e-3, dk=5e-3, dv=5e-3, dlog_fgate=5e-3)
    for name, a, e in zip(NAMES, out, ref):
        assert torch.isfinite(a).all(), name
        err = ((a.double() - e).norm() / e.norm()).item()
        assert err < bounds[name], f"{name}: relative error {err:.2e} >= {bounds[name]:.0e}"


@pytest.mark.gpu
@pytest.mark.triton
@gpu_tested
def test_other_calls_keep_the_triton_forward():
    """Window, ACP, packed sequences, Tq < Tk, d64 and fp32 on the GPU: not for Gluon, and still right."""
    cap, version = torch.cuda.get_device_capability(), triton.__version__
    q, k, v = (torch.randn(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    log_fgate = F.logsigmoid(torch.randn(1, 256, 2, device="cuda") + 2)
    assert _eligible(q, k, v, capability=cap, version=version)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
    for kwargs, eligible in ((dict(window=64), dict(window=64)), (dict(cu_seqlens=cu), dict(cu_seqlens=cu)),
                             (dict(prune=ACP()), dict(threshold=torch.zeros(1, 2, device="cuda")))):
        assert not _eligible(q, k, v, capability=cap, version=version, **eligible)
        o = forgetting_attention(q, k, v, log_fgate, **kwargs)
        ref = forgetting_attention_reference(q.double(), k.double(), v.double(), log_fgate.double(),
                                             **{key: val for key, val in kwargs.items() if key != "prune"})
        assert ((o.double() - ref).norm() / ref.norm()).item() < 5e-3, kwargs
    assert not _eligible(q[:, 128:], k, v, capability=cap, version=version)
    assert not _eligible(q[..., :64].contiguous(), k[..., :64].contiguous(), v[..., :64].contiguous(),
                         capability=cap, version=version)
    assert not _eligible(q.float(), k.float(), v.float(), capability=cap, version=version)


# ----------------------------------------------------------------------------------------------- the Gluon dK/dV
BWD_TESTED = ta.GLUON_BWD_TESTED["capability"], ta.GLUON_BWD_TESTED["triton"]


def _bwd_eligible(q, k, v, do=None, cu_seqlens=None, window=None, capability=BWD_TESTED[0], version=BWD_TESTED[1]):
    return ta._gluon_bwd_eligible(q, k, v, q if do is None else do, cu_seqlens, window, capability, version)


def test_backward_dispatch_takes_only_the_tested_case(monkeypatch):
    """Tq == Tk without packed sequences or a window (ACP or not) at a tested head dim and dtype, on the tested GPU
    and Triton, with contiguous 16-byte-aligned q, k, v and dO, goes to the Gluon dK/dV; anything else keeps the
    Triton kernel."""
    for d in ta.GLUON_BWD_TESTED["head_dims"]:
        q = torch.empty(2, 300, 4, d, dtype=torch.bfloat16)
        k = v = torch.empty(2, 300, 2, d, dtype=torch.bfloat16)
        assert _bwd_eligible(q, k, v) and _bwd_eligible(q.half(), k.half(), v.half())
        assert not _bwd_eligible(q, k, v, capability=None) and not _bwd_eligible(q, k, v, capability=(10, 0))
        assert not _bwd_eligible(q, k, v, version="3.7.0")
        assert not _bwd_eligible(q.float(), k.float(), v.float()) and not _bwd_eligible(q, k.half(), v)
        assert not _bwd_eligible(q[:, :200], k, v, do=q[:, :200])  # Tq < Tk
        assert not _bwd_eligible(q, k, v, cu_seqlens=torch.tensor([0, 300], dtype=torch.int32))
        assert not _bwd_eligible(q, k, v, window=64)
        assert not _bwd_eligible(q, k, v, do=q.transpose(1, 2).contiguous().transpose(1, 2))  # dO strided
        flat = torch.empty(2 * 300 * 4 * d + 1, dtype=torch.bfloat16)
        assert not _bwd_eligible(q, k, v, do=flat[1:].view(2, 300, 4, d))  # dO not 16-byte aligned for TMA
        monkeypatch.setattr(ta, "GLUON_BACKWARD", False)
        assert not _bwd_eligible(q, k, v)
        monkeypatch.undo()
    odd = torch.empty(2, 300, 2, 96, dtype=torch.bfloat16)
    assert 96 not in ta.GLUON_BWD_TESTED["head_dims"] and not _bwd_eligible(odd, odd, odd)


gpu_bwd_tested = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != BWD_TESTED[0]
    or triton.__version__ != BWD_TESTED[1],
    reason=f"the Gluon dK/dV runs on sm_{BWD_TESTED[0][0]}{BWD_TESTED[0][1]} with Triton {BWD_TESTED[1]}")


def _spy_gluon_dkdv(monkeypatch) -> list:
    from foxlm.ops.forgetting_attention import gluon_bwd

    calls, real = [], gluon_bwd.gluon_dkdv

    def spy(*args, **kwargs):
        calls.append(args[8] is not None)  # whether ACP's threshold came with the call
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon_bwd, "gluon_dkdv", spy)
    return calls


def _grads_and_reference(B, T, Hq, Hk, D, dtype, prune, seed):
    torch.manual_seed(seed)
    q = torch.randn(B, T, Hq, D, device="cuda").to(dtype).requires_grad_()
    k = torch.randn(B, T, Hk, D, device="cuda").to(dtype).requires_grad_()
    v = torch.randn(B, T, Hk, D, device="cuda").to(dtype).requires_grad_()
    # the attention benchmark's gate profile (decay times from 16 to 16,384 tokens across heads): ACP skips the short
    # heads' far tiles and keeps the long ones'
    tau = torch.logspace(math.log10(16), math.log10(16384), Hq, dtype=torch.float64, device="cuda")
    bias = -torch.log(torch.expm1(1.0 / tau)).float()
    log_fgate = F.logsigmoid(bias + 0.5 * torch.randn(B, T, Hq, device="cuda")).requires_grad_()
    o = forgetting_attention(q, k, v, log_fgate, prune=ACP() if prune else None)
    do = torch.randn(o.shape, device="cuda", dtype=torch.float64).to(dtype).double()
    grads = torch.autograd.grad((o.double() * do).sum(), (q, k, v, log_fgate))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, log_fgate)]
    ro = forgetting_attention_reference(*ref_in)
    ref = torch.autograd.grad((ro * do).sum(), ref_in)
    return (q, k, v, log_fgate, do, prune), grads, ref


@pytest.mark.gpu
@pytest.mark.triton
@gpu_bwd_tested
@pytest.mark.parametrize("D", sorted(ta.GLUON_BWD_TESTED["head_dims"]))
@pytest.mark.parametrize("B, T, Hq, Hk, dtype, prune", [
    (2, 1000, 4, 2, torch.bfloat16, False),  # GQA, T not a multiple of the 128-key block
    (2, 1000, 4, 2, torch.bfloat16, True),  # ACP
    (1, 2048, 4, 4, torch.float16, True),
    (1, 1034, 2, 2, torch.float16, False),  # the last block's second warpgroup past T
    (2, 333, 4, 1, torch.bfloat16, False),  # a group of 4 query heads
    (1, 17, 2, 2, torch.bfloat16, False),  # shorter than one tile
])
def test_gluon_backward_matches_fp64_reference(monkeypatch, D, B, T, Hq, Hk, dtype, prune):
    """All four gradients with the Gluon dK/dV (dQ and the row sums from the Triton dQ kernel) against fp64, to the
    bounds the Triton backward meets (test_triton.py; the gate gradient to the peers' accuracy, see
    docs/benchmarks.md), with and without ACP; the backward took the Gluon kernel, and is deterministic."""
    calls = _spy_gluon_dkdv(monkeypatch)
    (q, k, v, log_fgate, do, _), grads, ref = _grads_and_reference(B, T, Hq, Hk, D, dtype, prune, seed=T + D)
    assert calls == [prune], calls
    for name, a, e in zip(NAMES[2:], grads, ref):
        assert torch.isfinite(a).all(), name
        err = ((a.double() - e).norm() / e.norm()).item()
        assert err < 5e-3, f"{name}: relative error {err:.2e} >= 5e-3"
    o = forgetting_attention(q, k, v, log_fgate, prune=ACP() if prune else None)
    again = torch.autograd.grad((o.double() * do).sum(), (q, k, v, log_fgate))
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.gpu
@pytest.mark.triton
@gpu_bwd_tested
@pytest.mark.parametrize("D", sorted(ta.GLUON_BWD_TESTED["head_dims"]))
def test_gluon_and_triton_dkdv_agree(monkeypatch, D):
    """The Gluon and Triton dK/dV kernels on the same inputs (GLUON_BACKWARD off: the Triton twin), with ACP: dQ is
    the same kernel's, dK and dV agree to a few roundings of their accumulation order, and the gate gradient is as
    accurate against fp64 (the kernels' ACP tiles differ, so their skipped mass does)."""
    (q, k, v, log_fgate, do, prune), gluon, ref = _grads_and_reference(2, 1500, 4, 2, D, torch.bfloat16, True, 7)
    monkeypatch.setattr(ta, "GLUON_BACKWARD", False)
    calls = _spy_gluon_dkdv(monkeypatch)
    o = forgetting_attention(q, k, v, log_fgate, prune=ACP())
    triton_grads = torch.autograd.grad((o.double() * do).sum(), (q, k, v, log_fgate))
    assert calls == []
    assert torch.equal(gluon[0], triton_grads[0])
    for name, a, b in zip(("dk", "dv"), gluon[1:3], triton_grads[1:3]):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 1e-3, name
    err_g, err_t = (((g.double() - ref[3]).norm() / ref[3].norm()).item() for g in (gluon[3], triton_grads[3]))
    assert err_g < 5e-3 and err_t < 5e-3, (err_g, err_t)


@pytest.mark.gpu
@pytest.mark.triton
@gpu_bwd_tested
def test_other_backwards_keep_the_triton_dkdv(monkeypatch):
    """Window, packed sequences and Tq < Tk on the GPU: not for the Gluon dK/dV, and still right."""
    calls = _spy_gluon_dkdv(monkeypatch)
    D = ta.GLUON_BWD_TESTED["head_dims"][0]
    q, k, v = (torch.randn(1, 256, 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    log_fgate = F.logsigmoid(torch.randn(1, 256, 2, device="cuda") + 2).requires_grad_()
    cu = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
    for kwargs in (dict(window=64), dict(cu_seqlens=cu), dict(tq=128)):
        tq = kwargs.pop("tq", 256)
        o = forgetting_attention(q[:, 256 - tq:], k, v, log_fgate, **kwargs)
        do = torch.randn(o.shape, device="cuda", dtype=torch.float64).to(o.dtype).double()
        grads = torch.autograd.grad((o.double() * do).sum(), (q, k, v, log_fgate))
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, log_fgate)]
        ro = forgetting_attention_reference(ref_in[0][:, 256 - tq:], *ref_in[1:], **kwargs)
        ref = torch.autograd.grad((ro * do).sum(), ref_in)
        for name, a, e in zip(NAMES[2:], grads, ref):
            err = ((a.double() - e).norm() / e.norm()).item()
            assert err < 5e-3, f"{kwargs or tq}: {name}: relative error {err:.2e}"
    assert calls == []

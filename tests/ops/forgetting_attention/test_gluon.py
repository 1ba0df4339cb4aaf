"""The Gluon forward (``gluon_fwd``, Hopper only): where dispatch sends a call, and, on the GPU it was tested on, its
outputs and the gradients through it (the Triton backward reads its o and lse) against the fp64 reference.

``triton_op.GLUON_TESTED`` names what this file passed on (architecture, Triton release, head dims, dtypes); run it
with ``pytest -m gpu`` on the device each time the kernel changes. Elsewhere the GPU tests skip, and dispatch keeps
the Triton forward, tested by test_triton.py.
"""

from __future__ import annotations

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


@pytest.mark.skipif(triton.__version__ != TESTED[1], reason=f"the Gluon forward was tested with Triton {TESTED[1]}")
def test_gluon_forward_compiles_for_hopper_without_spills():
    """Offline (no GPU): the kernel compiles for sm_90a at every head dim it has tiles for, its wgmma run
    asynchronously (ptxas did not serialize them), its tile loops spill nothing, and its partitions trade registers
    (producer 24, consumer warpgroups 240)."""
    from foxlm.ops.forgetting_attention.gluon_fwd import TILES  # Gluon itself imports on the CPU

    root = Path(__file__).parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    for d in TILES:
        out = subprocess.run([sys.executable, str(root / "benchmarks" / "kernel_resources.py"), "--head-dim", str(d),
                              "--kernels", "gluon"], capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        head, *loops = [line for line in out.stdout.splitlines() if "gluon forward" in line or "loop" in line]
        assert "spill_stores 0, spill_loads 0" in head and "wgmma_serialized False" in head, head
        budgets = re.search(r"setmaxnreg \[([\d, ]+)\]", head).group(1).split(", ")
        assert {"24", "240"} <= set(budgets), head
        tile_loops = [m for m in (re.search(r"HGMMA (\d+), MUFU \d+, LDL (\d+), STL (\d+)", x) for x in loops)
                      if m and int(m.group(1))]
        assert tile_loops and all(m.group(2) == m.group(3) == "0" for m in tile_loops), out.stdout


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

"""The gate gradient from padding channels (benchmarks/padding_channels.py): d(log_fgate) out of the extra channels of
dQ and dK alone, as a GPU kernel without a custom epilogue would give it, against the fp64 reference.

q' = [q, alpha, 0] and k' = [k, 0, beta] leave the logits unchanged; dK's first extra channel is scale alpha
colsum(dS), dQ's second scale beta rowsum(dS). The kernels run in Triton's interpreter with 16 x 16 tiles (head dim 48
padded to 50, inside the kernels' 64-wide tile); fresh random inputs every run.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from foxlm.ops import forgetting_attention, forgetting_attention_reference
from foxlm.ops.forgetting_attention import triton_op as ta

_spec = importlib.util.spec_from_file_location("padding_channels",
                                               Path(__file__).parents[3] / "benchmarks" / "padding_channels.py")
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)

TARGET = 5e-3  # the gate-gradient issue's bound for bf16 against fp64 (relative, Frobenius)
interpreter_only = pytest.mark.skipif(not ta._INTERPRETED, reason="fp32 dK from bf16 inputs: Triton's interpreter only")


EXACT_CASES = {  # name: (Hq, Hk, Tq, scale) with Tk = 40
    "plain": (2, 2, 40, None),
    "gqa2": (4, 2, 40, None),
    "tq<tk": (2, 1, 17, None),
    "negative-scale": (2, 1, 40, -0.3),
}


def _with_lse(fn, dlse: torch.Tensor):
    """An ``Attention`` over ``fn`` (forgetting_attention or the reference) for the loss <o, do> + <lse, dlse>, whose
    row sums of dS are dlse, not zero: the row channel then carries a gradient of its own. -> o, dq, dk, dv,
    d(log_fgate)."""
    def run(q, k, v, log_fgate, do, scale):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, log_fgate)]
        o, lse = fn(*leaves, scale=scale, return_lse=True)
        return (o.detach(), *torch.autograd.grad((o * do).sum() + (lse * dlse).sum(), leaves))
    return run


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_channels_give_the_gate_gradient_exactly(case):
    """In fp64 (the PyTorch path) the channels' row and column sums are the gate gradient to rounding, on every
    layout the padding covers: GQA (one column channel per head of a group), Tq < Tk, any nonzero scale. The loss
    takes lse too, so that the row sums are not zero and the row channel is checked as well."""
    Hq, Hk, Tq, scale = EXACT_CASES[case]
    q, k, v, log_fgate, do = (t.double() for t in pc.inputs(2, 40, Hq, Hk, 24, seed=int(torch.randint(1 << 30, ()))))
    q, do = q[:, -Tq:], do[:, -Tq:]
    dlse = torch.randn(2, Hq, Tq, dtype=torch.float64)
    expected = _with_lse(forgetting_attention_reference, dlse)(q, k, v, log_fgate, do, scale)
    attention = _with_lse(forgetting_attention, dlse)
    out = pc.gate_gradient_from_padding(q, k, v, log_fgate, do, lambda *x: attention(*x)[:4], scale=scale, alpha=0.5,
                                        beta=4.0)
    for name, a, e in zip(("o", "dq", "dk", "dv", "dlog_fgate"), out, expected):
        assert pc.relative_error(a, e) < 1e-6, name  # the path returns lse in fp32: ~1e-8 through dlse
    cols = pc.gate_gradient_from_padding(q, k, v, log_fgate, do, lambda *x: attention(*x)[:4], scale=scale,
                                         rows=False)[-1]
    assert pc.relative_error(cols, expected[-1]) > 0.1  # the row channel is needed


def test_bad_constants_and_scale_are_refused():
    q, k, v, log_fgate, do = pc.inputs(1, 8, 1, 1, 16, seed=0)
    attention = pc.autograd_attention(forgetting_attention)
    with pytest.raises(ValueError, match="alpha: expected a nonzero value exact in torch.bfloat16"):
        pc.gate_gradient_from_padding(q, k, v, log_fgate, do, attention, alpha=1 / 3)
    with pytest.raises(ValueError, match="beta: expected a nonzero value"):
        pc.gate_gradient_from_padding(q, k, v, log_fgate, do, attention, beta=0.0)
    with pytest.raises(ValueError, match="scale: expected a nonzero scale"):
        pc.gate_gradient_from_padding(q, k, v, log_fgate, do, attention, scale=0.0)


@pytest.mark.triton
@interpreter_only
@pytest.mark.parametrize("prune", [False, True])
def test_kernel_gate_gradient_from_channels(prune):
    """foxlm's backward (plain, and ACP's with its sums on the tensor cores) at 256 tokens, bf16: the gate gradient
    from the channels reaches the target where dK keeps fp32, and misses it with the column sums alone (the old error:
    the row sums carry o's rounding) or with dK stored in bf16 as the kernel stores it (the reverse cumsum adds up
    the column channel's rounding)."""
    B, T, H, D = 1, 256, 2, 48
    scale = 1.0 / math.sqrt(D)
    x = pc.inputs(B, T, H, H, D)
    expected = pc.reference(*x)[-1]
    o32, dq, dk, dv32 = pc.kernel_attention(prune, fp32_dk=True)(*pc.pad(*x[:2]), *x[2:], scale)
    assert dk.dtype == torch.float32 and dq.dtype == torch.bfloat16
    both, cols = (pc.relative_error(pc.gate_gradient_from_channels(dq, dk, D, scale=scale, rows=r), expected)
                  for r in (True, False))
    assert both < TARGET, f"rows + columns, fp32 dK: {both:.2e}"
    assert cols > TARGET, f"columns only: {cols:.2e}"  # the test can fail: the old defect misses the target

    # The kernel as it is (bf16 dK), with alpha = 2^-6, beta = 2^6: the original channels bit for bit as without
    # padding. The bf16 column channel's rounding is random along the sequence (1.3e-2 median at 256 tokens, 5.5e-3
    # at best in 120 draws of a model of it), so the test asks for the ratio, not for a miss.
    plain = pc.kernel_attention(prune)(*x, scale)  # the same backward without the padding
    out = pc.gate_gradient_from_padding(*x, pc.kernel_attention(prune), alpha=2.0 ** -6, beta=2.0 ** 6)
    for name, a, e in zip(("o", "dq", "dk", "dv"), out, plain):
        assert torch.equal(a, e), name
    rounded = pc.relative_error(out[-1], expected)
    assert rounded > 1.5 * both, f"bf16 dK {rounded:.2e} against fp32 dK {both:.2e}"
    # alpha and beta change no bit (powers of two scale every rounding alike)
    assert torch.equal(out[-1], pc.gate_gradient_from_padding(*x, pc.kernel_attention(prune))[-1])
    # The fp32 dK run is the same kernel but for the interpreter's fp32 sums (their order follows k's dtype): its
    # original channels agree to bf16's last bit, far below bf16's error against fp64 (~3e-3).
    for name, a, e in zip(("o", "dq", "dk", "dv"), (o32, dq[..., :D], dk[..., :D].bfloat16(), dv32), plain):
        assert pc.relative_error(a, e.double()) < 3e-4, f"{name}, fp32 dK run"


def test_torch_path_outputs_unchanged_by_padding():
    """The PyTorch path (bf16 in, fp32 inside) on padded q and k: o, dq, dk, dv bitwise as without padding, and within
    bf16's rounding of the reference."""
    x = pc.inputs(1, 128, 2, 1, 48)
    plain = pc.autograd_attention(forgetting_attention)(*x, 1.0 / math.sqrt(48))
    out = pc.gate_gradient_from_padding(*x, pc.autograd_attention(forgetting_attention))
    expected = pc.reference(*x)
    for name, a, e, r in zip(("o", "dq", "dk", "dv"), out, plain, expected):
        assert torch.equal(a, e), name
        assert pc.relative_error(a, r) < TARGET, name

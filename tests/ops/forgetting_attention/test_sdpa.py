"""``attention_from_cumsum``: one block of queries against one block of keys, against the fp64 oracle, on ``device``
(on a GPU machine the CUDA half of context parallelism: its blocks take this path, never the Triton kernels)."""

import pytest
import torch
import torch.nn.functional as F

from foxlm.ops import forgetting_attention, forgetting_attention_reference, gate_cumsum
from foxlm.ops.forgetting_attention import sdpa as sdpa_path
from foxlm.ops.forgetting_attention.acp import acp_threshold
from foxlm.ops.forgetting_attention.sdpa import attention_from_cumsum


def _inputs(B, T, Hq, Hk, D, Dv, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, Hk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, Hk, Dv, generator=g, dtype=torch.float64)
    log_f = F.logsigmoid(2 * torch.randn(B, T, Hq, generator=g, dtype=torch.float64) + 1.0)
    return tuple(t.to(device) for t in (q, k, v, log_f))


@pytest.fixture
def small_chunks(monkeypatch):
    """Several query chunks per block, so the chunk loop is what gets tested."""
    monkeypatch.setattr(sdpa_path, "CHUNK_ROWS", 16)


@pytest.mark.parametrize("Hq,Hk", [(4, 4), (4, 2)])
def test_blocks_merged_by_lse_match_reference(small_chunks, Hq, Hk, device):
    """Queries [m, T) against keys [0, m) (q_offset >= Tk: all visible) and against keys [m, T) (causal), merged
    through their lse, are the oracle's rows [m, T): outputs and the gradients of q, k, v and log f (via c)."""
    B, T, m, D, Dv = 2, 45, 19, 16, 8
    q, k, v, log_f = (t.requires_grad_() for t in _inputs(B, T, Hq, Hk, D, Dv, seed=3, device=device))
    scale = D ** -0.5
    c = gate_cumsum(log_f) - 1234.5  # a common offset changes nothing
    o1, l1 = attention_from_cumsum(q[:, m:], k[:, :m], v[:, :m], c[:, m:], c[:, :m], scale=scale, q_offset=m)
    o2, l2, probs = attention_from_cumsum(q[:, m:], k[:, m:], v[:, m:], c[:, m:], c[:, m:], scale=scale,
                                          return_probs=True)
    lse = torch.logaddexp(l1.double(), l2.double())
    w1, w2 = (torch.exp(l.double() - lse).transpose(1, 2)[..., None] for l in (l1, l2))
    o = w1 * o1 + w2 * o2
    ro, rlse = forgetting_attention_reference(q, k, v, log_f, return_lse=True)
    torch.testing.assert_close(o, ro[:, m:], rtol=1e-6, atol=1e-6)  # the block lse is fp32
    torch.testing.assert_close(lse, rlse[:, :, m:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(probs.double().sum(-1), torch.ones_like(lse), rtol=1e-6, atol=1e-6)
    g = torch.Generator().manual_seed(4)
    do, dl = (torch.randn(t.shape, generator=g, dtype=t.dtype).to(device) for t in (o, lse))
    inputs = (q, k, v, log_f)
    got = torch.autograd.grad((o * do).sum() + (lse * dl).sum(), inputs)
    want = torch.autograd.grad((ro[:, m:] * do).sum() + (rlse[:, :, m:] * dl).sum(), inputs)
    for name, a, b in zip("q k v log_f".split(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_default_offset_window_and_threshold(small_chunks, device):
    """Tq < Tk with the default q_offset and a window, and packed sequences, are the oracle; a threshold is the
    op's ACP, and a row whose keys are all pruned returns lse -inf and o = 0."""
    q, k, v, log_f = _inputs(1, 40, 4, 2, 16, 16, seed=6, device=device)
    cu = torch.tensor([0, 7, 7, 31, 40], dtype=torch.int32, device=device)
    c = gate_cumsum(log_f)  # not restarted: only differences within a sequence matter
    o, _ = attention_from_cumsum(q, k, v, c, c, scale=0.25, cu_seqlens=cu)
    torch.testing.assert_close(o, forgetting_attention_reference(q, k, v, log_f, scale=0.25, cu_seqlens=cu),
                               rtol=1e-10, atol=1e-10)
    q, k, v, log_f = _inputs(2, 40, 4, 2, 16, 16, seed=5, device=device)
    c = gate_cumsum(log_f)
    o, _ = attention_from_cumsum(q[:, 25:], k, v, c[:, 25:], c, scale=0.25, window=9)
    ro = forgetting_attention_reference(q[:, 25:], k, v, log_f, scale=0.25, window=9)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-10)
    log_f = log_f * 8  # fast forgetting: ACP prunes most keys
    c = gate_cumsum(log_f)
    thr = acp_threshold(q, k, scale=0.25)
    o, _ = attention_from_cumsum(q, k, v, c, c, scale=0.25, threshold=thr)
    po = forgetting_attention(q, k, v, log_f, scale=0.25, prune=True)
    torch.testing.assert_close(o, po, rtol=1e-10, atol=1e-10)
    assert (o - forgetting_attention_reference(q, k, v, log_f, scale=0.25)).abs().max() > 0  # something was pruned
    o, lse = attention_from_cumsum(q[:, 10:12], k[:, :4], v[:, :4], c[:, 10:12], c[:, :4], scale=0.25, q_offset=4,
                                   threshold=torch.zeros(2, 4, device=device))  # delta 0: every remote key pruned
    assert bool((lse == float("-inf")).all()) and bool((o == 0).all())


def test_bad_arguments_are_named():
    q, k, v, log_f = _inputs(1, 8, 4, 2, 8, 8, seed=0)
    c = gate_cumsum(log_f)
    with pytest.raises(ValueError, match="c_q"):
        attention_from_cumsum(q, k, v, c[:, :4], c, scale=1.0)
    with pytest.raises(ValueError, match="q_offset"):
        attention_from_cumsum(q, k, v, c, c, scale=1.0, q_offset=-1)
    with pytest.raises(ValueError, match="threshold"):
        attention_from_cumsum(q, k, v, c, c, scale=1.0, threshold=torch.zeros(1, 3))

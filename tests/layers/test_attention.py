"""foxlm.layers: attention paths against the fp64 reference, token shift, gates, ACP bound, gradients."""

import pytest
import torch

from foxlm.layers import (
    ForgettingAttention,
    RMSNorm,
    RotaryEmbedding,
    Segments,
    TokenShift,
    alibi_slopes,
)
from foxlm.layers.attention import ACPConfig
from foxlm.ops import forgetting_attention_reference, sequence_attention, use_backend

F64 = torch.float64


def _qkvg(B=2, T=24, Hq=4, Hk=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=g, dtype=F64) for h in (Hq, Hk, Hk))
    log_fgate = torch.nn.functional.logsigmoid(2 + torch.randn(B, T, Hq, generator=g, dtype=F64))
    return q, k, v, log_fgate


def test_sequence_attention_paths_match_reference():
    q, k, v, log_fgate = _qkvg()
    scale = 0.3
    ref = forgetting_attention_reference(q, k, v, log_fgate, scale=scale)
    op, _ = sequence_attention(q, k, v, log_fgate, scale=scale)
    dense, probs = sequence_attention(q, k, v, log_fgate, scale=scale, return_probs=True)
    torch.testing.assert_close(op, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dense, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)), rtol=1e-6, atol=1e-6)
    assert probs.triu(1).abs().max() == 0  # causal
    # gate "none": SDPA equals the reference with zero gates
    sdpa, _ = sequence_attention(q, k, v, None, scale=scale)
    torch.testing.assert_close(sdpa, forgetting_attention_reference(q, k, v, torch.zeros_like(log_fgate), scale=scale))


@pytest.mark.parametrize("window", [1, 5, 64])
def test_sliding_window_matches_banded_reference(window):
    q, k, v, log_fgate = _qkvg(T=40)
    out, _ = sequence_attention(q, k, v, log_fgate, scale=0.25, window=window)
    ref = forgetting_attention_reference(q, k, v, log_fgate, scale=0.25, window=window)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_segments_from_cu_seqlens_and_mask():
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    s = Segments.from_cu_seqlens(cu, 8)
    assert s.starts[0].tolist() == [True, False, False, True, False, False, False, False]
    assert s.positions[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert s.cu_seqlens.tolist() == [0, 3, 8] and s.max_seqlen == 5
    m = Segments.from_mask(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))
    assert m.cu_seqlens.tolist() == [0, 2, 5, 8, 10, 15]
    assert m.positions[0].tolist() == [0, 1, 0, 1, 2] and m.ids[1].tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="attention_mask"):
        Segments.from_mask(torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        Segments.from_cu_seqlens(torch.tensor([0, 5, 3], dtype=torch.int32), 3)
    # an IndexError, a bad unpack or a torch.where dtype error before, naming nothing
    for bad in (torch.ones(5), torch.ones(2, 0), torch.ones(1, 2, 3)):
        with pytest.raises(ValueError, match="attention_mask: expected a \\[B, T\\] tensor with T >= 1"):
            Segments.from_mask(bad)
    for bad in (torch.zeros(2, 0, dtype=torch.bool), torch.zeros(5, dtype=torch.bool), torch.zeros(2, 3)):
        with pytest.raises(ValueError, match="starts: expected a \\[B, T\\] torch.bool tensor"):
            Segments.from_starts(bad)


def test_packed_segments_equal_separate_sequences():
    q, k, v, log_fgate = _qkvg(B=1, T=20)
    cu = torch.tensor([0, 6, 13, 20], dtype=torch.int32)
    seg = Segments.from_cu_seqlens(cu, 20)
    packed, _ = sequence_attention(q, k, v, log_fgate, scale=0.3, cu_seqlens=seg.cu_seqlens)
    dense, _ = sequence_attention(q, k, v, log_fgate, scale=0.3, cu_seqlens=seg.cu_seqlens, return_probs=True)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = forgetting_attention_reference(q[:, a:b], k[:, a:b], v[:, a:b], log_fgate[:, a:b], scale=0.3)
        torch.testing.assert_close(packed[:, a:b], alone, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(dense[:, a:b], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window", [None, 3])
def test_padded_batch_probabilities_are_per_row(window):
    """Segments of a padded batch (cu_seqlens over the flattened B*T tokens): the probabilities are [B, H, T, T],
    zero across segments, and o equals the op's and each segment alone."""
    q, k, v, log_fgate = _qkvg(B=3, T=10)
    seg = Segments.from_mask(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 10, [1] * 6 + [0] * 4]))
    kw = dict(scale=0.3, cu_seqlens=seg.cu_seqlens, max_seqlen=seg.max_seqlen, window=window)
    o, none = sequence_attention(q, k, v, log_fgate, **kw)
    dense, probs = sequence_attention(q, k, v, log_fgate, **kw, return_probs=True)
    assert none is None and probs.shape == (3, 4, 10, 10)
    torch.testing.assert_close(dense, o, rtol=1e-10, atol=1e-10)
    across = (seg.ids[:, :, None] != seg.ids[:, None, :])[:, None].expand_as(probs)
    assert (probs[across] == 0).all() and probs[~across].gt(0).any()
    a, b = 0, 3  # the left padding of row 0 is a segment of its own
    alone = forgetting_attention_reference(q[:1, a:b], k[:1, a:b], v[:1, a:b], log_fgate[:1, a:b], scale=0.3,
                                           window=window)
    torch.testing.assert_close(o[:1, a:b], alone, rtol=1e-10, atol=1e-10)


def test_token_shift_formula_and_reset():
    torch.manual_seed(0)
    shift = TokenShift(16, 3).double()
    x, h = torch.randn(2, 6, 3, 4, dtype=F64), torch.randn(2, 6, 16, dtype=F64)
    prev = torch.randn(2, 3, 4, dtype=F64)
    reset = torch.zeros(2, 6, dtype=torch.bool)
    reset[1, 3] = True
    y = shift(x, h, prev, reset)
    alpha = torch.sigmoid(h @ shift.proj.weight.T)[..., None]
    for b in range(2):
        for t in range(6):
            before = prev[b] if t == 0 else x[b, t - 1]
            if reset[b, t]:
                before = torch.zeros_like(before)
            torch.testing.assert_close(y[b, t], alpha[b, t] * before + (1 - alpha[b, t]) * x[b, t])


def test_rmsnorm_per_head_weights():
    norm = RMSNorm((3, 4)).double()
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 5, 3, 4, dtype=F64)
    expected = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_gates_bias_alibi_none():
    x = torch.randn(2, 5, 32)
    alibi = ForgettingAttention(32, 4, gate="alibi")
    bias = ForgettingAttention(32, 4, gate="bias")
    torch.testing.assert_close(alibi.log_fgate(x), -alibi_slopes(4).expand(2, 5, 4))
    torch.testing.assert_close(bias.log_fgate(x), alibi.log_fgate(x))  # "bias" starts at the ALiBi slopes
    assert ForgettingAttention(32, 4, gate="none").log_fgate(x) is None
    assert ForgettingAttention(32, 4).log_fgate(x).dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(gate="sigmoid"), "gate"), (dict(num_kv_heads=3), "num_kv_heads"), (dict(window=0), "window"),
     (dict(gate="none", acp_config=ACPConfig(acp=True)), "acp"),
     # a ZeroDivisionError (or a RuntimeError from a negative size) before; a bool or float window was kept
     (dict(num_heads=0), "num_heads: expected a positive int"), (dict(num_heads=-4), "num_heads"),
     (dict(num_kv_heads=0), "num_kv_heads: expected a positive int"), (dict(head_dim=0), "head_dim"),
     (dict(window=True), "window"), (dict(window=2.5), "window"),
     # a ZeroDivisionError (default head dim 32 // 64 = 0), or a module of zero-width projections / a TypeError
     (dict(num_heads=64), "hidden_size: 32 is less than num_heads=64"), (dict(hidden_size=0), "hidden_size"),
     (dict(hidden_size=True, num_heads=1), "hidden_size"), (dict(hidden_size=32.0), "hidden_size")],
)
def test_layer_rejects_bad_arguments(kwargs, match):
    num_heads, num_kv_heads = kwargs.pop("num_heads", 4), kwargs.pop("num_kv_heads", None)
    hidden_size = kwargs.pop("hidden_size", 32)
    with pytest.raises(ValueError, match=match):
        ForgettingAttention(hidden_size, num_heads, num_kv_heads, **kwargs)


def test_qk_norm_logit_bound_holds_and_acp_changes_little():
    torch.manual_seed(0)
    acp = ACPConfig(acp=True)
    layer = ForgettingAttention(64, 4, 2, qk_norm=True, acp_config=acp).double()
    for norm in (layer.q_norm, layer.k_norm):
        torch.nn.init.uniform_(norm.weight, -2, 2)
    x = 3 * torch.randn(2, 256, 64, dtype=F64)
    q = layer.q_norm(layer.q_proj(x).view(2, 256, 4, 16))
    k = layer.k_norm(layer.k_proj(x).view(2, 256, 2, 16)).repeat_interleave(2, 2)
    logits = layer.scale * torch.einsum("bqhd,bkhd->bhqk", q, k).abs().amax(dim=(0, 2, 3))
    bound = layer.logit_bound()
    assert bound.shape == (4,) and bool((logits <= bound).all())
    # the layer's forget gates decay fast enough for ACP to prune; the output moves by < tolerance-sized amounts
    with torch.no_grad():
        layer.fgate_proj.bias.fill_(-1.0)
        pruned, _, _ = layer(x)
        acp.acp = False  # the layer reads its ACP config at every forward
        exact, _, _ = layer(x)
    assert 0 < (pruned - exact).abs().max() < 1e-3


def test_qk_norm_logit_bound_holds_for_bf16_q_and_k():
    """q and k reach the kernels rounded to bf16: a token's logit with itself (q_proj = k_proj) rises up to a unit
    roundoff per side past D * scale * max|w_q| * max|w_k|, the bound in exact arithmetic; ACP's and eviction's
    tolerance holds only if U allows for it."""
    torch.manual_seed(0)
    layer = ForgettingAttention(64, 4, 4, qk_norm=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.k_proj.weight.copy_(layer.q_proj.weight)
    x = torch.randn(4, 512, 64, dtype=torch.bfloat16)
    q = layer.q_norm(layer.q_proj(x).view(4, 512, 4, 16))
    k = layer.k_norm(layer.k_proj(x).view(4, 512, 4, 16))
    logits = layer.scale * torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()).abs().amax(dim=(0, 2, 3))
    assert bool((logits > 16 * layer.scale).any())  # past the exact-arithmetic bound
    for bound in (layer.logit_bound(torch.bfloat16), layer.logit_bound()):
        assert bool((logits <= bound).all())
    # fp32 q and k: the margin stays within fp32's rounding
    assert torch.allclose(layer.logit_bound(torch.float32), torch.full((4,), 16 * layer.scale), rtol=1e-5, atol=0)


def test_layer_gradients_match_finite_differences():
    """Input, gate projection and token-shift weights of a fox-pro layer over two packed documents (fp64)."""
    torch.manual_seed(0)
    layer = ForgettingAttention(
        16, 2, qk_norm=True, output_gate=True, output_norm=True, k_shift=True, v_shift=True
    ).double()
    seg = Segments.from_cu_seqlens(torch.tensor([0, 4, 9], dtype=torch.int32), 9)
    names = ["fgate_proj.weight", "fgate_proj.bias", "k_shift.proj.weight", "v_shift.proj.weight"]
    params = dict(layer.named_parameters())

    def f(x, *values):
        out = torch.func.functional_call(
            layer, dict(zip(names, values)), (x,), dict(segments=seg, reset=seg.starts)
        )
        return out[0]

    x = torch.randn(1, 9, 16, dtype=F64, requires_grad=True)
    values = [(params[n].detach() + 0.3 * torch.randn_like(params[n])).requires_grad_() for n in names]
    assert torch.autograd.gradcheck(f, [x, *values], eps=1e-6, atol=1e-7, fast_mode=True)


def test_token_shift_does_not_leak_across_segments():
    torch.manual_seed(0)
    layer = ForgettingAttention(16, 2, k_shift=True, v_shift=True).double()
    x = torch.randn(1, 10, 16, dtype=F64)
    seg = Segments.from_cu_seqlens(torch.tensor([0, 4, 10], dtype=torch.int32), 10)
    y, _, _ = layer(x, segments=seg, reset=seg.starts)
    second, _, _ = layer(x[:, 4:])
    torch.testing.assert_close(y[:, 4:], second, rtol=1e-12, atol=1e-12)
    x2 = x.clone()
    x2[:, 3] += 1.0  # changing the last token of document 1 must not move document 2
    y2, _, _ = layer(x2, segments=seg, reset=seg.starts)
    torch.testing.assert_close(y2[:, 4:], y[:, 4:], rtol=0, atol=1e-13)  # fp64 rounding of the shared cumsum only
    assert not torch.equal(y2[:, 3], y[:, 3])


def test_rope_layer_rotates_by_the_given_cos_sin():
    """A rope layer takes the (cos, sin) its model computes once; without them it names the argument."""
    layer = ForgettingAttention(32, 4, gate="none", rope=True).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="rotary"):
        layer(x)
    positions = torch.arange(9).expand(2, 9)
    y, _, _ = layer(x, rotary=RotaryEmbedding(8)(positions, torch.float64))
    y_shifted, _, _ = layer(x, rotary=RotaryEmbedding(8)(positions + 100, torch.float64))
    torch.testing.assert_close(y, y_shifted)  # relative positions only
    plain = ForgettingAttention(32, 4, gate="none").double()
    plain.load_state_dict(layer.state_dict())
    assert not torch.allclose(plain(x)[0], y)  # and the rotation changes the output


@pytest.mark.parametrize("kwargs,match", [
    (dict(theta=-1.0), "theta"), (dict(theta=0.0), "theta"), (dict(theta=float("nan")), "theta"),
    (dict(theta=float("inf")), "theta"), (dict(head_dim=7), "head_dim"), (dict(head_dim=0), "head_dim"),
    (dict(head_dim=8.0), "head_dim"),
])
def test_rotary_embedding_rejects_bad_arguments(kwargs, match):
    """theta <= 0, inf or NaN made NaN (or inf) frequencies, so NaN cos and sin and NaN attention, with no error."""
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding(**{"head_dim": 8, **kwargs})


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "torch"])
def test_pro_layer_backends_match_fp64(backend, device):
    """A fox-pro layer (GQA, token shift, QK-norm, output norm and gate) over two packed documents, fp32 on either
    back-end: the output and every gradient as the fp64 layer's."""
    torch.manual_seed(0)
    kw = dict(qk_norm=True, output_gate=True, output_norm=True, k_shift=True, v_shift=True)
    ref = ForgettingAttention(32, 4, 2, **kw).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.3 * torch.randn_like(p))
    layer = ForgettingAttention(32, 4, 2, **kw).to(device)
    layer.load_state_dict(ref.state_dict())
    seg = Segments.from_cu_seqlens(torch.tensor([0, 5, 13], dtype=torch.int32), 13)
    x = torch.randn(1, 13, 32, dtype=F64)
    dy = torch.randn(1, 13, 32, dtype=F64)

    def run(module, x, seg):
        x = x.requires_grad_()
        y = module(x, segments=seg, reset=seg.starts)[0]
        return y, torch.autograd.grad(y, [x, *module.parameters()], dy.to(y))

    want, want_grads = run(ref, x, seg)
    seg = Segments(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in vars(seg).values()))
    with use_backend(backend):
        got, grads = run(layer, x.float().to(device), seg)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.double().cpu(), w, rtol=1e-4, atol=1e-5)


def test_use_backend_names_the_argument_and_restores_on_an_exception():
    from foxlm.ops import backend

    before = backend._backend
    with pytest.raises(ValueError, match="name: expected one of"):
        with use_backend("cuda"):
            pass
    with pytest.raises(RuntimeError, match="inside"):
        with use_backend("torch" if before != "torch" else "auto"):
            raise RuntimeError("inside")
    assert backend._backend == before


def test_blocks_match_hf_llama():
    """RMSNorm, SwiGLU and RoPE against transformers' Llama classes with the same weights and positions (per-row
    position_ids, as after left padding, up to 2^17). In bf16 and fp16 RMSNorm rounds once, after the weight (the FoX
    authors' fla norm), where LlamaRMSNorm rounds the normalised x and then the product: one unit in the last place
    apart at most, and no farther from fp64."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaMLP,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from foxlm.layers import SwiGLU
    from foxlm.ops import apply_rotary

    torch.manual_seed(0)
    weight = 1 + 0.5 * torch.randn(96)
    x = 3 * torch.randn(4, 7, 96)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ours, theirs = RMSNorm(96), LlamaRMSNorm(96, eps=1e-6)
        for norm in (ours, theirs):
            norm.weight.data.copy_(weight)
            norm.to(dtype)
        xd = x.to(dtype)
        exact = xd.double() * xd.double().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt() * ours.weight.double()
        y, y_hf = ours(xd), theirs(xd)
        assert y.dtype == y_hf.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(y, y_hf, rtol=2e-7, atol=1e-6)
        else:
            ulp = torch.finfo(dtype).eps * y_hf.double().abs().clamp_min(torch.finfo(dtype).tiny)
            assert bool(((y.double() - y_hf.double()).abs() <= ulp).all())
            assert (y.double() - exact).abs().max() <= (y_hf.double() - exact).abs().max()

    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=2, rope_theta=500000.0,
                         max_position_embeddings=1 << 17)
    mlp, swiglu = LlamaMLP(config), SwiGLU(64, 160)
    swiglu.load_state_dict(mlp.state_dict())
    h = torch.randn(3, 5, 64)
    torch.testing.assert_close(swiglu(h), mlp(h), rtol=0, atol=1e-6)

    positions = torch.stack([torch.arange(9), torch.arange(9).clamp_min(3) - 3, torch.arange(9) + (1 << 17) - 9])
    q = torch.randn(3, 9, 2, 32)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    want = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)[0].transpose(1, 2)
    got = apply_rotary(q, *RotaryEmbedding(32, 500000.0)(positions))
    # both angles are fp32 products of fp32 frequencies (Llama's 1 / theta^x, ours theta^-x: an ulp apart at most)
    torch.testing.assert_close(got[:2], want[:2], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=2e-2)
    exact = apply_rotary(q.double(), *RotaryEmbedding(32, 500000.0)(positions, torch.float64))
    assert (got[2] - exact[2]).abs().max() <= (want[2] - exact[2]).abs().max() + 1e-6

"""foxlm.generate: the paged cache against full forwards, eviction, generate() against HF generate, sampling, CLI."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from foxlm_cli import foxlm, one_line_error

from foxlm.generate import CachedDecoder, GenerateOutput, PagedFoxCache, generate, sample_next
from foxlm.models import FoxConfig, FoxForCausalLM
from foxlm.ops import use_backend

V = 512

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(arch: str, seed: int = 0, dtype=torch.float64, **overrides) -> FoxForCausalLM:
    torch.manual_seed(seed)
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128)
    cfg = FoxConfig.preset(arch, "tiny", vocab_size=V, bos_token_id=None, eos_token_id=None, **{**small, **overrides})
    return FoxForCausalLM(cfg).to(dtype).eval()


def _prompts(gen, lengths):
    return [torch.randint(0, V, (n,), generator=gen).tolist() for n in lengths]


def _left_pad(prompts):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    return ids, mask


def _prefill(model, cache, prompts, chunk):
    ids, mask = (t.to(model.device) for t in _left_pad(prompts))
    for a in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, a:a + chunk], attention_mask=mask[:, :a + chunk], cache=cache, use_cache=True)
    return out.logits[:, -1]


def _full_logits(model, rows):
    return torch.stack([model(torch.tensor([r])).logits[0, -1] for r in rows])


@pytest.mark.parametrize("arch, overrides, chunk", [
    ("fox-pro", {}, 64),  # QK-norm, token shift, output gate, GQA; one prefill call
    ("fox-pro", {}, 7),  # chunked prefill: Tq < Tk through the op, rows starting mid-way
    ("transformer-pro", {}, 64),  # RoPE at per-row positions, no gate
    ("fox-llama", {"window": 6}, 5),  # sliding window: the dense path and the kernel's window
])
def test_paged_cache_matches_full_forward(arch, overrides, chunk):
    """Prefill of left-padded prompts of different lengths, then decode steps: every step's logits equal
    a cache-less forward of each row's whole sequence (fp64)."""
    model = _model(arch, **overrides)
    gen = torch.Generator().manual_seed(1)
    prompts = _prompts(gen, (9, 21, 14))
    cache = PagedFoxCache.from_model(model, 3, 40, page_size=4)
    with torch.no_grad():
        logits = _prefill(model, cache, prompts, chunk)
        rows = [list(p) for p in prompts]
        torch.testing.assert_close(logits, _full_logits(model, rows), rtol=1e-9, atol=1e-9)
        decoder = CachedDecoder(model, cache)
        for _ in range(4):
            tokens = torch.randint(0, V, (3,), generator=gen)
            rows = [r + [int(t)] for r, t in zip(rows, tokens)]
            torch.testing.assert_close(decoder.step(tokens), _full_logits(model, rows), rtol=1e-9, atol=1e-9)
    assert cache.lengths.tolist() == [len(r) for r in rows]


@pytest.mark.parametrize("arch, chunk", [
    ("fox-pro", 64),  # token shift: the state after a right-padded prompt is its last real token's
    ("fox-pro", 7),  # chunked prefill: the short rows' last chunks are all padding
    ("transformer-pro", 64),  # RoPE positions count real tokens only
])
def test_paged_cache_right_padding(arch, chunk):
    """Right-padded prompts (HF-style: the mask then grows by ones), prefill and decode through the model with a
    PagedFoxCache: each row's logits equal a cache-less forward of its real tokens (fp64)."""
    model = _model(arch)
    gen = torch.Generator().manual_seed(4)
    prompts = _prompts(gen, (9, 21, 14))
    width = max(map(len, prompts))
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
        mask[b, :len(p)] = 1
    cache = PagedFoxCache.from_model(model, 3, 40, page_size=4)
    with torch.no_grad():
        logits = torch.cat([model(input_ids=ids[:, a:a + chunk], attention_mask=mask[:, :a + chunk], cache=cache,
                                  use_cache=True).logits for a in range(0, width, chunk)], 1)
        last = torch.stack([logits[b, len(p) - 1] for b, p in enumerate(prompts)])
        rows = [list(p) for p in prompts]
        torch.testing.assert_close(last, _full_logits(model, rows), rtol=1e-9, atol=1e-9)
        # the last column too (where generate reads), in a chunk of padding only as well: the cache kept the output
        torch.testing.assert_close(logits[:, -1], _full_logits(model, rows), rtol=1e-9, atol=1e-9)
        for _ in range(3):
            tokens = torch.randint(0, V, (3, 1), generator=gen)
            rows = [r + [int(t)] for r, t in zip(rows, tokens)]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(input_ids=tokens, attention_mask=mask, cache=cache, use_cache=True)
            torch.testing.assert_close(out.logits[:, -1], _full_logits(model, rows), rtol=1e-9, atol=1e-9)
    assert cache.lengths.tolist() == [len(r) for r in rows]


def test_paged_cache_decode_steps_ignore_autocast():
    """Decode steps of a paged cache on the PyTorch path, under bf16 autocast (a CPU model's, or with the torch
    back-end on a GPU), against the fp64 reference: as accurate as without autocast, as the prompt path, the chunks and
    the Triton kernel are. The steps' matmuls ran in bf16 (QK-normed logits of ~10 rounded to bf16): 2e4x the error
    of fp32, 6e-3 relative."""
    from foxlm.ops.forgetting_attention.reference import forgetting_attention_reference

    B, T, Hq, Hk, D = 2, 24, 4, 2, 64
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, T, Hq, D, generator=gen), dim=-1) * 2 * D**0.5  # |logit| <= 4*8
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, D, generator=gen), dim=-1) * 2 * D**0.5
    v = torch.randn(B, T, Hk, D, generator=gen)
    log_f = torch.nn.functional.logsigmoid(torch.randn(B, T, Hq, generator=gen) + 4)
    want = forgetting_attention_reference(*(t.double() for t in (q, k, v, log_f)), scale=D**-0.5)[:, 16:]
    errors = []
    for autocast in (False, True):
        cache = PagedFoxCache(num_layers=1, num_heads=Hq, num_kv_heads=Hk, head_dim=D, batch_size=B, max_length=T,
                              device="cpu", dtype=torch.float32, page_size=8)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            cache.attend(0, q[:, :16], k[:, :16], v[:, :16], log_f[:, :16], scale=D**-0.5)  # the prompt
            got = torch.cat([cache.attend(0, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], log_f[:, t:t + 1],
                                          scale=D**-0.5) for t in range(16, T)], 1)  # decode steps
        errors.append(((got.double() - want).norm() / want.norm()).item())
    assert errors[1] < 1.1 * errors[0] + 1e-6, errors


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors take the kernel only in Triton's interpreter"))])
def test_paged_cache_returns_q_dtype_on_every_path(backend):
    """bf16 q, k, v into an fp32 PagedFoxCache (an fp32 model's cache under bf16 autocast): every call's output is in
    q's dtype, as FoxCache's and flash_attn_with_kvcache's are, and as accurate as the fp64 reference allows. The
    decode steps (T <= 16 new tokens a row) gave the cache's fp32, the prompt and chunks bf16."""
    from foxlm.ops.forgetting_attention.reference import forgetting_attention_reference

    B, Hq, Hk, D = 2, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    sizes = (5, 1, 3, 20)
    q, k, v = (torch.randn(B, sum(sizes), h, D, generator=gen).bfloat16() for h in (Hq, Hk, Hk))
    log_f = -torch.rand(B, sum(sizes), Hq, generator=gen)
    want = forgetting_attention_reference(q.double(), k.double(), v.double(), log_f.double(), scale=0.3)
    cache = PagedFoxCache(num_layers=1, num_heads=Hq, num_kv_heads=Hk, head_dim=D, batch_size=B, max_length=64,
                          device="cpu", dtype=torch.float32, page_size=4)
    at = 0
    with use_backend(backend):
        for T in sizes:
            cols = slice(at, at + T)
            o = cache.attend(0, q[:, cols], k[:, cols], v[:, cols], log_f[:, cols], scale=0.3)
            assert o.dtype == torch.bfloat16, T
            torch.testing.assert_close(o.double(), want[:, cols], rtol=1e-2, atol=1e-2)
            at += T


_PAGED = dict(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, batch_size=1, max_length=8, device="cpu",
              dtype=torch.float32)


@pytest.mark.parametrize("change, message", [
    ({"page_size": 2.5}, "page_size: expected a positive int, got 2.5"),
    ({"batch_size": True}, "batch_size: expected a positive int, got True"),
    ({"num_kv_heads": 0}, "num_kv_heads: expected a positive int, got 0"),
    ({"num_heads": 0}, "num_heads: expected a positive int, got 0"),
    ({"head_dim": 0}, "head_dim: expected a positive int, got 0"),
    ({"num_layers": 0}, "num_layers: expected a positive int, got 0"),
    ({"max_length": 8.0}, "max_length: expected a positive int, got 8.0"),
    ({"num_pages": -3}, "num_pages: expected a positive int or None, got -3"),
    ({"num_pages": 2.5}, "num_pages: expected a positive int or None, got 2.5"),
    ({"dtype": torch.int32}, "dtype: expected a floating-point dtype for the keys and values, got torch.int32"),
    ({"logit_bounds": [torch.ones(2)] * 2}, r"logit_bounds: expected one per layer \(1\) or None, got 2"),
    ({"window": 0}, "window: expected a positive int or None, got 0"),
    ({"window": 2.5}, "window: expected a positive int or None, got 2.5"),
])
def test_paged_cache_mistakes_name_the_argument(change, message):
    """PagedFoxCache's shape and pool arguments: a one-line error naming the argument. They were TypeErrors of
    torch.zeros naming its own argument, a ZeroDivisionError, or a cache made anyway (a pool of 0-wide pages, a
    negative pool size taken as 2, integer keys, a bound list that evict() would index wrongly)."""
    with pytest.raises(ValueError, match=message):
        PagedFoxCache(**{**_PAGED, **change})


@pytest.mark.parametrize("change, message", [
    (dict(D=8), r"q: expected \[B, T, Hq, head_dim\] = \[1, 3, 2, 4\] as the cache, got \[1, 3, 2, 8\]"),
    (dict(Dv=8), r"v: expected \[B, T, Hk, head_dim\] = \[1, 3, 1, 4\] as the cache, got \[1, 3, 1, 8\]"),
    (dict(Dv=2), r"v: expected \[B, T, Hk, head_dim\] = \[1, 3, 1, 4\] as the cache, got \[1, 3, 1, 2\]"),
    (dict(Tk=4), r"k: expected \[B, T, Hk, head_dim\] = \[1, 3, 1, 4\] as the cache, got \[1, 4, 1, 4\]"),
    (dict(Hf=1), r"log_fgate: expected \[B, T, Hq\] = \[1, 3, 2\] as the cache, got \[1, 3, 1\]"),
])
def test_paged_cache_refuses_new_tokens_of_other_shapes(change, message):
    """q, k, v and log_fgate of another head dim, length or head count than the cache's: a one-line error naming the
    argument, raised before anything is stored. The pools are written through flat views, so keys or values of another
    head dim were written across slots (over other tokens') and the call returned as if all was well."""
    D, Dv, Tk, Hf = (change.get(n, d) for n, d in (("D", 4), ("Dv", 4), ("Tk", 3), ("Hf", 2)))
    cache = PagedFoxCache(**_PAGED)
    with pytest.raises(ValueError, match=message):
        cache.attend(0, torch.randn(1, 3, 2, D), torch.randn(1, Tk, 1, D), torch.randn(1, Tk, 1, Dv),
                     -torch.rand(1, 3, Hf), scale=0.5)
    assert cache.lengths.tolist() == [0] and cache.get_seq_length() == 0
    cache.attend(0, torch.randn(1, 3, 2, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4), -torch.rand(1, 3, 2),
                 scale=0.5)  # the right shapes go on
    assert cache.lengths.tolist() == [3]


def test_paged_cache_refuses_padding_inside_a_call():
    """A row whose real tokens are not one run in a call: a clear error, not attention over the wrong columns."""
    model = _model("fox-llama")
    cache = PagedFoxCache.from_model(model, 1, 16, page_size=4)
    attn = model.model.layers[0].attn
    q = torch.randn(1, 4, attn.num_heads, attn.head_dim, dtype=torch.float64)
    k = torch.randn(1, 4, attn.num_kv_heads, attn.head_dim, dtype=torch.float64)
    with pytest.raises(ValueError, match="valid: each row's real tokens must be one run"):
        cache.attend(0, q, k, k.clone(), torch.full((1, 4, attn.num_heads), -0.1), scale=0.25,
                     valid=torch.tensor([[True, False, True, True]]))


def test_paged_cache_refuses_max_length_and_stays_as_it_was():
    """A forward past the cache's max_length (or of another batch size) is a one-line error, raised before any state
    changes: a later forward that fits decodes as if the refused ones never came (the token shift's state of the first
    layer had been overwritten by the refused tokens)."""
    model = _model("fox-pro")
    gen = torch.Generator().manual_seed(8)
    ids, extra, fits = (torch.randint(0, V, (2, n), generator=gen) for n in (6, 3, 2))
    cache = PagedFoxCache.from_model(model, 2, 8, page_size=4)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="max_length: a row would hold 9 tokens, the cache was made for 8"):
            model(extra, cache=cache, use_cache=True)
        with pytest.raises(ValueError, match=r"x: expected B=2, Hk=2, got \(3, 1, 2, 16\)"):
            model(fits[:1].repeat(3, 1)[:, :1], cache=cache, use_cache=True)  # another batch: refused as well
        got = model(fits, cache=cache, use_cache=True).logits
        want = model(torch.cat([ids, fits], 1)).logits[:, -2:]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert cache.lengths.tolist() == [8, 8]


def test_hf_generate_refuses_a_paged_cache():
    """HF ``generate`` cannot drive a PagedFoxCache (a fixed batch, no beam reordering, no cropping, not a transformers
    Cache): a one-line error naming past_key_values and foxlm's own generate, not an AttributeError from deep inside
    transformers, nor a batch-size mismatch at the first beam-search forward."""
    model = _model("fox-pro")
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(6))
    for kwargs in (dict(), dict(num_beams=2), dict(prompt_lookup_num_tokens=2)):
        cache = PagedFoxCache.from_model(model, 2, 16, page_size=4)
        with pytest.raises(ValueError, match=r"past_key_values: HF generate decodes .* got a PagedFoxCache; "
                                             r".*foxlm\.generate\.generate"):
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=3,
                           do_sample=False, pad_token_id=0, **kwargs)
        assert cache.get_seq_length() == 0  # refused before any forward


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors take the kernel only in Triton's interpreter"))])
def test_paged_cache_frees_pages_outside_the_sliding_window(backend):
    """A cache made for a sliding window frees the pages no later query can read (query i sees keys j > i - window,
    and queries only move forward): over 40 decode steps (pages of 4, window 6: a page boundary of the window at
    every residue) each (row, kv head) keeps at most ceil(window / page) + 1 pages, the default pool holds them
    without growing, and every output equals the fp64 reference with the window. Every page was kept before."""
    from foxlm.ops.forgetting_attention.reference import forgetting_attention_reference

    B, Hq, Hk, D, page, window, steps = 2, 4, 2, 8, 4, 6, 40
    prompts = (5, 13)
    dtype, atol = (torch.float64, 1e-10) if backend == "torch" else (torch.float32, 1e-5)
    gen = torch.Generator().manual_seed(5)
    n = max(prompts) + steps
    q, k, v = (torch.randn(B, n, h, D, generator=gen, dtype=torch.float64) for h in (Hq, Hk, Hk))
    log_f = torch.nn.functional.logsigmoid(2 + torch.randn(B, n, Hq, generator=gen, dtype=torch.float64))
    # row b's tokens are its first prompts[b] + steps columns: the prompt left-padded to the widest one
    width = max(prompts)
    valid = torch.arange(width)[None, :] >= width - torch.tensor(prompts)[:, None]
    shifted = [torch.stack([t[b].roll(width - p, 0) for b, p in enumerate(prompts)]) for t in (q, k, v, log_f)]
    cache = PagedFoxCache(num_layers=1, num_heads=Hq, num_kv_heads=Hk, head_dim=D, batch_size=B,
                          max_length=max(prompts) + steps, device="cpu", dtype=dtype, page_size=page, window=window)
    pool = cache.stats()["pool_pages"]
    per_head = -(-window // page) + 1
    with use_backend(backend):
        cache.attend(0, *(t[:, :width].to(dtype) for t in shifted[:3]), shifted[3][:, :width].float(), scale=0.3,
                     valid=valid, window=window)
        for s in range(steps):
            cols = [p + s for p in prompts]
            new = [torch.stack([t[b, c] for b, c in enumerate(cols)])[:, None] for t in (q, k, v, log_f)]
            o = cache.attend(0, *(t.to(dtype) for t in new[:3]), new[3].float(), scale=0.3, window=window)
            for b, c in enumerate(cols):
                want = forgetting_attention_reference(q[b:b + 1, :c + 1], k[b:b + 1, :c + 1], v[b:b + 1, :c + 1],
                                                      log_f[b:b + 1, :c + 1].float().double(), scale=0.3,
                                                      window=window)[:, -1:]
                torch.testing.assert_close(o[b:b + 1].double(), want, rtol=0, atol=atol)
            live = -(-cache.lengths.long() // page)[:, None] - cache.cache_start.long()[0]  # [B, Hk]
            assert int(live.max()) <= per_head, (s, live)
    stats = cache.stats()
    assert stats["live_pages"] <= B * Hk * per_head < stats["full_pages"] // 2
    assert stats["pool_pages"] == pool <= 1 + B * Hk * per_head and cache.version == 0


def test_paged_cache_refuses_a_window_wider_than_its_own():
    """A cache that frees the keys outside its window refuses a call that would read them (a wider window, or none):
    a one-line error naming the window, before anything is stored; a narrower window reads only kept keys."""
    cache = PagedFoxCache(**{**_PAGED, "page_size": 2}, window=3)
    args = (torch.randn(1, 2, 2, 4), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), -torch.rand(1, 2, 2))
    for window in (None, 4):
        with pytest.raises(ValueError, match=f"window: this cache frees the keys outside window=3, got {window}"):
            cache.attend(0, *args, scale=0.5, window=window)
    assert cache.lengths.tolist() == [0]
    cache.attend(0, *args, scale=0.5, window=2)
    assert cache.lengths.tolist() == [2]


def test_generate_with_a_sliding_window_equals_hf_generate_and_frees_pages(device):
    """generate() with a sliding-window model (fox-llama, window 6, pages of 4): HF generate's tokens over 40 steps of
    a left-padded batch, and the cache ends with the pages of the window only (it kept every page before). On the GPU
    the steps take the Triton kernel in a CUDA graph, whose first live pages move between replays."""
    model = _model("fox-llama", window=6, dtype=torch.float64 if device == "cpu" else torch.float32).to(device)
    prompts = _prompts(torch.Generator().manual_seed(7), (5, 19, 11))
    ids, mask = _left_pad(prompts)
    hf = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=40, do_sample=False,
                        pad_token_id=0)
    with use_backend("auto" if device == "cuda" else "torch"):
        out = generate(model, prompts, 40, page_size=4)
    assert out.sequences == hf[:, ids.shape[1]:].tolist()
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert out.cache["live_pages"] <= layers * len(prompts) * heads * (-(-6 // 4) + 1) < out.cache["full_pages"] // 3


def _fast_forgetting_model():
    """fox-pro whose heads forget at very different speeds (gate biases -1 .. 6): most pages can go."""
    model = _model("fox-pro", seed=3)
    with torch.no_grad():
        for block in model.model.layers:
            block.attn.fgate_proj.bias.copy_(torch.tensor([-1.0, 0.0, 1.0, 6.0]))
    return model


def test_paged_cache_bounds_the_logits_in_the_dtype_autocast_gives_q_and_k():
    """An fp32 QK-norm model under CPU autocast(bfloat16) gives attention bf16 q and k (the projections run in bf16, the
    norm keeps their dtype): from_model's eviction bounds allow for bf16 rounding, as the layer's own ACP bound does.
    They allowed for fp32's, 0.8% smaller here: eviction could free keys still above the tolerance. An fp64 model
    (which autocast does not cast), no autocast, and an explicit compute_dtype keep the dtype they give."""
    model = _model("fox-pro", dtype=torch.float32)
    attn = model.model.layers[0].attn
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(1, 3, model.config.hidden_size)
        assert attn.q_norm(attn.q_proj(x).view(1, 3, attn.num_heads, attn.head_dim)).dtype == torch.bfloat16
        under = PagedFoxCache.from_model(model, 1, 16)
        fp64 = PagedFoxCache.from_model(_model("fox-pro"), 1, 16)
    for bounds, dtype in ((under.logit_bounds, torch.bfloat16),
                          (PagedFoxCache.from_model(model, 1, 16).logit_bounds, torch.float32),
                          (fp64.logit_bounds, torch.float64),
                          (PagedFoxCache.from_model(model, 1, 16, compute_dtype=torch.float16).logit_bounds,
                           torch.float16)):
        for block, bound in zip(model.model.layers, bounds):
            torch.testing.assert_close(bound, block.attn.logit_bound(dtype), rtol=0, atol=0)
    assert (under.logit_bounds[0] > attn.logit_bound(torch.float32)).all()
    assert under.dtype == torch.float32  # the keys are kept as the model's
    with pytest.raises(ValueError, match="compute_dtype: expected a floating-point torch.dtype or None, got 'bf16'"):
        PagedFoxCache.from_model(model, 1, 16, compute_dtype="bf16")


def test_eviction_refuses_queries_coarser_than_its_bounds_allow_for():
    """A cache made outside autocast (bounds for fp32's rounding) and attended under bf16 autocast: evict refuses,
    naming compute_dtype, where it would have freed pages by a bound bf16 logits may pass. Made under autocast (or
    given compute_dtype) it evicts."""
    model = _fast_forgetting_model().float()
    prompts = _prompts(torch.Generator().manual_seed(2), (60, 100))
    outside = PagedFoxCache.from_model(model, 2, 120, page_size=8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _prefill(model, outside, prompts, 128)
        with pytest.raises(ValueError, match=r"evict: the queries came in torch\.bfloat16, but the logit bounds allow "
                                             r"for torch\.float32's rounding only.*compute_dtype=torch\.bfloat16\)"):
            outside.evict()
        for cache in (PagedFoxCache.from_model(model, 2, 120, page_size=8),
                      PagedFoxCache.from_model(model, 2, 120, page_size=8, compute_dtype=torch.bfloat16)):
            _prefill(model, cache, prompts, 128)
            assert cache.evict() > 0
    with pytest.raises(ValueError, match="bound_dtype: expected a floating-point torch.dtype or None, got 'bf16'"):
        PagedFoxCache(**_PAGED, bound_dtype="bf16")


def test_eviction_matches_full_cache():
    """Eviction frees pages, and decoding with the evicted cache stays within the bound of full decoding."""
    model = _fast_forgetting_model()
    gen = torch.Generator().manual_seed(2)
    prompts = _prompts(gen, (60, 100))
    tol = math.exp(-6)
    full = PagedFoxCache.from_model(model, 2, 140, page_size=8)
    kept = PagedFoxCache.from_model(model, 2, 140, page_size=8, tolerance=tol, num_pages=40)
    with torch.no_grad():
        a, b = _prefill(model, full, prompts, 128), _prefill(model, kept, prompts, 128)
        assert kept.evict() > 0
        dec_full, dec_kept = CachedDecoder(model, full), CachedDecoder(model, kept)
        worst = 0.0
        for i in range(24):
            tokens = torch.randint(0, V, (2,), generator=gen)
            a, b = dec_full.step(tokens), dec_kept.step(tokens)
            worst = max(worst, float((a - b).abs().max()))
            if i % 8 == 7:
                kept.evict()
    stats = kept.stats()
    assert stats["fraction"] < 0.75 and stats["full_pages"] == full.stats()["full_pages"]
    assert kept.version > 0  # the 40-page pool had to grow, and did
    # Each attention row loses < tol of its mass, so outputs move by O(tol); logits here are O(1).
    assert 0 < worst < 10 * tol, worst


def test_generate_with_eviction_equals_hf_generate_over_many_pages():
    """Greedy decoding of a left-padded batch for 90 tokens (pages of 8: many page boundaries, evictions after the
    prefill and every 8 steps, the early-stop checks at every 16th step): with a tiny tolerance the
    tokens of HF generate (no eviction), and pages evicted all the same."""
    model = _fast_forgetting_model()
    prompts = _prompts(torch.Generator().manual_seed(2), (5, 70, 33))
    ids, mask = _left_pad(prompts)
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=90, do_sample=False, pad_token_id=0)
    out = generate(model, prompts, 90, page_size=8, evict=True, tolerance=1e-12)
    assert out.sequences == hf[:, ids.shape[1]:].tolist()
    assert out.cache["fraction"] < 0.9


def test_eviction_needs_qk_norm_and_a_forget_gate():
    with pytest.raises(ValueError, match="evict: needs a QK-norm model"):
        generate(_model("fox-llama"), [[1, 2, 3]], 2, evict=True)
    with pytest.raises(ValueError, match="evict: needs a forget gate, and this model has gate='none'"):
        generate(_model("transformer-pro"), [[1, 2, 3]], 2, evict=True)  # QK-norm, but no key ever decays


def test_generate_equals_hf_generate():
    """foxlm's path and HF ``generate`` (through the model's FoxCache), greedy, left-padded batch."""
    model = _model("fox-pro", seed=5)
    gen = torch.Generator().manual_seed(3)
    prompts = _prompts(gen, (7, 12))
    ids, mask = _left_pad(prompts)
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ours = generate(model, prompts, 6, page_size=4)
    assert ours.sequences == hf[:, ids.shape[1]:].tolist()
    assert ours.decode_steps == 6 and ours.cache["fraction"] == 1.0
    again = generate(model, prompts, 6, page_size=4, evict=True, tolerance=1e-12)
    assert again.sequences == ours.sequences  # eviction with a tiny tolerance changes nothing


def test_generate_a_peft_model_equals_hf_generate():
    """A LoRA-adapted model (PEFT's wrapper, which HF generate takes) through foxlm's path, eviction included: the
    same tokens as HF generate on it, not an AttributeError of the wrapper's missing ``model.layers``."""
    from peft import LoraConfig, get_peft_model

    model = _model("fox-pro", seed=5)
    prompts = _prompts(torch.Generator().manual_seed(3), (7, 12))
    ids, mask = _left_pad(prompts)
    base = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    adapted = get_peft_model(model, LoraConfig(r=4, init_lora_weights=False))  # B != 0: LoRA changes the output
    hf = adapted.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert not torch.equal(hf, base)
    assert generate(adapted, prompts, 6, page_size=4).sequences == hf[:, ids.shape[1]:].tolist()
    assert generate(adapted, prompts, 6, page_size=4, evict=True, tolerance=1e-12).sequences == \
        hf[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("lengths", [(9, 9), (7, 12)])
@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_generate_repetition_penalty_equals_hf_generate(penalty, lengths):
    """repetition_penalty in greedy decoding: the tokens of HF generate with it (its RepetitionPenaltyLogitsProcessor
    over each row's prompt and new tokens; a left-padded row's padding counts for neither, HF reading the
    attention_mask), and not the tokens without it."""
    model = _model("fox-pro", seed=5)
    prompts = _prompts(torch.Generator().manual_seed(3), lengths)
    ids, mask = _left_pad(prompts)
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                        repetition_penalty=penalty)
    ours = generate(model, prompts, 12, repetition_penalty=penalty, page_size=4).sequences
    assert ours == hf[:, ids.shape[1]:].tolist()
    assert ours != generate(model, prompts, 12, page_size=4).sequences


def test_generate_min_new_tokens_equals_hf_generate():
    """min_new_tokens holds back every eos id until that many tokens are out (greedy), as HF generate's
    MinNewTokensLengthLogitsProcessor: rows that stopped at the second and third token run on, and stop at an eos
    after the minimum when one comes."""
    model = _model("fox-pro", seed=5)
    prompts = _prompts(torch.Generator().manual_seed(3), (7, 12))
    ids, mask = _left_pad(prompts)
    greedy = generate(model, prompts, 10).sequences
    eos = [greedy[0][1], greedy[1][2]]

    def cut(row):  # HF pads a finished row with pad_token_id: its tokens up to its first eos
        end = next((i for i, t in enumerate(row) if t in eos), None)
        return row if end is None else row[:end + 1]

    lengths = {}
    for least in (0, 2, 3, 10):
        hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                            eos_token_id=eos, min_new_tokens=least)
        ours = generate(model, prompts, 10, eos_token_id=eos, min_new_tokens=least, page_size=4).sequences
        assert ours == [cut(row) for row in hf[:, ids.shape[1]:].tolist()]
        lengths[least] = [len(row) for row in ours]
        assert all(n > least for n in lengths[least] if n < 10)  # an eos comes only after the first `least` tokens
    assert lengths[0] == [2, 3] and lengths[10] == [10, 10]
    assert any(least < n < 10 for least in (2, 3) for n in lengths[least])  # a row stopped after its minimum


@pytest.mark.parametrize("seed", [0, 1])
def test_generate_min_p_sampling_equals_hf_generate(seed):
    """Sampling with min_p, a repetition penalty and a temperature (applied penalty first, then temperature, then
    min_p, HF's order) draws HF generate's tokens from the same seed: the same kept tokens, the same probabilities."""
    model = _model("fox-pro", seed=5)
    prompts = _prompts(torch.Generator().manual_seed(3), (7, 12))
    ids, mask = _left_pad(prompts)
    controls = dict(do_sample=True, temperature=0.7, min_p=0.8, repetition_penalty=1.3)  # min_p: ~30 of 512 stay
    torch.manual_seed(seed)
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0, top_k=0, **controls)
    torch.manual_seed(seed)
    ours = generate(model, prompts, 10, page_size=4, **controls).sequences
    assert ours == hf[:, ids.shape[1]:].tolist()
    torch.manual_seed(seed)
    assert ours != generate(model, prompts, 10, page_size=4, **{**controls, "min_p": 0.0}).sequences


def _cut(row, stops):
    """A row of HF generate, which pads a finished row: its tokens up to its first stop."""
    end = next((i for i, t in enumerate(row) if t in stops), None)
    return row if end is None else row[:end + 1]


@pytest.mark.parametrize("peft", [False, True])
def test_generate_unset_controls_take_the_generation_config_as_hf_generate(peft):
    """Greedy with nothing set: the stop at ``model.generation_config.eos_token_id`` (a list, then an int), the tokens
    of HF ``model.generate`` with nothing set (which reads the same config), through a PEFT wrapper too (its base
    model's config); ``eos_token_id=[]`` stops at nothing, as HF's with a pad_token_id."""
    model = _model("fox-pro", seed=5)
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, init_lora_weights=False))
    prompts = _prompts(torch.Generator().manual_seed(3), (7, 12))
    ids, mask = _left_pad(prompts)
    full = generate(model, prompts, 10, page_size=4).sequences  # the config has no eos yet: no stop
    assert model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10)[:, ids.shape[1]:].tolist() == full
    for eos in ([full[0][1], full[1][2]], full[0][1]):
        model.generation_config.eos_token_id = eos
        stops = eos if isinstance(eos, list) else [eos]
        hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10)[:, ids.shape[1]:].tolist()
        ours = generate(model, prompts, 10, page_size=4).sequences
        assert ours == [_cut(row, stops) for row in hf] and len(ours[0]) == 2
        assert len(ours[1]) == (3 if isinstance(eos, list) else len(_cut(full[1], stops)))
        hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[], pad_token_id=0)
        assert generate(model, prompts, 10, page_size=4, eos_token_id=[]).sequences == full == \
            hf[:, ids.shape[1]:].tolist()
    model.generation_config.min_new_tokens = 3  # the config's holds back its eos too: row 0 no longer stops at 2
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10)[:, ids.shape[1]:].tolist()
    ours = generate(model, prompts, 10, page_size=4).sequences
    assert ours == [_cut(row, [full[0][1]]) for row in hf] and len(ours[0]) > 3
    assert generate(model, prompts, 10, page_size=4, eos_token_id=[]).sequences == full  # none to hold back: no error


@pytest.mark.parametrize("top_k", [None, 0, 5])
def test_generate_unset_sampling_controls_take_the_generation_config_as_hf_generate(top_k):
    """A generation_config that samples (temperature, top_p, repetition_penalty; top_k None: HF's default of 50, or
    0: all tokens, or 5) with an eos: foxlm's generate with nothing set draws HF generate's tokens with nothing set
    from the same seed; with top_k None not the tokens of top_k=0 (all tokens, foxlm's former default). The caller's
    own value still wins over the config's."""
    model = _model("fox-pro", seed=5)
    prompts = _prompts(torch.Generator().manual_seed(3), (7, 12))
    ids, mask = _left_pad(prompts)
    eos = list(range(0, V, 16))  # a stop list of 1/16 of the vocabulary: rows stop at various steps, or run to 10
    model.generation_config.update(do_sample=True, temperature=0.7, top_k=top_k, top_p=0.95, repetition_penalty=1.3,
                                   eos_token_id=eos)

    def draw(seed, **kwargs):
        torch.manual_seed(seed)
        hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **kwargs)[:, ids.shape[1]:]
        torch.manual_seed(seed)
        ours = generate(model, prompts, 10, page_size=4, **kwargs).sequences
        assert ours == [_cut(row, eos) for row in hf.tolist()]
        return ours

    for seed in (0, 1):
        ours = draw(seed)
        if top_k is None:
            assert ours != draw(seed, top_k=0)
        assert ours != draw(seed, do_sample=False)


def test_generate_eos_and_sampling():
    model = _model("fox-llama", seed=7)
    prompts = [[5, 6, 7], [8] * 11]
    greedy = generate(model, prompts, 5)
    eos = greedy.sequences[0][1]
    cut = generate(model, prompts, 5, eos_token_id=eos)
    assert cut.sequences[0] == greedy.sequences[0][:2]
    top1 = generate(model, prompts, 5, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(0))
    assert top1.sequences == greedy.sequences
    s1 = generate(model, prompts, 5, do_sample=True, temperature=2.0, generator=torch.Generator().manual_seed(1))
    s2 = generate(model, prompts, 5, do_sample=True, temperature=2.0, generator=torch.Generator().manual_seed(1))
    assert s1.sequences == s2.sequences
    limited = generate(model, prompts, 5, do_sample=True, temperature=5.0, vocab_size=10,
                       generator=torch.Generator().manual_seed(2))
    assert all(t < 10 for s in limited.sequences for t in s)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompts, 2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="prompts"):
        generate(model, [[1], []], 2)


def test_generate_stops_at_any_of_a_list_of_eos_tokens():
    """eos_token_id as a list (what a generation_config may hold): each row stops at the first of its tokens in the
    list (HF generate's reading); a list was a TypeError of masked_fill, after the model had prefilled."""
    model = _model("fox-llama", seed=3)
    prompts = [[5, 6, 7], [8] * 11]
    greedy = generate(model, prompts, 8).sequences
    stops = [greedy[1][2], greedy[0][3]]  # row 1's third new token, row 0's fourth: the list's order crosses the rows

    def cut(row):
        end = next(i for i, t in enumerate(row) if t in stops)
        return row[:end + 1]

    assert all(any(t in stops for t in row) for row in greedy)
    assert generate(model, prompts, 8, eos_token_id=stops).sequences == [cut(row) for row in greedy]
    with pytest.raises(ValueError, match="eos_token_id: expected a token id, a list of them or None, got 'x'"):
        generate(model, prompts, 2, eos_token_id="x")


def test_generate_takes_numpy_token_ids_and_names_a_flat_prompt():
    """Token ids as numpy gives (a tokenizer's return_tensors="np", or a list of numpy integers) decode as the same
    ids in lists: they were refused as not being "non-negative token ids". One prompt passed flat ([ids] without its
    list) is named, not a TypeError of list(int)."""
    import numpy as np

    model = _model("fox-llama", seed=7)
    prompts = [[5, 6, 7], [8, 9, 10]]
    expected = generate(model, prompts, 3).sequences
    for given in (np.array(prompts), [np.array(p) for p in prompts], [list(np.array(p)) for p in prompts]):
        assert generate(model, given, 3).sequences == expected
    assert generate(model, np.array(prompts[0]), 3).sequences == expected[:1]
    with pytest.raises(ValueError, match=r"prompts\[0\]: expected a list of token ids, got the id 5 \(one prompt"):
        generate(model, prompts[0], 3)


def test_generate_takes_a_padded_batch_with_its_attention_mask():
    """A tokenizer's padded batch, its padding ids real vocabulary ids, with its attention_mask (left or right
    padding, tensors or numpy): the tokens of HF generate given the same input_ids and attention_mask. There was no
    argument for the mask: a padded tensor's padding was read as prompt tokens."""
    model = _model("fox-pro", seed=5)
    prompts = _prompts(torch.Generator().manual_seed(3), (7, 12, 4))
    ids, mask = _left_pad(prompts)
    ids = ids.masked_fill(mask == 0, 7)  # a padding id that is a real token
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=7)
    want = hf[:, ids.shape[1]:].tolist()
    assert generate(model, ids, 6, attention_mask=mask, page_size=4).sequences == want
    assert generate(model, ids.numpy(), 6, attention_mask=mask.bool().numpy(), page_size=4).sequences == want
    right, right_mask = torch.full_like(ids, 7), torch.zeros_like(mask)  # a tokenizer's default padding side
    for b, p in enumerate(prompts):
        right[b, :len(p)], right_mask[b, :len(p)] = torch.tensor(p), 1
    assert generate(model, right, 6, attention_mask=right_mask, page_size=4).sequences == want
    assert generate(model, ids, 6, page_size=4).sequences != want  # without the mask, padding is prompt


@pytest.mark.parametrize("args, kwargs, message", [
    ([[[1, 2], [3, V]], 2], {}, rf"prompts\[1\]: token id {V} is outside the model's vocabulary of {V}"),
    ([[[1, 2]], 2], {"vocab_size": 0}, f"vocab_size: expected 1 to the model's {V}, got 0"),
    ([[[1, 2]], 2], {"vocab_size": V + 1}, f"vocab_size: expected 1 to the model's {V}, got {V + 1}"),
    ([[[1, 2]], 2.5], {}, "max_new_tokens: expected an integer >= 1, got 2.5"),
    ([[[1, 2]], 2], {"do_sample": True, "top_k": 2.5}, "top_k: expected an integer >= 0, got 2.5"),
    ([[[1, 2]], 2], {"do_sample": True, "top_k": "5"}, "top_k: expected an integer >= 0, got '5'"),
    ([[[1, 2]], 2], {"do_sample": True, "top_p": "0.5"}, r"top_p: expected a probability mass in \(0, 1\], got '0.5'"),
    ([[[1, 2]], 2], {"do_sample": True, "temperature": "0.7"}, "temperature: expected > 0, got '0.7'"),
    # greedy decoding ignored them (a truthy do_sample string sampled)
    ([[[1, 2]], 2], {"temperature": -0.7}, r"temperature: expected > 0 \(or 0 when greedy\), got -0.7"),
    ([[[1, 2]], 2], {"temperature": float("nan")}, r"temperature: expected > 0 \(or 0 when greedy\), got nan"),
    ([[[1, 2]], 2], {"do_sample": "no"}, "do_sample: expected True or False, got 'no'"),
    ([[[1, 2]], 2], {"prefill_chunk": 1.5}, "prefill_chunk: expected an integer >= 1, got 1.5"),
    ([[[1, 2]], 2], {"page_size": 2.0}, "page_size: expected an integer >= 1, got 2.0"),
    ([[[1, 2]], 2], {"vocab_size": 10.5}, f"vocab_size: expected 1 to the model's {V}, got 10.5"),
    ([[[1, 2]], 2], {"do_sample": True, "min_p": 1.5},
     r"min_p: expected a fraction of the likeliest token's probability in \[0, 1\], got 1.5"),
    ([[[1, 2]], 2], {"do_sample": True, "min_p": "0.1"}, r"min_p: expected .* in \[0, 1\], got '0.1'"),
    ([[[1, 2]], 2], {"repetition_penalty": 0.0}, r"repetition_penalty: expected a positive number \(1: no penalty\), "
                                                  r"got 0.0"),
    ([[[1, 2]], 2], {"repetition_penalty": "1.2"}, r"repetition_penalty: expected a positive number .*, got '1.2'"),
    ([[[1, 2]], 2], {"min_new_tokens": -1, "eos_token_id": 0}, "min_new_tokens: expected an integer >= 0, got -1"),
    ([[[1, 2]], 2], {"min_new_tokens": 1.5, "eos_token_id": 0}, "min_new_tokens: expected an integer >= 0, got 1.5"),
    ([[[1, 2]], 2], {"min_new_tokens": 3, "eos_token_id": 0}, r"min_new_tokens: expected at most max_new_tokens \(2\), "
                                                              r"got 3"),
    ([[[1, 2]], 2], {"min_new_tokens": 1}, "min_new_tokens: needs eos_token_id"),
    # a truthy string evicted, another type of generator was ignored when greedy (a TypeError of torch.multinomial
    # naming its own argument when sampling), and CUDA graphs asked for off CUDA ran eagerly (or failed in torch.cuda)
    ([[[1, 2]], 2], {"evict": "no"}, "evict: expected True or False, got 'no'"),
    ([[[1, 2]], 2], {"cuda_graph": "yes"}, "cuda_graph: expected True, False or None, got 'yes'"),
    ([[[1, 2]], 2], {"cuda_graph": True}, "cuda_graph: CUDA graphs need a CUDA device, the model is on cpu"),
    ([[[1, 2]], 2], {"generator": 3}, "generator: expected a torch.Generator or None, got 3"),
    ([[[1, 2]], 2], {"do_sample": True, "generator": 3}, "generator: expected a torch.Generator or None, got 3"),
    # a padded batch's mask, which must say where each row's one run of real tokens is
    ([[[1, 2]], 2], {"attention_mask": [[1, 1, 1]]},
     r"attention_mask: expected the prompts' shape \(1, 2\), got \(1, 3\)"),
    ([[[1, 2]], 2], {"attention_mask": [[1, 2]]}, "attention_mask: expected 1 at real tokens and 0 at padding"),
    ([[[1, 2]], 2], {"attention_mask": [[0.0, 1.0]]}, "attention_mask: expected 1 at real tokens and 0 at padding"),
    ([[[1, 2]], 2], {"attention_mask": [[0, 0]]}, r"attention_mask\[0\]: expected one run of real tokens .*, got none"),
    ([[[1, 2, 3]], 2], {"attention_mask": [[1, 0, 1]]}, r"attention_mask\[0\]: .*, got padding between real tokens"),
    ([[[1, 2], [3]], 2], {"attention_mask": [[1, 1], [1]]}, r"prompts: with an attention_mask, expected a \[B, T\]"),
])
def test_generate_mistakes_name_the_argument(args, kwargs, message):
    """Token ids past the vocabulary (an IndexError of the embedding), a vocab_size the logits cannot be cut to and
    counts or numbers of another type (TypeErrors deep inside, naming nothing or torch's own argument) are one-line
    errors naming the argument."""
    with pytest.raises(ValueError, match=message):
        generate(_model("fox-llama"), *args, **kwargs)


def test_generate_names_a_bad_generation_config_value():
    """A bad control taken from the model's generation_config is named as the config's entry, not as an argument the
    caller never passed; the caller's own value still wins over it."""
    model = _model("fox-llama")
    model.generation_config.top_k = -1
    with pytest.raises(ValueError, match=r"model\.generation_config\.top_k: expected an integer >= 0, got -1"):
        generate(model, [[1, 2]], 2, do_sample=True)
    assert len(generate(model, [[1, 2]], 2, do_sample=True, top_k=0).sequences[0]) == 2
    model.generation_config.update(top_k=None, temperature=-1.0)
    with pytest.raises(ValueError, match=r"model\.generation_config\.temperature: expected > 0 \(or 0 when greedy\)"):
        generate(model, [[1, 2]], 2)
    model.generation_config.update(temperature=0.0)  # greedy, whose temperature 0 is no mistake
    assert len(generate(model, [[1, 2]], 2).sequences[0]) == 2


def test_generate_warns_of_generation_config_entries_it_does_not_apply():
    """A generation_config asking for what foxlm's decoding does not do (beams, an n-gram ban: HF generate applies
    them) gets a warning naming them; a model's own config, and neutral values, get none."""
    model = _model("fox-llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(model, [[1, 2]], 2)
        model.generation_config.num_beams, model.generation_config.suppress_tokens = 1, []
        generate(model, [[1, 2]], 2)
    model.generation_config.num_beams, model.generation_config.no_repeat_ngram_size = 4, 3
    with pytest.warns(UserWarning, match=r"^model\.generation_config sets num_beams=4, no_repeat_ngram_size=3: "
                                         r"foxlm's generate does not apply them") as caught:
        generate(model, [[1, 2]], 2)
    assert caught[0].filename == __file__  # the caller's line, not generate's


def test_generate_warns_of_encoder_repetition_penalty():
    """A generation_config entry HF generate applies to a FoX model: encoder_repetition_penalty (a penalty, or a boost,
    for the prompt's tokens). foxlm's generate gave the unpenalised tokens, without a word."""
    model = _model("fox-llama", seed=5)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    plain = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    model.generation_config.encoder_repetition_penalty = 3.0
    assert not torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0), plain)
    with pytest.warns(UserWarning, match=r"^model\.generation_config sets encoder_repetition_penalty=3\.0: foxlm's "):
        generate(model, ids, 8)


def test_generate_num_return_sequences_equals_hf_generate():
    """num_return_sequences, given or from the generation_config: HF generate's rows (each prompt's sequences one
    after another) and, from the same seed, HF's sampled tokens, a padded batch with an eos list included. It was one
    sequence a prompt (the config's only warned of). Greedy, it is HF's error, named."""
    model = _model("fox-pro", seed=5)
    prompts = _prompts(torch.Generator().manual_seed(3), (7, 12))
    ids, mask = _left_pad(prompts)
    eos = list(range(0, V, 16))  # rows stop at various steps, or run to 10

    def draw(seed, **kwargs):
        torch.manual_seed(seed)
        hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0, eos_token_id=eos,
                            **kwargs)[:, ids.shape[1]:].tolist()
        torch.manual_seed(seed)
        ours = generate(model, prompts, 10, page_size=4, eos_token_id=eos, **kwargs).sequences
        assert ours == [_cut(row, eos) for row in hf]
        return ours

    ours = draw(0, do_sample=True, temperature=0.7, num_return_sequences=3)
    assert len(ours) == 6 and len({tuple(row) for row in ours}) > 2
    model.generation_config.update(do_sample=True, num_return_sequences=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no longer warned of: applied
        assert len(draw(1)) == 4
    model.generation_config.do_sample = False  # update() would refuse it, as HF generate does below
    with pytest.raises(ValueError, match="num_return_sequences"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match=r"^model\.generation_config\.num_return_sequences: greedy decoding gives one "
                                         r"sequence a prompt, got 2 .*; sample them with do_sample=True"):
        generate(model, prompts, 2)
    with pytest.raises(ValueError, match="^num_return_sequences: greedy decoding gives one sequence a prompt, got 3"):
        generate(model, prompts, 2, do_sample=False, num_return_sequences=3)
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match=f"^num_return_sequences: expected an integer >= 1, got {bad}"):
            generate(model, prompts, 2, do_sample=True, num_return_sequences=bad)


def test_generate_takes_eos_token_id_as_a_tensor():
    """eos_token_id as a 0-d or 1-d integer tensor (HF generate takes one) stops where HF's does; it was refused. A
    tensor of floats (HF's never stops) or of two dimensions is named."""
    model = _model("fox-pro", seed=5)
    prompts = _prompts(torch.Generator().manual_seed(3), (7, 12))
    ids, mask = _left_pad(prompts)
    full = generate(model, prompts, 10, page_size=4).sequences
    for eos in (torch.tensor(full[0][1]), torch.tensor([full[0][1], full[1][2]])):
        hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                            eos_token_id=eos)[:, ids.shape[1]:].tolist()
        ours = generate(model, prompts, 10, page_size=4, eos_token_id=eos).sequences
        assert ours == [_cut(row, eos.view(-1).tolist()) for row in hf] and len(ours[0]) == 2
    for bad, got in ((torch.tensor([5.0]), r"1-d torch\.float32"), (torch.tensor([[5]]), r"2-d torch\.int64")):
        with pytest.raises(ValueError, match=rf"^eos_token_id: expected a 0-d or 1-d integer tensor, got {got}$"):
            generate(model, prompts, 2, eos_token_id=bad)


def test_generate_names_an_infinite_temperature_that_min_new_tokens_makes_nan():
    """temperature=inf samples uniformly (HF's tokens from the same seed); with min_new_tokens holding back the eos,
    whose -inf logit it makes NaN, HF generate fails in torch.multinomial naming neither, and foxlm's failed so too,
    after the prefill: it is an error naming temperature."""
    model = _model("fox-llama", seed=5)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    hot = dict(do_sample=True, temperature=math.inf, top_k=0)
    torch.manual_seed(0)
    hf = model.generate(ids, max_new_tokens=6, pad_token_id=0, **hot)[:, ids.shape[1]:].tolist()
    torch.manual_seed(0)
    assert generate(model, ids, 6, **hot).sequences == hf
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        model.generate(ids, max_new_tokens=6, pad_token_id=0, eos_token_id=3, min_new_tokens=2, **hot)
    with pytest.raises(ValueError, match=r"^temperature: inf cannot sample while min_new_tokens holds back "
                                         r"eos_token_id"):
        generate(model, ids, 6, eos_token_id=3, min_new_tokens=2, **hot)
    assert len(generate(model, ids, 6, eos_token_id=V + 1, min_new_tokens=2, **hot).sequences[0]) == 6  # none held


def test_generate_gives_the_model_back_in_its_mode():
    """generate decodes in eval mode and leaves a training model training (HF generate changes no mode)."""
    model = _model("fox-llama", seed=7)
    prompts = [[5, 6, 7], [8] * 11]
    expected = generate(model, prompts, 4).sequences  # from eval mode
    model.train()
    assert generate(model, prompts, 4).sequences == expected and model.training
    model.eval()
    generate(model, prompts, 2)
    assert not model.training


def test_sample_next_top_p():
    gen = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.05, 0.6, 0.3, 0.05]])).expand(200, 4)
    picks = sample_next(logits, do_sample=True, top_p=0.5, generator=gen)
    assert picks.eq(1).all()  # token 1 alone reaches the 0.5 mass
    picks = sample_next(logits, do_sample=True, top_p=0.8, generator=gen)
    assert set(picks.tolist()) == {1, 2}
    picks = sample_next(logits, do_sample=True, generator=gen)
    assert set(picks.tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("probs, top_p", [
    ([0.5, 0.25, 0.25], 0.5),  # the first token alone reaches the mass
    ([0.375, 0.125, 0.3125, 0.1875], 0.6875),  # two tokens do
    ([0.4, 0.2, 0.2, 0.2], 0.5),  # ties at the boundary: the tied token HF keeps
    ([0.25, 0.25, 0.25, 0.25], 0.5),
    ([0.125, 0.5, 0.25, 0.125], 0.75),
    ([0.05, 0.6, 0.3, 0.05], 0.8),  # no exact boundary
    ([0.2, 0.5, 0.3], 0.0),  # no mass: the likeliest token (HF keeps one), not a NaN distribution
])
def test_sample_next_top_p_boundary_as_hf(probs, top_p):
    """Where a prefix of the sorted tokens holds exactly top_p of the mass, the tokens after it go, as in HF's
    TopPLogitsWarper (the smallest prefix reaching top_p); one more token was kept, and sampled. The likeliest token
    always stays, as HF's warper keeps one: top_p=0 dropped every token once the boundary was fixed. Of tokens tied at
    the boundary, those HF keeps stay (others did: a descending sort orders ties otherwise)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.log(torch.tensor([probs]))
    kept = set(torch.nonzero(TopPLogitsWarper(top_p)(None, logits.clone())[0].isfinite())[:, 0].tolist())
    picks = sample_next(logits.expand(400, -1), do_sample=True, top_p=top_p, generator=torch.Generator().manual_seed(0))
    assert set(picks.tolist()) == kept


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 0.0}, "temperature: expected > 0, got 0.0"),
    ({"top_k": -1}, "top_k: expected an integer >= 0, got -1"),
    ({"top_k": 2.5}, "top_k: expected an integer >= 0, got 2.5"),
    ({"top_p": 1.5}, r"top_p: expected a number in \[0, 1\], got 1.5"),
    ({"min_p": 2.0}, r"min_p: expected a number in \[0, 1\], got 2.0"),
])
def test_sample_next_mistakes_name_the_argument(kwargs, message):
    """sample_next's sampling controls, checked as HF's warpers check theirs: torch errors naming nothing (a NaN
    distribution, an index out of range) or, for top_p > 1, no error."""
    with pytest.raises(ValueError, match=message):
        sample_next(torch.randn(2, 10), do_sample=True, **kwargs)


@pytest.mark.parametrize("seed", [0, 1])
def test_sample_next_draws_hf_tokens_from_bf16_logits(seed):
    """bf16 logits, where many tie, through temperature, top-k and top-p: sample_next draws the tokens HF generate's
    warpers and multinomial draw from the same seed. Half the rows kept another set of tokens (top-p's ties and sums
    taken in the other order), so seeded sampling of a bf16 model left HF generate's tokens."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = (2 * torch.randn(256, 1000, generator=torch.Generator().manual_seed(seed))).bfloat16()
    scores = logits.float()  # HF generate processes fp32 copies of the logits
    for warper in (TemperatureLogitsWarper(0.8), TopKLogitsWarper(400), TopPLogitsWarper(0.9)):
        scores = warper(None, scores)
    want = torch.multinomial(scores.softmax(-1), 1, generator=torch.Generator().manual_seed(seed))[:, 0]
    got = sample_next(logits, do_sample=True, temperature=0.8, top_k=400, top_p=0.9,
                      generator=torch.Generator().manual_seed(seed))
    assert torch.equal(got, want)


@pytest.mark.parametrize("probs, min_p", [
    ([0.5, 0.25, 0.15, 0.1], 0.5),  # exactly half the likeliest's probability stays
    ([0.5, 0.25, 0.15, 0.1], 0.3),
    ([0.1, 0.6, 0.3], 1.0),  # the likeliest alone
    ([0.4, 0.4, 0.2], 1.0),  # tied likeliest tokens both stay
    ([0.05, 0.6, 0.3, 0.05], 0.0),  # all
])
def test_sample_next_min_p_as_hf(probs, min_p):
    """min_p keeps the tokens HF's MinPLogitsWarper keeps: at least min_p times the likeliest token's probability."""
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = torch.log(torch.tensor([probs]))
    kept = set(torch.nonzero(MinPLogitsWarper(min_p)(None, logits.clone())[0].isfinite())[:, 0].tolist())
    picks = sample_next(logits.expand(400, -1), do_sample=True, min_p=min_p, generator=torch.Generator().manual_seed(0))
    assert set(picks.tolist()) == kept


@pytest.mark.usefixtures("small_tiles")
def test_decode_steps_through_triton_kernel(device):
    """The model's decode steps through the Triton kernel (on the GPU, else interpreted) match the PyTorch path;
    on the GPU the Triton steps replay a CUDA graph (the second step) and the PyTorch ones stay eager."""
    model = _model("fox-pro", seed=9, dtype=torch.float32).to(device)
    prompts = _prompts(torch.Generator().manual_seed(4), (10, 17))
    outs = []
    for backend in ("torch", "triton"):
        cache = PagedFoxCache.from_model(model, 2, 24, page_size=8)
        with torch.no_grad():
            _prefill(model, cache, prompts, 32)  # the PyTorch path (the conftest's default)
            decoder = CachedDecoder(model, cache)
            with use_backend(backend):
                outs.append(torch.stack([decoder.step(torch.tensor([3, 4], device=device)),
                                         decoder.step(torch.tensor([5, 6], device=device))]))
            assert (decoder._graph is not None) == (backend == "triton" and device == "cuda")
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def test_decode_rate_leaves_out_the_warm_up_step():
    """The decode rate counts the steps after the first (a warm-up: kernels, graph, allocations), all rows; the
    first token comes from the prefill (its time to first token). A slow first step does not lower the rate."""
    torch.manual_seed(0)
    model = FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", vocab_size=97, hidden_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=64)).eval()
    out = generate(model, [[1, 2, 3], [4, 5]], 6)
    assert out.decode_steps == 6 and out.batch_size == 2 and 0 < out.first_step_seconds <= out.decode_seconds
    assert out.decode_tokens_per_s == pytest.approx(2 * 4 / (out.decode_seconds - out.first_step_seconds))
    slow_start = GenerateOutput([[0]], decode_seconds=2.0, decode_steps=12, first_step_seconds=1.0, batch_size=3)
    assert slow_start.decode_tokens_per_s == 30.0  # 10 steady steps of 3 rows in 1 s
    assert GenerateOutput([[0]], decode_seconds=1.0, decode_steps=2, first_step_seconds=1.0).decode_tokens_per_s \
        is None


def test_generate_cli(tmp_path, capsys):
    from foxlm.cli import main

    torch.manual_seed(0)
    model = FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny"))
    model.save_pretrained(tmp_path / "m")
    code = main(["generate", str(tmp_path / "m"), "--prompt", "The forget gate", "--prompt", "Hi",
                 "--max-new-tokens", "4", "--no-eos", "--evict", "--stats", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "=== 0 ===\nThe forget gate" in out and "=== 1 ===\nHi" in out
    assert "time to first token" in err and "first step" in err and "(warm-up), then" in err and "tokens/s" in err
    assert "pages" in err
    assert main(["generate", str(tmp_path / "m"), "--prompt", "Hi", "--device", "tpu"]) == 2
    assert "foxlm generate: error: device: expected e.g. 'cpu'" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "m"), "--prompt", "Hi", "--max-new-tokens", "0"]) == 2
    assert "error: --max-new-tokens: expected a positive number of tokens, got 0" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "m")]) == 2
    assert "error: --prompt: give at least one" in capsys.readouterr().err


def test_generate_cli_prints_only_what_was_asked(tmp_path):
    """No progress bars of transformers' loading in a command's output."""
    FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", num_hidden_layers=1)).save_pretrained(tmp_path / "m")
    proc = foxlm("generate", tmp_path / "m", "--prompt", "Hi", "--max-new-tokens", "2", "--device", "cpu")
    assert proc.returncode == 0 and proc.stdout.startswith("Hi") and "Loading weights" not in proc.stderr, proc.stderr


def test_generate_cli_mistakes_are_one_line(tmp_path):
    missing = foxlm("generate", tmp_path / "nothing", "--prompt", "Hi")
    assert f"{tmp_path / 'nothing'} is not a run folder" in one_line_error(missing, "generate")
    if not torch.cuda.is_available():
        no_gpu = foxlm("generate", tmp_path / "nothing", "--prompt", "Hi", "--device", "cuda")
        assert "device: cuda is not one of the 0 visible GPUs" in one_line_error(no_gpu, "generate")


@pytest.mark.parametrize("flags, message", [
    (["--sample", "--temperature", "0"], "--temperature: expected a positive number, got 0.0"),
    (["--sample", "--top-k", "-1"], "--top-k: expected 0 (all tokens) or a positive number, got -1"),
    (["--sample", "--top-p", "0"], "--top-p: expected a probability mass in (0, 1], got 0.0"),
    (["--top-p", "0.9"], "--top-p: applies to sampling only; add --sample"),
    (["--temperature", "0.7"], "--temperature: applies to sampling only; add --sample"),
    (["--page-size", "0"], "--page-size: expected a positive number of tokens, got 0"),
    (["--evict", "--tolerance", "1.5"], "--tolerance: expected a value in (0, 1), got 1.5"),
    (["--tolerance", "1e-3"], "--tolerance: applies to eviction only; add --evict"),
    (["--sample", "--seed", str(2**64)], f"--seed: expected a 64-bit integer, got {2**64}"),
    (["--sample", "--min-p", "1.5"], "--min-p: expected a fraction of the likeliest token's probability in [0, 1], "
                                     "got 1.5"),
    (["--min-p", "0.1"], "--min-p: applies to sampling only; add --sample"),
    (["--num-return-sequences", "2"], "--num-return-sequences: applies to sampling only; add --sample"),
    (["--sample", "--num-return-sequences", "0"], "--num-return-sequences: expected a positive number, got 0"),
    (["--repetition-penalty", "0"], "--repetition-penalty: expected a positive number (1: no penalty), got 0.0"),
    (["--min-new-tokens", "-1"], "--min-new-tokens: expected 0 to --max-new-tokens (128), got -1"),
    (["--max-new-tokens", "4", "--min-new-tokens", "5"], "--min-new-tokens: expected 0 to --max-new-tokens (4), got 5"),
    (["--min-new-tokens", "2", "--no-eos"], "--min-new-tokens: holds back the stop at <|endoftext|>, which --no-eos"),
])
def test_generate_cli_decoding_flags_are_checked_by_their_names(flags, message, tmp_path, capsys):
    """A bad decoding flag is named as given, before the model loads (the folder need not exist): generate() named
    its own arguments (temperature, top_p, page_size), sampling flags without --sample (--tolerance without --evict)
    were silently ignored, and a seed past torch's 64 bits failed after the load without naming --seed."""
    from foxlm.cli import main

    assert main(["generate", str(tmp_path / "nothing"), "--prompt", "Hi", *flags]) == 2
    assert f"foxlm generate: error: {message}" in capsys.readouterr().err


def _byte_model_folder(folder):
    """A 1-layer byte-level fox-pro saved at ``folder`` as `foxlm train tokenizer=byte` saves one (its config records
    the tokenizer); returns (the byte tokenizer, the model)."""
    from foxlm.data import get_tokenizer

    byte = get_tokenizer("byte")
    torch.manual_seed(0)
    cfg = FoxConfig.preset("fox-pro", "tiny", vocab_size=320, bos_token_id=byte.eot_id, eos_token_id=byte.eot_id,
                           num_hidden_layers=1)
    cfg.foxlm_tokenizer = byte.spec()
    model = FoxForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    return byte, model


def test_generate_cli_uses_the_models_tokenizer(tmp_path, capsys):
    """A byte-level model (as `foxlm train tokenizer=byte` saves it: its config records the tokenizer) decodes in
    bytes; GPT-2 BPE ids would not even fit its 320-token vocabulary."""
    from foxlm.cli import main

    byte, model = _byte_model_folder(tmp_path / "m")
    assert main(["generate", str(tmp_path / "m"), "--prompt", "To be, or", "--max-new-tokens", "6", "--no-eos",
                 "--device", "cpu"]) == 0
    out = generate(model, [[byte.eot_id] + byte.encode("To be, or")], 6, eos_token_id=[], vocab_size=byte.vocab_size)
    text = byte.decode([t for t in out.sequences[0] if t != byte.eot_id])
    assert capsys.readouterr().out == "To be, or" + text + "\n"
    assert main(["generate", str(tmp_path / "m"), "--prompt", "Hi", "--tokenizer", "gpt2"]) == 2
    assert "tokenizer: " in capsys.readouterr().err


def test_generate_cli_passes_repetition_penalty_min_p_and_min_new_tokens(tmp_path, capsys):
    """--repetition-penalty, --min-p and --min-new-tokens reach generate(): the CLI prints its text for them."""
    from foxlm.cli import main

    byte, model = _byte_model_folder(tmp_path / "m")
    assert main(["generate", str(tmp_path / "m"), "--prompt", "To be", "--max-new-tokens", "6", "--sample",
                 "--seed", "3", "--min-p", "0.5", "--repetition-penalty", "1.5", "--min-new-tokens", "6",
                 "--device", "cpu"]) == 0
    out = generate(model, [[byte.eot_id] + byte.encode("To be")], 6, do_sample=True, top_k=0, min_p=0.5,
                   repetition_penalty=1.5, min_new_tokens=6, eos_token_id=byte.eot_id, vocab_size=byte.vocab_size,
                   generator=torch.Generator().manual_seed(3))
    plain = generate(model, [[byte.eot_id] + byte.encode("To be")], 6, do_sample=True, eos_token_id=byte.eot_id,
                     vocab_size=byte.vocab_size, generator=torch.Generator().manual_seed(3))
    assert len(out.sequences[0]) == 6 and out.sequences != plain.sequences
    assert capsys.readouterr().out == "To be" + byte.decode(out.sequences[0]) + "\n"


def test_generate_cli_samples_num_return_sequences(tmp_path, capsys):
    """--num-return-sequences N prints N sampled continuations of each prompt, those of generate() with
    num_return_sequences, each after its own prompt."""
    from foxlm.cli import main

    byte, model = _byte_model_folder(tmp_path / "m")
    assert main(["generate", str(tmp_path / "m"), "--prompt", "To be", "--prompt", "or not", "--max-new-tokens", "6",
                 "--sample", "--seed", "3", "--num-return-sequences", "2", "--no-eos", "--device", "cpu"]) == 0
    out = generate(model, [[byte.eot_id] + byte.encode(p) for p in ("To be", "or not")], 6, do_sample=True, top_k=0,
                   eos_token_id=[], num_return_sequences=2, vocab_size=byte.vocab_size,
                   generator=torch.Generator().manual_seed(3))
    assert len(out.sequences) == 4 and out.sequences[0] != out.sequences[1]
    assert capsys.readouterr().out == "".join(
        f"=== {i // 2}.{i % 2} ===\n{('To be', 'or not')[i // 2]}{byte.decode(seq)}\n"
        for i, seq in enumerate(out.sequences))


def test_generate_cli_flags_hold_over_the_generation_config(tmp_path, capsys):
    """The command's flags keep their documented defaults whatever the model's generation_config.json says (generate
    reads it for the controls left None): --no-eos stops at nothing, not at the config's eos; greedy without
    --sample; --top-k 0 (its default) samples among all tokens, not the config's top_k."""
    from foxlm.cli import main

    byte, model = _byte_model_folder(tmp_path / "m")
    prompt = [byte.eot_id] + byte.encode("To be, or")
    full = generate(model, [prompt], 6, eos_token_id=[], vocab_size=byte.vocab_size).sequences[0]
    model.generation_config.update(eos_token_id=full[1], do_sample=True, temperature=3.0, top_k=2)
    model.save_pretrained(tmp_path / "m")
    assert main(["generate", str(tmp_path / "m"), "--prompt", "To be, or", "--max-new-tokens", "6", "--no-eos",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out == "To be, or" + byte.decode([t for t in full if t != byte.eot_id]) + "\n"
    assert main(["generate", str(tmp_path / "m"), "--prompt", "To be, or", "--max-new-tokens", "6", "--sample",
                 "--seed", "3", "--device", "cpu"]) == 0
    drawn = generate(model, [prompt], 6, do_sample=True, temperature=1.0, top_k=0, eos_token_id=byte.eot_id,
                     vocab_size=byte.vocab_size, generator=torch.Generator().manual_seed(3)).sequences[0]
    assert capsys.readouterr().out == "To be, or" + byte.decode([t for t in drawn if t != byte.eot_id]) + "\n"


def test_generate_cli_keeps_the_gate_and_shift_fp32_in_bf16(tmp_path, monkeypatch):
    """--dtype bfloat16 (auto on CUDA) loads the model in bf16 as from_pretrained does, the forget gate and token
    shift staying fp32 (``_keep_in_fp32_modules_strict``), instead of casting every weight to bf16."""
    import foxlm.generate.decoding as decoding
    from foxlm.cli import main

    FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", num_hidden_layers=1)).save_pretrained(tmp_path / "m")
    seen, real = {}, decoding.generate

    def generate_and_record(model, *args, **kwargs):  # the real generate, with the model it was given noted
        seen.update({name: p.dtype for name, p in model.named_parameters()})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(decoding, "generate", generate_and_record)
    assert main(["generate", str(tmp_path / "m"), "--prompt", "Hi", "--max-new-tokens", "2", "--device", "cpu",
                 "--dtype", "bfloat16"]) == 0
    kept = {name: dtype for name, dtype in seen.items() if "fgate_proj" in name or "shift.proj" in name}
    assert kept and set(kept.values()) == {torch.float32}, kept
    assert seen["model.layers.0.attn.q_proj.weight"] == torch.bfloat16

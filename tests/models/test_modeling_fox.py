"""foxlm.models: presets, HF integration (save/load, Auto classes, generate), KV-cache decoding, packing, padding."""

import json
import math

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    DynamicCache,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

import foxlm  # noqa: F401  (registers the Auto classes)
from foxlm.models import ARCHS, FoxCache, FoxConfig, FoxForCausalLM, FoxModel, KVCache
from foxlm.models.cache import SHIFT_HISTORY

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
             bos_token_id=None, eos_token_id=None)
# every arch, plus GQA, the data-independent gates and a sliding window
VARIANTS = [dict(arch=a) for a in ARCHS] + [
    dict(arch="fox-pro", num_key_value_heads=2),
    dict(arch="fox-llama", gate="bias"),
    dict(arch="fox-llama", gate="alibi", window=4),
    dict(arch="transformer-pro", window=5),
]


def _model(arch, seed=0, **overrides):
    torch.manual_seed(seed)
    model = FoxForCausalLM(FoxConfig.preset(arch, "tiny", **{**SMALL, **overrides})).double().eval()
    for p in model.parameters():  # move off the init point: gates, norms and shifts far from trivial
        p.data += 0.1 * torch.randn_like(p)
    return model


def _ids(B, T, seed=1):
    return torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{x}" for x in v.values()))
def test_full_forward_equals_cached_decoding(variant):
    model = _model(**variant)
    ids = _ids(2, 14)
    full = model(ids).logits
    cache = FoxCache()
    pieces = [model(ids[:, :4], cache=cache, use_cache=True).logits]  # prefill
    pieces.append(model(ids[:, 4:7], cache=cache, use_cache=True).logits)  # chunked prefill (Tq < Tk)
    for t in range(7, 14):  # token by token
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        assert out.past_key_values is cache
        pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-9, atol=1e-9)
    assert cache.get_seq_length() == 14


@pytest.mark.parametrize("variant", [dict(arch="fox-pro"), dict(arch="fox-llama", window=4)], ids=["full", "window"])
def test_mask_sizes_as_a_dynamic_cache_of_the_same_tokens(variant):
    """``get_mask_sizes`` (transformers' ``create_causal_mask`` asks a cache for the mask's key length and offset): a
    FoxCache keeps every token, sliding window or not, so its answer is a DynamicCache's after the same tokens. It
    raised, calling the FoxCache one of linear-attention layers only."""
    from transformers import DynamicCache

    model = _model(**variant)
    cache, dynamic = FoxCache(), DynamicCache()
    assert cache.get_mask_sizes(5, 0) == dynamic.get_mask_sizes(5, 0) == (5, 0)  # before any token
    model(_ids(2, 7), cache=cache, use_cache=True)
    for layer in range(2):
        dynamic.update(torch.zeros(2, 2, 7, 8), torch.zeros(2, 2, 7, 8), layer)
    for layer, query_length in ((0, 1), (1, 1), (0, 3)):
        assert cache.get_mask_sizes(query_length, layer) == dynamic.get_mask_sizes(query_length, layer)


@pytest.mark.parametrize("name", ["llama", "fox-pro", "fox-llama"])
def test_given_cache_is_used_with_use_cache_false_as_in_llama(name):
    """A cache passed with ``use_cache=False``: transformers' models attend to it and append to it (use_cache only
    says whether to make one when none is given), and so does FoX's docstring. FoX dropped it silently: the new token
    was computed without its context (other logits) and the cache was neither filled nor returned."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if name == "llama":
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
                                             intermediate_size=64, num_hidden_layers=2)).double().eval()
    else:
        model = _model(name)
    ids = _ids(2, 8)
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        cache = DynamicCache() if name == "llama" else FoxCache()
        model(ids[:, :7], past_key_values=cache, use_cache=True)
        out = model(ids[:, 7:], past_key_values=cache, use_cache=False)
    torch.testing.assert_close(out.logits[:, -1], full, rtol=1e-9, atol=1e-9)
    assert out.past_key_values is cache and cache.get_seq_length() == 8


def test_crop_then_decode_equals_full_forward():
    """FoxCache.crop (assisted decoding's rejection of candidates): decoding on from the cropped cache gives
    the logits of a full forward over the kept prefix plus the new tokens, token shift included."""
    model = _model("fox-pro")
    ids, other = _ids(2, 12), _ids(2, 5, seed=7)
    cache = FoxCache()
    model(ids, cache=cache, use_cache=True)
    cache.crop(torch.tensor(-2))  # drop the last 2 as transformers 5.17's assisted decoding does, a 0-d tensor
    cache.crop(-2)  # the last 2 more (HF's negative form), then 3 more by length
    cache.crop(5)
    assert cache.get_seq_length() == 5
    with pytest.raises(TypeError, match="max_length: expected an int"):
        cache.crop(2.0)
    got = model(other, cache=cache, use_cache=True).logits
    want = model(torch.cat([ids[:, :5], other], 1)).logits[:, 5:]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    cache.crop(99)  # longer than the cache: nothing to do
    assert cache.get_seq_length() == 10


def test_assisted_generation_equals_greedy():
    """HF assisted decoding (a draft model proposes, the cache is cropped at the first rejection) gives the
    greedy continuation."""
    model = _model("fox-pro")
    ids = _ids(1, 6)
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False)
    for draft in (_model("fox-pro"), _model("fox-pro", seed=3)):  # all candidates accepted; most rejected
        assisted = model.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=False)
        assert torch.equal(assisted, greedy)


class _StopAfter(StoppingCriteria):
    """Stops generate at ``length`` tokens, its max_new_tokens left high: the assistant drafts up to that."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_assisted_generation_with_drafts_longer_than_the_shift_history():
    """Drafts of more than SHIFT_HISTORY tokens, rejected at once: the main model's and the draft's caches drop them
    all (transformers has them record their past), and the tokens are the greedy ones."""
    model = _model("fox-pro")
    draft = _model("fox-pro", seed=3, num_hidden_layers=1)
    draft.generation_config.update(num_assistant_tokens=SHIFT_HISTORY + 4, num_assistant_tokens_schedule="constant",
                                   assistant_confidence_threshold=0.0)  # always the whole draft
    ids = _ids(1, 4)
    greedy = model.generate(ids, max_new_tokens=2, do_sample=False)
    assisted = model.generate(ids, assistant_model=draft, max_new_tokens=SHIFT_HISTORY + 8, do_sample=False,
                              stopping_criteria=StoppingCriteriaList([_StopAfter(6)]))  # two drafts
    assert torch.equal(assisted[:, :6], greedy)


@pytest.mark.parametrize("arch", ["fox-pro", "transformer-pro"])
def test_deferred_stop_check_can_roll_back_the_cache(arch):
    """transformers' ``generate`` on Apple GPUs defers its stop check by a step (``DeferredStopCheck``) and, when it
    returns the cache, asks the cache how many recurrent states to record before that step (it raised on a FoxCache),
    then crops the extra token. Its set-up runs here on a real FoxCache (its events need a GPU: the loop's steps and
    the crop of ``finish`` are taken by hand): the cropped cache continues as one that never saw the extra token."""
    DeferredStopCheck = getattr(pytest.importorskip("transformers.generation.utils"), "DeferredStopCheck", None)
    if DeferredStopCheck is None:
        pytest.skip("this transformers has no deferred stop check")
    model = _model(arch)
    ids, steps = _ids(2, 5), _ids(2, 3, seed=2)
    kept, rolled_back = FoxCache(), FoxCache()
    for cache in (kept, rolled_back):
        model(ids, past_key_values=cache, use_cache=True)
    DeferredStopCheck(ids, 20, rolled_back, cache_is_returned=True)
    for t in range(3):
        model(steps[:, t:t + 1], past_key_values=rolled_back, use_cache=True)
        if t < 2:
            model(steps[:, t:t + 1], past_key_values=kept, use_cache=True)
    rolled_back.crop(-1)  # DeferredStopCheck.finish's undo of the extra step
    nxt = _ids(2, 1, seed=4)
    torch.testing.assert_close(model(nxt, past_key_values=rolled_back, use_cache=True).logits,
                               model(nxt, past_key_values=kept, use_cache=True).logits, rtol=0, atol=0)


# generate's cache argument and output field: "cache" from transformers 5.24, "past_key_values" before
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _returned_cache(out) -> FoxCache:
    return out[CACHE]


def _assert_generates_on_as_plain(model, cache: FoxCache, seq: torch.Tensor) -> None:
    """A greedy generate going on from ``cache`` (which holds ``seq``, but its last token where generate left it) after
    a few more prompt tokens gives the tokens of a plain generate of the whole input, and leaves the token-shift
    history that generate's cache keeps (the input is longer than SHIFT_HISTORY: a recording cache keeps more)."""
    ids = torch.cat([seq, _ids(1, 3, seed=5)], 1)
    assert ids.shape[1] + 8 > SHIFT_HISTORY
    plain = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    on = model.generate(ids, **{CACHE: cache}, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert _returned_cache(on) is cache and torch.equal(on.sequences, plain.sequences)
    assert len(cache.layers) == model.config.num_hidden_layers and all(layer.shift for layer in cache.layers)
    for got, want in zip(cache.layers, _returned_cache(plain).layers, strict=True):
        assert {n: h.shape for n, h in got.shift.items()} == {n: h.shape for n, h in want.shift.items()}


def test_deferred_stop_check_finish_stops_the_recording():
    """``DeferredStopCheck.finish`` switches the returned cache's past recording off, through ``record_past`` on each
    of ``cache.layers`` (a FoxCache had none, so it recorded on: its history grew with every token to the next crop,
    which a plain generate never makes). The loop's steps are taken by hand (its events need a GPU)."""
    DeferredStopCheck = getattr(pytest.importorskip("transformers.generation.utils"), "DeferredStopCheck", None)
    if DeferredStopCheck is None:
        pytest.skip("this transformers has no deferred stop check")
    model = _model("fox-pro")
    prompt, steps = _ids(1, SHIFT_HISTORY - 6), _ids(1, 2, seed=2)
    cache = FoxCache()
    model(prompt, past_key_values=cache, use_cache=True)
    check = DeferredStopCheck(prompt, SHIFT_HISTORY + 20, cache, cache_is_returned=True)
    assert all(layer.record_past for layer in cache.layers)  # what finish switches off (is_recording_past: 5.25+)
    for t in range(2):  # the second step is the extra one that finish undoes
        model(steps[:, t:t + 1], past_key_values=cache, use_cache=True)
    check.stop_reported = True  # what the step after the stop read off the device
    assert check.finish() == 1 and cache.get_seq_length() == SHIFT_HISTORY - 5
    assert not any(layer.record_past for layer in cache.layers)
    _assert_generates_on_as_plain(model, cache, torch.cat([prompt, steps[:, :1]], 1))


def test_assisted_generation_returns_a_cache_that_no_longer_records():
    """transformers leaves the cache of assisted decoding recording its past; FoxForCausalLM switches it off, so that
    a plain generate going on from the returned cache trims its token-shift history as one that never recorded."""
    model, draft = _model("fox-pro"), _model("fox-pro", seed=3, num_hidden_layers=1)
    out = model.generate(_ids(1, SHIFT_HISTORY - 8), assistant_model=draft, max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True)
    cache = _returned_cache(out)
    _assert_generates_on_as_plain(model, cache, out.sequences)
    assert not any(layer.record_past for layer in cache.layers)


def test_crop_beyond_the_shift_history_raises():
    model = _model("fox-pro")
    cache = FoxCache()
    model(_ids(1, 300), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="max_length"):
        cache.crop(10)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_documents_equal_documents_alone(arch):
    model = _model(arch)
    lengths = [5, 1, 8, 6]
    ids = _ids(1, sum(lengths))
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    out = model(ids, labels=ids, cu_seqlens=cu, output_log_fgates=True, return_per_token_loss=True)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = model(ids[:, a:b], labels=ids[:, a:b], return_per_token_loss=True)
        torch.testing.assert_close(out.logits[:, a:b], alone.logits, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(out.per_token_loss[:, a : b - 1], alone.per_token_loss, rtol=1e-9, atol=1e-9)
    assert len(out.log_fgates) == 2 and out.log_fgates[0].shape == (1, 20, 4)


@pytest.mark.parametrize("arch", ["fox-pro", "transformer-pro"])
def test_padded_batch_equals_rows_alone(arch):
    """Left padding (generation) and right padding (evaluation) with attention_mask, with and without a cache."""
    model = _model(arch)
    ids = _ids(3, 9)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9, [0] * 5 + [1] * 4])
    padded = model(ids, attention_mask=mask).logits
    cache = FoxCache()
    cached = [model(ids[:, :6], attention_mask=mask[:, :6], cache=cache, use_cache=True).logits]
    for t in range(6, 9):
        cached.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True).logits)
    cached = torch.cat(cached, 1)
    right = model(ids, attention_mask=mask.flip(1)).logits
    for b in range(3):
        real = mask[b].bool()
        alone = model(ids[b : b + 1, real]).logits[0]
        torch.testing.assert_close(padded[b, real], alone, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(cached[b, real], alone, rtol=1e-9, atol=1e-9)
        alone_right = model(ids[b : b + 1, real.flip(0)]).logits[0]
        torch.testing.assert_close(right[b, real.flip(0)], alone_right, rtol=1e-9, atol=1e-9)


def test_generate_greedy_reproducible_and_batched_left_padding_equals_one_by_one():
    model = _model("fox-pro")
    model.generation_config.pad_token_id = 0
    prompts = [_ids(1, n, seed=n)[0] for n in (3, 7, 5)]
    T = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long), p]) for p in prompts])
    mask = (torch.arange(T)[None] >= torch.tensor([T - len(p) for p in prompts])[:, None]).long()
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    again = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(batched, again)
    for b, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=6, do_sample=False)
        assert torch.equal(batched[b, T:], alone[0, len(p):])
    # the new tokens are the greedy choice of a full forward over prompt + continuation
    seq = torch.cat([prompts[0], batched[0, T:]])[None]
    greedy = model(seq).logits[0, len(prompts[0]) - 1 : -1].argmax(-1)
    assert torch.equal(greedy, batched[0, T:])


def test_generate_sampling_reproducible_with_seed():
    model = _model("fox-llama")
    ids = _ids(2, 4)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(model.generate(ids, max_new_tokens=5, do_sample=True, top_k=20, pad_token_id=0))
    assert torch.equal(*runs)


def test_generic_hf_cache_is_replaced_and_bad_cache_rejected():
    model = _model("fox-llama")
    ids = _ids(1, 5)
    out = model(ids, past_key_values=DynamicCache(), use_cache=True)
    assert isinstance(out.past_key_values, FoxCache)
    filled = DynamicCache()
    filled.update(torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8), 0)
    with pytest.raises(ValueError, match="past_key_values"):
        model(ids, past_key_values=filled)


def test_other_hf_caches_and_attention_implementations_are_refused(tmp_path):
    """HF's StaticCache (``cache_implementation="static"``), its offloading cache ("offloaded") and its attention
    kernels ("sdpa", "flash_attention_2") would be silently bypassed by foxlm's own FoxCache and attention op: they
    are refused, naming the argument."""
    model = _model("fox-pro")
    ids = _ids(1, 5)
    with pytest.raises(ValueError, match="cache_implementation: .*StaticCache"):
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="static", pad_token_id=0)
    # passed by hand, the same cache is named as the argument it came in (it named cache_implementation)
    with pytest.raises(ValueError, match=r"past_key_values: .*not a StaticCache; pass a FoxCache"):
        model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=16), use_cache=True)
    # an offloading DynamicCache became a plain FoxCache, silently keeping every layer on the model's device
    with pytest.raises(ValueError, match="cache_implementation: .*does not offload"):
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="offloaded", pad_token_id=0)
    with pytest.raises(ValueError, match="past_key_values: .*does not offload"):
        model.generate(ids, max_new_tokens=2, do_sample=False, past_key_values=DynamicCache(offloading=True),
                       pad_token_id=0)
    with pytest.raises(ValueError, match="past_key_values: .*does not offload"):
        model(ids, past_key_values=DynamicCache(offloading=True), use_cache=True)
    model.save_pretrained(tmp_path)
    for impl in ("sdpa", "flash_attention_2"):
        with pytest.raises(ValueError, match="does not support"):
            AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=impl)
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float64)
    torch.testing.assert_close(eager(ids).logits, model(ids).logits)


def test_continuous_batching_is_refused():
    """transformers' continuous batching (``cache_implementation="paged"``, ``generate_batch``) runs its own paged
    attention, without a forget gate: FoX refuses it in one line. generate returned the prompts alone, as if nothing
    had been generated, after the batching loop had logged every request's failure."""
    from transformers import GenerationConfig

    model = _model("fox-pro")
    with pytest.raises(ValueError, match="cache_implementation: .*continuous batching.*foxlm.generate.generate"):
        model.generate(_ids(1, 5), max_new_tokens=2, do_sample=False, cache_implementation="paged", pad_token_id=0)
    with pytest.raises(ValueError, match="cache_implementation: .*continuous batching"):
        model.generate_batch(inputs=[[1, 2, 3]], generation_config=GenerationConfig(max_new_tokens=2))


class _ProtocolOnlyCache:
    """A cache that is not an HF Cache and only speaks the protocol of foxlm.models.cache (as a paged cache
    would): it keeps everything itself, here by delegating to a FoxCache per layer, and counts calls."""

    def __init__(self):
        self.inner, self.calls = FoxCache(), []

    def attend(self, layer_idx, q, k, v, log_fgate, **kwargs):
        self.calls.append((layer_idx, q.shape[1], sorted(kwargs)))
        return self.inner.attend(layer_idx, q, k, v, log_fgate, **kwargs)

    def get_shift_state(self, layer_idx, name):
        return self.inner.get_shift_state(layer_idx, name)

    def set_shift_state(self, layer_idx, name, x, valid=None):
        self.inner.set_shift_state(layer_idx, name, x, valid=valid)

    def get_seq_length(self, layer_idx=0):
        return self.inner.get_seq_length(layer_idx)


def test_any_cache_with_the_protocol_plugs_in():
    model = _model("fox-pro")
    ids = _ids(2, 8)
    cache = _ProtocolOnlyCache()
    logits = [model(ids[:, :5], past_key_values=cache).logits]
    logits += [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(5, 8)]
    torch.testing.assert_close(torch.cat(logits, 1), model(ids).logits, rtol=1e-9, atol=1e-9)
    assert isinstance(cache, KVCache)
    kwargs = ["prune", "scale", "valid", "window"]
    assert cache.calls[:2] == [(0, 5, kwargs), (1, 5, kwargs)] and len(cache.calls) == 8


def test_both_caches_implement_the_kv_cache_protocol():
    """FoxCache and PagedFoxCache are KVCaches, with attend's parameters exactly the protocol's (names, kinds,
    defaults), so the layer's keyword arguments reach either unchanged; an HF cache without ``attend`` is not one."""
    import inspect

    from foxlm.generate.cache import PagedFoxCache

    paged = PagedFoxCache(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, batch_size=1, max_length=8,
                          device="cpu", dtype=torch.float32)
    assert isinstance(FoxCache(), KVCache) and isinstance(paged, KVCache) and not isinstance(DynamicCache(), KVCache)
    for name in ("attend", "get_shift_state", "set_shift_state", "get_seq_length"):
        want = inspect.signature(getattr(KVCache, name)).parameters
        for cls in (FoxCache, PagedFoxCache):
            got = inspect.signature(getattr(cls, name)).parameters
            assert [(p.name, p.kind, p.default) for p in got.values()] == \
                [(p.name, p.kind, p.default) for p in want.values()], (cls.__name__, name)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_preset_trains_saves_and_loads(arch, tmp_path):
    assert FoxConfig.preset(arch, "tiny").vocab_size == 50304
    torch.manual_seed(0)
    model = FoxForCausalLM(FoxConfig.preset(arch, "tiny", vocab_size=1024))  # a small vocabulary keeps CI fast
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1024, (2, 32))
    labels = ids.clone()
    labels[:, :3] = -100
    losses = []
    for _ in range(2):
        loss = model(ids, labels=labels).loss
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded_config = AutoConfig.from_pretrained(tmp_path).to_dict()
    assert {k: v for k, v in loaded_config.items() if k != "_name_or_path"} == {
        k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"
    }
    model.eval()
    for loaded in (FoxForCausalLM.from_pretrained(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path)):
        assert type(loaded) is FoxForCausalLM
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is FoxModel
    torch.testing.assert_close(base(ids).last_hidden_state, model.model(ids).last_hidden_state, rtol=0, atol=0)


def test_learned_bias_gate_survives_save_and_load(tmp_path):
    """The "bias" gate has a custom init (ALiBi slopes): loading must keep the trained values."""
    model = _model("fox-llama", gate="bias")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    for a, b in zip(model.model.layers, loaded.model.layers):
        assert torch.equal(a.attn.fgate_bias, b.attn.fgate_bias)
    ids = _ids(1, 6)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("size,nominal", [("125m", 125e6), ("360m", 360e6), ("760m", 760e6)])
def test_paper_sizes_parameter_counts(size, nominal):
    """Nominal sizes count one embedding matrix (as if tied); the Pro models' narrower MLP makes room for their
    output gate (~d^2 a layer), so every arch is within 2.5% of the nominal size."""
    for arch in ARCHS:
        with torch.device("meta"):
            model = FoxForCausalLM(FoxConfig.preset(arch, size))
        count = model.num_parameters() - model.lm_head.weight.numel()
        assert 0.975 < count / nominal < 1.025, (arch, count)


# The FoX authors' model shapes, (layers, d_model, heads), from their configs/experiment/longcrawl64/
# {forgetting_transformer,transformer}/{llama,pro}_{125m_2b,360m_7b,760m_48b}.yaml: their Transformer baselines at
# 760m have num_heads 12 (head dim 128), their FoX models 24 (head dim 64).
AUTHORS_SHAPES = {
    "125m": {arch: (12, 768, 12) for arch in ARCHS},
    "360m": {arch: (24, 1024, 16) for arch in ARCHS},
    "760m": {"fox-llama": (24, 1536, 24), "fox-pro": (24, 1536, 24),
             "transformer-llama": (24, 1536, 12), "transformer-pro": (24, 1536, 12)},
}


# Their MLP (modeling_forgetting_transformer.py's MLP): int(2/3 x hidden_ratio x hidden_size) rounded up to a multiple
# of 256, with hidden_ratio 3.5 in their Pro configs ("output gates use extra params so we reduce it here"); else 4.
AUTHORS_MLP = {arch: {size: 256 * math.ceil(int(shape[1] * (3.5 if arch.endswith("pro") else 4) * 2 / 3) / 256)
                      for size, shapes in AUTHORS_SHAPES.items() for shape in [shapes[arch]]} for arch in ARCHS}


@pytest.mark.parametrize("size", sorted(AUTHORS_SHAPES))
def test_paper_sizes_have_the_authors_layers_width_and_heads(size):
    """Every preset at a paper size builds the authors' shape: layers, width, heads and head dim, the MLP's width, and
    for the RoPE baselines their rope_base, 500000."""
    for arch in ARCHS:
        with torch.device("meta"):
            model = FoxForCausalLM(FoxConfig.preset(arch, size))
        attn = model.model.layers[0].attn
        layers, width, heads = AUTHORS_SHAPES[size][arch]
        assert (len(model.model.layers), model.config.hidden_size, attn.num_heads, attn.head_dim) == \
            (layers, width, heads, width // heads), (arch, size)
        assert model.model.layers[0].mlp.down_proj.in_features == AUTHORS_MLP[arch][size], (arch, size)
        assert model.config.rope == arch.startswith("transformer")
        if model.config.rope:
            assert model.config.rope_theta == 500000.0, (arch, size)


def test_loss_mean_per_token_and_outputs():
    model = _model("fox-llama")
    ids = _ids(2, 10)
    labels = ids.clone()
    labels[0, 5:] = -100
    out = model(ids, labels=labels, return_per_token_loss=True, output_attentions=True, output_log_fgates=True,
                output_hidden_states=True)
    logp = torch.log_softmax(out.logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    counted = labels[:, 1:] != -100
    torch.testing.assert_close(out.per_token_loss, -logp * counted)
    torch.testing.assert_close(out.loss, (-logp)[counted].mean())
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 10, 10)
    torch.testing.assert_close(out.attentions[1].sum(-1), torch.ones(2, 4, 10, dtype=torch.float32))
    assert all((g <= 0).all() and g.dtype == torch.float64 for g in out.log_fgates)  # fp32 below fp64 models
    assert len(out.hidden_states) == 3


def test_gradient_checkpointing_gives_the_same_gradients():
    model = _model("fox-pro").train()
    ids = _ids(2, 12)
    model(ids, labels=ids).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # activation_checkpointing_enable from transformers 5.2x, gradient_checkpointing_enable before
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    assert model.model.gradient_checkpointing
    model(ids, labels=ids).loss.backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(gate="softmax"), "gate"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(window=0), "window"),
        (dict(hidden_size=-8), "hidden_size"),
        (dict(acp_tolerance=2.0), "acp_tolerance"),
        (dict(qk_norm="yes"), "qk_norm"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters"),
        (dict(rope=True, rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
         "rope_parameters"),
    ],
)
def test_bad_config_values_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        FoxConfig.preset("fox-llama", "tiny", **overrides)


def test_plain_rope_parameters_are_taken_and_not_saved(tmp_path):
    """A Llama config's plain RoPE entries (transformers' defaults) are accepted; no variant is kept or saved, since
    the baselines' RoPE has none (a rope_scaling was taken, saved, and changed nothing in the logits)."""
    config = FoxConfig.preset("transformer-llama", "tiny", rope_theta=1e4,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                              partial_rotary_factor=1.0, rope_scaling=None)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not {"rope_parameters", "rope_scaling", "partial_rotary_factor"} & set(saved)
    assert saved["rope"] is True and saved["rope_theta"] == 1e4


def test_from_pretrained_checks_the_fields_it_is_given(tmp_path):
    """Fields given to from_pretrained (AutoConfig's and the model's) are checked as the constructor's: transformers
    set them on the loaded config unchecked, and tie_word_embeddings=True or a shared QK-norm without QK-norm built a
    model whose saved config.json no longer loaded. A valid field, and the attribute-mapped name, still apply."""
    _model("fox-pro").save_pretrained(tmp_path / "m")
    for fields, message in ((dict(tie_word_embeddings=True), "tie_word_embeddings: FoX models have an untied"),
                            (dict(qk_norm=False, qk_norm_shared=True), "qk_norm_shared: a shared QK-norm weight"),
                            (dict(gate="softmax"), "gate: expected one of"),
                            (dict(max_position_embeddings=0), "train_length: expected a positive integer")):
        for load in (AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
            with pytest.raises(ValueError, match=message):
                load(tmp_path / "m", **fields)
    config, unused = AutoConfig.from_pretrained(tmp_path / "m", window=8, max_position_embeddings=64, other=1,
                                                return_unused_kwargs=True)
    assert (config.window, config.train_length, unused) == (8, 64, {"other": 1})
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "m", window=8).config.window == 8


def test_bad_preset_and_input_errors():
    with pytest.raises(ValueError, match="arch"):
        FoxConfig.preset("fox-xl", "tiny")
    with pytest.raises(ValueError, match="size"):
        FoxConfig.preset("fox-pro", "1b")
    with pytest.raises(ValueError, match="acp"):
        FoxConfig.preset("transformer-llama", "tiny", acp=True)
    model = _model("fox-llama")
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(_ids(2, 6), cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(_ids(1, 6), cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="labels"):
        model(_ids(1, 6), labels=_ids(1, 5))
    with pytest.raises(ValueError, match="attention_mask"):  # a hole in a first call's mask is fine: a length is not
        model(_ids(1, 4), attention_mask=torch.tensor([[1, 0, 1]]))


@pytest.mark.triton
def test_model_on_the_triton_kernels_matches_the_torch_path(device):
    """Layer -> fused op integration (strides, packed and padded rows, GQA): on the GPU, else in the interpreter."""
    from foxlm.ops import use_backend

    torch.manual_seed(0)
    config = FoxConfig.preset("fox-pro", "tiny", **{**SMALL, "num_key_value_heads": 2})
    model = FoxForCausalLM(config).eval().to(device)
    ids = _ids(2, 12).to(device)
    mask = torch.tensor([[0, 0, 0] + [1] * 9, [1] * 12], device=device)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    with torch.no_grad():
        triton_out = [model(ids, attention_mask=mask).logits, model(ids[:1], cu_seqlens=cu).logits]
        with use_backend("torch"):
            torch_out = [model(ids, attention_mask=mask).logits, model(ids[:1], cu_seqlens=cu).logits]
    for a, b in zip(triton_out, torch_out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["fox-pro", "fox-llama"])  # the QK-norm bound, and the data bound
@pytest.mark.parametrize("padded", [False, True])
def test_probe_acp_records_what_acp_skips(arch, padded):
    from foxlm.layers import Segments
    from foxlm.ops import acp_stats

    model = _model(arch)
    with torch.no_grad():  # fast-forgetting gates, so that some tiles fall below the threshold
        for layer in model.model.layers:
            layer.attn.fgate_proj.bias.fill_(-4.0)
    ids = _ids(2, 40)
    kept = {}
    hooks = [layer.attn.q_proj.register_forward_hook(lambda m, i, o, n=n: kept.__setitem__(("q", n), o))
             for n, layer in enumerate(model.model.layers)]
    hooks += [(layer.attn.k_shift or layer.attn.k_proj).register_forward_hook(
        lambda m, i, o, n=n: kept.__setitem__(("k", n), o)) for n, layer in enumerate(model.model.layers)]
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 29:] = 0  # right padding: the rows are segments of one flattened row
    kwargs = dict(attention_mask=mask) if padded else {}
    with model.probe_acp(block_m=8, block_n=4) as share:
        with pytest.raises(RuntimeError, match="no forward was recorded"):
            share.per_head()
        out = model(ids, output_log_fgates=True, **kwargs)
    for h in hooks:
        h.remove()
    got = share.per_head()
    assert got.shape == (2, 4) and got.max() > 0
    for n, (layer, g) in enumerate(zip(model.model.layers, out.log_fgates)):  # against the op on the same q, k
        attn = layer.attn
        q, k = kept[("q", n)].view(2, 40, 4, -1), kept[("k", n)].view(2, 40, 4, -1)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cu = None
        if padded:
            q, k, g = (x.reshape(1, 80, *x.shape[2:]) for x in (q, k, g))
            cu = Segments.from_mask(mask).cu_seqlens
        want, _ = acp_stats(q, k, g, scale=attn.scale, logit_bound=attn.logit_bound(),
                            tolerance=attn.acp_config.acp_tolerance,
                            block_m=8, block_n=4, cu_seqlens=cu)
        torch.testing.assert_close(got[n], want)
    model.set_acp(True)  # the same share with ACP on: it records, it does not change what is skipped
    with model.probe_acp(block_m=8, block_n=4) as again:
        model(ids, **kwargs)
        model(ids[:, :20], cache=FoxCache(), use_cache=True)  # decoding through a cache is not recorded
    torch.testing.assert_close(again.per_head(), got)
    assert all(not layer.attn.acp_probe.active for layer in model.model.layers)


def test_probe_acp_leaves_every_layer_as_it_was():
    """Leaving probe_acp, normally or by an exception, restores each layer's probe (settings, and the records list
    itself): an inner probe_acp leaves the outer one recording with its own tile sizes, and after the blocks a forward
    records nothing and gives the same outputs bitwise."""
    model = _model("fox-pro")
    with torch.no_grad():  # fast-forgetting gates: shares above 0, which the tile sizes and tolerance change
        for layer in model.model.layers:
            layer.attn.fgate_proj.bias.fill_(-4.0)
    ids = _ids(2, 40)
    probes = [layer.attn.acp_probe for layer in model.model.layers]
    before = [((p.active, p.tolerance, p.block_m, p.block_n), p.records) for p in probes]

    def assert_as_before():
        for p, (settings, records) in zip(probes, before, strict=True):
            assert (p.active, p.tolerance, p.block_m, p.block_n) == settings and p.records is records
        assert not any(records for _, records in before)  # nothing recorded outside a block

    logits = model(ids).logits
    with model.probe_acp(block_m=8, block_n=4) as alone:
        model(ids)
    assert_as_before()
    with model.probe_acp(block_m=8, block_n=4) as outer:
        model(ids)
        with pytest.raises(KeyError), model.probe_acp(tolerance=1e-3, block_m=16, block_n=8) as inner:
            model(ids)
            raise KeyError("the body fails")
        model(ids)
    assert_as_before()
    assert [len(r) for r in outer.records] == [2, 2] and [len(r) for r in inner.records] == [1, 1]
    torch.testing.assert_close(outer.per_head(), alone.per_head(), rtol=0, atol=0)
    assert not torch.equal(inner.per_head(), alone.per_head())
    assert torch.equal(model(ids).logits, logits)
    assert_as_before()


def test_probe_acp_rejects_bad_arguments():
    with pytest.raises(ValueError, match="no forget gates"):
        with _model("transformer-pro").probe_acp():
            pass
    model = _model("fox-pro")
    for kwargs, match in ((dict(tolerance=1.5), "tolerance"), (dict(block_m=0), "block_m")):
        with pytest.raises(ValueError, match=match):
            with model.probe_acp(**kwargs):
                pass


def test_transformer_llama_is_hf_llama():
    """transformer-llama with Hugging Face's Llama's weights gives its logits: the RoPE baseline is Llama, its
    rotary layout included. In fp64 both, but Llama computes its rotary angles in fp32 (~3e-7 of difference)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ours = _model("transformer-llama", num_key_value_heads=2)
    cfg = ours.config
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)).double().eval()
    names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", ".attn.": ".self_attn."}
    weights = {}
    for key, value in ours.state_dict().items():
        for a, b in names.items():
            key = key.replace(a, b)
        weights[key] = value
    llama.load_state_dict(weights, strict=True)
    ids = _ids(2, 23)
    torch.testing.assert_close(ours(ids).logits, llama(ids).logits, rtol=1e-5, atol=2e-6)
    positions = torch.arange(5, 28).expand(2, 23)  # shifted positions, as in a continued sequence
    torch.testing.assert_close(ours(ids, position_ids=positions).logits, llama(ids, position_ids=positions).logits,
                               rtol=1e-5, atol=2e-6)


def test_shared_qk_norm_is_the_per_head_norm_with_one_weight_vector():
    """qk_norm_shared (the FoX authors' released Pro models): one [head_dim] weight for every head computes what the
    per-head norm computes with that vector in every row, ACP's logit bound included; qk_norm_eps is used."""
    torch.manual_seed(0)
    kw = dict(vocab_size=64, acp=True, qk_norm_eps=1e-5)
    shared = FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", qk_norm_shared=True, **kw)).eval()
    per_head = FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", **kw)).eval()
    state = {k: v + 0.3 * torch.randn_like(v) if "_norm" in k else v for k, v in shared.state_dict().items()}
    shared.load_state_dict(state)
    heads = shared.config.num_attention_heads
    per_head.load_state_dict({k: v.expand(heads, -1) if k.endswith(("q_norm.weight", "k_norm.weight")) else v
                              for k, v in state.items()})
    attn = shared.model.layers[0].attn
    assert attn.q_norm.weight.shape == (shared.config.head_dim,) and attn.q_norm.eps == 1e-5
    torch.testing.assert_close(attn.logit_bound(), per_head.model.layers[0].attn.logit_bound())
    assert attn.logit_bound().shape == (heads,)
    ids = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(shared(ids).logits, per_head(ids).logits)
    with pytest.raises(ValueError, match="qk_norm_shared: a shared QK-norm weight needs qk_norm=True"):
        FoxConfig.preset("fox-llama", "tiny", qk_norm_shared=True)
    with pytest.raises(ValueError, match="qk_norm_eps: expected a positive number or None"):
        FoxConfig.preset("fox-pro", "tiny", qk_norm_eps=0.0)

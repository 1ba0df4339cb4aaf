"""foxlm convert: the FoX authors' four released architectures and fla's FoX, as foxlm models, and back.

The authors' code (zhixuan-lin/forgetting-transformer) is not installable in CI (not on PyPI, its kernels are CUDA-only
Triton and jiterator); its checkpoints are built from its state-dict names and config keys, and its forward pass is
``authors_forward`` below: a transcription of its modeling code in plain PyTorch, written for this test and sharing
nothing with foxlm. ``test_transcription_matches_the_authors_code`` (opt-in: FOXLM_FOX_AUTHORS_SRC=their src/) runs
their own model classes on the CPU against it. fla runs for real (``pip install flash-linear-attention``), with its
Triton-only pieces replaced by the same math in PyTorch, each checked against fla's own reference function first.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import foxlm  # noqa: F401  (registers model_type "fox" with the Auto classes)
from foxlm.cli import main
from foxlm.data import get_tokenizer, prepare
from foxlm.data.assets import shakespeare_plays
from foxlm.models import FoxConfig, FoxForCausalLM, convert
from foxlm.models.convert import read_folder
from foxlm.models.state_dict_adapter import AUTHORS_FOX, AUTHORS_TRANSFORMER

RTOL = 1e-4
PRO = dict(use_k_shift=True, use_v_shift=True, qk_norm=True, use_output_gate=True, use_output_norm=True)
# The authors' four released architectures (REPRODUCE.md; their configs/experiment/longcrawl64/*/*_760m_48b.yaml),
# at a tiny size. Their Pro Transformer is their FoX class with fgate_type "none" and RoPE.
AUTHORS_ARCHS = {
    "fox-pro": dict(model_type=AUTHORS_FOX, qk_norm_share_param_across_head=True, **PRO),
    "fox-llama": dict(model_type=AUTHORS_FOX),
    "transformer-pro": dict(model_type=AUTHORS_FOX, fgate_type="none", use_rope=True, **PRO),
    "transformer-llama": dict(model_type=AUTHORS_TRANSFORMER, use_rope=True),
}
C, H, L, V, T = 64, 4, 2, 96, 20


pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ------------------------------------------------------------------------------------------ the authors' format
def authors_config(**fields) -> dict:
    """config.json as the authors' classes save it (their __init__ keys), tiny."""
    cfg = dict(vocab_size=V, hidden_size=C, hidden_ratio=4, intermediate_size=None, num_hidden_layers=L, num_heads=H,
               num_kv_heads=None, hidden_act="swish", window_size=None, max_position_embeddings=None,
               initializer_range=0.02, elementwise_affine=True, norm_eps=1e-6, use_cache=True, pad_token_id=None,
               bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, attention_bias=False, fuse_norm=True,
               fuse_cross_entropy=True, rope_base=500000.0, torch_dtype="float32", transformers_version="4.44.0")
    if fields.get("model_type") == AUTHORS_FOX:
        cfg.update(use_rope=False, use_output_gate=False, ogate_act="sigmoid", fgate_type="full",
                   fgate_bias_init=False, decay_time_min=None, decay_time_max=None, use_output_norm=False,
                   qk_norm=False, qk_norm_share_param_across_head=False, use_k_shift=False, use_v_shift=False,
                   log_pruning_tolerance=None, architectures=["ForgettingTransformerForCausalLM"])
    else:
        cfg.update(use_rope=True, architectures=["TransformerForCausalLM"])
    cfg.update(fields)
    return cfg


def authors_weights(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights under the authors' state-dict names (norm weights away from 1, gate biases spread out; under
    QK-norm, q and k small enough that the norm's epsilon matters)."""
    D = C // H
    inter = cfg["intermediate_size"] or 256 * math.ceil(int(C * cfg["hidden_ratio"] * 2 / 3) / 256)
    fox = cfg["model_type"] == AUTHORS_FOX
    qk = 0.003 if fox and cfg["qk_norm"] else 0.15

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=gen) * std

    def norm(n):
        return 1 + w(n, std=0.2)

    sd = {"model.embeddings.weight": w(V, C, std=1.0), "model.norm.weight": norm(C), "lm_head.weight": w(V, C)}
    for i in range(L):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.attn."
        sd.update({p + "attn_norm.weight": norm(C), p + "mlp_norm.weight": norm(C),
                   a + "q_proj.weight": w(C, C, std=qk), a + "o_proj.weight": w(C, C),
                   p + "mlp.gate_proj.weight": w(2 * inter, C),
                   p + "mlp.down_proj.weight": w(C, inter)})
        for n in ("k", "v"):
            if fox and cfg[f"use_{n}_shift"]:
                sd[a + f"{n}_proj.linear.weight"] = w(C, C, std=qk if n == "k" else 0.15)
                sd[a + f"{n}_proj.shift_proj.weight"] = w(H, C, std=0.5)
            else:
                sd[a + f"{n}_proj.weight"] = w(C, C, std=qk if n == "k" else 0.15)
        if fox and cfg["fgate_type"] == "full":
            sd[a + "fgate_proj.weight"], sd[a + "fgate_proj.bias"] = w(H, C), 2 + w(H, std=1.5)
        if fox and cfg["fgate_type"] == "bias_only":
            sd[a + "fgate_bias"] = 2 + w(H, std=1.5)
        if fox and cfg["use_output_gate"]:
            sd[a + "ogate_proj.weight"] = w(C, C)
        if fox and cfg["use_output_norm"]:
            sd[a + "output_norm.weight"] = norm(C)
        if fox and cfg["qk_norm"]:
            n = D if cfg["qk_norm_share_param_across_head"] else C
            sd[a + "q_norm.weight"], sd[a + "k_norm.weight"] = norm(n), norm(n)
    return sd


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, base):
    """Rotate-half RoPE (the authors' Tri Dao rotary, interleaved=False) of x: [B, T, H, D]."""
    D = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv
    cos, sin = ang.cos().float()[None, :, None], ang.sin().float()[None, :, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def authors_forward(sd: dict[str, torch.Tensor], cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of the authors' ForgettingTransformerForCausalLM / TransformerForCausalLM, transcribed from
    their modeling code: ShiftLinear (alpha = sigmoid(shift_proj(x)) weighs the previous token's projection), QK-norm
    (GroupNorm per head, or one RMSNorm over head_dim when shared; eps 1e-5), RoPE after it, logsigmoid gates summed
    into c_i - c_j, output RMSNorm times sigmoid(ogate), fused gate/up MLP (gate first)."""
    fox = cfg["model_type"] == AUTHORS_FOX
    B, T_ = ids.shape
    D = C // H
    eps = cfg["norm_eps"]
    x = sd["model.embeddings.weight"][ids]
    causal = torch.ones(T_, T_, dtype=torch.bool).tril()
    for i in range(L):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.attn."
        h = _rms(x, sd[p + "attn_norm.weight"], eps)

        def proj(n):
            if fox and cfg[f"use_{n}_shift"]:
                out = (h @ sd[a + f"{n}_proj.linear.weight"].T).view(B, T_, H, D)
                alpha = torch.sigmoid(h @ sd[a + f"{n}_proj.shift_proj.weight"].T)[..., None]
                prev = F.pad(out, (0, 0, 0, 0, 1, 0))[:, :T_]
                return alpha * prev + (1 - alpha) * out
            return (h @ sd[a + f"{n}_proj.weight"].T).view(B, T_, H, D)

        q, k, v = (h @ sd[a + "q_proj.weight"].T).view(B, T_, H, D), proj("k"), proj("v")
        if fox and cfg["qk_norm"]:
            shape = (D,) if cfg["qk_norm_share_param_across_head"] else (H, D)
            q = _rms(q, sd[a + "q_norm.weight"].view(shape), 1e-5)
            k = _rms(k, sd[a + "k_norm.weight"].view(shape), 1e-5)
        if cfg["use_rope"]:
            q, k = _rope(q, cfg["rope_base"]), _rope(k, cfg["rope_base"])
        if fox and cfg["fgate_type"] == "full":
            log_f = F.logsigmoid(h @ sd[a + "fgate_proj.weight"].T + sd[a + "fgate_proj.bias"])
        elif fox and cfg["fgate_type"] == "bias_only":
            log_f = F.logsigmoid(sd[a + "fgate_bias"]).expand(B, T_, H)
        else:
            log_f = torch.zeros(B, T_, H)
        c = log_f.cumsum(1).transpose(1, 2)  # [B, H, T]
        s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D) + c[..., :, None] - c[..., None, :]
        o = torch.einsum("bhij,bjhd->bihd", s.masked_fill(~causal, -math.inf).softmax(-1), v)
        if fox and cfg["use_output_norm"]:
            o = _rms(o, sd[a + "output_norm.weight"].view(H, D), eps)
        o = o.reshape(B, T_, C)
        if fox and cfg["use_output_gate"]:
            o = o * torch.sigmoid(h @ sd[a + "ogate_proj.weight"].T)
        x = x + o @ sd[a + "o_proj.weight"].T
        gate, up = (_rms(x, sd[p + "mlp_norm.weight"], eps) @ sd[p + "mlp.gate_proj.weight"].T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T


@pytest.mark.skipif(not os.environ.get("FOXLM_FOX_AUTHORS_SRC"), reason="FOXLM_FOX_AUTHORS_SRC: their src/ folder")
def test_transcription_matches_the_authors_code(monkeypatch):
    """Opt-in (their repository is not installable in CI): the authors' modeling code, run on the CPU with its Triton
    and CUDA-jiterator pieces replaced by their own PyTorch references (rms_norm_ref, group_norm_ref,
    group_norm_gated_ref, apply_rotary_emb_torch, the token shift of their test_op) and plain attention, loads the
    test's state dicts with every name matching and gives ``authors_forward``'s logits."""
    import sys

    monkeypatch.syspath_prepend(os.environ["FOXLM_FOX_AUTHORS_SRC"])
    monkeypatch.setattr(torch.cuda.jiterator, "_create_jit_fn", lambda *a, **k: None)  # built at their import time
    monkeypatch.setattr(torch.cuda.jiterator, "_create_multi_output_jit_fn", lambda *a, **k: None)
    fox = pytest.importorskip("forgetting_transformer.model.forgetting_transformer.modeling_forgetting_transformer")
    llama = pytest.importorskip("forgetting_transformer.model.transformer.modeling_transformer")
    ln = sys.modules["forgetting_transformer.model.forgetting_transformer.layernorm"]
    gated = sys.modules["forgetting_transformer.model.forgetting_transformer.fuse_norm_gate"]
    rot = sys.modules["forgetting_transformer.model.forgetting_transformer.rotary"]
    from fla.modules.norm.layernorm import rms_norm_ref as fla_rms_norm_ref

    def attention(q, k, v, log_fgate, head_first=True, sm_scale=None, seq_start=None, adaptive_threshold=None):
        c = log_fgate.float().cumsum(-1)  # [B, H, T]
        s = q @ k.transpose(-1, -2) * sm_scale + c[..., :, None] - c[..., None, :]
        return s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf).softmax(-1) @ v

    def rope_table(dim, base):
        inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        return torch.outer(torch.arange(T, dtype=torch.float32), inv)

    class Rotary(torch.nn.Module):  # fla's RotaryEmbedding (their LLaMA class) with their torch rotary
        def __init__(self, dim, base):
            super().__init__()
            self.dim, self.base = dim, base

        def forward(self, q, k, seqlen_offset=0, max_seqlen=None):
            ang = rope_table(self.dim, self.base)[: q.shape[1]]
            return tuple(rot.apply_rotary_emb_torch(x, ang.cos(), ang.sin()) for x in (q, k))

    def norm(ref, kw):
        return lambda self, x, residual=None, prenorm=False, *a, **k: ref(
            x, self.weight, self.bias, residual=residual, eps=self.eps, prenorm=prenorm, upcast=True, **kw(self))

    monkeypatch.setattr(ln.RMSNorm, "forward", norm(ln.rms_norm_ref, kw=lambda m: {}))
    monkeypatch.setattr(ln.GroupNorm, "forward", norm(ln.group_norm_ref, kw=lambda m: dict(
        num_groups=m.num_groups, is_rms_norm=m.is_rms_norm)))
    monkeypatch.setattr(gated.FusedGroupNormGated, "forward", lambda self, x, g, *a, **k: gated.group_norm_gated_ref(
        x, g, self.weight, self.bias, num_groups=self.num_groups, eps=self.eps, is_rms_norm=True, upcast=True))
    monkeypatch.setattr(llama.RMSNorm, "forward", norm(fla_rms_norm_ref, kw=lambda m: {}))
    monkeypatch.setattr(rot, "apply_rotary_emb_func", lambda x, cos, sin, interleaved=False, seqlen_offsets=0, **k:
                        rot.apply_rotary_emb_torch(x, cos[: x.shape[1]], sin[: x.shape[1]], interleaved))
    monkeypatch.setattr(fox, "token_shift", lambda x, prev_w, curr_w: F.pad(x, (0, 0, 0, 0, 1, 0))[:, : x.shape[1]]
                        * prev_w[..., None] + x * curr_w[..., None])
    monkeypatch.setattr(fox, "glu_linear", lambda x, y, w, b: F.linear(torch.sigmoid(x) * y, w, b))
    monkeypatch.setattr(fox, "forgetting_attention", attention)
    for module in (fox, llama):
        monkeypatch.setattr(module, "swiglu_linear", lambda x, y, w, b: F.linear(F.silu(x) * y, w, b))
    monkeypatch.setattr(llama, "RotaryEmbedding", Rotary)
    monkeypatch.setattr(llama, "flash_attn_func", lambda q, k, v, causal, window_size: attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), q.new_zeros(q.shape[0], q.shape[2], q.shape[1]),
        sm_scale=q.shape[-1] ** -0.5).transpose(1, 2))
    from forgetting_transformer.model.forgetting_transformer import (
        ForgettingTransformerConfig,
        ForgettingTransformerForCausalLM,
    )
    from forgetting_transformer.model.transformer.configuration_transformer import TransformerConfig

    classes = {AUTHORS_FOX: (ForgettingTransformerConfig, ForgettingTransformerForCausalLM),
               AUTHORS_TRANSFORMER: (TransformerConfig, llama.TransformerForCausalLM)}
    for arch, fields in AUTHORS_ARCHS.items():
        cfg = authors_config(**fields)
        sd = authors_weights(cfg, torch.Generator().manual_seed(0))
        config_cls, model_cls = classes[cfg["model_type"]]
        model = model_cls(config_cls(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}))
        model.float().eval().load_state_dict(sd, strict=True)
        ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert _rel(authors_forward(sd, cfg, ids), model(ids, use_cache=False).logits) < RTOL, arch


def _greedy(logits_fn, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation by recomputing the whole prefix each step (no cache)."""
    for _ in range(n):
        ids = torch.cat([ids, logits_fn(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def _write(folder, cfg: dict, sd: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("arch", sorted(AUTHORS_ARCHS))
def test_authors_architectures_convert_with_equal_logits_and_greedy_tokens(arch, tmp_path):
    gen = torch.Generator().manual_seed(sorted(AUTHORS_ARCHS).index(arch))
    cfg = authors_config(**AUTHORS_ARCHS[arch])
    sd = authors_weights(cfg, gen)
    _write(tmp_path / "src", cfg, sd)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert isinstance(model, FoxForCausalLM)
    # the authors' JSON GPT-2 (50257 ids), their default, does not fit V rows: none recorded
    assert getattr(model.config, "foxlm_tokenizer", None) is None
    ids = torch.randint(0, V, (2, T), generator=gen)
    with torch.no_grad():
        want = authors_forward(sd, cfg, ids)
        assert _rel(model(ids).logits, want) < RTOL
        prompt = ids[:1, :6]
        expected = _greedy(lambda x: authors_forward(sd, cfg, x), prompt, 8)
    got = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)  # through the FoxCache
    assert torch.equal(got, expected)


def test_authors_per_head_qk_norm_and_bias_gate_convert(tmp_path):
    """The other variants the authors' FoX class has: per-head QK-norm weights and the data-independent gate."""
    gen = torch.Generator().manual_seed(7)
    cfg = authors_config(model_type=AUTHORS_FOX, fgate_type="bias_only", intermediate_size=96, **PRO)
    sd = authors_weights(cfg, gen)
    _write(tmp_path / "src", cfg, sd)
    convert(tmp_path / "src", tmp_path / "dst")
    model = FoxForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert model.config.gate == "bias" and not model.config.qk_norm_shared
    ids = torch.randint(0, V, (2, T), generator=gen)
    with torch.no_grad():
        assert _rel(model(ids).logits, authors_forward(sd, cfg, ids)) < RTOL


@pytest.mark.parametrize("arch", sorted(AUTHORS_ARCHS))
def test_foxlm_to_authors_to_foxlm_gives_identical_tensors(arch, tmp_path):
    gen = torch.Generator().manual_seed(11)
    cfg = authors_config(**AUTHORS_ARCHS[arch])
    sd = authors_weights(cfg, gen)
    _write(tmp_path / "src", cfg, sd)
    convert(tmp_path / "src", tmp_path / "fox")
    convert(tmp_path / "fox", tmp_path / "authors", to="fox-authors")
    convert(tmp_path / "authors", tmp_path / "fox2")
    back = load_file(tmp_path / "authors" / "model.safetensors")
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    a, b = load_file(tmp_path / "fox" / "model.safetensors"), load_file(tmp_path / "fox2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    written = json.loads((tmp_path / "authors" / "config.json").read_text())
    for key in ("model_type", "fgate_type", "use_rope", "qk_norm_share_param_across_head", "use_k_shift", "rope_base"):
        assert written.get(key) == cfg.get(key), key
    assert FoxConfig.from_pretrained(tmp_path / "fox2").to_diff_dict() == \
        FoxConfig.from_pretrained(tmp_path / "fox").to_diff_dict()


def test_the_default_jobs_model_converts_to_the_authors_format(tmp_path):
    """`foxlm train`'s default model (fox-pro) has the authors' QK-norm epsilon, which their code hard-codes."""
    from foxlm.train.config import load_config

    job = load_config()
    for arch in (job.arch, "transformer-pro"):
        FoxForCausalLM(FoxConfig.preset(arch, job.size, vocab_size=V)).save_pretrained(tmp_path / arch)
        convert(tmp_path / arch, tmp_path / f"{arch}-authors", to="fox-authors")
        convert(tmp_path / f"{arch}-authors", tmp_path / f"{arch}-back")
        assert FoxConfig.from_pretrained(tmp_path / f"{arch}-back").qk_norm_eps == 1e-5


def test_a_foxlm_config_with_a_number_field_of_another_type_is_named(tmp_path, capsys):
    """A foxlm config.json whose rms_norm_eps, rope_theta or initializer_range is null or a string: one line naming
    the field under --to fox-authors (these were TypeError tracebacks from FoxConfig's checks)."""
    FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", vocab_size=V)).save_pretrained(tmp_path / "m")
    good = json.loads((tmp_path / "m" / "config.json").read_text())
    for field, value, want in (("rms_norm_eps", None, "a positive number"), ("rope_theta", "1e4", "a positive number"),
                               ("initializer_range", None, "a non-negative std")):
        (tmp_path / "m" / "config.json").write_text(json.dumps({**good, field: value}))
        capsys.readouterr()
        assert main(["convert", str(tmp_path / "m"), str(tmp_path / "authors"), "--to", "fox-authors"]) == 2
        assert f"error: {field}: expected {want}, got {value!r}" in capsys.readouterr().err
    assert not (tmp_path / "authors").exists()


def test_a_tokenizer_named_for_the_authors_format_is_refused(tmp_path, capsys):
    """--tokenizer with --to fox-authors: one line naming it (it was dropped without a word, DST carrying what SRC
    records instead)."""
    FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", vocab_size=300)).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="tokenizer: --to fox-authors carries the tokenizer SRC records; --tokenizer "
                                         "names the one to record converting to foxlm"):
        convert(tmp_path / "m", tmp_path / "authors", to="fox-authors", tokenizer="byte")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "m"), str(tmp_path / "authors"), "--to", "fox-authors", "--tokenizer",
                 "byte"]) == 2
    assert capsys.readouterr().err.startswith("foxlm convert: error: tokenizer: --to fox-authors")
    assert not (tmp_path / "authors").exists()


@pytest.mark.parametrize("change, message", [
    (dict(qk_norm_eps=None), r"their QK-norm epsilon is 1e-05 \(fixed in their code\); this model's is 1e-06: a "
                             r"model trained with model.qk_norm_eps=1.0e-5 \(the fox-pro and transformer-pro "
                             r"presets' value\) converts"),
    (dict(gate="alibi"), "gate='alibi' has no counterpart"),
    (dict(num_key_value_heads=2), "num_key_value_heads: their FoX class has no GQA"),
    (dict(window=16), "window: their FoX class has no sliding window"),
])
def test_foxlm_models_the_authors_classes_cannot_express_are_errors(change, message, tmp_path):
    FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", vocab_size=V, **change)).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=f"--to fox-authors: {message}"):
        convert(tmp_path / "m", tmp_path / "authors", to="fox-authors")
    assert not (tmp_path / "authors").exists()


def test_sharded_bin_and_old_config_fields(tmp_path):
    """A pytorch_model.bin (read with weights_only) split over two shards, with no dtype field, a null
    max_position_embeddings and a null rope_base (no RoPE: not read); --dtype bfloat16 casts (all but the gate)."""
    gen = torch.Generator().manual_seed(3)
    cfg = {**authors_config(**AUTHORS_ARCHS["fox-llama"]), "rope_base": None}
    del cfg["torch_dtype"]
    sd = authors_weights(cfg, gen)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    names = sorted(sd)
    shards = {"pytorch_model-1.bin": names[: len(names) // 2], "pytorch_model-2.bin": names[len(names) // 2:]}
    for file, keys in shards.items():
        torch.save({k: sd[k] for k in keys}, src / file)
    (src / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    assert read_folder(src)[1].keys() == sd.keys()
    convert(src, tmp_path / "f32")
    convert(src, tmp_path / "bf16", dtype="bfloat16")
    assert all(t.dtype == torch.float32 for t in load_file(tmp_path / "f32" / "model.safetensors").values())
    assert all(t.dtype == (torch.float32 if "fgate_proj" in k else torch.bfloat16)
               for k, t in load_file(tmp_path / "bf16" / "model.safetensors").items())


def test_a_damaged_index_shard_or_tokenizer_config_is_an_error_naming_the_file(tmp_path):
    """A source folder whose index, shards or tokenizer_config.json are damaged: one error naming the file (these were
    KeyError, AttributeError and TypeError tracebacks), and a tensor in two shards is refused, not one copy dropped."""
    gen = torch.Generator().manual_seed(3)
    cfg = authors_config(**AUTHORS_ARCHS["fox-llama"])
    sd = authors_weights(cfg, gen)
    names = sorted(sd)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    cases = {
        "no-weight-map": ({"metadata": {}}, {}, "expected a weight_map of tensor names to shard files"),
        "list-weight-map": ({"weight_map": ["a.bin"]}, {}, "expected a weight_map of tensor names to shard files"),
        "outside": ({"weight_map": {"x": "../other/a.bin"}}, {}, "shard '../other/a.bin' is not a file of its folder"),
        "missing-shard": ({"weight_map": {"x": "a.bin", "y": "b.bin"}}, {"a.bin": sd},
                          "b.bin, a shard pytorch_model.bin.index.json names, is missing"),
        "twice": ({"weight_map": {"x": "a.bin", "y": "b.bin"}},
                  {"a.bin": {k: sd[k] for k in first}, "b.bin": {k: sd[k] * 2 for k in [first[0], *second]}},
                  f"src: {first[0]} is in .*b.bin and in an earlier shard"),
        "not-a-dict": ({"weight_map": {"x": "a.bin"}}, {"a.bin": [sd[first[0]]]}, "a.bin holds no state dict"),
    }
    for name, (index, shards, message) in cases.items():
        src = tmp_path / name
        src.mkdir()
        (src / "config.json").write_text(json.dumps(cfg))
        (src / "pytorch_model.bin.index.json").write_text(json.dumps(index))
        for file, state in shards.items():
            torch.save(state, src / file)
        with pytest.raises(ValueError, match=message):
            convert(src, tmp_path / "dst")
        assert main(["convert", str(src), str(tmp_path / "dst")]) == 2
    byte_rows = {k: torch.randn(257, C, generator=gen) for k in ("model.embeddings.weight", "lm_head.weight")}
    _write(tmp_path / "tok", {**cfg, "vocab_size": 257}, {**sd, **byte_rows})  # rows for the byte tokenizer's ids
    for text, message in (("{bad", "not valid JSON"), ("[1]", "expected a JSON object, found a list")):
        (tmp_path / "tok" / "tokenizer_config.json").write_text(text)
        with pytest.raises(ValueError, match=f"tokenizer_config.json: {re.escape(message)}.*; pass --tokenizer"):
            convert(tmp_path / "tok", tmp_path / "dst")
    convert(tmp_path / "tok", tmp_path / "dst", tokenizer="byte")  # not read when --tokenizer names one


def test_auto_dtype_is_the_weights_never_a_narrower_label(tmp_path):
    """--dtype auto keeps the weights' dtype (bf16 stays bf16, both ways); a config.json whose dtype label says
    bfloat16 over float32 weights no longer casts them down, and weights of mixed dtypes become float32."""
    gen = torch.Generator().manual_seed(4)
    cfg = authors_config(**AUTHORS_ARCHS["fox-pro"])
    sd = authors_weights(cfg, gen)
    cases = {"bf16": ("bfloat16", {k: v.bfloat16() for k, v in sd.items()}, torch.bfloat16),
             "mislabelled": ("bfloat16", sd, torch.float32),
             "mixed": ("float32", {k: v.half() if k.startswith("model.layers.1.") else v for k, v in sd.items()},
                       torch.float32)}
    for name, (label, weights, want) in cases.items():
        _write(tmp_path / name, {**cfg, "torch_dtype": label}, weights)
        convert(tmp_path / name, tmp_path / f"{name}-fox")
        got = load_file(tmp_path / f"{name}-fox" / "model.safetensors")
        assert {t.dtype for t in got.values()} == {want}, name
        if name == "mislabelled":
            assert all(torch.equal(got[k], sd[k]) for k in ("lm_head.weight", "model.norm.weight"))
    convert(tmp_path / "bf16-fox", tmp_path / "bf16-authors", to="fox-authors")
    assert {t.dtype for t in load_file(tmp_path / "bf16-authors" / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16-authors" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("change, message", [
    (dict(fgate_type="fixed", fgate_bias_init=True, decay_time_min=1.0, decay_time_max=9.0), "fgate_type='fixed'"),
    (dict(ogate_act="silu", use_output_gate=True), "ogate_act='silu'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(window_size=8), "window_size=8"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings=True"),
    (dict(some_new_flag=1), "some_new_flag: unknown to foxlm's converter"),
    (dict(intermediate_size=100), "intermediate_size=100, but the weights have 256"),
    (dict(hidden_ratio=3), "hidden_ratio=3 gives an MLP of 256"),
    (dict(num_heads=None), "num_heads is missing"),
    (dict(use_rope="false"), "use_rope='false'; expected true or false"),  # was read as true: RoPE added
    (dict(num_heads=0), "num_heads=0; expected a positive int"),  # these were tracebacks
    (dict(hidden_size="64"), "hidden_size='64'; expected a positive int"),
    (dict(hidden_ratio="4"), "hidden_ratio='4'; expected a positive number"),
    (dict(log_pruning_tolerance="-10"), "log_pruning_tolerance='-10'; expected a number"),
    (dict(num_kv_heads=0), "num_kv_heads=0; expected a positive int"),  # was read as "no GQA"
    (dict(norm_eps=None), "norm_eps is missing"),  # a TypeError traceback
    (dict(log_pruning_tolerance=5.0), "log_pruning_tolerance=5.0; expected a negative number"),  # named acp_tolerance
    (dict(log_pruning_tolerance=-math.inf), "log_pruning_tolerance=-inf; expected a negative number"),
    (dict(bos_token_id="1"), "bos_token_id='1'; expected a token id"),  # was written into the foxlm config
    (dict(eos_token_id=[2, -1]), r"eos_token_id=\[2, -1\]; expected a token id"),
])
def test_flags_foxlm_cannot_represent_are_errors_naming_them(change, message, tmp_path):
    gen = torch.Generator().manual_seed(0)
    base = authors_config(**AUTHORS_ARCHS["fox-llama"])
    sd = authors_weights(base, gen)
    if change.get("hidden_ratio") == 3:  # weights of a 4x MLP under a config that says 3x (2*64 -> 256 as well)
        sd = authors_weights(authors_config(model_type=AUTHORS_FOX, intermediate_size=192), gen)
    _write(tmp_path / "src", {**base, **change}, sd)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        convert(tmp_path / "src", tmp_path / "dst")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    assert not (tmp_path / "dst").exists()


def test_weights_that_do_not_fit_the_config_are_errors(tmp_path):
    gen = torch.Generator().manual_seed(0)
    cfg = authors_config(**AUTHORS_ARCHS["fox-llama"])
    sd = authors_weights(cfg, gen)
    _write(tmp_path / "extra", cfg, {**sd, "model.layers.0.attn.ogate_proj.weight": torch.randn(C, C)})
    with pytest.raises(ValueError, match="ogate_proj.weight: not part of the model"):
        convert(tmp_path / "extra", tmp_path / "dst")
    del sd["model.layers.1.attn.fgate_proj.bias"]
    _write(tmp_path / "missing", cfg, sd)
    with pytest.raises(ValueError, match=r"model.layers.1.attn.fgate_proj.bias is missing"):
        convert(tmp_path / "missing", tmp_path / "dst")


def test_weights_of_the_wrong_shape_are_errors_naming_them_in_both_directions(tmp_path):
    """A tensor whose shape the config does not give is refused naming it: from the authors' format (was a
    load_state_dict or view traceback) and to it (a foxlm folder with a wrong-shaped or missing tensor was written
    out as a complete authors' folder, or was a KeyError traceback)."""
    gen = torch.Generator().manual_seed(0)
    cfg = authors_config(**AUTHORS_ARCHS["fox-pro"])
    sd = authors_weights(cfg, gen)
    cases = {"model.layers.0.attn.q_proj.weight": torch.randn(C, C // 2),  # loaded into the model: size mismatch
             "model.layers.1.attn.output_norm.weight": torch.randn(C + H),  # viewed as [H, D] first
             "model.layers.0.mlp.gate_proj.weight": torch.randn(2 * 256 + 2, C)}  # split in two halves
    for name, bad in cases.items():
        _write(tmp_path / name, cfg, {**sd, name: bad})
        assert main(["convert", str(tmp_path / name), str(tmp_path / "dst")]) == 2
        with pytest.raises(ValueError, match=re.escape(f"weights: {name} has shape {list(bad.shape)}, but the "
                                                       "config asks for")):
            convert(tmp_path / name, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    _write(tmp_path / "src", cfg, sd)
    convert(tmp_path / "src", tmp_path / "fox")
    fox = load_file(tmp_path / "fox" / "model.safetensors")
    for name, change in (("wrong", {"model.layers.0.attn.q_proj.weight": torch.randn(3, 3)}),
                         ("missing", {"lm_head.weight": None})):
        (tmp_path / name).mkdir()
        shutil.copy(tmp_path / "fox" / "config.json", tmp_path / name)
        save_file({k: change.get(k, v) for k, v in fox.items() if change.get(k, v) is not None},
                  str(tmp_path / name / "model.safetensors"))
        message = "has shape [3, 3], but the config asks for [64, 64]" if name == "wrong" else \
            "lm_head.weight is missing"
        with pytest.raises(ValueError, match=re.escape(message)):
            convert(tmp_path / name, tmp_path / "authors", to="fox-authors")
        assert main(["convert", str(tmp_path / name), str(tmp_path / "authors"), "--to", "fox-authors"]) == 2
    assert not (tmp_path / "authors").exists()


def test_dst_is_never_clobbered_without_overwrite(tmp_path):
    gen = torch.Generator().manual_seed(0)
    cfg = authors_config(**AUTHORS_ARCHS["fox-llama"])
    _write(tmp_path / "src", cfg, authors_weights(cfg, gen))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.txt").write_text("irreplaceable")
    with pytest.raises(ValueError, match="not a foxlm or FoX-authors model folder"):
        convert(tmp_path / "src", notes, overwrite=True)
    assert (notes / "thesis.txt").read_text() == "irreplaceable"
    convert(tmp_path / "src", tmp_path / "dst")
    with pytest.raises(ValueError, match="pass overwrite=True"):
        convert(tmp_path / "src", tmp_path / "dst")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "notes", "src"]  # no temporary folder left
    with pytest.raises(ValueError, match="is the source folder; convert into another folder"):
        convert(tmp_path / "src", tmp_path / "src", overwrite=True)
    with pytest.raises(ValueError, match="src_format: .* holds a 'fox-authors' model"):
        convert(tmp_path / "src", tmp_path / "d2", src_format="fla")


def test_overwrite_replaces_only_what_convert_wrote(tmp_path, monkeypatch, capsys):
    """``convert proj/src proj --overwrite`` on a project folder holding a converted model, notes, results and the
    source itself: refused, every file kept (it used to replace the whole folder); so is a home folder that holds a
    model, and a model folder with other files beside the model."""
    gen = torch.Generator().manual_seed(0)
    cfg = authors_config(**AUTHORS_ARCHS["fox-llama"])
    proj = tmp_path / "proj"
    _write(proj / "src", cfg, authors_weights(cfg, gen))
    convert(proj / "src", tmp_path / "model")
    for f in (tmp_path / "model").iterdir():  # the project's own converted model, beside its source
        shutil.copy(f, proj)
    (proj / "NOTES.md").write_text("my notes")
    (proj / "my_eval_results").mkdir()
    (proj / "my_eval_results" / "run1.csv").write_text("step,loss\n1,2.0\n")

    def files(folder):
        return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    before = files(proj)
    assert main(["convert", str(proj / "src"), str(proj), "--overwrite"]) == 2
    assert f"dst: {proj} holds the source {proj / 'src'}; convert into a folder outside it" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "model"), str(proj), "--to", "fox-authors", "--overwrite"]) == 2
    assert "holds files convert did not write (NOTES.md, my_eval_results, src); --overwrite replaces only a folder " \
           "holding nothing but a converted model: convert into a new folder" in capsys.readouterr().err
    assert files(proj) == before

    home = tmp_path / "home"
    shutil.copytree(tmp_path / "model", home)  # a home folder that happens to hold a model
    (home / ".bashrc").write_text("export PATH")
    monkeypatch.setenv("HOME", str(home))
    before = files(home)
    assert main(["convert", str(proj / "src"), "~", "--overwrite"]) == 2
    assert f"dst: {home} is the home folder; convert into a folder of its own" in capsys.readouterr().err
    assert files(home) == before

    # a folder holding nothing but a converted model is still replaced; "." names the folder it is run in
    assert main(["convert", str(proj / "src"), str(tmp_path / "model"), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert main(["convert", str(proj / "src"), "."]) == 0
    assert (tmp_path / "here" / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_overwrite_never_replaces_a_checkpoints_model(tmp_path, capsys):
    """A run checkpoint's model/ (a foxlm model folder with its tokenizer's copy) is part of the checkpoint: --overwrite
    refuses it, and the checkpoint stays valid (replacing it broke the checkpoint's sha256 manifest, so a resumed
    run fell back to an older checkpoint or started over)."""
    from tokenizer_folders import llama_style_tokenizer
    from train.runs import tiny_config

    from foxlm.checkpoint.manifest import verify_checkpoint
    from foxlm.train import latest_valid_checkpoint, train

    plays = random.Random(0).sample(shakespeare_plays(), 2)
    folder = llama_style_tokenizer(tmp_path / "tok", [p.read_text() for p in plays], vocab_size=300)
    prepare(plays, tmp_path / "data", tokenizer=str(folder), val_fraction=0.5, workers=0, progress=False)
    train(tiny_config(tmp_path / "data", tmp_path / "run", f"tokenizer=hf:{folder.resolve()}", "max_steps=1"))
    ckpt = latest_valid_checkpoint(tmp_path / "run")
    assert main(["convert", str(ckpt / "model"), str(tmp_path / "authors"), "--to", "fox-authors"]) == 0
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "authors"), str(ckpt / "model"), "--overwrite"]) == 2
    assert f"dst: {ckpt / 'model'} is part of the checkpoint {ckpt}; convert into a folder of its own" \
        in capsys.readouterr().err
    assert verify_checkpoint(ckpt) is None


def test_overwrite_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path, monkeypatch):
    """DST a symlink to a converted model, --overwrite: was an rmtree traceback after the swap, the link replaced by a
    real folder and a `.LINK.foxlm-old-PID` link left behind; now the model where it points is replaced, every file
    flushed to disk before the swap. A DST under a file is one line naming that file."""
    gen = torch.Generator().manual_seed(0)
    cfg = authors_config(**AUTHORS_ARCHS["fox-llama"])
    _write(tmp_path / "src", cfg, authors_weights(cfg, gen))
    convert(tmp_path / "src", tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "link"), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real", "src"]
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link").resolve() == tmp_path / "real"
    assert load_file(tmp_path / "real" / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    written = sorted(p.name for p in (tmp_path / "real").iterdir())
    assert sorted(Path(f).name for f in synced if ".real.foxlm-tmp-" in f) == written
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"dst: {tmp_path / 'file'} is a file, not a folder to write"):
        convert(tmp_path / "src", tmp_path / "file" / "sub" / "out")


def test_a_damaged_config_is_named(tmp_path):
    """A damaged config.json is an error naming the file, under convert and loading (json's own names none)."""
    from foxlm.models.loading import load_checkpoint_model

    gen = torch.Generator().manual_seed(0)
    cfg = authors_config(**AUTHORS_ARCHS["fox-llama"])
    _write(tmp_path / "src", cfg, authors_weights(cfg, gen))
    convert(tmp_path / "src", tmp_path / "model")
    for folder in (tmp_path / "src", tmp_path / "model"):
        (folder / "config.json").write_text('{"model_type": "fox", ')
    with pytest.raises(ValueError, match="config.json does not match its sha256"):  # convert's manifest saw it
        load_checkpoint_model(tmp_path / "model")
    (tmp_path / "model" / "manifest.json").unlink()  # a folder with no manifest (e.g. from the hub) is parsed
    expected = f"^{re.escape(str(tmp_path / 'src' / 'config.json'))}: not valid JSON \\(.*\\); the model folder is " \
               "damaged"
    with pytest.raises(ValueError, match=expected):
        convert(tmp_path / "src", tmp_path / "dst")
    with pytest.raises(ValueError, match=expected.replace("src", "model")):
        load_checkpoint_model(tmp_path / "model")


def test_a_run_or_checkpoint_folder_converts_its_model_and_a_missing_src_is_named(tmp_path, capsys):
    """SRC may be a run folder (its latest valid checkpoint) or a checkpoint folder, as for generate and eval (both
    were 'holds no config.json'); a SRC that does not exist says so."""
    from train.runs import tiny_config

    from foxlm.train import latest_valid_checkpoint, train

    data = tmp_path / "bytes"
    prepare(shakespeare_plays()[:2], data, tokenizer="byte", val_fraction=0.5, workers=0, progress=False)
    run = tmp_path / "run"
    train(tiny_config(data, run, "arch=fox-pro", "model.qk_norm_eps=1.0e-5", "max_steps=2", "save_every=1"))
    ckpt = latest_valid_checkpoint(run)
    convert(ckpt / "model", tmp_path / "from-model", to="fox-authors")
    want = load_file(tmp_path / "from-model" / "model.safetensors")
    for src in (run, ckpt):
        assert main(["convert", str(src), str(tmp_path / f"from-{src.name}"), "--to", "fox-authors"]) == 0
        got = load_file(tmp_path / f"from-{src.name}" / "model.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "dst")]) == 2
    assert f"src: {tmp_path / 'nothing'} does not exist" in capsys.readouterr().err


def test_a_damaged_tokenizer_record_is_an_error_naming_the_field(tmp_path):
    """A foxlm_tokenizer in SRC's config.json that is no record: an error naming it (these were KeyError and
    AttributeError tracebacks, and a string record was passed over for the authors' default tokenizer)."""
    gen = torch.Generator().manual_seed(0)
    cfg = authors_config(**AUTHORS_ARCHS["fox-llama"])
    sd = authors_weights(cfg, gen)
    cfg["vocab_size"] = 257  # rows for the byte tokenizer's ids
    sd.update({k: torch.randn(257, C, generator=gen) for k in ("model.embeddings.weight", "lm_head.weight")})
    for i, record in enumerate(({}, {"name": 3}, "gpt2")):
        _write(tmp_path / f"src{i}", {**cfg, "foxlm_tokenizer": record}, sd)
        with pytest.raises(ValueError, match=f"src: .*config.json records foxlm_tokenizer={re.escape(repr(record))}, "
                                             "expected a tokenizer record .*; pass --tokenizer"):
            convert(tmp_path / f"src{i}", tmp_path / "dst")
        assert main(["convert", str(tmp_path / f"src{i}"), str(tmp_path / "dst")]) == 2
    convert(tmp_path / "src0", tmp_path / "dst", tokenizer="byte")  # not read when --tokenizer names one
    assert FoxForCausalLM.from_pretrained(tmp_path / "dst").config.foxlm_tokenizer["name"] == "byte"


# --------------------------------------------------------------------------------------------------------- fla
def _fla_on_cpu(monkeypatch):
    """fla's model code with its Triton-only kernels replaced by PyTorch: its GroupNorm by fla's group_norm_ref, its
    SwiGLU by silu(g) * y, its attention by fla's naive_forgetting_attn (prefill) and ``_decode_step`` (one query
    per sequence against its cache). ``test_fla_cpu_replacements_match_fla_references`` checks these."""
    fla_attn = pytest.importorskip("fla.layers.forgetting_attn")
    import fla.modules.mlp as fla_mlp
    from fla.modules import GroupNorm
    from fla.modules.norm.layernorm import group_norm_ref
    from fla.ops.forgetting_attn.naive import naive_forgetting_attn

    def prefill(q, k, v, g, scale=None, window_size=None, cu_seqlens=None):
        if cu_seqlens is not None:  # a padded batch, unpadded to one row: attend within each sequence
            outs = [naive_forgetting_attn(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], scale)
                    for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
            return torch.cat(outs, 1).to(q.dtype)
        return naive_forgetting_attn(q, k, v, g, scale, window_size).to(q.dtype)

    monkeypatch.setattr(fla_attn, "parallel_forgetting_attn", prefill)
    monkeypatch.setattr(fla_attn, "attn_decoding_one_step", _decode_step)
    monkeypatch.setattr(fla_mlp, "swiglu", lambda g, y: F.silu(g) * y)
    monkeypatch.setattr(GroupNorm, "forward", lambda self, x, *args, **kw: group_norm_ref(
        x, self.weight, self.bias, num_groups=self.num_groups, eps=self.eps, is_rms_norm=self.is_rms_norm))


def _decode_step(q, k, v, g, scale=None, cu_seqlens=None, **kw):
    """fla's attn_decoding_one_step in PyTorch: q [1, B, HQ, D], k/v [1, sum T, H, D], g [1, sum T, HQ]; query b
    is the last token of sequence b (cu_seqlens)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    for b, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        c = g[0, s:e].float().cumsum(0)  # [T, HQ]
        rep = q.shape[2] // k.shape[2]
        kk, vv = k[0, s:e].repeat_interleave(rep, 1).float(), v[0, s:e].repeat_interleave(rep, 1).float()
        logits = torch.einsum("hd,thd->ht", q[0, b].float() * scale, kk) + (c[-1][:, None] - c.T)
        outs.append(torch.einsum("ht,thd->hd", logits.softmax(-1), vv))
    return torch.stack(outs)[None].to(q.dtype)


def test_fla_cpu_replacements_match_fla_references():
    pytest.importorskip("fla")
    from fla.modules.activations import swiglu  # noqa: F401  (the Triton op replaced; its math is silu(x) * y)
    from fla.modules.norm.layernorm import group_norm_ref
    from fla.ops.forgetting_attn.naive import naive_forgetting_attn

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 4, 8, generator=gen) for _ in range(3))
    g = F.logsigmoid(torch.randn(1, 9, 4, generator=gen) + 2)
    full = naive_forgetting_attn(q, k, v, g)
    # the decoding step of every prefix equals the last row of fla's reference on that prefix
    for t in (1, 5, 9):
        step = _decode_step(q[:, t - 1: t], k[:, :t], v[:, :t], g[:, :t], cu_seqlens=torch.tensor([0, t]))
        torch.testing.assert_close(step[0, 0], naive_forgetting_attn(q[:, :t], k[:, :t], v[:, :t], g[:, :t])[0, -1])
    torch.testing.assert_close(full[0, -1], _decode_step(q[:, -1:], k, v, g, cu_seqlens=torch.tensor([0, 9]))[0, 0])
    # group_norm_ref with is_rms_norm is a per-group RMSNorm: the math the model's GroupNorm kernel computes
    x, w = torch.randn(3, 32, generator=gen), torch.randn(32, generator=gen)
    y = group_norm_ref(x, w, None, num_groups=4, eps=1e-5, is_rms_norm=True)
    xs = x.view(3, 4, 8)
    torch.testing.assert_close(y, (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(3, 32) * w)


@pytest.mark.parametrize("variant", [dict(), dict(qk_norm=True, use_output_gate=True, num_kv_heads=2)])
def test_fla_forgetting_transformer_converts_with_equal_logits_and_greedy_tokens(variant, tmp_path, monkeypatch):
    _fla_on_cpu(monkeypatch)
    from fla.models import ForgettingTransformerConfig, ForgettingTransformerForCausalLM

    torch.manual_seed(5)
    cfg = ForgettingTransformerConfig(hidden_size=C, num_hidden_layers=L, num_heads=H, vocab_size=V,
                                      intermediate_size=96, fuse_norm=False, fuse_swiglu=False,
                                      fuse_cross_entropy=False, **variant)
    fla_model = ForgettingTransformerForCausalLM(cfg).float().eval()
    with torch.no_grad():  # move the norms and gate biases off their initial values
        for name, p in fla_model.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name or name.endswith("bias") else 0.05))
    fla_model.save_pretrained(tmp_path / "fla", max_shard_size="100KB")  # sharded safetensors
    assert (tmp_path / "fla" / "model.safetensors.index.json").is_file()
    assert main(["convert", str(tmp_path / "fla"), str(tmp_path / "dst"), "--from", "fla"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert getattr(model.config, "foxlm_tokenizer", None) is None  # fla records no tokenizer foxlm knows
    ids = torch.randint(0, V, (2, T))
    with torch.no_grad():
        assert _rel(model(ids).logits, fla_model(ids).logits) < RTOL
    prompt = ids[:1, :6]
    with torch.no_grad():
        want = _fla_greedy_with_cache(fla_model, prompt, 8)
        assert torch.equal(want, _greedy(lambda x: fla_model(x).logits, prompt, 8))
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), want)


@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "GPT2TokenizerFast"])
def test_an_fla_folder_carrying_its_tokenizer_converts_with_it(tokenizer_class, tmp_path, monkeypatch):
    """An fla checkpoint saved with its tokenizer (``tokenizer.save_pretrained``): DST records and carries that
    tokenizer, so a text through AutoTokenizer of either folder gives the same logits, and `foxlm generate` reads it.
    (A class other than GPT-2's was dropped, leaving DST without a tokenizer; a GPT2TokenizerFast of another
    vocabulary was recorded as GPT-2 BPE by its class name, and DST carried GPT-2's files.) A slow GPT-2 folder whose
    vocab.json is not GPT-2's is refused naming it."""
    _fla_on_cpu(monkeypatch)
    import transformers
    from fla.models import ForgettingTransformerConfig, ForgettingTransformerForCausalLM
    from tokenizer_folders import llama_style_tokenizer
    from transformers import AutoTokenizer

    plays = random.Random(0).sample(shakespeare_plays(), 2)
    folder = llama_style_tokenizer(tmp_path / "tok", [p.read_text() for p in plays], vocab_size=300)
    torch.manual_seed(5)
    fla_model = ForgettingTransformerForCausalLM(ForgettingTransformerConfig(
        hidden_size=C, num_hidden_layers=L, num_heads=H, vocab_size=320, intermediate_size=96, fuse_norm=False,
        fuse_swiglu=False, fuse_cross_entropy=False)).float().eval()
    src = tmp_path / "fla"
    fla_model.save_pretrained(src)
    getattr(transformers, tokenizer_class)(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<s>",
                                           eos_token="</s>").save_pretrained(src)
    folder.rename(tmp_path / "moved")  # DST must carry its own copy
    assert main(["convert", str(src), str(tmp_path / "dst")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert model.config.foxlm_tokenizer["vocab_size"] <= 320 and model.config.foxlm_tokenizer["name"] != "gpt2"
    text = "To be, or not to be"
    want = AutoTokenizer.from_pretrained(src)(text, return_tensors="pt").input_ids
    got = AutoTokenizer.from_pretrained(tmp_path / "dst")(text, return_tensors="pt").input_ids
    assert torch.equal(got[:, 1:], want)  # foxlm's copy starts a text with its end-of-text token, as its data does
    with torch.no_grad():
        assert _rel(model(want).logits, fla_model(want).logits) < RTOL
    assert main(["generate", str(tmp_path / "dst"), "--prompt", "To be", "--max-new-tokens", "3", "--device",
                 "cpu"]) == 0
    # a slow GPT-2 tokenizer's files (vocab.json, merges.txt) of another vocabulary, with no tokenizer.json
    content = json.loads((src / "tokenizer.json").read_text())["model"]
    (src / "tokenizer.json").unlink()
    (src / "vocab.json").write_text(json.dumps(content["vocab"]))
    (src / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in content["merges"]) + "\n")
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    with pytest.raises(ValueError, match=re.escape(f"src: {src / 'vocab.json'} is not GPT-2's, though "
                                                   "tokenizer_config.json names GPT2Tokenizer; pass --tokenizer")):
        convert(src, tmp_path / "dst2")
    assert not (tmp_path / "dst2").exists()


def test_a_folder_saved_over_in_another_sharding_converts_what_from_pretrained_loads(tmp_path, monkeypatch):
    """save_pretrained unsharded over a sharded save leaves the index (its shards deleted), and sharded over an
    unsharded one leaves model.safetensors: from_pretrained reads model.safetensors first, and so does convert, whose
    model gives the logits of the model fla loads. (Convert read the index first: the first folder was refused as
    damaged, a shard missing, and the second converted other weights than fla's model has.)"""
    _fla_on_cpu(monkeypatch)
    from fla.models import ForgettingTransformerConfig, ForgettingTransformerForCausalLM

    torch.manual_seed(6)
    fla_model = ForgettingTransformerForCausalLM(ForgettingTransformerConfig(
        hidden_size=C, num_hidden_layers=L, num_heads=H, vocab_size=V, intermediate_size=96, fuse_norm=False,
        fuse_swiglu=False, fuse_cross_entropy=False)).float()
    ids = torch.randint(0, V, (2, T))
    for name, shard_sizes in (("unsharded-last", ["100KB", "5GB"]), ("sharded-last", ["5GB", "100KB"])):
        for size in shard_sizes:  # the second save's weights differ from the first's
            with torch.no_grad():
                for p in fla_model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            fla_model.save_pretrained(tmp_path / name, max_shard_size=size)
        assert {"model.safetensors", "model.safetensors.index.json"} <= {f.name for f in (tmp_path / name).iterdir()}
        assert main(["convert", str(tmp_path / name), str(tmp_path / f"{name}-fox")]) == 0
        model = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-fox").eval()
        loaded = ForgettingTransformerForCausalLM.from_pretrained(tmp_path / name).float().eval()
        with torch.no_grad():
            assert _rel(model(ids).logits, loaded(ids).logits) < RTOL, name


def _fla_greedy_with_cache(fla_model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding through fla's own cache, one token a step. (fla 0.6's ``generate`` passes its cache as
    ``past_key_values``, which transformers 5.25 renamed to ``cache``; its model would start afresh each step.)"""
    out = fla_model(ids, use_cache=True, attention_mask=torch.ones_like(ids))
    for _ in range(n):
        ids = torch.cat([ids, out.logits[:, -1].argmax(-1, keepdim=True)], 1)
        out = fla_model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True,
                        attention_mask=torch.ones_like(ids))
    return ids


# ------------------------------------------------------------------------------------------------- tokenizer
def test_json_gpt2_tokenizer_round_trips_and_escapes_like_the_authors():
    tok = get_tokenizer("json-gpt2")
    gpt2 = get_tokenizer("gpt2")
    texts = ['He said "hi"\n\tthen left.', "naïve café — 日本語 🦊", "back\\slash {\"json\": [1, 2]}\r\n", ""]
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert ids == gpt2.encode(json.dumps(text)[1:-1])  # what the authors' prepare_for_tokenization feeds BPE
    assert tok.encode('a"b\n') == gpt2.encode('a\\"b\\n')
    assert (tok.vocab_size, tok.eot_id) == (gpt2.vocab_size, gpt2.eot_id)
    assert tok.spec()["name"] == "json-gpt2" and tok.spec()["fingerprint"] == gpt2.spec()["fingerprint"]
    cut = tok.encode("é!")[:-1]  # decoding stops inside an escape: whatever is whole comes back
    assert tok.decode(cut) in ("é", "")


def _gpt2_tokenizer_folders(root: Path) -> dict[str, Path]:
    """GPT-2's tokenizer as the authors' folders may carry it, from GPT-2's own files: "authors", as their
    save_model.py writes it (transformers 4.44 saving their slow JSONGPT2Tokenizer: GPT-2's vocab.json and merges.txt,
    tokenizer_config.json naming their class); "slow", the same files saved through GPT2Tokenizer; "fast", GPT-2 as
    transformers 5 saves it (a tokenizer.json, tokenizer_config.json naming GPT2Tokenizer)."""
    import transformers

    from foxlm.data.assets import gpt2_files

    encoder, bpe = gpt2_files()
    folders = {name: root / name for name in ("authors", "slow", "fast")}
    settings = {"add_bos_token": True, "add_prefix_space": False, "bos_token": "<|endoftext|>",
                "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
                "model_max_length": 16384, "pad_token": None, "unk_token": "<|endoftext|>"}
    for name, cls in (("authors", "JSONGPT2Tokenizer"), ("slow", "GPT2Tokenizer")):
        folders[name].mkdir(parents=True)
        shutil.copyfile(encoder, folders[name] / "vocab.json")
        shutil.copyfile(bpe, folders[name] / "merges.txt")
        (folders[name] / "special_tokens_map.json").write_text(json.dumps(
            {k: "<|endoftext|>" for k in ("bos_token", "eos_token", "unk_token")}))
        (folders[name] / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": cls}))
    transformers.AutoTokenizer.from_pretrained(folders["slow"]).save_pretrained(folders["fast"])
    assert (folders["fast"] / "tokenizer.json").is_file()
    return folders


def _with_files_of(src: Path, folder: Path) -> Path:
    for file in folder.iterdir():
        shutil.copyfile(file, src / file.name)
    return src


def test_an_authors_folder_carrying_gpt2_tokenizer_files_records_json_gpt2(tmp_path):
    """The authors' models saw GPT-2 BPE of JSON-escaped text only (LongCrawl64): an authors' folder carrying GPT-2's
    tokenizer files records json-gpt2 whatever class saved them, so `foxlm eval` and `generate` encode a text as the
    authors' tokenizer does; --tokenizer still says otherwise, and a tokenizer of another vocabulary (their SlimPajama
    runs saved another one) is recorded as it is. (Saved through GPT2Tokenizer, or as a tokenizer.json, they recorded
    GPT-2 on raw text: a newline or quote became other ids than the model was trained on.)"""
    from tokenizer_folders import llama_style_tokenizer

    from foxlm.data.tokenizer import model_tokenizer

    gen = torch.Generator().manual_seed(8)
    cfg = authors_config(**{**AUTHORS_ARCHS["fox-llama"], "vocab_size": 50304, "num_hidden_layers": 1})
    sd = {k: v for k, v in authors_weights({**cfg, "num_hidden_layers": L}, gen).items() if "layers.1." not in k}
    sd["model.embeddings.weight"], sd["lm_head.weight"] = (torch.randn(50304, C, generator=gen) for _ in range(2))
    text = 'She said "café"\n\tand left'
    escaped = get_tokenizer("gpt2").encode(json.dumps(text)[1:-1])
    assert escaped != get_tokenizer("gpt2").encode(text)
    for name, folder in _gpt2_tokenizer_folders(tmp_path / "tokenizers").items():
        _write(tmp_path / name, cfg, sd)
        convert(_with_files_of(tmp_path / name, folder), tmp_path / f"{name}-dst")
        config = FoxConfig.from_pretrained(tmp_path / f"{name}-dst")
        assert config.foxlm_tokenizer["name"] == "json-gpt2", name
        assert model_tokenizer(config).encode(text) == escaped, name
    assert main(["convert", str(tmp_path / "fast"), str(tmp_path / "raw"), "--tokenizer", "gpt2"]) == 0
    assert FoxConfig.from_pretrained(tmp_path / "raw").foxlm_tokenizer["name"] == "gpt2"
    plays = random.Random(0).sample(shakespeare_plays(), 2)
    other = llama_style_tokenizer(tmp_path / "llama-tok", [p.read_text() for p in plays], vocab_size=300)
    _write(tmp_path / "llama", cfg, sd)
    convert(_with_files_of(tmp_path / "llama", other), tmp_path / "llama-dst")
    config = FoxConfig.from_pretrained(tmp_path / "llama-dst")
    assert model_tokenizer(config).encode(text) == get_tokenizer(str(other)).encode(text)


def test_a_tokenizer_with_more_ids_than_the_model_has_rows_is_refused(tmp_path, capsys):
    """A tokenizer whose ids pass the model's embedding rows, named by --tokenizer, recorded in SRC or carried in its
    files: refused in one line naming --tokenizer, DST not written (it was recorded, and its ids indexed past the
    embedding later). The authors' default, guessed for a folder that names no tokenizer, is left unrecorded instead,
    saying so: such a model was not trained on their data."""
    gen = torch.Generator().manual_seed(9)
    cfg = authors_config(**AUTHORS_ARCHS["fox-llama"])
    sd = authors_weights(cfg, gen)
    _write(tmp_path / "src", cfg, sd)
    too_many = f"tokenizer: gpt2 (--tokenizer) has 50257 ids, more than the model's vocabulary of {V}; pass --tokenizer"
    with pytest.raises(ValueError, match=re.escape(too_many)):
        convert(tmp_path / "src", tmp_path / "dst", tokenizer="gpt2")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--tokenizer", "gpt2"]) == 2
    assert capsys.readouterr().err == f"foxlm convert: error: {too_many} naming the tokenizer it was trained with\n"
    _write(tmp_path / "recorded", {**cfg, "foxlm_tokenizer": get_tokenizer("byte").spec()}, sd)
    with pytest.raises(ValueError, match=re.escape(f"tokenizer: byte ({tmp_path / 'recorded'}'s tokenizer) has 257 "
                                                   f"ids, more than the model's vocabulary of {V}; pass --tokenizer")):
        convert(tmp_path / "recorded", tmp_path / "dst")
    _write(tmp_path / "files", cfg, sd)
    _with_files_of(tmp_path / "files", _gpt2_tokenizer_folders(tmp_path / "tokenizers")["authors"])
    with pytest.raises(ValueError, match=re.escape(f"tokenizer: json-gpt2 ({tmp_path / 'files'}'s tokenizer) has "
                                                   f"50257 ids, more than the model's vocabulary of {V}")):
        convert(tmp_path / "files", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    capsys.readouterr()
    # no tokenizer named: the authors' json-gpt2 guessed, and not fitting
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("src: ")]
    assert said == [f"src: {tmp_path / 'src'} names no tokenizer, and the FoX authors' json-gpt2 (50257 ids) does not "
                    f"fit its vocabulary of {V}: none recorded (pass --tokenizer to record the one it was trained "
                    "with)"]
    assert getattr(FoxConfig.from_pretrained(tmp_path / "dst"), "foxlm_tokenizer", None) is None


def test_a_tokenizer_src_names_but_foxlm_cannot_read_is_said_to_be_unrecorded(tmp_path, capsys):
    """An authors' folder whose tokenizer_config.json names a tokenizer with no files foxlm reads (a SentencePiece
    tokenizer.model, as a Llama tokenizer is saved), or names no class: DST records no tokenizer, and convert says so
    in one stderr line naming --tokenizer, as it does for their default that does not fit the vocabulary. It said
    nothing, and `foxlm eval` / `generate` then took GPT-2 BPE for the model's tokenizer. --tokenizer records one."""
    gen = torch.Generator().manual_seed(10)
    cfg = authors_config(**AUTHORS_ARCHS["fox-llama"])
    sd = authors_weights(cfg, gen)
    for name, settings, extra in [("llama", {"tokenizer_class": "LlamaTokenizer"}, ", and its tokenizer_config.json "
                                   "names LlamaTokenizer"), ("unnamed", {"model_max_length": 2048}, "")]:
        _write(tmp_path / name, cfg, sd)
        (tmp_path / name / "tokenizer_config.json").write_text(json.dumps(settings))
        (tmp_path / name / "tokenizer.model").write_bytes(bytes(range(64)))  # SentencePiece's: not read by foxlm
        capsys.readouterr()
        assert main(["convert", str(tmp_path / name), str(tmp_path / f"{name}-dst")]) == 0
        said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("src: ")]
        assert said == [f"src: {tmp_path / name} holds no tokenizer files foxlm reads (a tokenizer.json, or "
                        f"encoder.json and vocab.bpe){extra}: none recorded (pass --tokenizer to record the one it "
                        "was trained with)"]
        assert getattr(FoxConfig.from_pretrained(tmp_path / f"{name}-dst"), "foxlm_tokenizer", None) is None
    cfg["vocab_size"] = 257  # rows for the byte tokenizer's ids
    _write(tmp_path / "byte", cfg, {**sd, **{k: torch.randn(257, C, generator=gen) for k in
                                             ("model.embeddings.weight", "lm_head.weight")}})
    shutil.copy(tmp_path / "llama" / "tokenizer_config.json", tmp_path / "byte")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "byte"), str(tmp_path / "byte-dst"), "--tokenizer", "byte"]) == 0
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("src: ")]
    assert FoxConfig.from_pretrained(tmp_path / "byte-dst").foxlm_tokenizer["name"] == "byte"


def test_remote_code_an_auto_map_names_is_never_run_and_said_to_be_ignored(tmp_path, capsys):
    """A config.json whose auto_map names remote code (a hub copy of a model with its own .py files): as
    from_pretrained without trust_remote_code, a model_type foxlm knows converts with foxlm's own mapping, that code
    never run, and one stderr line says the auto_map was ignored (it was dropped without a word); an unknown
    model_type is refused, the error saying its remote code is never run."""
    gen = torch.Generator().manual_seed(10)
    cfg = authors_config(**AUTHORS_ARCHS["fox-pro"])
    sd = authors_weights(cfg, gen)
    auto_map = {"AutoConfig": "configuration_fox.RemoteConfig", "AutoModelForCausalLM": "modeling_fox.RemoteFox"}
    ran = tmp_path / "ran"
    for name, model_type in (("src", cfg["model_type"]), ("unknown", "remote_fox")):
        _write(tmp_path / name, {**cfg, "model_type": model_type, "auto_map": auto_map}, sd)
        for file in ("configuration_fox.py", "modeling_fox.py"):
            (tmp_path / name / file).write_text(f"open({str(ran)!r}, 'w').close()\n")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("src: ignored")]
    assert said == [f"src: ignored {tmp_path / 'src' / 'config.json'}'s auto_map (AutoConfig, AutoModelForCausalLM): "
                    f"remote code is never run; read as fox-authors's model_type {cfg['model_type']!r}"]
    ids = torch.randint(0, V, (2, T), generator=gen)
    with torch.no_grad():
        logits = FoxForCausalLM.from_pretrained(tmp_path / "dst").eval()(ids).logits
    assert _rel(logits, authors_forward(sd, cfg, ids)) < RTOL
    with pytest.raises(ValueError, match=r"src: model_type 'remote_fox' is none of \[.*\]; its auto_map names remote "
                                         "code, which convert never runs"):
        convert(tmp_path / "unknown", tmp_path / "dst2")
    assert not ran.exists() and not (tmp_path / "dst2").exists()


# ---------------------------------------------------------------------------- a trained model, there and back
def test_trained_model_exported_and_converted_back_gives_the_same_per_token_losses(tmp_path):
    data = tmp_path / "bytes"
    prepare(random.Random(0).sample(shakespeare_plays(), 3), data, tokenizer="byte", val_fraction=0.34, workers=0,
            progress=False)
    run = tmp_path / "run"
    assert main(["train", "device=cpu", "arch=fox-pro", "model.hidden_size=64", "model.num_hidden_layers=2",
                 "model.num_attention_heads=2", "model.intermediate_size=128",
                 "tokenizer=byte", "seq_len=32", "batch_size=4", "warmup_steps=2", "lr=3e-3", "min_lr=3e-4",
                 "max_steps=30", "eval_every=0", "save_every=30", "progress=false", "tensorboard=false",
                 "sample_tokens=0", f"data={data}", f"out_dir={run}"]) == 0
    model_dir = sorted((run / "checkpoints").iterdir())[-1] / "model"
    assert main(["convert", str(model_dir), str(tmp_path / "authors"), "--to", "fox-authors"]) == 0
    assert main(["convert", str(tmp_path / "authors"), str(tmp_path / "back")]) == 0
    assert FoxConfig.from_pretrained(tmp_path / "back").foxlm_tokenizer["name"] == "byte"
    losses = []
    for name, ckpt in (("orig", model_dir), ("back", tmp_path / "back")):
        assert main(["eval", "loss", str(ckpt), "--data", str(data), "--train-length", "32", "--max-sequences", "2",
                     "--out", str(tmp_path / name), "--no-progress", "--device", "cpu"]) == 0
        rows = (tmp_path / name / "per_token_loss.csv").read_text().splitlines()[1:]
        losses.append(np.array([r.split(",") for r in rows], dtype=float))
    assert losses[0][:, 1].mean() < math.log(257) - 1  # it learned something (a uniform guess: ln 257)
    np.testing.assert_array_equal(losses[0], losses[1])


def test_converted_model_generates_and_evaluates_with_its_recorded_tokenizer(tmp_path, capsys):
    """The authors' models read JSON-escaped text: `foxlm generate` uses the json-gpt2 tokenizer convert recorded
    without a flag, and `foxlm eval` refuses data prepared with another tokenizer."""
    gen = torch.Generator().manual_seed(1)
    cfg = authors_config(**{**AUTHORS_ARCHS["fox-llama"], "vocab_size": 50304, "num_hidden_layers": 1})
    sd = {k: v for k, v in authors_weights({**cfg, "num_hidden_layers": L}, gen).items() if "layers.1." not in k}
    sd["model.embeddings.weight"], sd["lm_head.weight"] = torch.randn(50304, C, generator=gen), \
        torch.randn(50304, C, generator=gen) * 0.5
    _write(tmp_path / "src", cfg, sd)
    convert(tmp_path / "src", tmp_path / "dst")
    outputs = {}
    for flag in ([], ["--tokenizer", "json-gpt2"]):
        capsys.readouterr()
        assert main(["generate", str(tmp_path / "dst"), "--prompt", 'She said "no"\nand', "--max-new-tokens", "4",
                     "--device", "cpu", "--no-eos", *flag]) == 0
        outputs[tuple(flag)] = capsys.readouterr().out
    assert outputs[()] == outputs[("--tokenizer", "json-gpt2")]
    assert main(["generate", str(tmp_path / "dst"), "--prompt", "x", "--device", "cpu", "--tokenizer", "gpt2"]) == 2
    assert "was trained with 'json-gpt2'" in capsys.readouterr().err  # another tokenizer's ids: refused
    data = tmp_path / "bytes"
    prepare(shakespeare_plays()[:3], data, tokenizer="byte", val_fraction=0.34, workers=0, progress=False)
    capsys.readouterr()
    assert main(["eval", "loss", str(tmp_path / "dst"), "--data", str(data), "--train-length", "16", "--out",
                 str(tmp_path / "out"), "--no-progress", "--device", "cpu"]) == 2
    assert re.search(r"--data: .* was prepared with byte, but .* was trained with json-gpt2", capsys.readouterr().err)


def test_init_from_a_converted_model_trains_on_json_gpt2_data_only(tmp_path):
    gen = torch.Generator().manual_seed(2)
    cfg = authors_config(**{**AUTHORS_ARCHS["fox-llama"], "vocab_size": 50304, "num_hidden_layers": 1,
                            "intermediate_size": 128, "bos_token_id": 50256, "eos_token_id": 50256})
    sd = {k: v for k, v in authors_weights({**cfg, "num_hidden_layers": L}, gen).items() if "layers.1." not in k}
    sd["model.embeddings.weight"], sd["lm_head.weight"] = (torch.randn(50304, C, generator=gen) for _ in range(2))
    _write(tmp_path / "src", cfg, sd)
    convert(tmp_path / "src", tmp_path / "dst")
    assert FoxConfig.from_pretrained(tmp_path / "dst").eos_token_id == 50256
    plays = shakespeare_plays()[:3]
    args = ["train", "device=cpu", "arch=fox-llama", "model.hidden_size=64", "model.num_hidden_layers=1",
            "model.num_attention_heads=4", "model.intermediate_size=128", "seq_len=32", "batch_size=2",
            "max_steps=2", "eval_every=0", "save_every=0", "progress=false", "tensorboard=false", "sample_tokens=0",
            f"init_from={tmp_path / 'dst'}"]
    for tokenizer, code in (("gpt2", 2), ("json-gpt2", 0)):  # (the embedded default config says tokenizer=gpt2)
        prepare(plays, tmp_path / tokenizer, tokenizer=tokenizer, val_fraction=0.34, workers=0, progress=False)
        assert main([*args, f"tokenizer={tokenizer}", f"data={tmp_path / tokenizer}",
                     f"out_dir={tmp_path / ('run-' + tokenizer)}"]) == code, tokenizer
    assert (tmp_path / "run-json-gpt2" / "checkpoints").is_dir()


def test_a_narrower_dtype_keeps_the_gate_and_shift_as_from_pretrained_does(tmp_path):
    """--dtype bfloat16 of float32 weights: every tensor bf16 but the forget gate and token shift, which stay fp32 as
    in a model from_pretrained loads in bf16 (and saves again); rounding them would move every attention weight."""
    gen = torch.Generator().manual_seed(5)
    cfg = authors_config(**AUTHORS_ARCHS["fox-pro"])
    sd = authors_weights(cfg, gen)
    _write(tmp_path / "src", cfg, sd)
    convert(tmp_path / "src", tmp_path / "fp32")
    convert(tmp_path / "src", tmp_path / "bf16", dtype="bfloat16")
    full, got = (load_file(tmp_path / name / "model.safetensors") for name in ("fp32", "bf16"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).state_dict()
    kept = {k for k, t in loaded.items() if t.dtype == torch.float32}
    assert kept and any("fgate_proj" in k for k in kept) and any("shift" in k for k in kept)
    assert {k for k, t in got.items() if t.dtype == torch.float32} == kept
    assert all(torch.equal(got[k], full[k]) for k in kept)
    assert all(torch.equal(got[k], loaded[k]) for k in got)


def test_a_tokenizer_folder_travels_with_converted_models(tmp_path, capsys):
    """A run's model folder carries a copy of its tokenizer folder (the original may move); so does what convert
    writes, to the authors' format and back, and from fla with --tokenizer FOLDER: after the folder moves, the
    converted models still generate in it and load with AutoTokenizer. (Convert dropped the copy: the record named
    the moved folder only, and converting back or generating failed with 'is gone'.)"""
    from tokenizer_folders import llama_style_tokenizer
    from train.runs import tiny_config
    from transformers import AutoTokenizer

    from foxlm.train import latest_valid_checkpoint, train

    plays = random.Random(0).sample(shakespeare_plays(), 2)
    folder = llama_style_tokenizer(tmp_path / "tok", [p.read_text() for p in plays], vocab_size=300)
    data, run = tmp_path / "data", tmp_path / "run"
    prepare(plays, data, tokenizer=str(folder), val_fraction=0.5, workers=0, progress=False)
    train(tiny_config(data, run, f"tokenizer=hf:{folder.resolve()}", "max_steps=1"))
    model_dir = latest_valid_checkpoint(run) / "model"
    converted = [tmp_path / "authors", tmp_path / "back"]
    assert main(["convert", str(model_dir), str(converted[0]), "--to", "fox-authors"]) == 0
    if importlib.util.find_spec("fla") is not None:
        from fla.models import ForgettingTransformerConfig, ForgettingTransformerForCausalLM

        ForgettingTransformerForCausalLM(ForgettingTransformerConfig(
            hidden_size=C, num_hidden_layers=L, num_heads=H, vocab_size=320, intermediate_size=96, fuse_norm=False,
            fuse_swiglu=False, fuse_cross_entropy=False)).save_pretrained(tmp_path / "fla")
        converted.append(tmp_path / "from-fla")
        assert main(["convert", str(tmp_path / "fla"), str(converted[2]), "--tokenizer", str(folder)]) == 0
    folder.rename(tmp_path / "moved")  # the data and the run carry their own copies
    assert main(["convert", str(converted[0]), str(converted[1])]) == 0
    want = get_tokenizer(str(tmp_path / "moved")).encode("To be")
    capsys.readouterr()
    for model in converted:
        assert AutoTokenizer.from_pretrained(model)("To be").input_ids[1:] == want, model
        if model != converted[0]:
            assert main(["generate", str(model), "--prompt", "To be", "--max-new-tokens", "3", "--device", "cpu"]) == 0
            assert capsys.readouterr().out.startswith("To be")

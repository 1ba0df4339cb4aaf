"""The state-dict adapter of foxlm's models (torchtitan's ``StateDictAdapter``): the FoX authors' and fla's
ForgettingTransformer configs and tensor names, mapped to foxlm's and back. ``foxlm convert`` (``convert.py``) reads
and writes the folders; this module owns the mapping.

Every field of the source config is either mapped to a ``FoxConfig`` field, checked to hold the one value foxlm can
represent, or listed below as not changing what the model computes; anything else is an error naming the field.
Every source tensor lands in exactly one foxlm tensor (or the reverse); a left-over or missing tensor is an error.
"""

from __future__ import annotations

import math

import torch

from .configuration_fox import FoxConfig

AUTHORS_FOX = "forgetting_transformer-project_fox"  # their FoX class (also their Pro Transformer: fgate_type "none")
AUTHORS_TRANSFORMER = "transformer-project_fox"  # their LLaMA Transformer class
FLA_FOX = "forgetting_transformer"
FORMATS = {AUTHORS_FOX: "fox-authors", AUTHORS_TRANSFORMER: "fox-authors", FLA_FOX: "fla",
           FoxConfig.model_type: "foxlm"}
# The QK-norm epsilon the authors' and fla's QK-norms use (their norm modules' default; config.norm_eps is not passed).
PEER_QK_NORM_EPS = 1e-5

# Keys transformers writes into any config.json (bookkeeping, generation defaults, label maps): no architecture.
_HF_KEYS = {
    "_name_or_path", "architectures", "auto_map", "transformers_version", "model_type", "torch_dtype", "dtype",
    "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size",
    "id2label", "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
    "tf_legacy_loss", "use_bfloat16", "sep_token_id", "decoder_start_token_id", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "pad_token_id",
}
# Peer fields that change how a model trains or runs, never the function it computes (why, per field).
_INERT = {
    "fuse_norm": "fused kernel choice", "fuse_cross_entropy": "training loss kernel", "fuse_swiglu": "fused kernel",
    "fuse_linear_cross_entropy": "training loss kernel", "use_l2warp": "training loss term",
    "initializer_range": "initialisation", "use_cache": "decoding default", "fgate_bias_init": "initialisation",
    "decay_time_min": "initialisation", "decay_time_max": "initialisation",
    "elementwise_affine": "not read by either peer's FoX model code",
    "max_position_embeddings": "RoPE table size only; foxlm computes RoPE per position",
}


def _peer_defaults(model_type: str) -> dict:
    """The defaults of the peer config classes' __init__ (what a field missing from config.json means)."""
    common = dict(hidden_ratio=4, intermediate_size=None, num_kv_heads=None, hidden_act="swish", window_size=None,
                  norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if model_type == FLA_FOX:
        return {**common, "qkv_bias": False, "qk_norm": False, "use_output_gate": False, "attnres_block_size": None}
    authors = {**common, "attention_bias": False, "rope_base": 500000.0}
    if model_type == AUTHORS_TRANSFORMER:
        return {**authors, "use_rope": True}
    return {**authors, "use_rope": False, "use_output_gate": False, "ogate_act": "sigmoid", "fgate_type": "full",
            "use_output_norm": False, "qk_norm": False, "qk_norm_share_param_across_head": False, "use_k_shift": False,
            "use_v_shift": False, "log_pruning_tolerance": None}


# ------------------------------------------------------------------------------------------------------------ config
class _Fields:
    """A peer config, read field by field; ``leftover()`` names the fields nobody read."""

    def __init__(self, raw: dict, defaults: dict):
        self.raw, self.defaults, self.read = raw, defaults, set()

    def __call__(self, key: str, required: bool = False):
        self.read.add(key)
        value = self.raw[key] if key in self.raw else self.defaults.get(key)  # an explicit null stays null
        if required and value is None:
            raise ValueError(f"config.json: {key} is missing (needed to build the model)")
        return value

    def positive(self, key: str, kind: type = int, required: bool = False):
        """A positive int (``kind`` int) or number (``kind`` float), or None unless ``required``."""
        value = self(key, required)
        ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool) and value > 0
        if value is not None and not ok:
            what = "number" if kind is float else "int"
            raise ValueError(f"config.json: {key}={value!r}; expected a positive {what}")
        return value

    def token_ids(self, key: str) -> int | list[int] | None:
        """A token id (a non-negative int), a list of them (several end-of-text ids), or None."""
        value = self(key)
        ids = value if isinstance(value, list) and value else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"config.json: {key}={value!r}; expected a token id (an int), a list of them, or null")
        return value

    def flag(self, key: str) -> bool:
        """A true/false field (null: false); a string such as "false" is an error, not true."""
        value = self(key)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"config.json: {key}={value!r}; expected true or false")
        return bool(value)

    def expect(self, key: str, allowed: tuple, why: str):
        value = self(key)
        if value not in allowed:
            raise ValueError(f"config.json: {key}={value!r} cannot be converted: {why}")
        return value

    def leftover(self) -> list[str]:
        return sorted(set(self.raw) - self.read - _HF_KEYS - set(_INERT))


def _intermediate_size(f: _Fields, weights: dict[str, torch.Tensor], hidden: int) -> int:
    """The MLP width from the weights, checked against intermediate_size / hidden_ratio when the config has them."""
    key = "model.layers.0.mlp.down_proj.weight"
    if key not in weights:
        raise ValueError(f"weights: {key} is missing")
    size = weights[key].shape[1]
    given, ratio = f.positive("intermediate_size"), f.positive("hidden_ratio", float)
    if given is not None and given != size:
        raise ValueError(f"config.json: intermediate_size={given}, but the weights have {size}")
    if given is None and ratio is not None:
        expected = 256 * math.ceil(int(hidden * ratio * 2 / 3) / 256)
        if expected != size:
            raise ValueError(f"config.json: hidden_ratio={ratio} gives an MLP of {expected}, the weights have {size}")
    return size


def _common_config(f: _Fields, weights: dict[str, torch.Tensor]) -> dict:
    """The FoxConfig fields both peers' configs share."""
    hidden, heads = f.positive("hidden_size", required=True), f.positive("num_heads", required=True)
    if hidden % heads:
        raise ValueError(f"config.json: num_heads={heads} does not divide hidden_size={hidden}")
    if "model.embeddings.weight" not in weights:
        raise ValueError("weights: model.embeddings.weight is missing")
    vocab = weights["model.embeddings.weight"].shape[0]
    if f("vocab_size") not in (None, vocab):
        raise ValueError(f"config.json: vocab_size={f('vocab_size')}, but the embedding has {vocab} rows")
    f.expect("tie_word_embeddings", (False,), "foxlm models have an untied LM head")
    f.expect("hidden_act", ("swish", "silu"), "foxlm's MLP is SwiGLU")
    layers = f.positive("num_hidden_layers", required=True)
    f("foxlm_tokenizer")  # the tokenizer record (``_tokenizer_spec``), written by foxlm's export
    return dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=f.positive("num_kv_heads") or heads, head_dim=hidden // heads,
        intermediate_size=_intermediate_size(f, weights, hidden),
        rms_norm_eps=f.positive("norm_eps", float, required=True),
        bos_token_id=f.token_ids("bos_token_id"), eos_token_id=f.token_ids("eos_token_id"),
    )


def authors_config(raw: dict, weights: dict[str, torch.Tensor]) -> dict:
    """FoxConfig fields of the FoX authors' ``ForgettingTransformerConfig`` / ``TransformerConfig``."""
    mtype = raw["model_type"]
    f = _Fields(raw, _peer_defaults(mtype))
    out = _common_config(f, weights)
    f.expect("attention_bias", (False,), "foxlm's projections have no bias")
    rope = f.flag("use_rope")
    theta = f.positive("rope_base", float, required=rope)  # read only under RoPE
    out.update(rope=rope, **({} if theta is None else {"rope_theta": float(theta)}))
    window = f("window_size")
    if mtype == AUTHORS_TRANSFORMER:
        out.update(gate="none", window=window)
    else:
        if f("num_kv_heads") is not None:
            raise ValueError("config.json: num_kv_heads must be null for the authors' FoX class (it raises otherwise)")
        f.expect("window_size", (None,), "the authors' FoX attention ignores it in the forward pass")
        f.expect("ogate_act", ("sigmoid",), "foxlm's output gate is a sigmoid")
        gates = {"full": "data", "bias_only": "bias", "none": "none"}
        fgate = f.expect("fgate_type", tuple(gates), "foxlm has no fixed forget gate of arbitrary values")
        tolerance = f("log_pruning_tolerance")
        if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))):
            raise ValueError(f"config.json: log_pruning_tolerance={tolerance!r}; expected a number (a log) or null")
        if tolerance is not None and not -math.inf < tolerance < 0:  # ACP's tolerance is in (0, 1)
            raise ValueError(f"config.json: log_pruning_tolerance={tolerance!r}; expected a negative number (the log "
                             "of a pruning tolerance in (0, 1)) or null")
        qk_norm, shared = f.flag("qk_norm"), f.flag("qk_norm_share_param_across_head")
        out.update(
            gate=gates[fgate], qk_norm=qk_norm, qk_norm_shared=qk_norm and shared,
            qk_norm_eps=PEER_QK_NORM_EPS if qk_norm else None, output_gate=f.flag("use_output_gate"),
            output_norm=f.flag("use_output_norm"), k_shift=f.flag("use_k_shift"), v_shift=f.flag("use_v_shift"),
            acp=tolerance is not None, **({} if tolerance is None else {"acp_tolerance": math.exp(tolerance)}),
        )
    if (left := f.leftover()):
        raise ValueError(f"config.json: {', '.join(left)}: unknown to foxlm's converter; refusing to drop it")
    return out


def fla_config(raw: dict, weights: dict[str, torch.Tensor]) -> dict:
    """FoxConfig fields of fla's ``ForgettingTransformerConfig``."""
    f = _Fields(raw, _peer_defaults(FLA_FOX))
    out = _common_config(f, weights)
    f.expect("qkv_bias", (False,), "foxlm's projections have no bias")
    f.expect("window_size", (None,), "fla's attention ignores it in the forward pass but truncates its cache")
    f.expect("attnres_block_size", (None,), "foxlm has no attention residuals")
    qk_norm = f.flag("qk_norm")
    out.update(gate="data", qk_norm=qk_norm, qk_norm_eps=PEER_QK_NORM_EPS if qk_norm else None,
               output_gate=f.flag("use_output_gate"))
    if (left := f.leftover()):
        raise ValueError(f"config.json: {', '.join(left)}: unknown to foxlm's converter; refusing to drop it")
    return out


def to_authors_config(cfg: FoxConfig) -> dict:
    """The authors' config.json for a foxlm config, or a ValueError naming what their classes cannot express."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"--to fox-authors: {what}")

    need(cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size,
         "head_dim must be hidden_size / num_attention_heads")
    need(cfg.gate in ("data", "bias", "none"), f"gate={cfg.gate!r} has no counterpart (data, bias or none)")
    need(not cfg.qk_norm or cfg.qk_norm_eps == PEER_QK_NORM_EPS,
         f"their QK-norm epsilon is {PEER_QK_NORM_EPS} (fixed in their code); this model's is "
         f"{cfg.qk_norm_eps or cfg.rms_norm_eps}: a model trained with model.qk_norm_eps=1.0e-5 (the fox-pro and "
         "transformer-pro presets' value) converts")
    llama = cfg.gate == "none" and cfg.rope and not any(
        (cfg.qk_norm, cfg.output_gate, cfg.output_norm, cfg.k_shift, cfg.v_shift))
    need(llama or cfg.window is None, "window: their FoX class has no sliding window")
    need(llama or cfg.num_key_value_heads == cfg.num_attention_heads, "num_key_value_heads: their FoX class has no GQA")
    out = dict(
        model_type=AUTHORS_TRANSFORMER if llama else AUTHORS_FOX,
        architectures=["TransformerForCausalLM" if llama else "ForgettingTransformerForCausalLM"],
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, hidden_ratio=None,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads, hidden_act="swish", max_position_embeddings=None,
        initializer_range=cfg.initializer_range, norm_eps=cfg.rms_norm_eps, use_cache=True,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, tie_word_embeddings=False,
        attention_bias=False, fuse_cross_entropy=cfg.fuse_cross_entropy, rope_base=cfg.rope_theta, use_rope=cfg.rope,
    )
    if llama:
        return {**out, "num_kv_heads": None if cfg.num_key_value_heads == cfg.num_attention_heads
                else cfg.num_key_value_heads, "window_size": cfg.window}
    return {
        **out, "num_kv_heads": None, "window_size": None, "use_output_gate": cfg.output_gate, "ogate_act": "sigmoid",
        "fgate_type": {"data": "full", "bias": "bias_only", "none": "none"}[cfg.gate],
        "use_output_norm": cfg.output_norm, "qk_norm": cfg.qk_norm,
        "qk_norm_share_param_across_head": cfg.qk_norm_shared,
        "use_k_shift": cfg.k_shift, "use_v_shift": cfg.v_shift,
        "log_pruning_tolerance": math.log(cfg.acp_tolerance) if cfg.acp else None,
    }


# ----------------------------------------------------------------------------------------------------------- weights
def _name_pairs(cfg: FoxConfig, fmt: str) -> list[tuple[str, str, str]]:
    """(peer name, foxlm name, kind) for every tensor; kind "same", "heads" (peer [H*D] <-> foxlm [H, D]) or
    "glu" (the authors' fused [2I, C] gate+up projection <-> foxlm's gate_proj and up_proj)."""
    emb = "model.embeddings.weight"
    pairs = [(emb, "model.embed_tokens.weight", "same"), ("model.norm.weight", "model.norm.weight", "same"),
             ("lm_head.weight", "lm_head.weight", "same")]
    authors = fmt == "fox-authors"
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.attn."
        pairs += [(p + n, p + n, "same") for n in ("attn_norm.weight", "mlp_norm.weight", "mlp.down_proj.weight")]
        pairs += [(a + n, a + n, "same") for n in ("q_proj.weight", "o_proj.weight")]
        for name, shift in (("k", cfg.k_shift), ("v", cfg.v_shift)):
            if shift:
                pairs += [(a + f"{name}_proj.linear.weight", a + f"{name}_proj.weight", "same"),
                          (a + f"{name}_proj.shift_proj.weight", a + f"{name}_shift.proj.weight", "same")]
            else:
                pairs.append((a + f"{name}_proj.weight", a + f"{name}_proj.weight", "same"))
        if authors:
            pairs.append((p + "mlp.gate_proj.weight", p + "mlp.gate_proj.weight", "glu"))
        else:
            pairs += [(p + f"mlp.{n}.weight", p + f"mlp.{n}.weight", "same") for n in ("gate_proj", "up_proj")]
        if cfg.gate == "data":
            gate = "fgate_proj" if authors else "f_proj"
            pairs += [(a + f"{gate}.weight", a + "fgate_proj.weight", "same"),
                      (a + f"{gate}.bias", a + "fgate_proj.bias", "same")]
        if cfg.gate == "bias":
            pairs.append((a + "fgate_bias", a + "fgate_bias", "same"))
        if cfg.output_gate:
            pairs.append((a + ("ogate_proj.weight" if authors else "g_proj.weight"), a + "g_proj.weight", "same"))
        if cfg.output_norm:
            pairs.append((a + "output_norm.weight", a + "o_norm.weight", "heads"))
        if cfg.qk_norm:
            kind = "same" if cfg.qk_norm_shared else "heads"
            pairs += [(a + f"{n}_norm.weight", a + f"{n}_norm.weight", kind) for n in ("q", "k")]
    return pairs


def foxlm_shapes(cfg: FoxConfig) -> dict[str, torch.Size]:
    """The shape of every tensor foxlm's model of ``cfg`` saves (the model built on the meta device: no memory)."""
    from .modeling_fox import FoxForCausalLM

    with torch.device("meta"):
        return {name: t.shape for name, t in FoxForCausalLM(cfg).state_dict().items()}


def _check_shape(name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"weights: {name} has shape {list(t.shape)}, but the config asks for {list(want)}")


def _check_rope_table(name: str, t: torch.Tensor, cfg: FoxConfig) -> None:
    """A saved RoPE frequency buffer must be the one rope_theta gives (foxlm recomputes it)."""
    half = cfg.head_dim // 2
    expected = 1.0 / cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
    if t.shape != expected.shape or not torch.allclose(t.double(), expected, rtol=1e-3):
        raise ValueError(f"weights: {name} is not the RoPE table of rope_base={cfg.rope_theta}")


def peer_to_foxlm(weights: dict[str, torch.Tensor], cfg: FoxConfig, fmt: str) -> dict[str, torch.Tensor]:
    """The foxlm state dict of a peer's (``fmt``: "fox-authors" or "fla"); every tensor must be used."""
    left, out, shapes = dict(weights), {}, foxlm_shapes(cfg)
    H, Hk, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for src, dst, kind in _name_pairs(cfg, fmt):
        if src not in left:
            raise ValueError(f"weights: {src} is missing (the config asks for it)")
        t = left.pop(src)
        want = shapes[dst]
        want = (math.prod(want),) if kind == "heads" else (2 * want[0], *want[1:]) if kind == "glu" else tuple(want)
        _check_shape(src, t, want)
        if kind == "heads":
            t = t.view(Hk if ".k_norm." in src else H, D)
        if kind == "glu":
            out[dst], out[dst.replace("gate_proj", "up_proj")] = t.chunk(2, dim=0)  # their gate half comes first
        else:
            out[dst] = t
    for name in [n for n in left if n.endswith("rotary.inv_freq")]:
        _check_rope_table(name, left.pop(name), cfg)
    if left:
        raise ValueError(f"weights: {', '.join(sorted(left)[:5])}{' ...' if len(left) > 5 else ''}: not part of the "
                         "model its config describes; refusing to drop them")
    return out


def foxlm_to_authors(weights: dict[str, torch.Tensor], cfg: FoxConfig) -> dict[str, torch.Tensor]:
    """The authors' state dict of a foxlm one (the inverse of ``peer_to_foxlm(..., "fox-authors")``)."""
    for name, shape in foxlm_shapes(cfg).items():
        if name not in weights:
            raise ValueError(f"weights: {name} is missing (the config asks for it)")
        _check_shape(name, weights[name], tuple(shape))
    left, out = dict(weights), {}
    for src, dst, kind in _name_pairs(cfg, "fox-authors"):
        t = left.pop(dst)
        if kind == "glu":
            t = torch.cat([t, left.pop(dst.replace("gate_proj", "up_proj"))], dim=0)
        out[src] = t.reshape(-1) if kind == "heads" else t
    if left:
        raise ValueError(f"weights: {', '.join(sorted(left))}: no place in the authors' format")
    return out

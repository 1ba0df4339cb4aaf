"""``FoxConfig``: the FoX model family (FoX and Transformer baselines, LLaMA and Pro blocks) as one HF config."""

from __future__ import annotations

import inspect

from transformers import PretrainedConfig

from ..layers import GATES
from ..ops.forgetting_attention.acp import check_tolerance
from ..presets import ARCHS, FOX_FIELDS, SIZES, derived_fields, preset_fields


class FoxConfig(PretrainedConfig):
    """Configuration of ``FoxModel`` / ``FoxForCausalLM``; ``FoxConfig.preset(arch, size)`` gives the paper models.

    Its fields and their defaults are declared once, in ``foxlm.presets.FOX_FIELDS``; keyword arguments only.

    Args:
        vocab_size: 50304 = GPT-2 BPE's 50257 padded to a multiple of 64.
        hidden_size, num_hidden_layers, num_attention_heads: width, depth, query heads.
        num_key_value_heads: key/value heads (GQA); default num_attention_heads.
        head_dim: default hidden_size // num_attention_heads.
        intermediate_size: SwiGLU width; default 8/3 * hidden_size rounded up to a multiple of 256.
        rms_norm_eps, initializer_range: RMSNorm epsilon, std of the normal init (LM head untied).
        gate: "data" (FoX), "bias" (data-independent learned per head), "alibi" (fixed), "none" (Transformer).
        qk_norm, output_gate, output_norm, k_shift, v_shift: the Pro block parts.
        qk_norm_shared: one QK-norm weight vector [head_dim] for all heads (the FoX authors' released Pro models)
            instead of one per head; qk_norm_eps: the QK-norm epsilon (default rms_norm_eps; the Pro presets',
            theirs and fla's: 1e-5).
        rope, rope_theta: rotary embedding (Transformer baselines).
        window: sliding-window attention length (None: full causal).
        acp, acp_tolerance: Adaptive Computation Pruning in training/eval forwards, and its epsilon.
        fuse_cross_entropy: training forwards with labels compute the LM head and loss a chunk of tokens at a
            time (``foxlm.ops.cross_entropy``) and return no logits.
        deterministic_attention: passed to ``forgetting_attention`` as FlashAttention's ``deterministic``; every
            attention backward is deterministic (no atomics) whatever its value. Kept so that configs that set it
            load unchanged.
        train_length: the context length (tokens) the model was trained at, recorded by ``foxlm train``; None when
            unknown. Not a limit (FoX has no positional embedding): tools that ask for a model's length read it as
            ``max_position_embeddings`` (lm-eval's context window, ``generate``'s warning past it).
    """

    model_type = "fox"
    attribute_map = {"max_position_embeddings": "train_length"}
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(self, **kwargs):
        fields = derived_fields({name: kwargs.pop(name, default) for name, default in FOX_FIELDS.items()})
        hf_fields = {name: fields.pop(name) for name in ("bos_token_id", "eos_token_id", "tie_word_embeddings")}
        for name, value in fields.items():
            setattr(self, name, value)
        self._check()
        _refuse_rope_variants(kwargs, self.rope_theta)
        super().__init__(**hf_fields, **kwargs)
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings: FoX models have an untied LM head")

    # the arguments, as help() and inspect show them: those of FOX_FIELDS, keyword only, then PretrainedConfig's
    __init__.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
           for name, default in FOX_FIELDS.items()]
        + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """transformers' ``from_dict``, the FoX fields among ``kwargs`` (``from_pretrained(path, window=8)``) given to
        the constructor, which checks them: transformers sets such a field on the built config unchecked, and a model
        then built (``tie_word_embeddings=True``: an untied head under a config saying tied) saved a config.json that
        no longer loads."""
        config_dict = dict(config_dict)
        for key in list(kwargs):
            name = cls.attribute_map.get(key, key)  # max_position_embeddings: train_length
            if name in FOX_FIELDS:
                config_dict[name] = kwargs.pop(key)
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def preset(cls, arch: str, size: str, **overrides) -> "FoxConfig":
        """The paper models: arch in ``ARCHS`` (fox-llama, fox-pro, transformer-llama, transformer-pro),
        size in ``SIZES`` (tiny, 125m, 360m, 760m); ``overrides`` replace any field."""
        if arch not in ARCHS:
            raise ValueError(f"arch: expected one of {sorted(ARCHS)}, got {arch!r}")
        if size not in SIZES:
            raise ValueError(f"size: expected one of {sorted(SIZES)}, got {size!r}")
        return cls(**{**preset_fields(arch, size), **overrides})

    def set_acp(self, acp: bool, tolerance: float | None = None) -> None:
        """Turn ACP on or off and (unless None) set its epsilon, checked as in the constructor; the attention
        layers of a model read both fields at every forward."""
        tolerance = self.acp_tolerance if tolerance is None else float(tolerance)
        self._check_acp(acp, tolerance)
        self.acp, self.acp_tolerance = acp, tolerance

    def _check_acp(self, acp: bool, tolerance: float) -> None:
        if not isinstance(acp, bool):
            raise ValueError(f"acp: expected a bool, got {acp!r}")
        if acp and self.gate == "none":
            raise ValueError("acp: pruning needs a forget gate, but gate='none'")
        check_tolerance(tolerance, "acp_tolerance")

    def _check(self) -> None:
        def positive_int(name: str, value) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")

        def number(value) -> bool:  # None or a string read from a config.json: compared, a TypeError
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size"):
            positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: must divide num_attention_heads={self.num_attention_heads}, "
                f"got {self.num_key_value_heads}"
            )
        if self.gate not in GATES:
            raise ValueError(f"gate: expected one of {GATES}, got {self.gate!r}")
        for name in ("qk_norm", "qk_norm_shared", "output_gate", "output_norm", "k_shift", "v_shift", "rope",
                     "fuse_cross_entropy", "deterministic_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.qk_norm_shared and not self.qk_norm:
            raise ValueError("qk_norm_shared: a shared QK-norm weight needs qk_norm=True")
        if self.qk_norm_eps is not None and not (isinstance(self.qk_norm_eps, (int, float)) and self.qk_norm_eps > 0):
            raise ValueError(f"qk_norm_eps: expected a positive number or None, got {self.qk_norm_eps!r}")
        if self.rope and self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head dim, got {self.head_dim}")
        for name in ("window", "train_length"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        self._check_acp(self.acp, self.acp_tolerance)
        for name in ("rms_norm_eps", "rope_theta"):
            if not (number(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name}: expected a positive number, got {getattr(self, name)!r}")
        if not (number(self.initializer_range) and self.initializer_range >= 0):
            raise ValueError(f"initializer_range: expected a non-negative std, got {self.initializer_range!r}")


def _refuse_rope_variants(kwargs: dict, rope_theta: float) -> None:
    """Pop transformers' RoPE variants from ``kwargs``, refusing any but plain RoPE: the baselines' RoPE has no
    scaling and rotates every channel, and a config taking them (a Llama config's ``rope_scaling``) would say what
    the model does not do, and save it."""
    scaling = kwargs.pop("rope_scaling", None)
    if scaling is not None:
        raise ValueError(f"rope_scaling: foxlm's RoPE (the Transformer baselines') has no scaling, got {scaling!r}; "
                         "set rope_theta instead")
    factor = kwargs.pop("partial_rotary_factor", None)
    if factor not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor: foxlm's RoPE rotates every channel (1.0), got {factor!r}")
    params = kwargs.pop("rope_parameters", None)
    plain = {"rope_type": "default", "rope_theta": rope_theta}
    if params is not None and (not isinstance(params, dict) or {**plain, **params} != plain):
        raise ValueError(f"rope_parameters: foxlm's RoPE is the default type with rope_theta={rope_theta}, got "
                         f"{params!r}; set rope_theta instead")

"""Any Hugging Face causal LM in foxlm's trainer and evaluations.

``arch=hf:MODEL_TYPE`` names a model type registered with ``AutoConfig`` and ``AutoModelForCausalLM`` (``hf:llama``,
``hf:mamba2``, ...), ``arch=PATH/config.json`` a config file; ``model.<field>=...`` sets that config's fields. foxlm's
own presets (``fox-pro``, ...) stay the default. Such a model trains with foxlm's chunked linear cross-entropy on its
backbone's hidden states and LM head (``use_chunked_loss``), so the fp32 logits of a whole batch never exist, unless
it soft-caps or scales its logits (Gemma 2, Cohere, Granite) or its LM head has a bias (GPT-J): then with its own
loss.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutput
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..ops.cross_entropy import linear_cross_entropy
from ..presets import BASELINES, FLA, HF_PREFIX, MODEL_TYPES, baseline_fields
from .baselines import require_fla


def config_fields(config: PretrainedConfig) -> set[str]:
    """What ``model.*`` may set on ``config``: its class's constructor arguments, the attributes it holds and the
    names it maps to them (``attribute_map``: GPT-2's hidden_size is its n_embd)."""
    params = set()
    for cls in type(config).__mro__:
        if issubclass(cls, PretrainedConfig):
            params |= set(inspect.signature(cls.__init__).parameters)
    return (params | set(config.to_dict()) | set(config.attribute_map)) - {"self", "kwargs", "args"}


def hf_config(arch: str, fields: dict | None = None, size: str = "tiny") -> PretrainedConfig:
    """The config ``arch`` names (``hf:MODEL_TYPE``: the type's defaults; a ``.json`` path: that file; a baseline:
    its preset at ``size``), with ``fields`` set; an unknown field, model type or a type without a causal LM is a
    ValueError naming it."""
    fields = dict(fields or {})
    if arch in BASELINES:
        if arch in FLA:
            require_fla(arch)
        fields = {**baseline_fields(arch, size), **fields}
        arch = f"{HF_PREFIX}{MODEL_TYPES[arch]}"
    if arch.startswith(HF_PREFIX):
        model_type = arch[len(HF_PREFIX):]
        if model_type not in CONFIG_MAPPING:
            raise ValueError(f"arch: {model_type!r} is not a model type registered with transformers' AutoConfig "
                             f"(e.g. hf:llama, hf:mamba2)")
        # the class's defaults, not a default config's values: fields it derives (Llama's num_key_value_heads and
        # head_dim) must follow ``fields``
        base, given = config_class(model_type)(), {}
    else:
        path = Path(arch).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"arch: {path} does not exist (expected a model's config.json)")
        try:  # a config needing a repository's code is refused, not asked about on stdin
            base = AutoConfig.from_pretrained(path, trust_remote_code=False)
        except Exception as e:  # transformers' OSError (not JSON), ValueError (its code), a validator's own types
            reason = " ".join(str(e.__cause__ or e).split())  # the message, on one line
            raise ValueError(f"arch: {path}: {reason}") from e
        given = base.to_diff_dict()
    return with_fields(base, fields, arch, given)


def config_class(model_type: str) -> type[PretrainedConfig]:
    """The config class of ``model_type``: transformers' own where it has one (importing fla re-registers "mamba2"
    as fla's with the Auto classes), else the one registered (foxlm's "fox", fla's types)."""
    own = CONFIG_MAPPING_NAMES.get(model_type)
    return getattr(transformers, own) if own else CONFIG_MAPPING[model_type]


def with_fields(base: PretrainedConfig, fields: dict, arch: str, given: dict) -> PretrainedConfig:
    """A config of ``base``'s class from ``given`` (what the user's config sets) with ``fields`` over it (``arch`` in
    errors), for a model ``AutoModelForCausalLM`` builds; ``fields`` are checked against ``base``'s."""
    unknown = sorted(set(fields) - config_fields(base))
    if unknown:
        raise ValueError(f"model.{unknown[0]}: not a field of {type(base).__name__} (arch={arch})")
    # under the config's own names, so that they replace what ``given`` holds under them
    fields = {base.attribute_map.get(name, name): value for name, value in fields.items()}
    try:
        config = type(base)(**{**given, **fields})
    except Exception as e:  # transformers' own checks (e.g. heads dividing hidden_size) raise several types
        reason = " ".join(str(e.__cause__ or e).split())  # the validator's own message, on one line
        raise ValueError(f"model: {type(base).__name__} refuses {fields}: {reason}") from e
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"arch: {config.model_type!r} has no model registered with AutoModelForCausalLM")
    return config


def decoder_layers(model: torch.nn.Module, arg: str = "parallel") -> torch.nn.ModuleList:
    """The blocks of a causal LM's backbone, for ``arg`` (``parallel``: FSDP2 shards them, ``compile``: each is
    compiled) to name in its error: the ModuleList of the classes the model keeps whole (``_no_split_modules``:
    Llama's ``model.layers``, Mamba's ``backbone.layers``, OPT's ``model.decoder.layers``), else one named ``layers``,
    ``h`` or ``blocks`` on the backbone."""
    kept = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(type(m).__name__ in kept for m in module):
            return module
    base = getattr(model, "base_model", model)
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    fix = "parallel=ddp" if arg == "parallel" else f"{arg}=false"
    raise ValueError(f"{arg}: cannot find the blocks of {type(model).__name__} (a ModuleList of its layers); use {fix}")


# Config fields through which transformers' causal LMs change their logits after the LM head (Gemma 2's soft cap,
# Cohere's and Falcon-H1's scales, Granite's divisor), with the value that changes nothing.
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0,
                     "lm_head_multiplier": 1.0}


def logit_transforms(config: PretrainedConfig) -> dict:
    """The fields of ``config`` by which its model's logits are not just the LM head's output."""
    return {name: getattr(config, name) for name, neutral in _LOGIT_TRANSFORMS.items()
            if getattr(config, name, neutral) not in (neutral, None)}


def use_chunked_loss(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model(input_ids=..., labels=...)`` return ``.loss`` from ``linear_cross_entropy`` on the backbone's
    hidden states and the LM head, chunk by chunk, instead of the model's own loss over [B, T, V] fp32 logits.
    Calls without labels (generation, evaluation) run the model's own forward, and so do the calls of a model whose
    logits are more than its LM head's output (``logit_transforms``: a soft cap or a scale; a head with a bias) or
    whose loss is more than the cross-entropy (a mixture of experts' router load-balancing loss, under
    ``output_router_logits``), whose own loss is then the right one. The model is the one called, so DDP and FSDP2
    hooks run as usual.
    ``num_items_in_batch`` (what HF's ``Trainer`` passes a forward that takes ``**kwargs``) makes the loss the sum over
    the labels divided by it, as in transformers' own loss. The new forward takes the arguments of the model's own
    (positional ones by its order, its signature shown), and ``return_dict`` and ``output_hidden_states`` as it does.
    Returns ``model``."""
    own_forward = model.forward
    # linear_cross_entropy has no bias: a biased head's logits (GPT-J's, CodeGen's) are the model's own to compute
    own_loss = bool(logit_transforms(model.config)) or getattr(model.get_output_embeddings(), "bias", None) is not None
    signature = inspect.signature(own_forward)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(own_forward)  # its signature too: HF's Trainer keeps the dataset columns that it names
    def forward(*args, num_items_in_batch: torch.Tensor | int | None = None, **kwargs):
        # arguments by name, as the model's forward takes them: model(ids, mask) passes a mask, not labels
        kwargs = signature.bind_partial(*args, **kwargs).arguments
        kwargs.update(kwargs.pop(var_keyword, None) or {})
        labels = kwargs.pop("labels", None)
        if labels is None:
            return own_forward(**kwargs)
        for key in ("cu_seqlens", "shift_labels"):
            if kwargs.pop(key, None) is not None:
                raise ValueError(f"{key}: {type(model).__name__} does not take {key} (packing=documents and cp > 1 "
                                 f"are for foxlm's own models)")
        # a MoE's loss adds its router's load-balancing term when the config or the call asks for router logits
        if own_loss or kwargs.get("output_router_logits", getattr(model.config, "output_router_logits", False)):
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            return own_forward(labels=labels, **kwargs)
        kwargs.setdefault("use_cache", False)
        kwargs.pop("logits_to_keep", None)  # no logits are computed
        return_dict = kwargs.pop("return_dict", None)
        return_dict = model.config.return_dict if return_dict is None else return_dict
        out = model.base_model(**kwargs, return_dict=True)
        hidden = out.last_hidden_state  # [B, T, C]
        head = model.get_output_embeddings()
        # position t predicts token t + 1, as in the models' own loss
        loss = linear_cross_entropy(hidden[:, :-1].flatten(0, 1), head.weight, labels[:, 1:].flatten(),
                                    reduction="mean" if num_items_in_batch is None else "sum")
        if num_items_in_batch is not None:
            loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                           else num_items_in_batch)
        result = CausalLMOutput(loss=loss, hidden_states=getattr(out, "hidden_states", None),
                                attentions=getattr(out, "attentions", None))
        return result if return_dict else result.to_tuple()

    model.forward = forward
    return model


def build_model(config: PretrainedConfig) -> torch.nn.Module:
    """A new, randomly initialized causal LM for ``config`` (``AutoModelForCausalLM.from_config``), for training: in
    fp32 whatever ``config.dtype`` (a pretrained model's config.json records its bf16 weights), as the trainer keeps
    every model's weights, bf16 being autocast's."""
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

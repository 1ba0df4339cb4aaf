"""foxlm.models: FoxConfig, FoxModel, FoxForCausalLM and the KV cache, registered with the HF Auto classes;
``load_checkpoint_model`` for a trained one, and ``convert`` for the FoX authors' and fla's checkpoints."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..presets import ARCHS, SIZES
from .cache import PAD_DECAY, FoxCache, KVCache
from .configuration_fox import FoxConfig
from .convert import convert
from .loading import load_checkpoint_model
from .modeling_fox import FoxCausalLMOutput, FoxForCausalLM, FoxModel, FoxModelOutput, FoxPreTrainedModel


def register_auto_classes() -> None:
    """Make ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` know model_type "fox" (idempotent)."""
    AutoConfig.register("fox", FoxConfig, exist_ok=True)
    AutoModel.register(FoxConfig, FoxModel, exist_ok=True)
    AutoModelForCausalLM.register(FoxConfig, FoxForCausalLM, exist_ok=True)
    # transformers tells a causal LM by this table of class names, which register leaves alone: Trainer's label
    # smoothing shifts the labels only for the models it lists (else each position is scored against its own token),
    # and the text-generation pipeline logs the others as unsupported. The Auto mappings read only the types that
    # CONFIG_MAPPING_NAMES (transformers' own) also holds, so this entry never sends them to import transformers.fox.
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("fox", "FoxForCausalLM")


register_auto_classes()

__all__ = [
    "ARCHS",
    "PAD_DECAY",
    "SIZES",
    "convert",
    "FoxCache",
    "KVCache",
    "FoxCausalLMOutput",
    "FoxConfig",
    "FoxForCausalLM",
    "FoxModel",
    "FoxModelOutput",
    "FoxPreTrainedModel",
    "load_checkpoint_model",
    "register_auto_classes",
]

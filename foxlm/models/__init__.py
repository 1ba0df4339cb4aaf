"""foxlm.models: FoxConfig, FoxModel, FoxForCausalLM and the KV cache, registered with the HF Auto classes;
``load_checkpoint_model`` for a trained one, and ``convert`` for the FoX authors' and fla's checkpoints."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

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

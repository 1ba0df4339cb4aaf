"""foxlm: the Forgetting Transformer (FoX) — kernels, models, training and evaluation.

Importing foxlm registers model_type "fox" with transformers' AutoConfig, AutoModel and
AutoModelForCausalLM, so ``AutoModelForCausalLM.from_pretrained(dir)`` loads foxlm checkpoints
without trust_remote_code.
"""

__version__ = "0.1.0"

from . import models  # noqa: E402,F401  (registers the Auto classes)

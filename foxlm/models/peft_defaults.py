"""PEFT's default adapter targets for model_type "fox": those of Llama, whose module names FoX's blocks share.

PEFT fills a config's missing ``target_modules`` from its ``TRANSFORMERS_MODELS_TO_*_MAPPING`` tables, looked up by
``config.model_type`` alone; it reads no attribute of the model or its config, so an entry there is the one place a
default can come from. Importing foxlm imports this module right after peft's first import (``foxlm/__init__.py``).
"""

from __future__ import annotations

from peft.utils import constants

# the projections FoX names as Llama does (attention q/k/v/o, SwiGLU gate/up/down); FoX's norms are named otherwise
# (attn_norm, mlp_norm), so a table whose Llama entry names a norm (LN tuning) gets no "fox" entry
LLAMA_NAMED = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def register_peft_defaults() -> None:
    """Give "fox" Llama's entry in each of PEFT's target-module tables whose Llama entry names only ``LLAMA_NAMED``
    projections (idempotent; an entry already there for "fox" stays)."""
    for name in dir(constants):
        table = getattr(constants, name)
        if not (name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_MAPPING") and isinstance(table, dict)):
            continue
        llama = table.get("llama")
        if isinstance(llama, list) and set(llama) <= LLAMA_NAMED:
            table.setdefault("fox", list(llama))


register_peft_defaults()

"""foxlm: the Forgetting Transformer (FoX) — kernels, models, training and evaluation.

Importing foxlm registers model_type "fox" with transformers' AutoConfig, AutoModel and
AutoModelForCausalLM, so ``AutoModelForCausalLM.from_pretrained(dir)`` loads foxlm checkpoints
without trust_remote_code. It does so without importing torch or transformers itself (the command line's
``--help`` stays instant): at once if transformers is already imported, else right after its first import.
Subpackages (``foxlm.models``, ``foxlm.ops``, ...) load on first access.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

__version__ = "0.1.0"

_SUBPACKAGES = ("data", "eval", "generate", "layers", "models", "ops", "parallel", "train")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _RegisterAfterLoad(importlib.abc.Loader):
    """Runs transformers' own loader, then imports foxlm.models (which registers the Auto classes)."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        importlib.import_module(f"{__name__}.models")


class _TransformersHook(importlib.abc.MetaPathFinder):
    """Finds ``transformers`` as the other finders do and wraps its loader; removes itself once used."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisterAfterLoad(spec.loader)
                return spec
        return None


if "transformers" in sys.modules:
    importlib.import_module(f"{__name__}.models")
elif not any(isinstance(f, _TransformersHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _TransformersHook())

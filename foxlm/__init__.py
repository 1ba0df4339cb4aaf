"""foxlm: the Forgetting Transformer (FoX) — kernels, models, training and evaluation.

Importing foxlm registers model_type "fox" with transformers' AutoConfig, AutoModel and
AutoModelForCausalLM, so ``AutoModelForCausalLM.from_pretrained(dir)`` loads foxlm checkpoints
without trust_remote_code, and gives PEFT's adapters for "fox" the default target modules Llama's have. It does so
without importing torch or transformers itself (the command line's
``--help`` stays instant): at once if transformers (peft) is already imported, else right after its first import.
Subpackages (``foxlm.models``, ``foxlm.ops``, ...) load on first access.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

__version__ = "0.1.0"

_SUBPACKAGES = ("checkpoint", "data", "eval", "generate", "layers", "models", "ops", "parallel", "train")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _RegisterAfterLoad(importlib.abc.Loader):
    """Runs a module's own loader, then retires its hook and imports the foxlm module that registers foxlm with it."""

    def __init__(self, loader: importlib.abc.Loader, hook: _AfterImportHook):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        if self.hook in sys.meta_path:
            sys.meta_path.remove(self.hook)
        importlib.import_module(self.hook.then)


class _AfterImportHook(importlib.abc.MetaPathFinder):
    """Finds ``name`` as the other finders do and wraps its loader to import ``then`` after it. It stays until the
    module is loaded: ``importlib.util.find_spec`` alone (transformers' check that peft is installed) loads nothing."""

    def __init__(self, name: str, then: str):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self.name or self not in sys.meta_path:
            return None
        at = sys.meta_path.index(self)
        sys.meta_path.remove(self)  # the other finders' spec, without finding this one again
        try:
            for finder in sys.meta_path:
                spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
                if spec is not None and spec.loader is not None:
                    spec.loader = _RegisterAfterLoad(spec.loader, self)
                    return spec
            return None
        finally:
            sys.meta_path.insert(at, self)


# transformers: the Auto classes; peft: its default adapter targets for model_type "fox" (peft looks them up by
# model_type in its own tables and reads nothing from the model or its config)
for _name, _then in (("transformers", f"{__name__}.models"), ("peft", f"{__name__}.models.peft_defaults")):
    if _name in sys.modules:
        importlib.import_module(_then)
    elif not any(isinstance(f, _AfterImportHook) and f.name == _name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportHook(_name, _then))
del _name, _then

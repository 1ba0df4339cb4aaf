"""foxlm.generate: fast generation with a paged KV cache, a Triton decode kernel, CUDA graphs and
forget-gate cache eviction (``generate``), and the ``foxlm generate`` command.

Names load on first access, so that the command line's ``--help`` does not import torch.
"""

import importlib

_EXPORTS = {
    "CachedDecoder": "decoding",
    "GenerateOutput": "decoding",
    "PagedFoxCache": "cache",
    "generate": "decoding",
    "sample_next": "decoding",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

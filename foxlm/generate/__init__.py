"""foxlm.generate: fast generation with a paged KV cache, a Triton decode kernel, CUDA graphs and
forget-gate cache eviction (``generate``), and the ``foxlm generate`` command."""

from .cache import PagedFoxCache
from .generate import CachedDecoder, GenerateOutput, generate, sample_next

__all__ = ["CachedDecoder", "GenerateOutput", "PagedFoxCache", "generate", "sample_next"]

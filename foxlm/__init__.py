"""foxlm: the Forgetting Transformer (FoX) — kernels, models, training and evaluation."""

__version__ = "0.1.0"

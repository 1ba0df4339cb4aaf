"""foxlm.train: ``foxlm train`` — config, deterministic loader, atomic checkpoints, the training loop.

Names load on first access, so that ``foxlm train --help`` and ``--print-config`` do not import torch.
"""

import importlib

_EXPORTS = {
    "Batch": "loader",
    "TokenLoader": "loader",
    "TrainConfig": "config",
    "Trainer": "trainer",
    "latest_valid_checkpoint": "foxlm.checkpoint.run_folder",
    "load_checkpoint_model": "foxlm.models.loading",
    "load_config": "config",
    "lr_at": "optim",
    "train": "trainer",
    "verify_checkpoint": "foxlm.checkpoint.manifest",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = _EXPORTS[name]
        return getattr(importlib.import_module(module if "." in module else f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""foxlm.train: ``foxlm train`` — config, deterministic loader, atomic checkpoints, the training loop."""

from ..models.loading import latest_valid_checkpoint, load_checkpoint_model, verify_checkpoint
from .config import TrainConfig, load_config
from .loader import Batch, TokenLoader
from .trainer import Trainer, lr_at, train

__all__ = [
    "Batch",
    "TokenLoader",
    "TrainConfig",
    "Trainer",
    "latest_valid_checkpoint",
    "load_checkpoint_model",
    "load_config",
    "lr_at",
    "train",
    "verify_checkpoint",
]

"""foxlm.train.metrics: FLOPs per step and the warning for a GPU-sized run on a CPU."""

from __future__ import annotations

import pytest
import torch

from foxlm.models import FoxConfig, FoxForCausalLM
from foxlm.train import load_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_config_sized_for_a_gpu_warns_on_the_cpu():
    """fox-pro-125m (32 x 16384 tokens a step) on the CPU is warned about, from its FLOPs per step; the default job,
    sized for a CPU, and the same config on a GPU are not."""
    from foxlm.train.metrics import cpu_warning, flops_per_token

    def step_flops(cfg) -> float:
        config = FoxConfig.preset(cfg.arch, cfg.size, train_length=cfg.seq_len, vocab_size=50304, **cfg.model)
        with torch.device("meta"):
            params = FoxForCausalLM(config).num_parameters()
        return flops_per_token(config, params, cfg.seq_len) * cfg.batch_size * cfg.seq_len

    big, default = step_flops(load_config("fox-pro-125m", [])), step_flops(load_config(None, []))
    warning = cpu_warning(big, torch.device("cpu"), "fox-pro 125m at 32 x 16384 tokens")
    assert warning.startswith("warning: fox-pro 125m at 32 x 16384 tokens is sized for a GPU: about ") and \
        "TFLOP per step" in warning
    assert cpu_warning(default, torch.device("cpu"), "default") is None
    assert cpu_warning(big, torch.device("cuda"), "fox-pro 125m") is None


"""foxlm.train.optim: the learning-rate schedule and the weight-decay groups."""

from __future__ import annotations

import pytest

from foxlm.models import FoxForCausalLM
from foxlm.train import lr_at
from foxlm.train.optim import param_groups
from foxlm.train.trainer import Trainer
from train.runs import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lr_schedule_and_weight_decay_groups(byte_data, tmp_path):
    cfg = tiny_config(byte_data, tmp_path, "max_steps=100", "warmup_steps=10", "lr=1e-3", "min_lr=1e-4")
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(55, cfg) == pytest.approx(5.5e-4) and lr_at(100, cfg) == pytest.approx(1e-4)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 120))
    model = FoxForCausalLM(Trainer(cfg).model_config)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert any("norm" in n for n in no_decay_names) and any("fgate_proj.bias" in n for n in no_decay_names)
    assert all(p.dim() >= 2 for p in decay["params"]) and no_decay["weight_decay"] == 0.0


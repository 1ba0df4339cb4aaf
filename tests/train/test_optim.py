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


def test_weight_decay_groups_are_the_fox_authors():
    """The FoX authors' group_parameters (src/forgetting_transformer/utils.py, with their TrainConfig defaults
    bias_weight_decay=False, normalization_weight_decay=False): weight decay on the weights of nn.Linear and
    nn.Embedding modules only; none on any norm (their per-head QK-norm and output GroupNorm too), bias or gate bias."""
    import torch

    from foxlm.models import FoxConfig

    model = FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny"))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    matrices = (torch.nn.Linear, torch.nn.Embedding)
    linear = {f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, matrices)}
    assert {names[id(p)] for p in decay["params"]} == linear
    assert {names[id(p)] for p in no_decay["params"]} == set(names.values()) - linear
    assert {"model.layers.0.attn.q_norm.weight", "model.layers.0.attn.o_norm.weight"} <= \
        {names[id(p)] for p in no_decay["params"]}


def test_a_warmup_longer_than_the_run_is_cut_to_it_with_a_warning(byte_data, tmp_path, capsys):
    """warmup_steps=15 (the default job's) with max_steps=4: the lr never reached its peak (4/15 of it at the end);
    the warmup is cut to the run, its last step at lr, and the run says so."""
    from foxlm.train import train

    cfg = tiny_config(byte_data, tmp_path / "run", "max_steps=4", "warmup_steps=15", "lr=1e-3", "min_lr=1e-4",
                      "eval_every=0")
    assert [lr_at(s, cfg) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    train(cfg)
    assert ("warning: warmup_steps=15 is more than max_steps=4: warming up over the 4 steps instead, to lr=0.001 at "
            "the last") in capsys.readouterr().err


def test_a_run_from_before_norms_left_weight_decay_resumes_with_the_new_groups(byte_data, tmp_path, monkeypatch):
    """A checkpoint of a run whose optimizer decayed the per-head norms (groups by number of dims, before) resumes
    with the norms out of the decay group and their Adam moments kept: the checkpoint's group membership must not
    come back with its state."""
    import torch

    import foxlm.train.optim as optim
    from foxlm.train import train

    def by_dims(model, weight_decay):
        params = [p for p in model.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(optim, "param_groups", by_dims)
        train(tiny_config(byte_data, run, "max_steps=2", "eval_every=0"))
    trainer = Trainer(tiny_config(byte_data, run, "max_steps=3", "eval_every=0"))
    state, _ = trainer.checkpointer.resume()
    assert state["step"] == 2
    q_norm = trainer.model.model.layers[0].attn.q_norm.weight
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0
    assert not any(p is q_norm for p in decay["params"]) and any(p is q_norm for p in no_decay["params"])
    assert torch.count_nonzero(trainer.optimizer.state[q_norm]["exp_avg_sq"]) > 0

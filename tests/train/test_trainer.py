"""foxlm.train.trainer: the loop (NaN steps, recomputation and accumulation, torch.compile, the device), and
what reads its logs."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from foxlm.train import train
from foxlm.train.trainer import Trainer
from train.runs import logged_losses, subprocess_env, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_non_finite_loss_skips_then_stops(byte_data, tmp_path):
    run = tmp_path / "nan"
    cfg = tiny_config(byte_data, run, "lr=1e30", "min_lr=1e30", "warmup_steps=0",
               "max_steps=20", "max_bad_steps=2", "grad_clip=0")
    with pytest.raises(FloatingPointError, match=f"max_bad_steps=2.*; no checkpoint was saved in {run}$"):
        train(cfg)
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r.get("skipped")]
    assert len(skipped) == 3 and all(not math.isfinite(r["loss"]) or not math.isfinite(r.get("grad_norm", 0))
                                     for r in skipped)


def _ignore_labels(trainer: Trainer, steps: set[int], rows: slice) -> None:
    """Make the trainer's loader ignore, at ``steps`` (0-based), the labels of ``rows`` of its last micro-batch:
    the loader itself never makes a micro-batch without a target (a row of two tokens or more has one), but a
    user's data through the same trainer may (every label ignored)."""
    real = trainer.loader.batch

    def batch(step: int):
        micro = real(step)
        if step in steps:
            b = micro[-1]
            labels = b.labels.clone()
            labels[rows] = -100
            micro[-1] = dataclasses.replace(b, labels=labels, num_targets=int((labels[:, 1:] != -100).sum()))
        return micro

    trainer.loader.batch = batch


@pytest.mark.parametrize("arch", [[], ["arch=hf:cohere", "model.logit_scale=0.25", "model.num_key_value_heads=1"]],
                         ids=["fox", "hf-own-loss"])
def test_a_micro_batch_without_targets_adds_nothing_to_the_step(byte_data, tmp_path, arch):
    """Steps 1 and 3 hold a micro-batch whose labels are all ignored: the step's loss is the sum over its targets
    over their count, as in one micro-batch holding the same targets (no NaN, no skipped step). Also for a Hugging
    Face model that computes its own loss (cohere: a logit scale), whose mean over no target is NaN: its NaN loss and
    gradients, weighed by 0, made the step a bad one."""
    extra = ["seq_len=8", "batch_size=2", "packing=windows", "max_steps=3", "eval_every=0", "warmup_steps=0", *arch]
    split = Trainer(tiny_config(byte_data, tmp_path / "split", *extra, "micro_batch_size=1"))
    _ignore_labels(split, {0, 2}, slice(None))
    assert [[b.num_targets for b in split.loader.batch(s)] for s in range(3)] == [[7, 0], [7, 7], [7, 0]]
    assert train(split)["bad_steps"] == 0
    whole = Trainer(tiny_config(byte_data, tmp_path / "whole", *extra))
    _ignore_labels(whole, {0, 2}, slice(1, None))  # its second row: the split's second micro-batch
    assert [[b.num_targets for b in whole.loader.batch(s)] for s in range(3)] == [[7], [14], [7]]
    train(whole)
    w, parts = logged_losses(tmp_path / "whole"), logged_losses(tmp_path / "split")
    assert w.keys() == parts.keys() == {1, 2, 3}
    assert all(math.isfinite(parts[k]) and parts[k] == pytest.approx(w[k], rel=1e-5) for k in w)


def test_a_step_without_targets_is_skipped_with_a_warning(byte_data, tmp_path, capsys):
    """A global batch whose labels are all ignored has no loss: the step leaves the model and optimizer as they were,
    logs a warning and no loss, is not a bad step, and the run goes on (it crashed dividing by 0 targets)."""
    extra = ["seq_len=8", "batch_size=1", "packing=documents", "max_steps=3", "eval_every=0", "warmup_steps=0"]
    trainer = Trainer(tiny_config(byte_data, tmp_path / "steps", *extra))
    _ignore_labels(trainer, {1}, slice(None))
    assert [b.num_targets for b in trainer.loader.batch(1)] == [0]
    trainer.start()
    try:
        assert math.isfinite(trainer.train_step()["loss"])
        params = list(trainer.model.parameters())
        before = [p.detach().clone() for p in params]
        moments = {k: v.clone() for k, v in trainer.optimizer.state[params[0]].items()}
        record = trainer.train_step()
    finally:
        trainer._unlock()
    assert record["skipped"] and "loss" not in record and trainer.bad_steps == 0 and trainer.step == 2
    assert all(torch.equal(p, q) for p, q in zip(before, params))
    assert all(torch.equal(v, trainer.optimizer.state[params[0]][k]) for k, v in moments.items())
    run = Trainer(tiny_config(byte_data, tmp_path / "run", *extra))
    _ignore_labels(run, {1}, slice(None))
    summary = train(run)
    assert summary["step"] == 3 and summary["bad_steps"] == 0 and math.isfinite(summary["loss"])
    assert "warning: step 2: no target in the batch (every label ignored), step skipped" in capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    (two,) = [r for r in records if r["step"] == 2]
    assert two["skipped"] and "loss" not in two and "grad_norm" not in two


def test_the_last_record_holds_the_steps_before_a_skipped_last_step(byte_data, tmp_path):
    """log_every=10: a run whose last step has no target, and one stopped past max_bad_steps (lr=1e30: step 1 trains,
    2 and 3 are NaN), log the mean loss of the steps that trained since the last record, as a run of log_every=1
    logged them; those losses were in no record (before the divergence: what a user wants to see)."""
    extra = ["seq_len=8", "batch_size=2", "max_steps=3", "eval_every=0"]
    trainer = Trainer(tiny_config(byte_data, tmp_path / "end", *extra, "log_every=10"))
    _ignore_labels(trainer, {2}, slice(None))
    assert train(trainer)["step"] == 3
    each = Trainer(tiny_config(byte_data, tmp_path / "each", *extra))
    _ignore_labels(each, {2}, slice(None))
    train(each)
    each_losses = logged_losses(tmp_path / "each")
    assert each_losses.keys() == {1, 2}  # the last step: skipped, without a loss
    records = [json.loads(line) for line in (tmp_path / "end" / "log.jsonl").read_text().splitlines()]
    (mean,) = [r for r in records if "loss" in r]
    assert mean["step"] == 3 and not mean.get("skipped") and mean["tokens"] == 3 * 2 * 8
    assert mean["loss"] == pytest.approx((each_losses[1] + each_losses[2]) / 2, rel=1e-6)

    nan = ["lr=1e30", "min_lr=1e30", "warmup_steps=0", "max_steps=20", "max_bad_steps=1", "grad_clip=0",
           "eval_every=0"]
    for run, every in (("nan-each", 1), ("nan-10", 10)):
        with pytest.raises(FloatingPointError, match="at 2 steps .* last at step 3"):
            train(tiny_config(byte_data, tmp_path / run, *nan, f"log_every={every}"))
    records = [json.loads(line) for line in (tmp_path / "nan-10" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped")] == [2, 3]
    (mean,) = [r for r in records if not r.get("skipped")]
    assert mean["step"] == 3 and math.isfinite(mean["loss"])
    assert mean["loss"] == pytest.approx(logged_losses(tmp_path / "nan-each")[1], rel=1e-6)


def test_eval_batches_past_the_val_split_are_reported(byte_data, tmp_path, capsys):
    """eval_batches=1000 of 64 x 512 tokens on a val split of a few such batches: validation reads the split once
    (its whole rows of 512 tokens, the last batch partial), the val loss of eval_batches=that count, and the run says
    so (it said nothing of the declared 1000)."""
    from foxlm.data import TokenDataset

    tokens = len(TokenDataset(byte_data, "val").tokens)
    n = -(-(tokens // 512) // 64)
    assert 1 < n < 1000
    extra = ["seq_len=512", "batch_size=64", "micro_batch_size=16", "max_steps=1", "eval_every=0"]
    many = train(tiny_config(byte_data, tmp_path / "many", *extra, "eval_batches=1000"))
    assert (f"eval_batches=1000 is more than the val split of {byte_data} holds ({tokens:,} tokens, 64 x 512 a "
            f"batch): validation reads {n} batches") in capsys.readouterr().err
    exact = train(tiny_config(byte_data, tmp_path / "exact", *extra, f"eval_batches={n}"))
    assert "eval_batches=" not in capsys.readouterr().err
    assert many["val_loss"] == exact["val_loss"]


def test_activation_checkpointing_and_accumulation_keep_the_losses(byte_data, tmp_path):
    """Recomputing activations, or splitting the batch into micro-batches, changes no loss."""
    extra = ["max_steps=3", "eval_every=0", "save_every=0", "packing=documents"]
    train(tiny_config(byte_data, tmp_path / "plain", *extra))
    train(tiny_config(byte_data, tmp_path / "ckpt", *extra, "activation_checkpointing=true", "micro_batch_size=1"))
    plain, ckpt = logged_losses(tmp_path / "plain"), logged_losses(tmp_path / "ckpt")
    assert plain.keys() == ckpt.keys() == {1, 2, 3}
    assert all(ckpt[k] == pytest.approx(plain[k], rel=1e-5) for k in plain)


def test_a_config_built_in_python_is_validated(byte_data, tmp_path):
    """A TrainConfig made in Python (not by load_config) is checked as the command line's: min_lr < 0 trained on at
    a negative learning rate (gradient ascent) once the cosine fell below 0, and lr < 0 failed inside AdamW with a
    message naming no key."""
    cfg = tiny_config(byte_data, tmp_path / "run", "max_steps=4", "warmup_steps=0", "eval_every=0")
    for key, value in {"min_lr": -1e-3, "lr": -1.0}.items():
        with pytest.raises(ValueError, match=f"^{key}: expected"):
            Trainer(dataclasses.replace(cfg, **{key: value}))
    assert not (tmp_path / "run").exists()


def test_torch_compile_keeps_the_losses(byte_data, tmp_path):
    """compile=true (torch.compile of every block, inductor on the CPU) trains to the eager losses; the blocks break
    their graph only at the ACP probe (``torch.compiler.disable``d: it keeps host-side statistics), without a
    warning, and the sample at the end decodes eagerly (one compile per cache length, else)."""
    from torch._dynamo.utils import counters

    extra = ["max_steps=2", "eval_every=0", "save_every=0"]
    train(tiny_config(byte_data, tmp_path / "eager", *extra))
    counters.clear()
    trainer = Trainer(tiny_config(byte_data, tmp_path / "compiled", *extra, "compile=true"))
    train(trainer)
    assert counters["graph_break"] and all("torch.compiler.disable" in reason for reason in counters["graph_break"])
    counters.clear()
    trainer.cfg.sample_tokens = 4
    trainer.sample()
    assert not counters["frames"]  # dynamo never ran
    eager, compiled = logged_losses(tmp_path / "eager"), logged_losses(tmp_path / "compiled")
    assert eager.keys() == compiled.keys() == {1, 2}
    assert all(compiled[k] == pytest.approx(eager[k], rel=1e-4) for k in eager)
    # the final validation, whose ACP probe runs inside the compiled blocks
    (ev,), (cv,) = ([json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()
                     if "val_loss" in line] for run in ("eager", "compiled"))
    assert cv["val_loss"] == pytest.approx(ev["val_loss"], rel=1e-4)
    assert cv["val_acp_skipped"] == pytest.approx(ev["val_acp_skipped"], abs=1e-6)


def test_missing_gpu_is_a_clear_error(byte_data, tmp_path):
    """(torchrun with more processes than GPUs asks for cuda:LOCAL_RANK: named here, not a CUDA error later.)"""
    with pytest.raises(ValueError, match=r"device: cuda:99 is not one of the \d+ visible GPUs"):
        Trainer(tiny_config(byte_data, tmp_path, "device=cuda:99"))


def test_trained_gates_benchmark_runs_end_to_end(byte_data, tmp_path):
    """benchmarks/trained_gates.py at a tiny size on the CPU: trains through the CLI, reads the trainer's logs and
    the evaluations' reports into one summary (its timings mean nothing here)."""
    script = Path(__file__).parents[2] / "benchmarks" / "trained_gates.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--data", str(byte_data), "--size", "tiny",
                    "--seq-len", "64", "--steps", "4", "--models", "transformer-pro", "fox-pro+acp",
                    "--eval-sequences", "1"], check=True, env=subprocess_env(), capture_output=True, timeout=600)
    (summary,) = tmp_path.glob("trained-gates-*.json")
    runs = json.loads(summary.read_text())["runs"]
    assert list(runs) == ["transformer-pro", "fox-pro+acp"]
    assert runs["transformer-pro"]["vs_transformer-pro"] == 1.0 and "acp_skipped_overall" not in runs["transformer-pro"]
    fox = runs["fox-pro+acp"]
    assert fox["tokens_per_s"] > 0 and math.isfinite(fox["val_loss"])
    assert 0.0 <= fox["acp_skipped_overall"] <= 1.0 and len(fox["acp_skipped_per_layer"]) == 4  # tiny: 4 layers
    assert 0.0 <= fox["acp_max_abs_loss_change"] < 1e-3



def test_sample_leaves_the_global_generators_as_they_were(device):
    """The end-of-training sample is seeded on its own: the CPU's and the GPU's generators come back unchanged, and the
    same seed gives the same tokens."""
    from foxlm.models import FoxConfig, FoxForCausalLM
    from foxlm.train.evaluation import sample

    torch.manual_seed(0)
    model = FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", vocab_size=64, num_hidden_layers=1)).to(device)
    before = torch.get_rng_state(), torch.cuda.get_rng_state() if device == "cuda" else None
    runs = [sample(model, [1, 2, 3], 5, seed=7, device=torch.device(device), autocast=False, eot_id=0, hf=False)
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 7
    assert torch.equal(torch.get_rng_state(), before[0])
    if device == "cuda":
        assert torch.equal(torch.cuda.get_rng_state(), before[1])


def test_a_run_without_progress_saves_without_transformers_bar(byte_data, tmp_path, capsys):
    """progress=false, called from Python (the CLI turns the hub's bars off for the whole process): the checkpoint's
    save_pretrained showed transformers' "Writing model shards" bar on stderr all the same; progress=true keeps it,
    and transformers' global switch is as it was after the run."""
    from transformers.utils import logging as hf_logging

    train(tiny_config(byte_data, tmp_path / "quiet", "max_steps=1", "eval_every=0"))
    assert "Writing model shards" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
    train(tiny_config(byte_data, tmp_path / "bars", "max_steps=1", "eval_every=0", "progress=true"))
    assert "Writing model shards" in capsys.readouterr().err


_HAMLET = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings. "


@pytest.mark.parametrize("packing", ["windows", "documents"])
@pytest.mark.parametrize("text, rows", [(_HAMLET.strip(), 3), ((_HAMLET * 3)[:220], 6)],
                         ids=["under-a-batch", "a-batch-and-a-half"])
def test_the_whole_val_split_is_validated_once(tmp_path, packing, text, rows):
    """batch_size 4 x seq_len 32 on a val split of 97 tokens (3 whole rows: under a batch) or of 221 (6 whole rows: a
    batch and a half), eval_batches=2: the val loss is the mean over all the split's whole rows, each read once, as
    the model gives it on each (as HF Trainer's eval loop reads a dataset whole, its last batch partial). A last batch
    past the split's end has rows that wrapped around to tokens read already: those weighed some tokens twice; and a
    split of 1.5 batches was validated on its first batch only, while one of 0.75 batches was validated whole."""
    data, val = _val_split(tmp_path, text)
    assert len(val) // 32 == rows
    trainer = Trainer(tiny_config(data, tmp_path / "run", "max_steps=1", f"packing={packing}"))
    assert trainer.evaluate()["val_loss"] == pytest.approx(_mean_row_loss(trainer.model, val, rows), rel=1e-6)


def _val_split(tmp_path: Path, text: str) -> tuple[Path, np.ndarray]:
    """A byte-level data folder whose val split is ``text`` and its end-of-text token: (the folder, its val tokens)."""
    from foxlm.data import TokenDataset, prepare
    from foxlm.data.assets import shakespeare_plays

    (tmp_path / "a.txt").write_text(shakespeare_plays()[0].read_text())
    (tmp_path / "b.txt").write_text(text)
    data = tmp_path / "data"
    prepare([tmp_path / "a.txt", tmp_path / "b.txt"], data, tokenizer="byte", val_fraction=0.5, workers=0,
            progress=False)
    return data, np.asarray(TokenDataset(data, "val").tokens).astype(np.int64)


def _mean_row_loss(model: torch.nn.Module, val: np.ndarray, rows: int) -> float:
    """The mean of the model's own loss on each of the first ``rows`` rows of 32 tokens of ``val``."""
    model.eval()
    with torch.no_grad():
        return sum(model(input_ids=r, labels=r).loss.item()
                   for r in (torch.from_numpy(val[i * 32:(i + 1) * 32])[None] for i in range(rows))) / rows


def test_a_validation_micro_batch_past_the_split_adds_nothing_to_an_hf_models_loss(tmp_path):
    """A Hugging Face model that computes its own loss (cohere: a logit scale) on a val split of 3 rows, batch_size 4
    in micro-batches of 1: the fourth micro-batch is past the split's end, without a target, and the model's mean
    over no target is NaN; weighed by 0 targets it still made the val loss NaN. The val loss is the 3 rows' mean."""
    data, val = _val_split(tmp_path, _HAMLET.strip())
    trainer = Trainer(tiny_config(data, tmp_path / "run", "max_steps=1", "arch=hf:cohere", "model.logit_scale=0.25",
                                  "model.num_key_value_heads=1", "micro_batch_size=1"))
    assert trainer.evaluate()["val_loss"] == pytest.approx(_mean_row_loss(trainer.model, val, 3), rel=1e-6)

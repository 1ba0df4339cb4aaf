"""foxlm.train.preemption: SIGTERM stops a run at a safe point with a checkpoint that resumes exactly."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from foxlm.train import latest_valid_checkpoint, train
from train.runs import TINY, logged_losses, subprocess_env, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sigterm_saves_and_stops_then_resumes_exactly(byte_data, tmp_path):
    """A preempted job (SIGTERM) ends with a checkpoint of its last whole step (the current one given up, or just
    done) and exit status 143; resumed, it trains the losses of an uninterrupted run. The learning rate is constant,
    so a longer max_steps does not change it."""
    extra = ["max_steps=1000000", "warmup_steps=0", "min_lr=3e-3", "save_every=0", "eval_every=0"]
    run = tmp_path / "preempted"
    cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env())
    log = run / "log.jsonl"
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = max(logged_losses(run))
    ckpt = run / "checkpoints" / f"step_{stopped:07d}"
    assert f"stopped by SIGTERM after step {stopped}; the same command resumes the run" in err or \
        f"stopped by SIGTERM during step {stopped + 1}: saved {ckpt}; the same command resumes the run" in err, err
    assert out.strip() == f"step {stopped}: stopped by SIGTERM; last checkpoint {ckpt}" and "sample" not in out
    assert sorted(logged_losses(run)) == list(range(1, stopped + 1))
    assert latest_valid_checkpoint(run).name == f"step_{stopped:07d}"

    more = [*extra[1:], f"max_steps={stopped + 3}"]
    summary = train(tiny_config(byte_data, run, *more))
    assert summary["step"] == stopped + 3 and "stopped" not in summary
    train(tiny_config(byte_data, tmp_path / "ref", *more))
    assert logged_losses(run) == logged_losses(tmp_path / "ref")  # exactly, step by step


def test_a_validation_a_stop_left_out_runs_first_when_resumed(byte_data, tmp_path, monkeypatch):
    """SIGTERM after step 2, whose validation was due (eval_every=2), and SIGTERM inside step 4's validation: each
    run stops with a checkpoint, and resumed, first logs that step's validation loss, that of an uninterrupted run.
    The log held no validation of that step: the resumed run went on from the next one."""
    import os

    from foxlm.train import evaluation
    from foxlm.train.trainer import Trainer

    extra = ["max_steps=6", "eval_every=2", "save_every=0"]
    train(tiny_config(byte_data, tmp_path / "ref", *extra))

    def vals(run):
        return {r["step"]: r["val_loss"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())
                if "val_loss" in r}

    ref = vals(tmp_path / "ref")
    assert sorted(ref) == [2, 4, 6]

    after = Trainer(tiny_config(byte_data, tmp_path / "after", *extra))  # SIGTERM between steps 2 and 3
    step = after.train_step
    after.train_step = lambda: (record := step(), record["step"] == 2 and os.kill(os.getpid(), signal.SIGTERM))[0]
    assert train(after)["stopped"] == "SIGTERM" and vals(tmp_path / "after") == {}

    inside = tmp_path / "inside"  # SIGTERM inside step 4's validation
    real = evaluation.validation_loss

    def cut(model, forward, *args):
        def signalled(b):
            if sum(1 for r in (inside / "log.jsonl").read_text().splitlines() if '"loss"' in r) == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            return forward(b)
        return real(model, signalled, *args)

    with monkeypatch.context() as m:
        m.setattr(evaluation, "validation_loss", cut)
        assert train(tiny_config(byte_data, inside, *extra))["stopped"] == "SIGTERM"
    assert vals(inside) == pytest.approx({2: ref[2]}, rel=1e-6)

    for run, stopped in (("after", 2), ("inside", 4)):
        assert latest_valid_checkpoint(tmp_path / run).name == f"step_{stopped:07d}"
        assert train(tiny_config(byte_data, tmp_path / run, *extra))["step"] == 6
        assert vals(tmp_path / run) == pytest.approx(ref, rel=1e-6), run
        assert logged_losses(tmp_path / run) == logged_losses(tmp_path / "ref"), run


def test_sigterm_inside_a_step_saves_the_random_draws_of_the_last_whole_step(byte_data, tmp_path):
    """hf:gpt2 draws dropout in each micro-batch. SIGTERM in step 3's second micro-batch, after the first drew its
    dropout: the run saves step 2 with the generator state step 2 ended with, not one the given-up micro-batch moved
    on, so that resumed it trains the losses of an uninterrupted run exactly."""
    import os

    from foxlm.train import load_config
    from foxlm.train.trainer import Trainer

    gpt2 = [t for t in TINY if not t.startswith("model.")] + [
        "arch=hf:gpt2", "model.n_embd=32", "model.n_layer=1", "model.n_head=2", "eval_every=0", "save_every=0",
        "micro_batch_size=2", "max_steps=4"]

    def config(run):
        return load_config(None, [*gpt2, f"data={byte_data}", f"out_dir={run}"])

    train(config(tmp_path / "ref"))
    run = tmp_path / "run"
    trainer = Trainer(config(run))
    loss, calls = trainer._loss, []

    def signalled(*args, **kwargs):
        calls.append(1)
        out = loss(*args, **kwargs)
        if len(calls) == 6:  # step 3's second micro-batch
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer._loss = signalled
    summary = train(trainer)
    assert summary["stopped"] == "SIGTERM" and summary["step"] == 2
    assert latest_valid_checkpoint(run).name == "step_0000002"
    assert train(config(run))["step"] == 4
    assert logged_losses(run) == logged_losses(tmp_path / "ref") and len(logged_losses(run)) == 4


def test_sigterm_stops_inside_a_long_step(byte_data, tmp_path):
    """A step of many micro-batches (a CPU step can take minutes): the first SIGTERM stops the run inside it, saving
    the last whole step, which resumes exactly."""
    extra = ["max_steps=1000000", "warmup_steps=0", "min_lr=3e-3", "save_every=0", "eval_every=0", "batch_size=128",
             "micro_batch_size=1"]
    run = tmp_path / "preempted"
    cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env())
    log = run / "log.jsonl"
    while not (log.exists() and log.read_text().endswith("\n")):  # step 1 is done: step 2 runs for a second or so
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    ckpt = run / "checkpoints" / "step_0000001"
    assert "SIGTERM: stopping at the next safe point, saving the last whole step" in err
    assert f"stopped by SIGTERM during step 2: saved {ckpt}; the same command resumes the run" in err, err
    assert out.strip() == f"step 1: stopped by SIGTERM; last checkpoint {ckpt}"
    assert sorted(logged_losses(run)) == [1] and latest_valid_checkpoint(run) == ckpt

    more = [*extra[1:], "max_steps=2"]
    assert train(tiny_config(byte_data, run, *more))["step"] == 2
    train(tiny_config(byte_data, tmp_path / "ref", *more))
    assert logged_losses(run) == logged_losses(tmp_path / "ref")  # exactly, step by step


def test_sigterm_in_a_first_long_step_stops_within_seconds_and_saves_nothing(byte_data, tmp_path):
    """A first step of minutes (4096 micro-batches): the bar shows its micro-batches, SIGTERM stops it within
    seconds, and the run says that nothing was saved, naming no checkpoint that does not exist."""
    extra = ["max_steps=10", "save_every=0", "eval_every=0", "batch_size=4096", "micro_batch_size=1",
             "progress=true"]
    run = tmp_path / "preempted"
    cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}", *extra]
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(cmd, stderr=stderr, stdout=subprocess.PIPE, text=True, env=subprocess_env())
        while "micro-batch " not in (tmp_path / "stderr").read_text():  # shown once the step has run 2 s
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        sent = time.perf_counter()
        out, _ = proc.communicate(timeout=120)
    took, err = time.perf_counter() - sent, (tmp_path / "stderr").read_text()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert re.search(r"micro-batch \d+/4096 of step 1, \d+ s in", err), err
    assert took < 10, took  # the step itself runs for a minute or more
    assert "stopped by SIGTERM during step 1: no step finished, nothing saved; the same command starts the run " \
           "again" in err, err
    assert out.strip() == f"step 0: stopped by SIGTERM; no checkpoint written in {run}"
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


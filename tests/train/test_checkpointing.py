"""foxlm.train.checkpointing: the run folder's lock, saving, exact resuming and init_from."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foxlm.data import TokenDataset, prepare
from foxlm.data.assets import shakespeare_plays
from foxlm.train import latest_valid_checkpoint, load_checkpoint_model, load_config, train
from foxlm.train.trainer import Trainer
from train.runs import TINY, logged_losses, subprocess_env, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_resume_after_kill_reproduces_losses(byte_data, tmp_path, capsys):
    """SIGKILL a real `foxlm train` process after a checkpoint, resume it, compare with an uninterrupted run."""
    extra = ["max_steps=30", "save_every=3", "keep_last=2", "eval_every=10", "packing=documents", "tensorboard=true"]
    ref = tmp_path / "ref"
    train(tiny_config(byte_data, ref, *extra))

    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}",
           *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=subprocess_env())
    for line in proc.stderr:
        if "step_0000006" in line:  # two checkpoints exist: kill it mid-run
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckpt = latest_valid_checkpoint(run)
    assert ckpt is not None and 6 <= int(ckpt.name.split("_")[1]) < 30

    leftover = run / "checkpoints" / ".step_0000009.tmp-123"  # what a kill during a save leaves
    leftover.mkdir(exist_ok=True)
    (leftover / "trainer.pt").write_bytes(b"half-written")
    summary = train(tiny_config(byte_data, run, *extra))
    assert summary["step"] == 30 and not leftover.exists()
    err = capsys.readouterr().err
    assert "resumed from" in err and "changed settings" not in err
    assert logged_losses(run) == logged_losses(ref)  # exactly, step by step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()  # each step once, with the resumed run's loss (purge_step drops what the killed run logged after)
    assert {e.step: e.value for e in tb.Scalars("train/loss")} == pytest.approx(logged_losses(ref), rel=1e-6)
    assert len(tb.Scalars("train/loss")) == 30
    a, b = load_checkpoint_model(run), load_checkpoint_model(ref / "checkpoints" / "step_0000030")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_0000027", "step_0000030"]
    assert (run / "checkpoints" / "latest").read_text() == "step_0000030"


def test_a_resumed_run_logs_the_mean_of_the_steps_since_the_last_record(byte_data, tmp_path):
    """log_every=4, killed after step 6's checkpoint: the resumed run's record of step 8 is the mean loss of steps 5
    to 8, as without the kill; it was that of steps 7 and 8, the steps after the checkpoint being lost."""
    extra = ["max_steps=8", "save_every=3", "keep_last=5", "log_every=4", "eval_every=0"]
    ref = tmp_path / "ref"
    train(tiny_config(byte_data, ref, *extra))
    run = tmp_path / "run"
    shutil.copytree(ref, run)  # what the run had written when killed after step 6's save (and its later log lines)
    shutil.rmtree(run / "checkpoints" / "step_0000008")
    train(tiny_config(byte_data, run, *extra))
    assert sorted(logged_losses(ref)) == [4, 8] and logged_losses(run) == logged_losses(ref)


def test_a_run_never_trains_into_checkpoints_it_does_not_continue(byte_data, tmp_path, capsys):
    """Another run's checkpoints, later ones than the resume point, or another model's are refused before anything
    is written (pruning by step would delete them or the new run's own); a checkpoint starts a run in a new out_dir."""
    run = tmp_path / "run"
    train(tiny_config(byte_data, run, "max_steps=4", "save_every=2", "eval_every=0"))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    cases = {("resume=never",): "another run's checkpoints",
             (f"resume={run / 'checkpoints' / 'step_0000002'}",): "after step_0000002, which this run resumes from",
             ("model.hidden_size=32",):
                 r"trained as fox-pro tiny with model=\{'hidden_size': 64, .*\{'hidden_size': 32",
             ("arch=transformer-pro",): "fgate_proj"}
    for extra, message in cases.items():
        with pytest.raises(ValueError, match=message):
            train(tiny_config(byte_data, run, "max_steps=6", "save_every=2", "eval_every=0", *extra))
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing written or pruned

    branch = tmp_path / "branch"
    capsys.readouterr()
    summary = train(tiny_config(byte_data, branch, "max_steps=6", "save_every=2", "eval_every=0",
                         f"resume={run / 'checkpoints' / 'step_0000002'}"))
    assert summary["step"] == 6 and min(logged_losses(branch)) == 3
    assert f"at step 2, with changed settings: max_steps: 4 -> 6; out_dir: '{run}' -> '{branch}'\n" in \
        capsys.readouterr().err
    assert sorted(p.name for p in (branch / "checkpoints").iterdir()) == \
        ["latest", "step_0000004", "step_0000006"]  # keep_last=3 of this run's own saves; none of the other run's
    with pytest.raises(ValueError, match="checkpoints of another run than"):
        train(tiny_config(byte_data, branch, "max_steps=8", f"resume={run / 'checkpoints' / 'step_0000004'}"))
    damaged = tmp_path / "damaged" / "checkpoints" / "step_0000004"
    shutil.copytree(run / "checkpoints" / "step_0000004", damaged)
    (damaged / "trainer.pt").write_bytes(b"not the saved state")
    with pytest.raises(ValueError, match="only checkpoints that do not verify"), pytest.warns(UserWarning):
        train(tiny_config(byte_data, tmp_path / "damaged", "max_steps=8"))
    # a damaged newest checkpoint after a good one: named as damaged, not as a later one the run ignores
    shutil.copytree(run / "checkpoints" / "step_0000002", damaged.parent / "step_0000002")
    with pytest.raises(ValueError, match=r"checkpoints after step_0000002, the newest that verifies, that do not "
                                         r"verify \(step_0000004\)"), pytest.warns(UserWarning):
        train(tiny_config(byte_data, tmp_path / "damaged", "max_steps=8"))


def test_init_from_starts_a_new_run_from_trained_weights(byte_data, tmp_path, capsys):
    """init_from: a new run (step 0, its own optimizer and schedule) from another run's weights, bitwise; the model
    settings it changes are reported; resuming the new run uses its own checkpoint, not init_from again."""
    src = tmp_path / "src"
    trained = train(tiny_config(byte_data, src, "max_steps=30", "eval_every=0"))
    fresh = train(tiny_config(byte_data, tmp_path / "fresh", "max_steps=1", "eval_every=0"))
    tuned = tmp_path / "tuned"
    args = ("eval_every=0", "seq_len=64", "lr=1e-3", "model.window=48")

    trainer = Trainer(tiny_config(byte_data, tuned, "max_steps=2", *args))
    folder, changed = trainer.checkpointer.initialize(src)
    assert folder == src / "checkpoints" / "step_0000030" / "model" and changed == ["window: None -> 48"]
    saved = load_checkpoint_model(src).state_dict()
    assert all(torch.equal(t, saved[name]) for name, t in trainer.model.state_dict().items())

    capsys.readouterr()
    summary = train(tiny_config(byte_data, tuned, "max_steps=2", f"init_from={src}", *args))
    err = capsys.readouterr().err
    assert f"initialized from {folder}, with changed model settings: window: None -> 48\n" in err
    assert sorted(logged_losses(tuned)) == [1, 2] and summary["step"] == 2
    assert summary["first_loss"] < fresh["first_loss"] - 1 and abs(summary["first_loss"] - trained["loss"]) < 0.5

    summary = train(tiny_config(byte_data, tuned, "max_steps=4", f"init_from={tmp_path / 'gone'}", *args))
    err = capsys.readouterr().err
    assert "resumed from" in err and "initialized from" not in err and summary["step"] == 4


def test_a_resumed_run_says_init_from_is_unused(byte_data, tmp_path, capsys):
    """Resumed with a new init_from and lr: lr is the one changed setting, and init_from is said to be unused (the
    resumed run goes on from its own weights); it was listed as a changed setting, which told that the run took it."""
    train(tiny_config(byte_data, tmp_path / "other", "max_steps=1", "eval_every=0"))
    train(tiny_config(byte_data, tmp_path / "run", "max_steps=2", "eval_every=0"))
    capsys.readouterr()
    summary = train(tiny_config(byte_data, tmp_path / "run", "max_steps=3", "eval_every=0", "lr=1e-3",
                                f"init_from={tmp_path / 'other'}"))
    err = capsys.readouterr().err
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000002"
    assert f"resumed from {ckpt} at step 2, with changed settings: max_steps: 2 -> 3; lr: 0.003 -> 0.001\n" in err
    assert f"init_from={tmp_path / 'other'} is not used: a resumed run goes on from its checkpoint's weights" in err
    assert summary["step"] == 3


def test_async_checkpoint_in_one_process_says_it_is_not_used(byte_data, tmp_path, capsys):
    """Background saves write the shards of several processes: a one-process run with async_checkpoint=true writes
    each checkpoint whole, and says so once, rather than ignoring the setting in silence."""
    summary = train(tiny_config(byte_data, tmp_path / "run", "max_steps=2", "save_every=1", "eval_every=0",
                                "async_checkpoint=true"))
    err = capsys.readouterr().err
    assert err.count("async_checkpoint=true is not used: one process writes each checkpoint whole") == 1
    assert summary["step"] == 2 and (tmp_path / "run" / "checkpoints" / "step_0000001").is_dir()


def test_a_resumed_run_trains_with_the_optimizer_settings_it_reports(byte_data, tmp_path):
    """Resuming with another weight_decay, beta1, beta2 or eps: the log reports them changed, and the optimizer uses
    them. Loading the optimizer's state dict brought the checkpoint's back, so the report was untrue."""
    run = tmp_path / "run"
    train(tiny_config(byte_data, run, "max_steps=2", "eval_every=0", "weight_decay=0.1"))
    trainer = Trainer(tiny_config(byte_data, run, "max_steps=4", "eval_every=0", "weight_decay=0.01", "beta1=0.8",
                                  "beta2=0.9", "eps=1e-5"))
    _, (note,) = trainer.checkpointer.resume()
    assert "weight_decay: 0.1 -> 0.01; beta1: 0.9 -> 0.8; beta2: 0.95 -> 0.9; eps: 1e-08 -> 1e-05" in note
    decay, no_decay = trainer.optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.01, 0.0)
    assert all(tuple(g["betas"]) == (0.8, 0.9) and g["eps"] == 1e-5 for g in (decay, no_decay))
    assert trainer.optimizer.state[decay["params"][0]]["step"] == 2  # the moments are the checkpoint's


def _tiny_gpt2(byte_data):
    """The config of a tiny hf:gpt2 run (tied embeddings, dropout) saving every 2 steps: run folder, overrides ->
    TrainConfig."""
    gpt2 = [t for t in TINY if not t.startswith("model.")] + [
        "arch=hf:gpt2", "model.n_embd=32", "model.n_layer=1", "model.n_head=2", "eval_every=0", "save_every=2"]
    return lambda run, *extra: load_config(None, [*gpt2, f"data={byte_data}", f"out_dir={run}", *extra])


def test_a_model_with_tied_embeddings_resumes_and_initializes(byte_data, tmp_path):
    """hf:gpt2 ties its LM head to the embedding, so save_pretrained writes that weight once: resuming reproduces an
    uninterrupted run and init_from takes its weights. Both refused it ("lm_head.weight: absent there")."""
    config = _tiny_gpt2(byte_data)
    train(config(tmp_path / "ref", "max_steps=4"))
    run = tmp_path / "run"
    train(config(run, "max_steps=2"))
    train(config(run, "max_steps=4"))
    assert logged_losses(run) == logged_losses(tmp_path / "ref") and len(logged_losses(run)) == 4
    trainer = Trainer(config(tmp_path / "new", "max_steps=1"))
    trainer.checkpointer.initialize(run)
    saved = load_checkpoint_model(run).state_dict()
    assert all(torch.equal(t, saved[name]) for name, t in trainer.model.state_dict().items())
    assert trainer.model.lm_head.weight is trainer.model.transformer.wte.weight  # still tied


def test_a_checkpoint_of_one_shared_rng_state_still_resumes_exactly(byte_data, tmp_path):
    """A checkpoint from before each process's RNG state was kept holds one (the main process's CPU state and all its
    GPUs'): a run of one process resumes from it as exactly as before (hf:gpt2 draws its dropout), and in a run of
    several only process 0 restores it, the others keeping their own streams, which the log says."""
    from foxlm.checkpoint.manifest import write_manifest
    from foxlm.train.rng import restore_rng_states

    config = _tiny_gpt2(byte_data)
    train(config(tmp_path / "ref", "max_steps=4"))
    run = tmp_path / "run"
    train(config(run, "max_steps=2"))
    ckpt = run / "checkpoints" / "step_0000002"
    state = torch.load(ckpt / "trainer.pt", weights_only=True)
    (own,) = state["rng"]
    state["rng"] = old = {"cpu": own["cpu"], "cuda": []}  # as written then, on a machine without a GPU
    torch.save(state, ckpt / "trainer.pt")
    write_manifest(ckpt, step=2)
    train(config(run, "max_steps=4"))
    assert logged_losses(run) == logged_losses(tmp_path / "ref") and len(logged_losses(run)) == 4
    a, b = load_checkpoint_model(run), load_checkpoint_model(tmp_path / "ref")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

    before = torch.get_rng_state()
    assert restore_rng_states(old, 2, 1, 2, torch.device("cpu"), seed=7) == (
        "warning: RNG: the checkpoint holds the main process's RNG state only (saved before foxlm kept each "
        "process's): process 0 restored; process 1 from seed=7 and rank; random draws (dropout) are not an "
        "uninterrupted run's")
    assert torch.equal(torch.get_rng_state(), before)  # process 1's own stream goes on
    assert restore_rng_states(old, 2, 0, 2, torch.device("cpu"), seed=7) is not None
    assert torch.equal(torch.get_rng_state(), own["cpu"])


def test_init_from_refuses_what_does_not_fit(byte_data, tmp_path):
    src = tmp_path / "src"
    train(tiny_config(byte_data, src, "max_steps=1", "eval_every=0"))
    model = src / "checkpoints" / "step_0000001" / "model"
    with pytest.raises(FileNotFoundError, match="init_from: .*nothing is not a run folder, a checkpoint folder"):
        train(tiny_config(byte_data, tmp_path / "new", f"init_from={tmp_path / 'nothing'}"))
    for extra, message in [("model.hidden_size=32", r"another model than this config's fox-pro tiny with model=\{'hid"),
                           ("arch=transformer-pro", "fgate_proj")]:
        with pytest.raises(ValueError, match=f"init_from: {model}.*{message}"):
            train(tiny_config(byte_data, tmp_path / "new", f"init_from={src}", extra))
    for key, value, message in [("foxlm_tokenizer", {"name": "gpt2"}, "was trained with the tokenizer"),
                                ("model_type", "llama", "holds a 'llama' model, not a foxlm model")]:
        other = tmp_path / key
        shutil.copytree(model, other)
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=message):
            train(tiny_config(byte_data, tmp_path / "new", f"init_from={other}"))
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_init_from_a_sharded_folder_reads_only_the_shards_its_index_names_there(byte_data, tmp_path, capsys):
    """A save_pretrained folder without a manifest (from the hub) whose model.safetensors.index.json is damaged, names
    a shard outside the folder, or a missing one: a one-line error naming init_from and the file (the first was a
    KeyError traceback, the second read a file of another folder)."""
    from foxlm.cli import main

    src = tmp_path / "src"
    train(tiny_config(byte_data, src, "max_steps=1", "eval_every=0"))
    hub = tmp_path / "hub"
    shutil.copytree(src / "checkpoints" / "step_0000001" / "model", hub)
    (hub / "model.safetensors").rename(hub / "model-00001-of-00001.safetensors")
    (tmp_path / "elsewhere.safetensors").write_bytes((hub / "model-00001-of-00001.safetensors").read_bytes())
    index = hub / "model.safetensors.index.json"
    for weight_map, message in [(None, "expected a weight_map of tensor names to shard files"),
                                ({"x": "../elsewhere.safetensors"}, "shard '../elsewhere.safetensors' is not a file of "
                                                                    "its folder"),
                                ({"x": "model-00002-of-00002.safetensors"},
                                 "model-00002-of-00002.safetensors, a shard model.safetensors.index.json names, is "
                                 "missing")]:
        index.write_text(json.dumps({"metadata": {}} if weight_map is None else {"weight_map": weight_map}))
        capsys.readouterr()
        assert main(["train", *TINY, f"data={byte_data}", f"out_dir={tmp_path / 'new'}", f"init_from={hub}"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"init_from: {hub}" in err and message in err, err
    # two shards holding one tensor: which a model got depended on the order they were read in
    from safetensors.torch import load_file, save_file

    first = hub / "model-00001-of-00001.safetensors"
    tensors = load_file(first)
    name = sorted(tensors)[0]
    save_file({name: tensors[name] + 1}, hub / "model-00002-of-00002.safetensors")
    index.write_text(json.dumps({"weight_map": {**{k: first.name for k in tensors},
                                                "extra": "model-00002-of-00002.safetensors"}}))
    capsys.readouterr()
    assert main(["train", *TINY, f"data={byte_data}", f"out_dir={tmp_path / 'new'}", f"init_from={hub}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"init_from: {name} is in {hub / 'model-00002-of-00002.safetensors'} and in " \
        "an earlier shard" in err, err
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_resume_names_a_folder_that_is_no_checkpoint(byte_data, tmp_path, capsys):
    """resume=PATH of a run folder, a checkpoint's model/, an export or nothing at all: a one-line error naming resume
    and what it takes (it was "checkpoint PATH: no readable manifest.json ([Errno 2] ...)", or a FileNotFoundError for
    an export's missing trainer.pt), before anything is written."""
    from foxlm.cli import main

    run = tmp_path / "run"
    train(tiny_config(byte_data, run, "max_steps=2", "save_every=2", "eval_every=0"))
    assert main(["export", str(run), str(tmp_path / "export")]) == 0
    ckpt = run / "checkpoints" / "step_0000002"
    for path, extra in [(run, f" \\(resume=auto with out_dir={run} continues that run\\)"),
                        (ckpt / "model", ""), (tmp_path / "export", ""), (tmp_path / "nothing", "")]:
        capsys.readouterr()
        assert main(["train", *TINY, f"data={byte_data}", f"out_dir={tmp_path / 'new'}", f"resume={path}"]) == 2
        err = capsys.readouterr().err
        kind = " but a run folder" if extra else ""
        expected = (f"foxlm train: error: resume: {path} is not a checkpoint folder{kind}; expected auto, never, or a "
                    f"checkpoint: a checkpoints/step_NNNNNNN folder .*{extra}$")
        assert "Traceback" not in err and re.fullmatch(expected, err.strip()), err
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_a_run_folder_in_use_is_refused(byte_data, tmp_path):
    """A second `foxlm train` in a run folder while another holds it (here: a lock taken by this process through
    another open file, as another process would) stops before writing; the folder is free again once released."""
    from foxlm.checkpoint.run_folder import lock_run

    run = tmp_path / "run"
    run.mkdir()
    held = lock_run(run)
    try:
        assert lock_run(run) is None
        with pytest.raises(ValueError, match=rf"out_dir: .* is in use by another foxlm train \(pid {os.getpid()}\)"):
            train(tiny_config(byte_data, run, "max_steps=2"))
        assert sorted(p.name for p in run.iterdir()) == [".foxlm-run", ".lock"]
    finally:
        held.close()
    assert train(tiny_config(byte_data, run, "max_steps=2"))["step"] == 2


def test_a_folder_of_user_files_is_never_trained_into(byte_data, tmp_path, capsys):
    """An out_dir holding a user's log.jsonl, train_config.yaml, tb/ events and notes but no checkpoints is refused
    before anything is written there (a run used to overwrite them); a new or empty folder is taken, and so is a run's
    own folder, also one killed before its first checkpoint, without touching the user's files added to it."""
    from foxlm.cli import main

    def files(folder: Path) -> dict:
        return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    mine = tmp_path / "mine"
    (mine / "tb").mkdir(parents=True)
    for name, text in {"log.jsonl": '{"step": 1, "loss": 0.25}\n', "train_config.yaml": "lr: 0.1\n",
                       "tb/events.out.tfevents.1.host": "my events", "NOTES.md": "my notes"}.items():
        (mine / name).write_text(text)
    before = files(mine)
    capsys.readouterr()
    assert main(["train", *TINY, f"data={byte_data}", f"out_dir={mine}", "max_steps=2"]) == 2
    assert capsys.readouterr().err == (f"foxlm train: error: out_dir: {mine} holds files no foxlm run wrote (NOTES.md, "
                                       "log.jsonl, tb, train_config.yaml), which a run would overwrite or mix with its "
                                       "own; train into a new or empty out_dir\n")
    assert files(mine) == before and sorted(p.name for p in mine.iterdir()) == ["NOTES.md", "log.jsonl", "tb",
                                                                                 "train_config.yaml"]
    with pytest.raises(NotADirectoryError, match="out_dir: .*NOTES.md is a file; expected a folder for the run"):
        train(tiny_config(byte_data, mine / "NOTES.md", "max_steps=2"))

    run = tmp_path / "empty"
    run.mkdir()
    assert train(tiny_config(byte_data, run, "max_steps=2", "eval_every=0"))["step"] == 2
    shutil.rmtree(run / "checkpoints")  # as if killed before its first save
    (run / "NOTES.md").write_text("notes on the run")
    assert train(tiny_config(byte_data, run, "max_steps=2", "eval_every=0"))["step"] == 2
    assert (run / "NOTES.md").read_text() == "notes on the run" and len(logged_losses(run)) == 2


def test_a_refused_run_leaves_out_dir_as_it_was(byte_data, tmp_path):
    """A folder of a user's files and checkpoints no foxlm run wrote is refused, and left as it was: the refused run
    marked it as a run's, so that once the checkpoints were moved away, as the error says, the next run took it and
    overwrote the user's log.jsonl. A new folder a run is refused into is not left behind."""
    mine = tmp_path / "mine"
    (mine / "checkpoints" / "step_0000100").mkdir(parents=True)
    (mine / "checkpoints" / "step_0000100" / "model.bin").write_text("my weights")
    (mine / "log.jsonl").write_text('{"step": 100, "loss": 0.25}\n')
    before = sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*"))
    with pytest.raises(ValueError, match="only checkpoints that do not verify"), pytest.warns(UserWarning):
        train(tiny_config(byte_data, mine, "max_steps=1"))
    assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*")) == before
    shutil.move(mine / "checkpoints", tmp_path / "moved")
    with pytest.raises(ValueError, match=r"holds files no foxlm run wrote \(log.jsonl\)"):
        train(tiny_config(byte_data, mine, "max_steps=1"))
    assert (mine / "log.jsonl").read_text() == '{"step": 100, "loss": 0.25}\n'

    (tmp_path / "export").mkdir()
    with pytest.raises(ValueError, match="export_dir: .* exists"):
        train(tiny_config(byte_data, tmp_path / "new" / "run", "max_steps=1", f"export_dir={tmp_path / 'export'}"))
    assert not (tmp_path / "new" / "run").exists()


def test_folders_a_run_cannot_make_are_refused_naming_their_key(byte_data, tmp_path):
    """An out_dir or export_dir whose path runs through a file (a typo's) is refused before anything is written,
    naming its key: export_dir's was found only after the whole run had trained, as "[Errno 17] File exists" naming
    the file, and out_dir's named no key. An export_dir something else makes while the run trains is refused naming
    export_dir, not foxlm export's `dst`, the run's last checkpoint kept."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for key, run, export in (("out_dir", notes / "run", None), ("export_dir", tmp_path / "run", notes / "model")):
        extra = ["max_steps=2", "eval_every=0"] + ([f"export_dir={export}"] if export else [])
        with pytest.raises(NotADirectoryError, match=f"^{key}: {export or run}: {notes} is a file, not a folder"):
            train(tiny_config(byte_data, run, *extra))
        assert not (tmp_path / "run").exists() and notes.read_text() == "mine"

    export = tmp_path / "export"
    trainer = Trainer(tiny_config(byte_data, tmp_path / "run", "max_steps=2", "eval_every=0",
                                  f"export_dir={export}"))
    trainer.start()
    export.mkdir()
    with pytest.raises(FileExistsError, match=f"^export_dir: {export} exists"):
        train(trainer)
    assert latest_valid_checkpoint(tmp_path / "run").name == "step_0000002" and not any(export.iterdir())


def test_an_out_dir_the_filesystem_cannot_make_is_refused_naming_it(byte_data, tmp_path):
    """An out_dir the filesystem refuses to make (a name past its 255 bytes here; a read-only disk alike): one error
    naming out_dir and why, nothing left behind. It was an OSError traceback naming no key (and on several processes
    the others waited for the main one's answer)."""
    run = tmp_path / ("a" * 300) / "run"
    with pytest.raises(ValueError, match=f"^out_dir: {run} cannot be made a run folder: File name too long$"):
        train(tiny_config(byte_data, run, "max_steps=1", "eval_every=0"))
    assert list(tmp_path.iterdir()) == []


def test_a_filesystem_without_flock_trains_unlocked(byte_data, tmp_path, monkeypatch):
    """Where flock fails (ENOLCK on some network or FUSE mounts; simulated here) training goes on, with a warning."""
    import errno

    from foxlm.checkpoint import run_folder

    def no_flock(f, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_folder.fcntl, "flock", no_flock)
    with pytest.warns(UserWarning, match="cannot lock .*No locks available"):
        assert train(tiny_config(byte_data, tmp_path / "run", "max_steps=2"))["step"] == 2


def test_checkpoint_holds_an_hf_tokenizer_for_gpt2_data(tmp_path):
    """A GPT-2 BPE run's checkpoint loads with the Auto classes alone: model and tokenizer from one folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "gpt2"
    prepare(random.Random().sample(shakespeare_plays(), 2), data, tokenizer="gpt2", val_fraction=0.5, workers=0,
            progress=False)
    run = tmp_path / "run"
    train(load_config(None, [*TINY, "tokenizer=gpt2", f"data={data}", f"out_dir={run}", "max_steps=2"]))
    folder = latest_valid_checkpoint(run) / "model"  # the manifest, tokenizer files included, verified
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tok("To be, or not to be", return_tensors="pt").input_ids
    foxlm_tok = TokenDataset(data, "val").tokenizer()
    assert ids.tolist()[0] == [foxlm_tok.eot_id] + foxlm_tok.encode("To be, or not to be")  # as documents open
    assert tok.pad_token_id == model.config.bos_token_id == model.config.eos_token_id == foxlm_tok.eot_id
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)


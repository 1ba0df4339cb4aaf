"""foxlm.train.cli: `foxlm train` end to end, and the run's failures as one line."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys

import pytest

from foxlm.train import latest_valid_checkpoint, train
from train.runs import TINY, subprocess_env, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_cli_train_learns_and_samples(byte_data, tmp_path, capsys):
    """`foxlm train` end to end: the loss drops well below the byte-level uniform log(257), a sample is printed."""
    from foxlm.cli import main

    rc = main(["train", *TINY, f"data={byte_data}", f"out_dir={tmp_path / 'run'}", "max_steps=60", "eval_every=30",
               "batch_size=8", "seq_len=64", "model.acp=true", "sample_tokens=8"])
    out, err = capsys.readouterr()
    assert rc == 0 and "--- sample (step 60) ---" in out
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and val[-1] < 0.6 * math.log(257)
    skipped = [r["val_acp_skipped"] for r in records if "val_loss" in r]  # what ACP skipped in validation
    assert all(0.0 <= x <= 1.0 for x in skipped) and "of the attention tiles" in err + out
    assert "8 x 64 tokens per step, 1 micro-batch per process" in err
    # again: the run is finished, so nothing is trained, no loss is made up and no sample made again (the default
    # job's took a minute on a CPU); display settings are not "changes"
    again = subprocess.run([sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}",
                            f"out_dir={tmp_path / 'run'}", "max_steps=60", "eval_every=30", "batch_size=8",
                            "seq_len=64", "model.acp=true", "sample_tokens=20", "progress=true"],
                           capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert again.returncode == 0, again.stderr
    assert "nothing to train: the run is at step 60, max_steps=60" in again.stderr
    assert "changed settings" not in again.stderr
    assert again.stdout.strip() == \
        f"step 60: no step trained; last checkpoint {tmp_path / 'run' / 'checkpoints' / 'step_0000060'}"


def test_cli_reports_a_run_that_cannot_start_in_one_line(byte_data, tmp_path, capsys):
    """Data, model, out_dir and init_from errors come before the first step: `foxlm train` prints them as one line and
    exits 2 (a traceback only for what fails while training); a refused run leaves out_dir unlocked."""
    from foxlm.cli import main

    run = tmp_path / "run"
    train(tiny_config(byte_data, run, "max_steps=2", "eval_every=0"))
    cases = {(f"data={tmp_path / 'missing'}", f"out_dir={tmp_path / 'new'}"): "data: .*missing does not exist",
             (f"data={byte_data}", f"out_dir={run}", "model.hidden_size=32"): "resume: .* was trained as fox-pro",
             (f"data={byte_data}", f"out_dir={tmp_path / 'new'}", f"init_from={tmp_path / 'nothing'}"):
                 "init_from: .*nothing is not a run folder",
             # the model config's own check, named as the user gave the key (it said "window: ...")
             (f"data={byte_data}", f"out_dir={tmp_path / 'new'}", "model.window=-5"):
                 "model.window: expected a positive integer, got -5"}
    capsys.readouterr()
    for args, message in cases.items():
        assert main(["train", *TINY, *args]) == 2
        err = capsys.readouterr().err
        assert re.match(f"foxlm train: error: {message}", err) and "Traceback" not in err, err
    assert main(["train", *TINY, f"data={byte_data}", f"out_dir={run}", "max_steps=3", "eval_every=0"]) == 0


def test_cli_reports_the_nan_limit_in_one_line_naming_the_last_checkpoint(byte_data, tmp_path):
    """A run that diverges after a checkpoint: `foxlm train` says so in one line (no traceback), naming the checkpoint
    that exists to go back to."""
    run = tmp_path / "run"
    train(tiny_config(byte_data, run, "max_steps=2", "eval_every=0"))
    cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}", "max_steps=30",
           "lr=1e30", "min_lr=1e30", "grad_clip=0", "max_bad_steps=1", "eval_every=0", "save_every=0"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    last = run / "checkpoints" / "step_0000002"
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert re.search(rf"^foxlm train: error: loss/gradient was NaN or Inf at 2 steps \(max_bad_steps=1\), last at step "
                     rf"\d+; lower lr \(now 1e\+30\) or check the data; the last checkpoint is {last}$", done.stderr,
                     re.M), done.stderr
    assert last.is_dir() and latest_valid_checkpoint(run) == last


def test_cli_reports_a_full_disk_in_one_line(byte_data, tmp_path):
    """A disk that fills up during a save (a 1 MiB tmpfs, mounted in a user namespace: the model's weights fit, the
    optimizer state does not) is one line naming the checkpoint, not torch.save's inline_container.cc message; the
    partial save is removed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = f"mount -t tmpfs -o size=1m none {disk}"
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "sh", "-c", mount]).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs unshare and user namespaces)")
    run = disk / "run"
    train_cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}",
                 "max_steps=1", "eval_every=0"]
    script = f'{mount} && "$@"; status=$?; ls -A {run / "checkpoints"}; exit $status'
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *train_cmd], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "inline_container" not in done.stderr, \
        done.stderr
    assert re.search(rf"^foxlm train: error: checkpoint: cannot save {run}/checkpoints/step_0000001: the disk is "
                     rf"full; free space there, or train into an out_dir on another disk$", done.stderr, re.M), \
        done.stderr
    assert done.stdout == ""  # the checkpoints folder the `ls` lists is empty: no partial save left


def test_a_full_disk_is_one_line_in_a_run_of_two_processes(byte_data, tmp_path):
    """Two processes (gloo, FSDP2) writing their shards onto a full disk: rank 0 prints the one line, rank 1 nothing;
    rank 1 printed the DCP CheckpointException's traceback (rank 0's OSError inside), the job's stderr a wall."""
    import socket

    disk = tmp_path / "disk"
    disk.mkdir()
    mount = f"mount -t tmpfs -o size=2m none {disk}"
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "sh", "-c", mount]).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs unshare and user namespaces)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = disk / "run"
    train_cmd = [sys.executable, "-m", "foxlm.cli", "train",
                 *TINY, f"data={byte_data}", f"out_dir={run}", "max_steps=1", "eval_every=0"]
    # both processes in the namespace that has the tmpfs; torchrun's own report of a failed job is not foxlm's
    script = (f'{mount} && for r in 0 1; do RANK=$r LOCAL_RANK=$r "$@" 2>{tmp_path}/err$r & done; '
              f'wait %1; a=$?; wait %2; b=$?; ls -A {run / "checkpoints"}; exit $((a + b))')
    env = {**subprocess_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *train_cmd], capture_output=True, text=True,
                          env=env, timeout=300)
    err0, err1 = ((tmp_path / f"err{r}").read_text() for r in (0, 1))
    assert done.returncode == 2, (err0, err1)  # each process exits 1
    assert re.search(rf"^foxlm train: error: checkpoint: cannot save {run}/checkpoints/step_0000001: the disk is "
                     rf"full", err0, re.M) and "Traceback" not in err0, err0
    assert "Traceback" not in err1 and "foxlm train: error" not in err1, err1
    assert done.stdout == ""  # no partial save left

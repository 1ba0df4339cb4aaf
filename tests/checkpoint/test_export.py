"""foxlm.checkpoint.export: the folders transformers loads, a checkpoint's model/ and an export."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from train.runs import tiny_config

from foxlm.train import latest_valid_checkpoint, load_checkpoint_model, train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_folders_the_readme_hands_to_transformers_load(byte_data, tmp_path):
    """The README's answer to which folder AutoModelForCausalLM takes: a checkpoint's model/ or an export, and not the
    run folder or checkpoints/latest (transformers' own errors, before any foxlm code runs)."""
    from transformers import AutoModelForCausalLM

    from foxlm.cli import main

    run = tmp_path / "run"
    train(tiny_config(byte_data, run, "max_steps=1"))
    assert main(["export", str(run), str(tmp_path / "export")]) == 0
    ckpt = latest_valid_checkpoint(run)
    readme = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())
    assert "`AutoModelForCausalLM.from_pretrained` takes a model folder: a checkpoint's `model/`" in readme
    for folder in (ckpt / "model", tmp_path / "export"):
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert torch.equal(model.lm_head.weight, load_checkpoint_model(run).lm_head.weight)
    for path in (run, run / "checkpoints" / "latest"):
        with pytest.raises((OSError, ValueError)):
            AutoModelForCausalLM.from_pretrained(path)



def test_a_checkpoint_copied_under_another_name_exports(byte_data, tmp_path, capsys):
    """A checkpoint folder the user copied and renamed ("best") is still a checkpoint: its manifest records its
    step (this was refused as "not a step_NNNNNNN folder", an error naming no argument). A destination that is a
    dangling link, or one under a file, is refused up front, in one line."""
    import shutil

    from foxlm.cli import main

    run = tmp_path / "run"
    train(tiny_config(byte_data, run, "max_steps=2", "save_every=2"))
    shutil.copytree(latest_valid_checkpoint(run), tmp_path / "best")
    (tmp_path / "link").symlink_to(tmp_path / "missing")  # a dangling link: was a raw OSError after the whole copy
    capsys.readouterr()
    assert main(["export", str(tmp_path / "best"), str(tmp_path / "link")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"dst: {tmp_path / 'link'} exists (a link to a missing path)" in err, err
    assert (tmp_path / "link").is_symlink() and not (tmp_path / "missing").exists()
    (tmp_path / "notes.txt").write_text("mine")  # a DST under a file: was "[Errno 17] File exists", naming no argument
    assert main(["export", str(tmp_path / "best"), str(tmp_path / "notes.txt" / "export")]) == 2
    err = capsys.readouterr().err
    assert f"dst: {tmp_path / 'notes.txt' / 'export'}: {tmp_path / 'notes.txt'} is a file, not a folder" in err, err
    assert main(["export", str(tmp_path / "best"), str(tmp_path / "export")]) == 0
    assert "from step 2 of" in (tmp_path / "export" / "README.md").read_text()
    exported = load_checkpoint_model(tmp_path / "export")
    assert torch.equal(exported.lm_head.weight, load_checkpoint_model(run).lm_head.weight)


def test_export_removes_what_a_killed_export_left(byte_data, tmp_path):
    """A killed export leaves its half-written copy in a hidden temporary beside DST (a whole model's size); the next
    export there removes it, as convert does, and leaves a live process's and a user's folders alone."""
    import subprocess
    import sys

    from foxlm.checkpoint.export import export_model

    run = tmp_path / "run"
    train(tiny_config(byte_data, run, "max_steps=1"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a PID no process has now
    stale = tmp_path / f".export.foxlm-tmp-{dead.pid}"
    kept = [tmp_path / f".export.foxlm-tmp-{os.getppid()}", tmp_path / ".export.old-2024"]
    for folder in (stale, *kept):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half written")
    export_model(run, tmp_path / "export")
    assert not stale.exists() and all(folder.is_dir() for folder in kept)
    assert (tmp_path / "export" / "model.safetensors").is_file()

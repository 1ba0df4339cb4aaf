"""foxlm.checkpoint.checkpointer: a checkpoint is written whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    from foxlm.checkpoint.checkpointer import write_checkpoint
    from foxlm.checkpoint.manifest import verify_checkpoint

    def save(text: str):
        def write(folder: Path) -> None:
            folder.mkdir()
            (folder / "weights.txt").write_text(text)
        return write

    state = {"step": 3, "x": torch.randn(5)}
    write_checkpoint(tmp_path, 3, save("first"), state, keep_last=2)
    path = write_checkpoint(tmp_path, 3, save("second"), state, keep_last=2)
    assert (path / "model" / "weights.txt").read_text() == "second" and verify_checkpoint(path) is None
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000003"]



def test_keep_last_deletes_only_checkpoints_foxlm_wrote(tmp_path):
    """Pruning to keep_last removes older checkpoints foxlm saved, never a step_* folder it did not write (one
    without a manifest.json, which every saved checkpoint has), nor what a step_* link points to."""
    from foxlm.checkpoint.checkpointer import write_checkpoint

    def save(folder: Path) -> None:
        folder.mkdir()
        (folder / "weights.txt").write_text("w")

    root = tmp_path / "run" / "checkpoints"
    mine = root / "step_0000001"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("a user's")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("a user's")
    (root / "step_0000002").symlink_to(tmp_path / "kept")
    for step in (3, 4, 5):
        write_checkpoint(tmp_path / "run", step, save, {"step": step}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000001", "step_0000002", "step_0000004",
                                                      "step_0000005"]
    assert (mine / "notes.txt").read_text() == "a user's" and (tmp_path / "kept" / "notes.txt").is_file()


def test_a_checkpoint_a_killed_save_set_aside_is_put_back(tmp_path):
    """A run killed while it saved a step again, between setting the old checkpoint aside and moving the new one in
    (replace_folder's swap), left the step only as a hidden temporary: the next run neither resumed from it nor ever
    deleted it. The next run to take the folder (lock_run) puts it back."""
    import subprocess
    import sys

    from foxlm.checkpoint.checkpointer import write_checkpoint
    from foxlm.checkpoint.run_folder import latest_valid_checkpoint, lock_run

    def save(folder: Path) -> None:
        folder.mkdir()
        (folder / "weights.txt").write_text("w")

    run = tmp_path / "run"
    for step in (1, 2):
        write_checkpoint(run, step, save, {"step": step}, keep_last=3)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    root = run / "checkpoints"
    (root / "step_0000002").rename(root / f".step_0000002.foxlm-old-{dead}")
    assert latest_valid_checkpoint(run).name == "step_0000001"
    lock = lock_run(run)
    try:
        assert latest_valid_checkpoint(run).name == "step_0000002"
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000001", "step_0000002"]
    finally:
        lock.close()

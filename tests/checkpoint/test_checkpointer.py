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


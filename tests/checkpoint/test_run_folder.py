"""foxlm.checkpoint.run_folder: the latest valid checkpoint of a run; a damaged one is never loaded."""

from __future__ import annotations

import pytest
import torch
from train.runs import tiny_config

from foxlm.models import FoxForCausalLM
from foxlm.train import latest_valid_checkpoint, load_checkpoint_model, train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_damaged_checkpoint_is_never_loaded(byte_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_config(byte_data, run, "max_steps=4", "save_every=2", "eval_every=0"))
    last = run / "checkpoints" / "step_0000004"
    weights = last / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0xFF  # flip bits in a weight
    weights.write_bytes(bytes(data))
    (run / "checkpoints" / ".step_0000006.tmp-1").mkdir()  # a half-written save left by a killed run
    with pytest.warns(UserWarning, match="damaged checkpoint"):
        assert latest_valid_checkpoint(run).name == "step_0000002"
    with pytest.raises(ValueError, match="does not match its sha256"):
        load_checkpoint_model(last)
    # its model/ folder, as a save_pretrained folder is given (from_pretrained's): checked by the checkpoint's manifest
    with pytest.raises(ValueError, match="is the model of checkpoint .*: model/model.safetensors does not match its "
                                         "sha256"):
        load_checkpoint_model(last / "model")
    with pytest.warns(UserWarning):
        model = load_checkpoint_model(run)
    assert isinstance(model, FoxForCausalLM)
    direct = load_checkpoint_model(run / "checkpoints" / "step_0000002" / "model")
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), direct.state_dict().values()))
    assert model.config.foxlm_tokenizer["name"] == "byte"
    assert model.config.train_length == tiny_config(byte_data, run).seq_len  # lm-eval's context window (eval harness)



def test_a_swap_killed_halfway_leaves_the_old_copy_to_be_put_back(tmp_path):
    """replace_folder killed after it set the old copy aside and before it moved the new one in: no folder at the
    destination, the old copy and the new one as temporaries of a dead process. The next writer's clean-up puts the
    old copy back (a complete one survives, as replace_folder promises) and deletes the new one's leftover."""
    import subprocess
    import sys

    from foxlm.checkpoint.files import remove_stale_temporaries

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dest = tmp_path / "model"
    old, new = tmp_path / f".model.foxlm-old-{dead}", tmp_path / f".model.foxlm-tmp-{dead}"
    old.mkdir()
    (old / "weights").write_text("the old, complete model")
    new.mkdir()
    (new / "weights").write_text("the new one, maybe half written")
    remove_stale_temporaries(dest)
    assert (dest / "weights").read_text() == "the old, complete model"
    assert not old.exists() and not new.exists()
    remove_stale_temporaries(dest)  # nothing stale left: the model stays
    assert (dest / "weights").is_file()


def test_a_checkpoint_with_a_damaged_manifest_is_skipped_and_refused(byte_data, tmp_path):
    """A manifest.json that is valid JSON but no manifest (a list, files not a mapping): the checkpoint is damaged,
    skipped on resume and refused by name on load (these were AttributeError tracebacks)."""
    run = tmp_path / "run"
    train(tiny_config(byte_data, run, "max_steps=4", "save_every=2", "eval_every=0"))
    last = run / "checkpoints" / "step_0000004"
    for text in ("[]", '{"files": ["model/config.json"]}'):
        (last / "manifest.json").write_text(text)
        with pytest.warns(UserWarning, match="skipping damaged checkpoint .*step_0000004: manifest.json is damaged"):
            assert latest_valid_checkpoint(run).name == "step_0000002"
        with pytest.raises(ValueError, match="path: checkpoint .*step_0000004: manifest.json is damaged"):
            load_checkpoint_model(last)

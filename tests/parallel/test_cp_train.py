"""`foxlm train cp=N` under torchrun (gloo, CPU): context parallel over cp processes (each holds a zigzag shard of
every sequence), data parallel over the rest. The losses match one process with the same global batch, for cp=2
(2 processes, FSDP2 and DDP) and a dp=2 x cp=2 mesh with FSDP2 (4 processes); checkpoints move between cp=2 and
cp=1 both ways; `foxlm eval loss --cp 2` gives one process's per-token losses.

The test launches this file with torchrun; its ``__main__`` runs the real CLI in each worker.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from foxlm.data import prepare
from foxlm.data.assets import shakespeare_plays
from foxlm.train import load_config

ARGS = ["device=cpu", "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.intermediate_size=128", "tokenizer=byte", "seq_len=32", "batch_size=4", "micro_batch_size=1",
        "max_steps=4", "warmup_steps=1", "lr=3e-3", "min_lr=3e-4", "eval_every=4", "eval_batches=1",
        "save_every=2", "log_every=1", "progress=false", "tensorboard=false", "resume=never", "sample_tokens=0"]

EVAL = ["--eval-length", "64", "--max-sequences", "2", "--device", "cpu", "--no-progress"]


def _records(run) -> dict:
    return {(r["step"], "loss" in r): r for r in map(json.loads, (run / "log.jsonl").read_text().splitlines())}


def _torchrun(tmp_path, nproc: int, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the trainer runs the PyTorch path
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(nproc), __file__, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _single(*args: str) -> None:
    from foxlm.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *args]) == 0
    finally:
        torch.set_num_threads(threads)


def _single_eval(run, out) -> np.ndarray:
    from foxlm.cli import main

    assert main(["eval", "loss", str(run), *EVAL, "--out", str(out)]) == 0
    return np.loadtxt(out / "per_token_loss.csv", delimiter=",", skiprows=1)


def _match(got: dict, want: dict, first: int, case: str) -> None:
    expected = {key: r for key, r in want.items() if key[0] >= first}
    assert set(got) == set(expected), case
    for key, b in expected.items():
        a = got[key]
        name = "loss" if key[1] else "val_loss"
        assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-6), (case, a, b)
        if key[1]:
            assert a["tokens"] == b["tokens"], (case, a, b)  # tokens count whole sequences
        if "val_acp_skipped" in b:  # one definition: the same share at any cp
            assert a["val_acp_skipped"] == pytest.approx(b["val_acp_skipped"], abs=1e-6), (case, a, b)


def test_cp_matches_one_process_and_checkpoints_move_between_cp(tmp_path):
    data = tmp_path / "bytes"
    prepare(random.Random().sample(shakespeare_plays(), 2), data, tokenizer="byte", val_fraction=0.5, workers=0,
            progress=False)
    common = ARGS + [f"data={data}", f"seed={random.randrange(1000)}"]
    _single(*common, f"out_dir={tmp_path / 'single'}")
    _torchrun(tmp_path, 2, str(tmp_path), "2", *common)
    ref = _records(tmp_path / "single")
    assert [k[0] for k in ref if k[1]] == [1, 2, 3, 4]
    _match(_records(tmp_path / "cp2"), ref, 1, "cp=2")
    _match(_records(tmp_path / "cp2-ddp"), ref, 1, "cp=2, DDP")
    _match(_records(tmp_path / "cp2-from-cp1"), ref, 3, "cp=2 resumed from cp=1")
    # `foxlm eval loss --cp 2` on the two processes: the one-process per-token losses
    want = _single_eval(tmp_path / "single", tmp_path / "eval-cp1")
    got = np.loadtxt(tmp_path / "eval-cp2" / "per_token_loss.csv", delimiter=",", skiprows=1)
    assert got.shape == want.shape == (64, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _single(*common, f"out_dir={tmp_path / 'cp1-from-cp2'}",
            f"resume={tmp_path / 'cp2' / 'checkpoints' / 'step_0000002'}")
    _match(_records(tmp_path / "cp1-from-cp2"), ref, 3, "cp=1 resumed from cp=2")
    _torchrun(tmp_path, 4, str(tmp_path), "4", *common)
    _match(_records(tmp_path / "dp2-cp2"), ref, 1, "dp=2 x cp=2, activation checkpointing")


def test_cp_settings_are_checked(capsys):
    with pytest.raises(ValueError, match="packing: context parallelism"):
        load_config(overrides=["cp=2", "packing=documents"])
    with pytest.raises(ValueError, match="seq_len: 36 must be a multiple of 2 x cp = 8"):
        load_config(overrides=["cp=4", "seq_len=36"])
    with pytest.raises(ValueError, match=r"model.window: a sliding window \(16\) is not available with context "
                       r"parallelism \(cp=2\)"):
        load_config(overrides=["cp=2", "model.window=16"])
    load_config(overrides=["cp=2", "model.window=null"])
    with pytest.raises(ValueError, match="cp: expected a positive integer"):
        load_config(overrides=["cp=0"])
    from foxlm.cli import main

    assert main(["eval", "loss", "no-such-run", "--cp", "2", "--out", "unused"]) == 2
    assert "--cp: 2 processes split each sequence, but 1 run" in capsys.readouterr().err


if __name__ == "__main__":  # one torchrun worker
    import torch.distributed as dist

    from foxlm.cli import main

    root, nproc, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist.init_process_group("gloo")
    if nproc == "2":
        assert main(["train", *args, "cp=2", f"out_dir={os.path.join(root, 'cp2')}"]) == 0
        assert main(["train", *args, "cp=2", "parallel=ddp", "save_every=0",
                     f"out_dir={os.path.join(root, 'cp2-ddp')}"]) == 0
        assert main(["train", *args, "cp=2", f"out_dir={os.path.join(root, 'cp2-from-cp1')}",
                     f"resume={os.path.join(root, 'single', 'checkpoints', 'step_0000002')}"]) == 0
        assert main(["eval", "loss", os.path.join(root, "single"), *EVAL, "--cp", "2",
                     "--out", os.path.join(root, "eval-cp2")]) == 0
    else:
        # activation checkpointing: the recomputed forward repeats the shards' exchanges, on every rank alike
        assert main(["train", *args, "cp=2", "parallel=fsdp", "activation_checkpointing=true",
                     f"out_dir={os.path.join(root, 'dp2-cp2')}"]) == 0
    dist.destroy_process_group()

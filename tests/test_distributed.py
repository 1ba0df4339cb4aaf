"""`foxlm train` under torchrun: 2 CPU processes on gloo (FSDP2 and DDP) match 1 process with the same global batch,
FSDP2 also when resumed from one of its checkpoints; SIGTERM to one process stops both after the same step, saved;
the job prints one summary.

The test launches this file with torchrun; its ``__main__`` runs the real CLI twice in each worker.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from foxlm.data import prepare
from foxlm.data.assets import shakespeare_plays

ARGS = ["device=cpu", "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.intermediate_size=128", "tokenizer=byte", "seq_len=32", "batch_size=4", "micro_batch_size=1",
        "max_steps=5", "warmup_steps=1", "lr=3e-3", "min_lr=3e-4", "eval_every=5", "eval_batches=2",
        "save_every=5", "log_every=1", "progress=false", "tensorboard=false", "resume=never", "sample_tokens=0"]


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_two_processes_match_one(tmp_path):
    from foxlm.cli import main
    from foxlm.train import latest_valid_checkpoint, load_checkpoint_model

    data = tmp_path / "bytes"
    prepare(random.Random().sample(shakespeare_plays(), 2), data, tokenizer="byte", val_fraction=0.5, workers=0,
            progress=False)
    packing = random.choice(["windows", "documents"])
    common = ARGS + [f"data={data}", f"packing={packing}", f"seed={random.randrange(1000)}"]
    # conftest turns on Triton's interpreter for kernel tests; the trainer runs the PyTorch path, as in-process
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           __file__, str(tmp_path), *common], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for run in ("fsdp", "fsdp-resumed", "fsdp-sigterm", "ddp"):  # the main process alone prints the summary
        assert done.stdout.count(f"; checkpoints in {tmp_path / run}/checkpoints\n") == 1, done.stdout

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *common, f"out_dir={tmp_path / 'single'}"]) == 0
    finally:
        torch.set_num_threads(threads)
    ref = _records(tmp_path / "single")
    assert [r["step"] for r in ref if "loss" in r] == [1, 2, 3, 4, 5]
    ref_model = load_checkpoint_model(tmp_path / "single")
    for parallel, first in (("fsdp", 1), ("ddp", 1), ("fsdp-resumed", 4)):  # resumed from FSDP2's step 3
        got = {(r["step"], "loss" in r): r for r in _records(tmp_path / parallel)}
        expected = [r for r in ref if r["step"] >= first]
        assert set(got) == {(r["step"], "loss" in r) for r in expected}
        for b in expected:
            a = got[b["step"], "loss" in b]
            key = "loss" if "loss" in b else "val_loss"
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (parallel, a, b)
            if "val_acp_skipped" in b:  # the ranks' shares of the validation batches, averaged
                assert a["val_acp_skipped"] == pytest.approx(b["val_acp_skipped"], abs=1e-6), (parallel, a, b)
        model = load_checkpoint_model(tmp_path / parallel)  # FSDP shards gathered into one safetensors file
        for (name, x), y in zip(model.state_dict().items(), ref_model.state_dict().values()):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, msg=f"{parallel}: {name}")

    steps = [r["step"] for r in _records(tmp_path / "fsdp-sigterm")]
    assert len(steps) >= 2 and steps == list(range(1, len(steps) + 1))
    assert latest_valid_checkpoint(tmp_path / "fsdp-sigterm").name == f"step_{len(steps):07d}"


def _sigterm_once_training(run: str) -> None:
    """SIGTERM this process once the run has logged two steps (its handler is installed by then)."""
    log = os.path.join(run, "log.jsonl")
    while not (os.path.exists(log) and len(open(log).read().splitlines()) >= 2):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":  # one torchrun worker: the real CLI, FSDP2 then DDP, in one process group
    import torch.distributed as dist

    from foxlm.cli import main

    root, args = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    assert main(["train", *args, "parallel=fsdp", "save_every=3", f"out_dir={os.path.join(root, 'fsdp')}"]) == 0
    assert main(["train", *args, "parallel=fsdp", f"out_dir={os.path.join(root, 'fsdp-resumed')}",
                 f"resume={os.path.join(root, 'fsdp', 'checkpoints', 'step_0000003')}"]) == 0
    stopped = os.path.join(root, "fsdp-sigterm")
    if dist.get_rank() == 1:  # only one process receives the signal
        threading.Thread(target=_sigterm_once_training, args=(stopped,), daemon=True).start()
    assert main(["train", *args, "parallel=fsdp", "max_steps=1000000", "save_every=0", "eval_every=0",
                 f"out_dir={stopped}"]) == 128 + signal.SIGTERM
    assert main(["train", *args, "parallel=ddp", f"out_dir={os.path.join(root, 'ddp')}"]) == 0
    dist.destroy_process_group()

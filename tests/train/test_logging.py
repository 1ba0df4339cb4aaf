"""foxlm.train.logging: log.jsonl and TensorBoard across a resume."""

from __future__ import annotations

import pytest

from foxlm.train import train
from train.runs import logged_losses, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_resume_tolerates_a_torn_last_log_line(byte_data, tmp_path):
    """A write of log.jsonl cut off (full disk, power loss) leaves a torn last line: resuming drops it and goes on; a
    damaged line before the last is an error naming it."""
    run = tmp_path / "run"
    train(tiny_config(byte_data, run, "max_steps=2", "eval_every=0"))
    log = run / "log.jsonl"
    whole = log.read_text()
    log.write_text(whole + '{"step": 3, "loss": 4.1')
    assert train(tiny_config(byte_data, run, "max_steps=3", "eval_every=0"))["step"] == 3
    assert sorted(logged_losses(run)) == [1, 2, 3]
    log.write_text('{"step": 1, "lo\n' + whole)
    with pytest.raises(ValueError, match=f"{log}: line 1 is not a JSON record"):
        train(tiny_config(byte_data, run, "max_steps=4", "eval_every=0"))


def test_a_resume_that_cannot_write_leaves_the_runs_log_and_config_whole(byte_data, tmp_path):
    """A resume on a disk that fills up as it starts (here a file size limit: the same write cut off) rewrote
    train_config.yaml and log.jsonl in place: the cut-off write kept their first bytes, and the records of the steps
    after them were lost for good. Each is now replaced whole, or left as it was."""
    import subprocess
    import sys

    from train.runs import TINY, subprocess_env

    run = tmp_path / "run"
    extra = ["max_steps=20", "eval_every=0", "save_every=10"]
    train(tiny_config(byte_data, run, *extra))
    before = {name: (run / name).read_bytes() for name in ("train_config.yaml", "log.jsonl")}
    assert len(before["train_config.yaml"]) > 400 and len(before["log.jsonl"]) > 2000
    child = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]),) * 2); from foxlm.cli import main; "
             "sys.exit(main(['train', *sys.argv[2:]]))")
    for limit in (400, 1500):  # train_config.yaml's write fails, then log.jsonl's
        done = subprocess.run([sys.executable, "-c", child, str(limit), *TINY, f"data={byte_data}", f"out_dir={run}",
                               *extra], capture_output=True, text=True, env=subprocess_env(), timeout=300)
        assert done.returncode != 0 and "File too large" in done.stderr, done.stderr
        assert {name: (run / name).read_bytes() for name in before} == before, limit
        assert sorted(p.name for p in run.iterdir()) == [".foxlm-run", ".lock", "checkpoints", *sorted(before)]
    assert sorted(logged_losses(run)) == list(range(1, 21))


def test_tensorboard_after_resume_holds_each_step_once_in_one_tag_scheme(tmp_path):
    """A killed run logged steps 1-4 (checkpoint at 2); the resumed run logs from step 3 with log_every=2, so its
    first event (4) does not go back in steps: only purge_step keeps the reader from holding step 4 twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from foxlm.train.logging import RunLog

    killed = RunLog(tmp_path, 0, 6, main=True, tensorboard=True, progress=False)
    for step in range(1, 5):
        killed.log({"step": step, "loss": 10.0 + step})
    killed.log({"step": 2, "val_loss": 9.0, "val_acp_skipped": 0.5})
    killed.close()
    resumed = RunLog(tmp_path, 2, 6, main=True, tensorboard=True, progress=False)
    resumed.log({"step": 4, "loss": 1.5, "lr": 0.1})
    resumed.log({"step": 4, "val_loss": 1.25})
    resumed.close()
    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    assert sorted(tb.Tags()["scalars"]) == ["train/loss", "train/lr", "val/acp_skipped", "val/loss"]
    assert [(e.step, e.value) for e in tb.Scalars("train/loss")] == [(1, 11.0), (2, 12.0), (4, 1.5)]
    assert [(e.step, e.value) for e in tb.Scalars("val/loss")] == [(2, 9.0), (4, 1.25)]



def test_a_run_started_again_from_step_0_replaces_the_tensorboard_events_of_the_first(byte_data, tmp_path):
    """A run that stopped (max_bad_steps) before its first checkpoint, started again in its out_dir: log.jsonl begins
    anew, and so does TensorBoard; it held the dead run's steps 1-4 beside the new run's 1-3."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    with pytest.raises(FloatingPointError, match="no checkpoint was saved"):
        train(tiny_config(byte_data, run, "lr=1e30", "min_lr=1e30", "warmup_steps=0", "max_steps=20",
                          "max_bad_steps=2", "grad_clip=0", "eval_every=0", "tensorboard=true"))
    train(tiny_config(byte_data, run, "max_steps=3", "eval_every=0", "tensorboard=true"))
    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    events, logged = tb.Scalars("train/loss"), sorted(logged_losses(run).items())
    assert [e.step for e in events] == [step for step, _ in logged] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([loss for _, loss in logged], rel=1e-6)


def test_a_log_record_holds_the_mean_loss_of_its_steps(byte_data, tmp_path):
    """log_every=2 logs at steps 2, 4 and the last, 5, the mean of the losses of the steps since the previous record
    (as HF Trainer and torchtitan do), not the loss of the step at which it logs."""
    extra = ["max_steps=5", "eval_every=0", "save_every=0"]
    train(tiny_config(byte_data, tmp_path / "each", *extra))
    train(tiny_config(byte_data, tmp_path / "pairs", *extra, "log_every=2"))
    each, pairs = logged_losses(tmp_path / "each"), logged_losses(tmp_path / "pairs")
    assert pairs.keys() == {2, 4, 5}
    expected = {2: (each[1] + each[2]) / 2, 4: (each[3] + each[4]) / 2, 5: each[5]}
    assert all(pairs[k] == pytest.approx(expected[k], rel=1e-5) for k in expected)

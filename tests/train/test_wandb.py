"""``foxlm train wandb=true``: the run's metrics in Weights & Biases, as an offline run (``WANDB_MODE=offline``)
whose ``.wandb`` file is read back here record by record with wandb's own protobuf messages."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from foxlm.data import prepare
from foxlm.data.assets import shakespeare_plays
from foxlm.train.logging import read_log

wandb_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2",
                                reason="the [wandb] extra is not installed: pip install 'foxlm[wandb]'")

TINY = ["device=cpu", "model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
        "model.intermediate_size=64", "tokenizer=byte", "seq_len=32", "batch_size=2", "max_steps=4", "warmup_steps=1",
        "log_every=1", "eval_every=2", "eval_batches=1", "progress=false", "tensorboard=false", "sample_tokens=0",
        "save_every=0"]


def _records(path: Path) -> list:
    """The records of a ``.wandb`` file: a 7-byte W&B header, then LevelDB log blocks of 32 KiB, each a run of
    chunks (checksum 4 bytes, length 2, type 1: full, first, middle, last) that a record spans."""
    data, records, pending, pos = path.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last: a whole record
            record = wandb_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
        elif kind == 0 and length == 0:  # zeros: the end of what was written
            break
    return records


def test_train_logs_its_metrics_to_an_offline_wandb_run(tmp_path):
    data = tmp_path / "bytes"
    prepare(random.Random(0).sample(shakespeare_plays(), 2), data, tokenizer="byte", val_fraction=0.5, workers=0,
            progress=False)
    run, wandb_dir = tmp_path / "run", tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), WANDB_SILENT="true")
    done = subprocess.run([sys.executable, "-m", "foxlm.cli", "train", *TINY, "wandb=true", f"data={data}",
                           f"out_dir={run}"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    (offline,) = (wandb_dir / "wandb").glob("offline-run-*")
    records = _records(next(offline.glob("run-*.wandb")))
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_record.display_name == run.name and run_record.project == "foxlm"
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}  # the train config
    assert config["max_steps"] == 4 and config["wandb"] is True and config["model"]["hidden_size"] == 32

    history = {}  # step -> the metrics logged at it
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            history.setdefault(items.pop("_step"), {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")})
    logged = {}  # what log.jsonl holds, as W&B keys
    for record in read_log(run / "log.jsonl"):
        step = record.pop("step")
        logged.setdefault(step, {}).update(
            {("val/" + k[4:] if k.startswith("val_") else f"train/{k}"): v for k, v in record.items()
             if isinstance(v, (int, float))})
    assert sorted(history) == [1, 2, 3, 4] and {"train/loss", "val/loss"} <= set(history[2])
    for step, metrics in logged.items():
        assert history[step] == pytest.approx(metrics), step


def test_wandb_true_without_wandb_says_which_extra(tmp_path):
    """Without wandb installed, one line naming the extra, and the run goes on (as with tensorboard=true)."""
    data = tmp_path / "bytes"
    prepare(random.Random(0).sample(shakespeare_plays(), 2), data, tokenizer="byte", val_fraction=0.5, workers=0,
            progress=False)
    child = ("import sys; sys.modules['wandb'] = None; from foxlm.cli import main; "
             "sys.exit(main(sys.argv[1:]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", child, "train", *TINY, "max_steps=1", "eval_every=0", "wandb=true",
                           f"data={data}", f"out_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("wandb=true: no W&B logs, wandb is not installed (the extra [wandb]: pip install 'foxlm[wandb]'; "
            "wandb=false silences this)") in done.stderr.splitlines()
    assert not (tmp_path / "run" / "wandb").exists()

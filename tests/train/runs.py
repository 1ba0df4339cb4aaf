"""What the training tests share: a tiny config on byte-level data, a run's logged losses, and the environment of a
`foxlm train` child process."""

from __future__ import annotations

import json
import os
from pathlib import Path

from foxlm.train import TrainConfig, load_config

# A very small model on byte-level Shakespeare, on the CPU also where there is a GPU (the GPU tests add
# device=cuda): steps take milliseconds.
TINY = ["device=cpu", "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.intermediate_size=128", "tokenizer=byte", "seq_len=32", "batch_size=4", "warmup_steps=2",
        "lr=3e-3", "min_lr=3e-4", "eval_batches=2", "log_every=1", "progress=false", "tensorboard=false",
        "sample_tokens=0"]


def tiny_config(data: Path, run: Path, *extra: str) -> TrainConfig:
    """``TINY`` on ``data``, into ``run``, with ``extra`` overrides."""
    return load_config(None, TINY + [f"data={data}", f"out_dir={run}", *extra])


def logged_losses(run: Path) -> dict[int, float]:
    """The training loss of each step a run logged: {step: loss}."""
    out = {}
    for line in (run / "log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def subprocess_env() -> dict:
    """The environment of a `foxlm train` child: one thread like this process, and the PyTorch attention path
    (conftest turns on Triton's interpreter for the kernel tests)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env

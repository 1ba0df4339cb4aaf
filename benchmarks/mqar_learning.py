#!/usr/bin/env python3
"""How long a tiny FoX takes to learn multi-query associative recall with `foxlm train`, on this machine.

    PYTHONPATH=. python benchmarks/mqar_learning.py --out OUT            # defaults: the CPU-sized setting below

Writes MQAR alone (byte tokenizer, ``--vocab`` split into keys / values / filler, ``--pairs``, documents of
``--length`` tokens), trains ``--arch`` at ``seq_len`` with ``foxlm train`` (a checkpoint every ``--every`` steps),
then runs ``foxlm eval recall`` on each checkpoint at the documents' length and at 2x, 4x the training length.
Prints and writes (``OUT/summary.json``) accuracy against steps and the training wall time, so the step at which
recall appears (and its cost) is measured, not guessed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
from _results import positive_int

from foxlm.cli import main as foxlm
from foxlm.data import get_tokenizer
from foxlm.data.mqar import MQARSpec, documents, write_dataset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for data/, run/, recall/ and summary.json")
    p.add_argument("--arch", default="fox-pro", help="model architecture (foxlm train arch=)")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers")
    p.add_argument("--hidden", type=positive_int, default=128, help="model width (heads of 64)")
    p.add_argument("--vocab", default="0:48", help="LO:HI byte ids (eot is 256)")
    p.add_argument("--pairs", default="2,4", help="key-value pairs a document draws from, comma-separated")
    p.add_argument("--length", type=positive_int, default=24, help="document length (tokens, eot included)")
    p.add_argument("--seq-len", type=positive_int, default=64, help="training length (tokens)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="sequences per step")
    p.add_argument("--steps", type=positive_int, default=1500, help="training steps")
    p.add_argument("--every", type=positive_int, default=250, help="steps between the checkpoints evaluated")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--samples", type=positive_int, default=64, help="recall documents per evaluated cell")
    args = p.parse_args(argv)

    out = Path(args.out)
    if (out / "run").exists() or (out / "summary.json").exists():  # a rerun would report a resumed run's time
        p.error(f"argument --out: {out} holds an earlier run (run/ or summary.json): expected a new folder")
    try:
        lo, hi = (int(x) for x in args.vocab.split(":"))
    except ValueError:
        p.error(f"argument --vocab: expected LO:HI byte ids, got {args.vocab!r}")
    try:
        pairs = [int(x) for x in args.pairs.split(",")]
    except ValueError:
        p.error(f"argument --pairs: expected comma-separated counts, got {args.pairs!r}")
    flags = {"vocab": "--vocab", "pairs": "--pairs", "length": "--length"}
    try:  # the task is checked before training: write_dataset's errors name its parameters, here the flags
        spec = MQARSpec((lo, hi))
        spec.check(get_tokenizer("byte"))
        documents(spec, (args.length, args.length), pairs, 0)
    except ValueError as e:
        name, _, rest = str(e).partition(": ")
        p.error(f"argument {flags.get(name, name)}: {rest}")
    write_dataset(out / "data", spec, lengths=(args.length, args.length), pairs=pairs,
                  tokens=max(1, args.batch_size * args.seq_len * args.steps // 4), tokenizer="byte", overwrite=True)
    run = out / "run"
    start = time.perf_counter()
    rc = foxlm(["train", f"arch={args.arch}", "size=tiny", f"data={out / 'data'}", "tokenizer=byte",
                f"model.num_hidden_layers={args.layers}", f"model.hidden_size={args.hidden}",
                f"model.intermediate_size={3 * args.hidden}", f"model.num_attention_heads={max(1, args.hidden // 64)}",
                f"seq_len={args.seq_len}", f"batch_size={args.batch_size}", f"max_steps={args.steps}",
                f"lr={args.lr}", f"min_lr={args.lr / 10}", f"warmup_steps={max(1, args.steps // 20)}",
                "weight_decay=0", f"save_every={args.every}", f"keep_last={args.steps // args.every + 1}",
                "eval_every=0", "eval_batches=2", f"log_every={args.every}", f"out_dir={run}", "sample_tokens=0",
                "tensorboard=false", "progress=false"])
    train_s = time.perf_counter() - start
    if rc:
        return rc
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    rows = []
    for ckpt in sorted((run / "checkpoints").glob("step_*")):
        step = int(ckpt.name.split("_")[1])
        res = out / "recall" / ckpt.name
        # the document length may be one of the multiples, which eval recall refuses to take twice
        lengths = ",".join(map(str, sorted({args.length, 2 * args.seq_len, 4 * args.seq_len})))
        rc = foxlm(["eval", "recall", str(ckpt), "--lengths", lengths, "--samples", str(args.samples), "--out",
                    str(res), "--no-progress"])
        if rc:
            return rc
        cells = json.loads((res / "recall.json").read_text())["cells"]
        loss = next((r["loss"] for r in reversed(log) if r.get("step") == step and "loss" in r), None)
        rows.append({"step": step, "train_loss": loss,
                     "accuracy": {f"{c['context_length']}/{c['pairs']}": c["accuracy"] for c in cells}})
        print(f"step {step}: loss {loss}, accuracy (length/pairs) {rows[-1]['accuracy']}", flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu: {platform.machine()}"
    summary = {"device": device, "date": datetime.date.today().isoformat(), "args": vars(args),
               "train_seconds": train_s, "tokens": args.steps * args.batch_size * args.seq_len,
               "chance_values": 1 / spec.third, "checkpoints": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"training: {args.steps} steps of {args.batch_size} x {args.seq_len} tokens in {train_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training throughput of ``foxlm train`` itself on real text, from initialization, and what ACP prunes once the
forget gates have trained.

``benchmarks/train.py`` times a step on random tokens with forget gates set to a stand-in profile. Here each model is
trained by the trainer (125m, one sequence of ``--seq-len`` tokens a step; on one GPU each step is replayed from a
CUDA graph, ``cuda_graph=auto``) on a
prepared corpus (``python recipes/debian_corpus.py --out data/debian-gpt2``), and its logged tokens/s are compared
in the same run. Then, for each FoX run, ``foxlm eval gates`` reports the share of attention FLOPs that ACP skips
with the trained gates on held-out documents, and ``foxlm eval loss --acp both`` how much ACP changes the loss.
Models: ``transformer-pro``, ``fox-pro``, ``fox-pro+acp`` (``model.acp=true``), or any ``ARCH[+acp]``.

    python benchmarks/trained_gates.py --out OUT [--steps 500] [--models transformer-pro fox-pro fox-pro+acp]

Checkpoints stay under ``OUT/runs``; the summary is ``OUT/trained-gates-DATE.json``. On a CPU it runs eagerly, for
trying it at small sizes (``--size tiny --seq-len 256``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

import torch
from _results import non_negative_int, positive_int, results_path


def foxlm(*args: str) -> None:
    """Run the ``foxlm`` CLI of this interpreter."""
    subprocess.run([sys.executable, "-m", "foxlm.cli", *args], check=True)


def tokens_per_s(log: Path, tail: float) -> tuple[list[dict], float]:
    """The logged training records and the mean tokens/s of their last ``tail`` share (the first is left out:
    it holds the kernels' autotuning and the graph's capture)."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    train = [r for r in records if "tokens_per_s" in r][1:]
    last = train[-max(1, round(tail * len(train))):]
    return records, sum(r["tokens_per_s"] for r in last) / len(last)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for runs/, eval/ and trained-gates-DATE.json")
    p.add_argument("--overwrite", action="store_true",
                   help="replace that day's summary (default: write trained-gates-DATE-2.json, ...)")
    p.add_argument("--data", default="data/debian-gpt2", help="a `foxlm data prepare` folder")
    p.add_argument("--models", nargs="+", default=["transformer-pro", "fox-pro", "fox-pro+acp"],
                   help="ARCH or ARCH+acp (model.acp=true) names")
    p.add_argument("--size", default="125m", help="model size preset (tiny, 125m, ...)")
    p.add_argument("--seq-len", type=positive_int, default=16384, help="tokens per step (one sequence)")
    p.add_argument("--steps", type=positive_int, default=500, help="training steps per model")
    p.add_argument("--warmup", type=non_negative_int, default=None, help="LR warm-up steps (default: steps / 10)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (min_lr: a tenth of it)")
    p.add_argument("--log-every", type=positive_int, default=None, help="default: steps / 20")
    p.add_argument("--eval-every", type=non_negative_int, default=0,
                   help="validation every N steps (0: at the end only)")
    p.add_argument("--tail", type=float, default=0.2, help="share of the logged steps, at the end, for tokens/s")
    p.add_argument("--eval-sequences", type=positive_int, default=4,
                   help="held-out sequences for the gate and loss evaluations")
    args = p.parse_args(argv)
    if not args.models or any(m.split("+")[0] == "" for m in args.models):
        raise SystemExit(f"--models: expected ARCH or ARCH+acp names, got {args.models}")
    if not 0 < args.tail <= 1:
        p.error(f"argument --tail: expected a share in (0, 1], got {args.tail}")
    date = datetime.date.today().isoformat()
    path = results_path(args.out / f"trained-gates-{date}.json", args.overwrite)  # makes --out
    log_every = args.log_every or max(1, args.steps // 20)
    common = [f"size={args.size}", f"data={args.data}", "tokenizer=null", f"seq_len={args.seq_len}", "batch_size=1",
              f"max_steps={args.steps}", f"lr={args.lr}", f"min_lr={args.lr / 10}",
              f"warmup_steps={args.warmup if args.warmup is not None else args.steps // 10}",
              f"eval_every={args.eval_every}", "eval_batches=8", f"log_every={log_every}", "save_every=0",
              "sample_tokens=0", "progress=false", "tensorboard=false", "cuda_graph=auto", "resume=never", "seed=0"]
    runs = {}
    for name in args.models:
        arch, *options = name.split("+")
        if options not in ([], ["acp"]):
            raise SystemExit(f"--models: {name!r}: the only option is +acp")
        run_dir = args.out / "runs" / name.replace("+", "-")
        foxlm("train", *common, f"arch={arch}", *(["model.acp=true"] if options else []), f"out_dir={run_dir}")
        records, tps = tokens_per_s(run_dir / "log.jsonl", args.tail)
        ckpt = max((run_dir / "checkpoints").glob("step_*"))
        runs[name] = {"tokens_per_s": tps, "val_loss": [r for r in records if "val_loss" in r][-1]["val_loss"],
                      "checkpoint": str(ckpt), "log": records, "fox": arch.startswith("fox")}
    base = runs.get("transformer-pro")
    for name, run in runs.items():
        if base is not None:
            run["vs_transformer-pro"] = run["tokens_per_s"] / base["tokens_per_s"]
        if run["fox"]:
            ev = args.out / "eval" / name.replace("+", "-")
            foxlm("eval", "gates", run["checkpoint"], "--data", args.data, "--length", str(args.seq_len),
                  "--num-sequences", str(args.eval_sequences), "--out", str(ev / "gates"), "--no-progress")
            gates = json.loads((ev / "gates" / "gates.json").read_text())
            run["acp_skipped_overall"] = gates["acp_skipped_overall"]
            run["acp_skipped_per_layer"] = gates["acp_skipped_per_layer"]
            foxlm("eval", "loss", run["checkpoint"], "--data", args.data, "--eval-length", str(args.seq_len),
                  "--max-sequences", str(args.eval_sequences), "--acp", "both", "--out", str(ev / "loss"),
                  "--no-progress")
            loss = json.loads((ev / "loss" / "loss.json").read_text())
            run["acp_max_abs_loss_change"] = next(iter(loss["acp_max_abs_loss_change"].values()))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    summary = {"benchmark": "trained_gates", "date": date, "device": device,
               "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    path.write_text(json.dumps(summary, indent=1))
    for name, run in runs.items():
        extra = "".join([f"  {run['vs_transformer-pro']:.3f}x transformer-pro" if base is not None else "",
                         f"  ACP skips {run['acp_skipped_overall']:.1%}" if run["fox"] else ""])
        print(f"{name}: {run['tokens_per_s']:,.0f} tok/s over the last {args.tail:.0%} of steps, "
              f"val loss {run['val_loss']:.4f}{extra}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""``foxlm train [--config NAME_OR_YAML] [key=value ...]`` (under ``torchrun`` the same command trains in parallel),
and ``foxlm export RUN_OR_CHECKPOINT DST``."""

from __future__ import annotations

import argparse
import signal
import sys


def register(subparsers) -> None:
    from .config import config_keys_help

    p = subparsers.add_parser(
        "train", help="train a model (no arguments: the embedded Shakespeare demo)",
        description="Train a FoX / Transformer model. Without arguments: a tiny fox-pro on Shakespeare "
                    "(GPT-2 BPE), minutes on a CPU. Under torchrun: FSDP2 (parallel=fsdp) or DDP.",
        # config keys are key=value (like the YAML they override); options of the command itself are --kebab-case
        epilog="config keys (key=value; model.FIELD=value sets a FoxConfig field), with the defaults that --config's "
               "YAML overrides (--print-config shows the resolved values); overrides apply in order, a key given "
               "twice takes the later value. A string key takes its value as written "
               "(key= or key=null unsets an optional one); the others read it as YAML 1.2 (true, 1e-3, [1, 2]):\n"
               + config_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="YAML file, or the name of a config shipped in foxlm/configs (default: 'default', the "
                        "Shakespeare demo; fox-pro-125m, ...)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (every key, with the overrides applied) as YAML and exit; "
                        "the output is a valid --config file, which shows after `model` (the overrides), as "
                        "comments, every field of the model it builds")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. lr=2e-3 max_steps=500 model.acp=true sample_tokens=0")
    p.set_defaults(func=_train)

    e = subparsers.add_parser(
        "export", help="write a run's or checkpoint's model as a save_pretrained folder",
        description="Write the model of a run (its latest valid checkpoint) or of a checkpoint folder, sharded (a run "
                    "of several processes) or not, as a save_pretrained folder: safetensors weights, config and "
                    "tokenizer, for AutoModelForCausalLM.from_pretrained, foxlm generate and foxlm eval.")
    e.add_argument("src", metavar="RUN_OR_CHECKPOINT", help="a run folder (out_dir) or a checkpoint folder")
    e.add_argument("dst", metavar="DST", help="the folder to create (it must not exist)")
    e.set_defaults(func=_export)


def _train(args: argparse.Namespace) -> int:
    from .config import load_config

    # A config, data or out_dir the run refuses (before its first step) is a ValueError or FileNotFoundError:
    # foxlm.cli prints it as one line.
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        from .config import printed_config

        print(printed_config(cfg), end="")
        return 0
    from ..checkpoint.checkpointer import (
        DiskFullError,  # not before --print-config, which needs neither torch nor a trainer
    )
    from .trainer import Trainer, train

    trainer = Trainer(cfg)
    trainer.start()
    try:
        summary = train(trainer)
    except (FloatingPointError, DiskFullError) as e:  # the run's own failures, not bugs: one line says what to do
        if trainer.d.main:
            print(f"foxlm train: error: {e}", file=sys.stderr)
        return 1
    if trainer.d.main:  # one summary for the job, as for its log lines
        print(_summary_line(summary))
    # a stopped job exits as a process ended by the signal does: it did not finish
    return 128 + signal.SIGTERM if summary.get("stopped") else 0


def _export(args: argparse.Namespace) -> int:
    from ..checkpoint.export import export_model

    print(f"exported {export_model(args.src, args.dst)}")  # a bad SRC or DST: foxlm.cli's one-line error
    return 0


def _summary_line(summary: dict) -> str:
    # what is on disk: a run stopped before its first save wrote none
    where = f"last checkpoint {summary['checkpoint']}" if summary.get("checkpoint") else \
        f"no checkpoint written in {summary['run_dir']}"
    if summary.get("stopped"):
        return f"step {summary['step']}: stopped by {summary['stopped']}; {where}"
    trained = f"train loss {summary['loss']:.4f}" if "loss" in summary else "no step trained"
    val = f", val loss {summary['val_loss']:.4f}" if summary.get("val_loss") is not None else ""
    return f"step {summary['step']}: {trained}{val}; {where}"

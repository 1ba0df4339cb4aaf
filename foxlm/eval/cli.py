"""``foxlm eval {loss,niah,recall,gates,harness}``: evaluations of foxlm checkpoints, writing CSVs and PNGs under
``--out``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import numpy as np

MIN_SEQUENCES = 16  # fewer sequences than this give a noisy per-token curve (e.g. one held-out play)
# the files each command writes into --out (glob patterns): one already there is replaced only with --overwrite
OUTPUTS = {"loss": ("per_token_loss.csv", "summary.csv", "summary.md", "per_token_loss.png", "loss.json"),
           "niah": ("niah.csv", "niah.png", "niah.json"),
           "recall": ("recall.csv", "recall.md", "recall.json", "recall.png"),
           "gates": ("maps_layer*.png", "decay_times.csv", "decay_times.png", "acp.csv", "acp.png", "gates.json")}
_OVERWRITE_HELP = "replace this command's result files already in --out (other files there are always kept)"


def _distinct(vals: list, text: str) -> list:
    """``vals`` parsed from ``text``, refused if one repeats: each value is a cell of a grid, and a repeated one was
    merged into its first (niah averaged the two, recall's table kept one)."""
    seen = set()
    for v in vals:
        if v in seen:
            raise argparse.ArgumentTypeError(f"{v:g} is given twice in {text!r}; expected distinct values")
        seen.add(v)
    return vals


def _ints(text: str) -> list[int]:
    """Lengths or counts: an empty list would mean the default to recall (silently) and a crash to niah."""
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return _distinct(vals, text)


def _nonempty(text: str) -> str:
    """A path or name: an empty one would mean the current folder (--out) or the default (--data), silently."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty value, got {text!r}")
    return text


def _fractions(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions in [0, 1], got {text!r}") from None
    if not vals or any(not 0 <= v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions in [0, 1], got {text!r}")
    return _distinct(vals, text)


def _common(p: argparse.ArgumentParser, *, many: bool = False) -> None:
    p.add_argument("checkpoints" if many else "checkpoint", nargs="+" if many else None, metavar="CHECKPOINT",
                   help="run dir, checkpoint dir or save_pretrained dir" + (" (several are overlaid)" if many else ""))
    p.add_argument("--data", type=_nonempty, default=None,
                   help="prepared token folder (`foxlm data prepare`); default: the data the checkpoints were trained "
                        "on, as their run recorded it, else the embedded Shakespeare corpus")
    p.add_argument("--split", default="val", help="held-out split to read (default: val)")
    p.add_argument("--out", type=_nonempty, required=True, help="output folder for CSV, PNG and JSON files")
    p.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="autocast precision; auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per forward pass")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="evaluate checkpoints: per-token loss, needle in a haystack, recall, gates, "
                                          "lm-eval")
    sub = p.add_subparsers(dest="eval_command", metavar="EVAL")

    loss = sub.add_parser("loss", help="per-token loss L(l) and perplexity P(l) over held-out documents",
                          description="Per-token loss L(l) and P(l) = exp(mean L(1..l)) at an evaluation length "
                                      "(default 4x the training length), several checkpoints overlaid.")
    _common(loss, many=True)
    loss.add_argument("--train-length", type=int, default=None,
                      help="training context length (default: read from the checkpoint's run)")
    loss.add_argument("--eval-length", type=int, default=None, help="tokens per sequence (default: 4x training)")
    loss.add_argument("--labels", default=None, help="comma-separated legend labels, one per checkpoint")
    loss.add_argument("--max-sequences", type=int, default=None, help="at most this many sequences")
    loss.add_argument("--acp", choices=("model", "off", "on", "both"), default="model",
                      help="ACP in the evaluation: as each checkpoint was trained (default), off, on, or both (each "
                           "checkpoint with and without it: the FoX paper's no-loss-change check)")
    loss.add_argument("--acp-tolerance", type=float, default=None,
                      help="ACP's epsilon, the attention mass it may drop from a row (default: the checkpoint's)")
    loss.add_argument("--windows", choices=("auto", "first", "all"), default="auto",
                      help="first: each long-enough document's first eval-length + 1 tokens (BOS-led); all: also "
                           f"its later non-overlapping windows (which start mid-document); auto (default): first when "
                           f"that gives at least {MIN_SEQUENCES} sequences (or --max-sequences), else all")
    loss.add_argument("--cp", type=int, default=1,
                      help="context parallel: under `torchrun --nproc-per-node N`, --cp N splits each sequence over "
                           "the N processes, for contexts longer than one device holds (--eval-length a multiple "
                           "of 2N)")
    loss.set_defaults(func=run_loss)

    niah = sub.add_parser("niah", help="needle in a haystack over context lengths x needle depths",
                          description="Needle in a haystack (easy and standard modes), greedy decoding, scored "
                                      "offline: answer phrase found, and log p(answer | context).")
    _common(niah)
    niah.add_argument("--lengths", type=_ints, required=True, help="comma-separated context lengths in tokens")
    niah.add_argument("--depths", type=_fractions, default=_fractions("0,0.25,0.5,0.75,1"),
                      help="comma-separated needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)")
    niah.add_argument("--modes", default="easy,standard", help="comma-separated: easy, standard")
    niah.add_argument("--trials", type=int, default=1, help="haystacks per cell (different held-out text)")
    niah.add_argument("--train-length", type=int, default=None,
                      help="training length, shown on the plot (default: read from the checkpoint's run)")
    niah.set_defaults(func=run_niah)

    recall = sub.add_parser("recall", help="multi-query associative recall by context length and number of pairs",
                            description="Multi-query associative recall (the MQAR documents of recipes/mqar.py): the "
                                        "share of queried values the model predicts greedily, teacher-forced, by "
                                        "context length (default 1x-4x the training length) and number of pairs.")
    recall.add_argument("checkpoint", metavar="CHECKPOINT", help="run dir, checkpoint dir or save_pretrained dir")
    recall.add_argument("--lengths", type=_ints, default=None,
                        help="comma-separated context lengths in tokens (default: 1x, 2x, 3x and 4x the training "
                             "length)")
    recall.add_argument("--pairs", type=_ints, default=None,
                        help="comma-separated numbers of key-value pairs (default: those the training data records)")
    recall.add_argument("--vocab", default=None,
                        help="LO:HI, the id range of keys, values and filler (thirds of it); default: the range the "
                             "training data records (recipes/mqar.py writes it into meta.json)")
    recall.add_argument("--data", type=_nonempty, default=None,
                        help="a dataset recipes/mqar.py wrote, whose recorded task (--vocab, --pairs) to evaluate; "
                             "default: the data the checkpoint's run trained on")
    recall.add_argument("--train-length", type=int, default=None,
                        help="training context length (default: read from the checkpoint's run or config)")
    recall.add_argument("--tokenizer", type=_nonempty, default=None,
                        help="gpt2, json-gpt2, byte, or a tokenizer folder, for a model that records none (default: "
                             "the one the model records, else GPT-2 BPE)")
    recall.add_argument("--samples", type=int, default=64, help="documents per cell (default 64)")
    recall.add_argument("--seed", type=int, default=1, help="seed of the evaluation documents (default 1)")
    recall.add_argument("--out", type=_nonempty, required=True,
                        help="output folder for recall.csv, recall.json, recall.md and recall.png")
    recall.add_argument("--overwrite", action="store_true", help=_OVERWRITE_HELP)
    recall.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    recall.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="autocast precision; auto = bfloat16 on CUDA, float32 on CPU")
    recall.add_argument("--batch-size", type=int, default=8, help="documents per forward pass (default 8)")
    recall.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    recall.set_defaults(func=run_recall)

    gates = sub.add_parser("gates", help="decay times, decay/attention maps and the ACP pruning report",
                           description="Per layer and head: forget-gate decay times over held-out text, decay-matrix "
                                       "and attention-map heatmaps of a sample, and the fraction of attention FLOPs "
                                       "ACP skips.")
    _common(gates)
    gates.add_argument("--length", type=int, default=2048, help="tokens per sequence for decay times and ACP")
    gates.add_argument("--num-sequences", type=int, default=4, help="held-out sequences for decay times and ACP")
    gates.add_argument("--map-length", type=int, default=None,
                       help="tokens of the sample drawn as heatmaps, at most --length (default 128, or --length if "
                            "shorter)")
    gates.add_argument("--block-m", type=int, default=128, help="ACP tile: query block (default 128, the kernel's)")
    gates.add_argument("--block-n", type=int, default=64, help="ACP tile: key block (default 64, the kernel's)")
    gates.add_argument("--tolerance", type=float, default=math.exp(-10), help="ACP tolerance (default e^-10)")
    gates.set_defaults(func=run_gates)

    # every argument, options included, belongs to lm_eval: this parser takes none itself (prefix "+")
    harness = sub.add_parser("harness", prefix_chars="+", add_help=False,
                             help="lm-evaluation-harness with foxlm registered (arguments are lm_eval's; -h: its help)",
                             description="Runs lm_eval's command line with foxlm imported, so `--model foxlm` and "
                                         "`--model hf` on foxlm checkpoints work. All arguments go to lm_eval.")
    harness.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm_eval arguments, e.g. --model foxlm ...")
    harness.set_defaults(func=run_harness)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _setup(args, checkpoints: list[str]):
    """Loaded models (on ``--device``), the held-out dataset folder, its tokenizer and the output folder (checked, not
    yet made: ``_made`` makes it once every check has passed)."""
    from foxlm.data import TokenDataset, matches_spec
    from foxlm.device import resolve_device

    from .utils import load_model

    if args.batch_size < 1:
        raise ValueError(f"--batch-size: expected >= 1, got {args.batch_size}")
    # loss, niah and gates draw figures: a missing matplotlib is said now, not at the first figure, after the
    # computation with some of the results written and the rest lost (the CLI names the extra that installs it)
    import matplotlib  # noqa: F401
    out = _out_folder(args)
    with _flag_errors(device="--device"):
        device = resolve_device(args.device)
    models = [load_model(c, device, args.progress) for c in checkpoints]
    specs = [getattr(m.config, "foxlm_tokenizer", None) for m in models]  # what `foxlm train` recorded
    data = Path(args.data).expanduser() if args.data else _training_data(checkpoints, specs, args.progress)
    if not (data / "meta.json").is_file():  # TokenDataset's own message names a "path", not the flag
        raise FileNotFoundError(f"--data: {data} is not a prepared dataset (no meta.json); prepare text with "
                                "`foxlm data prepare FILES_OR_DIRS --out DIR` and pass DIR")
    with _flag_errors(split="--split"):
        dataset = TokenDataset(data, args.split)
    tok = dataset.tokenizer([m.config._name_or_path for m in models if m.config._name_or_path])
    for c, m, spec in zip(checkpoints, models, specs):
        if spec is not None and not matches_spec(tok, spec):
            raise ValueError(f"--data: {data} was prepared with {tok.name}, but {c} was trained with "
                             f"{spec['name']}; pass data prepared with the model's tokenizer")
        if m.config.vocab_size < tok.vocab_size:
            raise ValueError(f"--data: its tokenizer ({tok.name}, {tok.vocab_size} ids) does not fit {c}'s "
                             f"vocabulary of {m.config.vocab_size}")
    return models, data, tok, out


def _out_folder(args) -> Path:
    """``--out``, refused if it or a folder above it is a file (checked before the models load; mkdir would say
    only "File exists"), or if it holds a file the command writes (a user's, or an earlier run's results) and
    ``--overwrite`` is not given."""
    out = Path(args.out).expanduser()
    blocked = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise NotADirectoryError(f"--out: {blocked} is a file; name a folder (new or existing) for the results")
    there = sorted({p.name for pattern in OUTPUTS[args.eval_command] for p in out.glob(pattern)}) if out.is_dir() \
        else []
    if there and not args.overwrite:
        raise FileExistsError(f"--out: {out} already holds {', '.join(there[:5])}{', ...' if len(there) > 5 else ''}; "
                              "pass --overwrite to replace them, or name another folder")
    return out


def _earlier_outputs(out: Path, command: str) -> set[str]:
    """Names in ``out`` of files the command writes, as an earlier run left them (a ``*`` of ``OUTPUTS`` is a layer
    number here: a user's ``maps_layer_mine.png`` is not one)."""
    if not out.is_dir():
        return set()
    patterns = [re.compile(re.escape(p).replace(r"\*", r"\d+")) for p in OUTPUTS[command]]
    return {p.name for p in out.iterdir() if p.is_file() and any(r.fullmatch(p.name) for r in patterns)}


def _remove_stale(out: Path, earlier: set[str], written: set[str]) -> None:
    """Remove the files of an earlier run (``_earlier_outputs``, replaced only with ``--overwrite``) that this run did
    not write again: a deeper model's extra layer maps, or a gated model's decay times after a model without gates,
    would otherwise sit among the new results as if they were its."""
    stale = sorted(earlier - written)
    for name in stale:
        (out / name).unlink()
    if stale:
        print(f"removed {', '.join(stale)} of an earlier run")


def _made(out: Path) -> Path:
    """``out``, made now: after the command's checks and its computation, so that a refused command leaves no empty
    or partial folder behind, and a folder that was there is untouched."""
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def _flag_errors(**flags: str):
    """Re-raises a ``ValueError`` whose message opens with a library's parameter name (``vocab: ...``, as
    foxlm.data.mqar and foxlm.device word theirs) under the flag that set it (``--vocab: ...``)."""
    try:
        yield
    except ValueError as e:
        name, sep, rest = str(e).partition(": ")
        if not sep or name not in flags:
            raise
        raise ValueError(f"{flags[name]}: {rest}") from None


def _training_data(checkpoints: list[str], specs: list[dict | None], progress: bool) -> Path:
    """The held-out data without ``--data``: the dataset the checkpoints' runs recorded (one for all of them), else the
    embedded Shakespeare corpus in the tokenizer the models record (GPT-2 BPE if none)."""
    from foxlm.data import ensure_default_corpus

    from .utils import run_train_data

    recorded = set()  # (data, tokenizer): the embedded corpus comes in one version per tokenizer, a folder in one
    for c, spec in zip(checkpoints, specs):
        run = run_train_data(c)
        if run is not None and run[0] != "shakespeare":
            recorded.add((run[0], None))
        else:
            recorded.add(("shakespeare", spec["name"] if spec else (run[1] if run else None) or "gpt2"))
    if len(recorded) > 1:
        names = sorted(d if t is None else f"{d} ({t})" for d, t in recorded)
        raise ValueError(f"--data: the checkpoints were trained on different data ({', '.join(names)}); "
                         "pass the prepared folder to evaluate them on")
    ((data, tokenizer),) = recorded
    if data == "shakespeare":
        return ensure_default_corpus(tokenizer, progress=progress)
    if not Path(data).expanduser().exists():
        raise ValueError(f"--data: the checkpoints were trained on {data}, which is not here (a path relative to where "
                         "training ran?); pass the prepared folder to evaluate on")
    return Path(data).expanduser()


def _check_exist(checkpoints: list[str]) -> None:
    for c in checkpoints:
        if not Path(c).expanduser().exists():
            raise FileNotFoundError(f"CHECKPOINT: {c} does not exist (expected a run, checkpoint or save_pretrained "
                                    "folder)")


def _check_train_length(args) -> None:
    if args.train_length is not None and args.train_length < 1:
        raise ValueError(f"--train-length: expected a positive number of tokens, got {args.train_length}")


def _train_length(args, checkpoint: str, model) -> int | None:
    """--train-length, else what ``checkpoint`` records: its config's ``train_length`` (``foxlm train`` writes it,
    and exports keep it), else the ``seq_len`` of the run it is in; None if neither."""
    from .utils import run_train_length

    return args.train_length or getattr(model.config, "train_length", None) or run_train_length(checkpoint)


def _default_labels(checkpoints: list[str]) -> list[str]:
    """Each checkpoint's folder name, with as many folders above it as tell the checkpoints apart (runs/fox/model and
    runs/tf/model are labelled fox/model and tf/model): a label names a curve, CSV columns and a summary row."""
    parts = [Path(os.path.abspath(Path(c).expanduser())).parts for c in checkpoints]
    for k in range(1, max(map(len, parts)) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [p[-1] for p in parts]  # one folder given twice: refused by _check_distinct


def _check_distinct(labels: list[str], what: str) -> None:
    """Refuse a label that names two of ``what``: their curves, CSV columns and summary rows could not be told
    apart, and results kept per label (--acp both's loss change) kept only the last."""
    twice = next((lab for i, lab in enumerate(labels) if lab in labels[:i]), None)
    if twice is not None:
        raise ValueError(f"--labels: {twice!r} labels two {what}; expected a distinct label per checkpoint")


def _windows(docs: list[np.ndarray], length: int, every: bool) -> list[np.ndarray]:
    if not every:
        return [d[:length] for d in docs]
    return [d[a:a + length] for d in docs for a in range(0, len(d) - length + 1, length)]


def _context_parallel(args):
    """For ``--cp N``: this process's part in splitting sequences over the N torchrun processes (the process
    group, created here unless the caller made it, and this process's GPU); None for ``--cp 1``. Returns
    (ContextParallel or None, whether this call created the process group)."""
    import torch
    import torch.distributed as dist

    from foxlm.device import resolve_device
    from foxlm.parallel import ContextParallel

    if args.cp < 1:
        raise ValueError(f"--cp: expected a positive number of processes, got {args.cp}")
    if args.cp == 1:
        return None, False
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.cp:
        raise ValueError(f"--cp: {args.cp} processes split each sequence, but {world} run; launch with "
                         f"`torchrun --nproc-per-node {args.cp} -m foxlm.cli eval loss ...`")
    with _flag_errors(device="--device"):
        device = resolve_device(args.device)
    if device.type == "cuda" and device.index is None:
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        torch.cuda.set_device(torch.device(args.device))
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return ContextParallel(None, "zigzag"), owns


def run_loss(args) -> int:
    import torch.distributed as dist

    cp, owns_group = _context_parallel(args)
    try:
        return _run_loss(args, cp)
    finally:
        if owns_group:
            dist.destroy_process_group()


def _run_loss(args, cp) -> int:
    import torch.distributed as dist

    from . import loss
    from .utils import check_positions, heldout_documents

    _check_exist(args.checkpoints)
    main = cp is None or dist.get_rank() == 0  # under --cp every process computes every curve; one writes them
    labels = args.labels.split(",") if args.labels else _default_labels(args.checkpoints)
    if len(labels) != len(args.checkpoints):
        raise ValueError(f"--labels: {len(labels)} labels for {len(args.checkpoints)} checkpoints")
    if not all(lab.strip() for lab in labels):  # an empty label is a curve the legend cannot name
        raise ValueError(f"--labels: expected a non-empty label per checkpoint, got {args.labels!r}")
    _check_distinct(labels, "checkpoints")
    # --acp both adds a curve "LABEL + ACP" per checkpoint, which another label may already be
    _check_distinct([lab + s for lab in labels for s in {"both": ("", " + ACP")}.get(args.acp, ("",))], "curves")
    if args.eval_length is not None and args.eval_length < 1:
        raise ValueError(f"--eval-length: expected a positive number of tokens, got {args.eval_length}")
    if args.max_sequences is not None and args.max_sequences < 1:
        raise ValueError(f"--max-sequences: expected a positive count, got {args.max_sequences}")
    _check_train_length(args)
    models, data, _, out = _setup(args, args.checkpoints)
    train_length = _train_length(args, args.checkpoints[0], models[0])
    if train_length is None:
        raise ValueError(f"--train-length: {args.checkpoints[0]} records no training length (no train_length in its "
                         "config.json, and not inside a `foxlm train` run); pass --train-length N (the seq_len it was "
                         "trained at)")
    if args.train_length is None:  # one length marks every curve: said where the checkpoints record others
        recorded = {lab: _train_length(args, c, m) for lab, c, m in zip(labels, args.checkpoints, models)}
        if len(set(recorded.values())) > 1:
            shown = ", ".join(f"{lab}: {n}" for lab, n in recorded.items())
            print(f"--train-length: the checkpoints record different training lengths ({shown}); the summary's "
                  f"milestones, the figure's mark and the default --eval-length take the first's, {train_length} "
                  f"(pass --train-length to choose)", file=sys.stderr)
    eval_length = args.eval_length if args.eval_length is not None else 4 * train_length
    if cp is not None and eval_length % (2 * args.cp):
        raise ValueError(f"--eval-length: {eval_length} must be a multiple of 2 x --cp = {2 * args.cp} (each process "
                         f"holds two equal chunks of every sequence)")
    for m in models:
        check_positions(m, eval_length, "--eval-length")
    if args.acp_tolerance is not None and args.acp == "model":
        raise ValueError("--acp-tolerance: only with --acp on, off or both")
    if args.acp_tolerance is not None and not 0.0 < args.acp_tolerance < 1.0:
        raise ValueError(f"--acp-tolerance: expected a value in (0, 1), got {args.acp_tolerance}")
    for c, m in zip(args.checkpoints, models):
        gate = getattr(m.config, "gate", None)  # None: not a foxlm model (any AutoModelForCausalLM)
        if args.acp in ("on", "both") and gate in ("none", None):
            raise ValueError(f"--acp: {c} has no forget gate ({'gate=none' if gate else m.config.model_type}); ACP "
                             f"applies to FoX models only")
        if args.acp == "off" and gate is None:
            raise ValueError(f"--acp: {c} is a {m.config.model_type!r} model, without ACP to turn off; use --acp model")
        if args.cp > 1 and gate is None:
            raise ValueError(f"--cp: {c} is a {m.config.model_type!r} model; context parallelism needs foxlm's models")
    runs = []  # (model, label, ACP on/off or None: as trained)
    for m, lab in zip(models, labels):
        if args.acp == "both":
            runs += [(m, lab, False), (m, f"{lab} + ACP", True)]
        else:
            runs.append((m, lab + (" + ACP" if args.acp == "on" else ""), {"on": True, "off": False}.get(args.acp)))
    docs = heldout_documents(data, args.split, eval_length + 1, args.max_sequences, what="--eval-length")
    # auto: BOS-led windows whenever there are as many as asked for; later ones start mid-document, without context
    enough = min(MIN_SEQUENCES, args.max_sequences or MIN_SEQUENCES)
    every = args.windows == "all" or (args.windows == "auto" and len(docs) < enough)
    seqs = _windows(docs, eval_length + 1, every)[:args.max_sequences]
    if args.windows == "auto" and every:
        print(f"--windows auto: {len(docs)} held-out documents have {eval_length + 1} tokens, so all their "
              f"non-overlapping windows are used ({len(seqs)} sequences)", file=sys.stderr)
    if len(seqs) < MIN_SEQUENCES and args.max_sequences is None:
        print(f"warning: only {len(seqs)} sequences of {eval_length + 1} tokens: L(l) and P(l) are noisy (more "
              "held-out text, or a shorter --eval-length)", file=sys.stderr)
    curves = []

    def write() -> str:
        _made(out)
        loss.write_csv(curves, out / "per_token_loss.csv")
        md = loss.write_summary(curves, train_length, out / "summary.csv", out / "summary.md")
        loss.plot(curves, train_length, out / "per_token_loss.png")
        extra = {"train_length": train_length, "eval_length": eval_length, "sequences": len(seqs), "data": str(data)}
        if len(curves) < len(runs):
            extra["curves_done"] = [c.label for c in curves]
        if args.acp == "both":  # per checkpoint: the largest change ACP makes to any position's mean loss
            extra["acp_max_abs_loss_change"] = {
                lab: float(np.abs(with_acp.loss - without.loss).max())
                for lab, without, with_acp in zip(labels, curves[::2], curves[1::2])}
            md += "\n" + "".join(f"ACP changes {lab}'s per-token loss by at most {d:.2e} nats.\n"
                                 for lab, d in extra["acp_max_abs_loss_change"].items())
            (out / "summary.md").write_text(md)
        _write_json(out / "loss.json", args, extra)
        return md

    try:
        for m, lab, acp in runs:
            if acp is not None:
                m.set_acp(acp, tolerance=args.acp_tolerance)
            curves.append(loss.per_token_loss(m, seqs, label=lab, batch_size=args.batch_size, dtype=args.dtype,
                                              show_progress=args.progress and main, context_parallel=cp))
    except KeyboardInterrupt:  # each curve takes a pass over the data: the finished ones are kept
        if main and curves:
            write()
            print(f"interrupted after {len(curves)} of {len(runs)} curves: wrote them to {out}", file=sys.stderr)
        raise
    if not main:
        return 0
    md = write()
    print(md, end="")
    print(f"wrote {out}/per_token_loss.csv, summary.csv, summary.md, per_token_loss.png")
    return 0


def run_niah(args) -> int:
    from . import niah
    from .utils import check_positions, heldout_documents

    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or any(m not in niah.MODES for m in modes):
        raise ValueError(f"--modes: expected a comma-separated subset of {niah.MODES}, got {args.modes!r}")
    if len(set(modes)) < len(modes):  # a mode given twice ran twice, averaged into the same cells
        twice = next(m for i, m in enumerate(modes) if m in modes[:i])
        raise ValueError(f"--modes: {twice!r} is given twice in {args.modes!r}; expected distinct modes")
    if args.trials < 1:
        raise ValueError(f"--trials: expected at least 1, got {args.trials}")
    _check_train_length(args)
    _check_exist([args.checkpoint])
    (model,), data, tok, out = _setup(args, [args.checkpoint])
    check_positions(model, max(args.lengths), "--lengths", extra=niah.completion_tokens(tok) - 1)
    hay = niah.haystack_tokens(tok, heldout_documents(data, args.split, 2, None))
    prompts = len(modes) * len(args.lengths) * len(args.depths) * args.trials
    results: list[niah.NeedleResult] = []

    def write() -> None:
        _made(out)
        niah.write_csv(results, out / "niah.csv")
        part = "" if len(results) == prompts else f": {len(results)} of {prompts} prompts, interrupted"
        niah.plot(results, out / "niah.png", train_length=_train_length(args, args.checkpoint, model),
                  title=f"Needle in a haystack (greedy decoding){part}")
        _write_json(out / "niah.json", args, {"data": str(data), "haystack_tokens": len(hay), "prompts": prompts,
                                              "prompts_done": len(results)})

    try:
        niah.run_niah(model, tok, hay, args.lengths, args.depths, modes=modes, trials=args.trials,
                      batch_size=args.batch_size, dtype=args.dtype, show_progress=args.progress, results=results)
    except KeyboardInterrupt:  # a grid takes hours at the paper's lengths: the prompts scored so far are kept
        if results:
            write()
            print(f"interrupted after {len(results)} of {prompts} prompts: wrote them to {out}/niah.csv, niah.png",
                  file=sys.stderr)
        raise
    write()
    for mode in modes:
        lengths, _, g = niah.grid(results, mode, "found")
        print(f"{mode}: answer found in {np.nanmean(g):.0%} of {g.size} cells (lengths {lengths})")
    print(f"wrote {out}/niah.csv, niah.png")
    return 0


def _vocab_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        return int(lo), int(hi)
    except ValueError:
        raise ValueError(f"--vocab: expected LO:HI token ids, e.g. 1000:1768, got {text!r}") from None


def run_recall(args) -> int:
    from foxlm.data import matches_spec, model_tokenizer
    from foxlm.data.mqar import MQARSpec, recorded_task
    from foxlm.device import resolve_device

    from . import recall
    from .utils import check_positions, load_model, run_train_data, run_train_length

    _check_exist([args.checkpoint])
    for name in ("samples", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.train_length is not None and args.train_length < 1:
        raise ValueError(f"--train-length: expected a positive number of tokens, got {args.train_length}")
    if args.seed < 0:  # numpy's seed sequence said only "expected non-negative integer"
        raise ValueError(f"--seed: expected a non-negative integer, got {args.seed}")
    if args.data is not None and not Path(args.data).expanduser().exists():
        raise FileNotFoundError(f"--data: {args.data} does not exist (expected a dataset recipes/mqar.py wrote)")
    data = args.data
    if data is None and (run := run_train_data(args.checkpoint)) is not None and run[0] != "shakespeare":
        data = run[0]
    if data is not None and args.data is None and args.vocab is None and not Path(data).expanduser().exists():
        raise ValueError(f"--data: {args.checkpoint} was trained on {data}, which is not here (a path relative to "
                         "where training ran?); pass that folder as --data, or --vocab and --pairs")
    task = recorded_task(data) if data is not None else None
    if args.data is not None and task is None:
        raise ValueError(f"--data: {args.data} records no MQAR task (a dataset recipes/mqar.py wrote has one)")
    if args.vocab is None and task is None:
        raise ValueError("--vocab: the checkpoint's training data records no MQAR task; pass --vocab LO:HI (and "
                         "--pairs), the ranges it was trained on")
    # MQARSpec words its errors for recipes/mqar.py too ("vocab: ...", "pairs: ...", "length: ..."): here they name
    # the flags, a recorded task's values included (the flags are how to pass others)
    with _flag_errors(vocab="--vocab"):
        spec = MQARSpec(_vocab_range(args.vocab) if args.vocab is not None else tuple(task["vocab"]))
    # a recorded count given twice weighted the data's draws; as a cell it is evaluated once (--pairs refuses repeats)
    pairs = args.pairs or (list(dict.fromkeys(task["pairs"])) if task is not None else None)
    if not pairs:
        raise ValueError("--pairs: the training data records no numbers of pairs; pass --pairs N,...")
    with _flag_errors(pairs="--pairs"):
        for p in pairs:  # before the model loads; 1 + 4p tokens hold p pairs, so only the count can be refused
            spec.check_document(1 + 4 * p, p)
    out = _out_folder(args)
    with _flag_errors(device="--device"):
        device = resolve_device(args.device)
    model = load_model(args.checkpoint, device, args.progress)
    train_length = args.train_length or run_train_length(args.checkpoint) or getattr(model.config, "train_length",
                                                                                     None)
    if args.lengths is None and not train_length:
        raise ValueError(f"--lengths: {args.checkpoint} records no training length to take 1x-4x of; pass --lengths "
                         "or --train-length")
    lengths = args.lengths or [k * train_length for k in (1, 2, 3, 4)]
    with _flag_errors(tokenizer="--tokenizer"):
        tok = model_tokenizer(model.config, args.tokenizer, what=args.checkpoint)
    if task is not None and (args.vocab is None or not args.pairs):  # the recorded ranges are ids of its tokenizer
        written = json.loads((Path(data).expanduser() / "meta.json").read_text()).get("tokenizer")
        if isinstance(written, dict) and not matches_spec(tok, written):
            raise ValueError(f"--data: {data} was written with {written.get('name')}, but {args.checkpoint}'s "
                             f"tokenizer is {tok.name}; its task's ids are not the ones the model saw (pass --vocab "
                             "and --pairs to evaluate the ranges anyway)")
    with _flag_errors(vocab="--vocab"):
        spec.check(tok)
    with _flag_errors(length="--lengths", pairs="--pairs"):
        for n in lengths:
            for p in pairs:
                spec.check_document(n, p)
    check_positions(model, max(lengths), "--lengths")  # the default lengths too: --lengths is how to change them
    cells = recall.run_recall(model, spec, lengths, pairs, bos_id=tok.eot_id, vocab_size=tok.vocab_size,
                              samples=args.samples, seed=args.seed, batch_size=args.batch_size, dtype=args.dtype,
                              show_progress=args.progress)
    _made(out)
    recall.write_csv(cells, out / "recall.csv")
    md = recall.table(cells, train_length)
    (out / "recall.md").write_text(md)
    _write_json(out / "recall.json", args, {"data": None if data is None else str(data), "task": spec.record(),
                                            "train_length": train_length, "lengths": lengths, "pairs": pairs,
                                            "cells": [vars(c) for c in cells]})
    print(md, end="")
    print(f"chance: {1 / spec.third:.4f} from the value range alone, 1/pairs among the values in context")
    written = "recall.csv, recall.md, recall.json"
    if importlib.util.find_spec("matplotlib") is not None:
        recall.plot(cells, out / "recall.png", train_length)
        written += ", recall.png"
    else:
        print("no figure: matplotlib is not installed (pip install 'foxlm[plot]')")
    print(f"wrote {out}/{written}")
    return 0


def run_gates(args) -> int:
    from . import gates
    from .utils import heldout_documents

    _check_exist([args.checkpoint])
    if args.map_length is None:  # the default fits any --length; one asked for must fit it (below)
        args.map_length = min(128, args.length)
    # before anything runs or is written: --num-sequences 0 was an IndexError, a bad tile or tolerance was refused
    # only after the maps were drawn
    for flag, value, least in (("--length", args.length, 2), ("--num-sequences", args.num_sequences, 1),
                               ("--map-length", args.map_length, 2), ("--block-m", args.block_m, 1),
                               ("--block-n", args.block_n, 1)):
        if value < least:
            raise ValueError(f"{flag}: expected at least {least}, got {value}")
    if not 0.0 < args.tolerance < 1.0:
        raise ValueError(f"--tolerance: expected a value in (0, 1), got {args.tolerance}")
    if args.map_length > args.length:  # the sample is the first sequence: it was cut to --length, silently
        raise ValueError(f"--map-length: {args.map_length} tokens drawn from a sequence of --length {args.length}; "
                         "expected --map-length <= --length")
    (model,), data, _, out = _setup(args, [args.checkpoint])
    if getattr(model.config, "gate", None) is None:
        raise ValueError(f"CHECKPOINT: {args.checkpoint} is a {model.config.model_type!r} model, without forget gates "
                         f"or attention maps to analyse; foxlm eval gates needs a foxlm model (model_type 'fox')")
    docs = heldout_documents(data, args.split, args.length, None, what="--length")
    seqs = _windows(docs, args.length, every=True)[:args.num_sequences]
    if len(seqs) < args.num_sequences:  # the figures are over fewer sequences than asked for: said, not only recorded
        print(f"--num-sequences: the {args.split} split gives {len(seqs)} sequences of --length {args.length}, "
              f"fewer than {args.num_sequences}; using those", file=sys.stderr)
    decay, attn = gates.sample_maps(model, seqs[0][:args.map_length], args.dtype)
    if decay is not None:  # computed before anything is written: a failure here leaves no half-filled --out
        log_fgates, report = gates.collect(model, seqs, block_m=args.block_m, block_n=args.block_n,
                                           tolerance=args.tolerance, batch_size=args.batch_size, dtype=args.dtype,
                                           show_progress=args.progress)
    earlier = _earlier_outputs(out, "gates")  # there only with --overwrite (_out_folder)
    _made(out)
    maps = [f"maps_layer{layer:02d}.png" for layer in range(len(attn))]
    for layer, (a, name) in enumerate(zip(attn, maps)):
        gates.plot_layer_maps(None if decay is None else decay[layer], a, layer, out / name)
    print(f"wrote {out}/maps_layer*.png")
    if decay is None:
        _remove_stale(out, earlier, set(maps))
        print("the model has no forget gates (gate='none'): no decay times and no ACP report")
        return 0
    decay_rows = gates.decay_stats(log_fgates)
    gates.write_decay_csv(decay_rows, out / "decay_times.csv")
    gates.plot_decay_times(decay_rows, out / "decay_times.png", context_length=args.length)
    gates.write_acp(report, out)
    _write_json(out / "gates.json", args, {"data": str(data), "sequences": len(seqs),
                                           "acp_skipped_per_layer": report.per_layer.tolist(),
                                           "acp_skipped_overall": report.overall})
    print(f"ACP (tiles {args.block_m}x{args.block_n}, tolerance {args.tolerance:.3g}) skips "
          f"{report.overall:.1%} of attention FLOPs; per layer: " + ", ".join(f"{x:.1%}" for x in report.per_layer))
    print(f"wrote {out}/decay_times.csv, decay_times.png, acp.csv, acp.png, gates.json")
    _remove_stale(out, earlier, {*maps, "decay_times.csv", "decay_times.png", "acp.csv", "acp.png", "gates.json"})
    return 0


def run_harness(args) -> int:
    try:
        import lm_eval  # noqa: F401
    except ModuleNotFoundError:
        raise ValueError("lm_eval: lm-evaluation-harness is not installed; it comes with foxlm's [eval] extra: "
                         "pip install -e '.[eval]' (from the foxlm checkout)") from None
    if _names_tasks(args.lm_eval_args):
        from ..hub import offline_unless_reachable

        # before huggingface_hub and datasets are imported: a task whose data is on the hub then fails at once, not
        # after five retries per file, and a local task (--include_path) runs
        if offline_unless_reachable():
            print("foxlm eval harness: the Hugging Face hub cannot be reached; running offline (tasks with local or "
                  "cached data only)", file=sys.stderr)
    from .harness import main

    return main(args.lm_eval_args)


def _names_tasks(argv: list[str]) -> bool:
    """Whether lm_eval arguments ``argv`` ask for tasks: ``--tasks``, ``--tasks=...``, an abbreviation argparse takes
    (``--task``), ``-t`` or ``-tNAME``."""
    return any(a.startswith("-t") or (len(name := a.partition("=")[0]) > 3 and "--tasks".startswith(name))
               for a in argv)


def _write_json(path: Path, args, extra: dict) -> None:
    """The command's arguments and facts about its inputs, next to its outputs."""
    meta = {k: v for k, v in vars(args).items() if k != "func"} | extra | {"argv": sys.argv}
    path.write_text(json.dumps(meta, indent=2, default=str) + "\n")

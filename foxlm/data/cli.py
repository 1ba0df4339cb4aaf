"""``foxlm data prepare INPUT... --out DIR``: tokenize text into packed shards."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="prepare token shards for training")
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    p = sub.add_parser("prepare", help="tokenize text files/folders, jsonl, parquet or a datasets folder",
                       description="Tokenize inputs into packed uint16 (uint32 for large vocabularies) shards with "
                                   "document boundaries, split into train/val by whole documents; a dataset with "
                                   "train and validation splits keeps them.")
    p.add_argument("inputs", nargs="+", help="files or folders (text, .gz, .jsonl, .json, .parquet, datasets "
                   "save_to_disk), or hub:NAME, a dataset datasets.load_dataset(NAME, streaming=True) streams "
                   "(Hub name or folder)")
    p.add_argument("--out", required=True, help="output folder (written atomically)")
    p.add_argument("--tokenizer", default="gpt2", help="'gpt2', 'json-gpt2', 'byte', or a folder with "
                   "encoder.json + vocab.bpe or a Hugging Face tokenizer.json")
    p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents held out (default 0.01)")
    p.add_argument("--text-key", default="text", help="field/column holding the text (jsonl, parquet, datasets)")
    p.add_argument("--glob", default="*", help="file-name pattern to take inside folders, at any depth, e.g. '*.md' "
                                               "(default: all files; a pattern with '/' globs paths)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all CPUs; 0: in-process)")
    p.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard before starting a new one")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the dataset in --out (only a folder holding nothing but a foxlm dataset)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from .prepare import prepare

    meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                   text_key=args.text_key, pattern=args.glob, workers=args.workers,
                   shard_tokens=args.shard_tokens, overwrite=args.overwrite, progress=not args.no_progress)
    s = meta["splits"]
    print(f"{args.out}: {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens ({meta['tokenizer']['name']}); "
          f"train {s['train']['num_tokens']:,} / val {s['val']['num_tokens']:,} tokens; "
          f"{meta['skipped']['count']} skipped")
    return 0

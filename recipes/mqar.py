#!/usr/bin/env python3
"""Multi-query associative recall (MQAR) documents as a foxlm dataset, alone or mixed into another one.

    python recipes/mqar.py --out data/mqar --tokens 2000000                     # MQAR alone (GPT-2 ids)
    python recipes/mqar.py --out data/debian-mqar --mix data/debian-gpt2 --mix-fraction 0.1
    foxlm train data=data/debian-mqar ...; foxlm eval recall runs/RUN --out out/recall

A document is ``<eot> k1 v1 ... kN vN  filler  kP1 vP1 ... kPN vPN`` (``foxlm/data/mqar.py``): N pairs, filler, then
every key again in random order followed by its value. ``--vocab LO:HI`` is split into thirds (keys, values,
filler); the default 1000:1768 is 256 ids each, all ordinary GPT-2 tokens. Each document draws N from ``--pairs`` and
its length from ``--length MIN:MAX``; with ``packing=windows`` (the default, and the only packing the recurrent
baselines take) a window of ``seq_len`` holds whole documents only if they are shorter, so keep MAX at or below
about half the training ``seq_len``. ``--mix DATA`` keeps every document of DATA's splits (``shakespeare``: the
embedded corpus) and interleaves MQAR documents evenly so that they make ``--mix-fraction`` of each split's tokens.
The output is deterministic given ``--seed``; ``meta.json`` records the task under ``"synthetic"``, and
``foxlm eval recall`` reads its ranges and pairs from there.
"""

from __future__ import annotations

import argparse
import sys


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        return (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output dataset folder (foxlm data prepare format)")
    p.add_argument("--tokens", type=int, default=None, help="training tokens of MQAR alone (without --mix)")
    p.add_argument("--mix", default=None, help="a prepared dataset (or 'shakespeare') to mix the MQAR documents into")
    p.add_argument("--mix-fraction", type=float, default=None, help="share of each split's tokens that is MQAR")
    p.add_argument("--pairs", type=_ints, default=[4, 8, 16], help="numbers of pairs a document draws from "
                                                                    "(default 4,8,16)")
    p.add_argument("--length", type=_range, default=(128, 512), help="document length in tokens, N or MIN:MAX "
                                                                     "(default 128:512)")
    p.add_argument("--vocab", type=_range, default=(1000, 1768), help="LO:HI ids for keys, values and filler "
                                                                      "(thirds; default 1000:1768)")
    p.add_argument("--seed", type=int, default=0, help="the documents' seed (the output is deterministic given it)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="held-out share of MQAR alone (default 0.01)")
    p.add_argument("--tokenizer", default="gpt2", help="the ids' tokenizer, for MQAR alone (--mix takes DATA's)")
    p.add_argument("--overwrite", action="store_true", help="replace the dataset in --out")
    args = p.parse_args(argv)

    from foxlm.cli import USER_ERRORS
    from foxlm.data import ensure_default_corpus
    from foxlm.data.mqar import MQARSpec, write_dataset

    try:
        mix = ensure_default_corpus(args.tokenizer) if args.mix == "shakespeare" else args.mix
        meta = write_dataset(args.out, MQARSpec(args.vocab), lengths=args.length, pairs=args.pairs, seed=args.seed,
                             tokens=args.tokens, val_fraction=args.val_fraction, mix=mix,
                             mix_fraction=args.mix_fraction, tokenizer=args.tokenizer, overwrite=args.overwrite)
    except USER_ERRORS as e:
        print(f"mqar.py: error: {e}", file=sys.stderr)
        return 2
    written = meta["synthetic"]["written"]
    print(f"{args.out}: {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens; MQAR train "
          f"{written['train']['tokens']:,} tokens ({written['train']['documents']:,} documents), val "
          f"{written['val']['tokens']:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

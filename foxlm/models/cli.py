"""``foxlm convert SRC DST``: the FoX authors' and fla's checkpoints as foxlm folders, and back
(``foxlm.models.convert``)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert the FoX paper's / fla's checkpoints to foxlm, or foxlm to the paper's format",
        description="Convert a save_pretrained folder (config.json + safetensors, sharded or not, or "
                    "pytorch_model.bin) between formats. Every config field is mapped or the conversion stops "
                    "naming it.",
    )
    p.add_argument("src", metavar="SRC",
                   help="source save_pretrained folder (or a foxlm run or checkpoint folder: its model)")
    p.add_argument("dst", metavar="DST", help="destination folder (not replaced unless --overwrite)")
    p.add_argument("--from", dest="src_format", default="auto", choices=("auto", "fox-authors", "fla", "foxlm"),
                   help="source format (default auto: from config.json's model_type)")
    p.add_argument("--to", default="foxlm", choices=("foxlm", "fox-authors"), help="target format (default foxlm)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights' dtype in DST (default auto: the source's)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer to record in a foxlm DST, its ids within the model's vocabulary (default: "
                        "SRC's; the authors' models: json-gpt2, also where SRC carries GPT-2's files)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it is a foxlm or FoX-authors model folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from foxlm.models.convert import convert  # absolute: foxlm.cli reads this module from its file

    dst = convert(args.src, args.dst, src_format=args.src_format, to=args.to, dtype=args.dtype,
                  tokenizer=args.tokenizer, overwrite=args.overwrite)
    print(f"{dst}: written ({args.to})")
    return 0

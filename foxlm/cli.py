"""``foxlm`` command line: ``foxlm {train,data,eval,generate,convert} ...``.

Each subcommand lives beside the code it drives (``foxlm/<area>/cli.py``) and registers itself here
through ``register(subparsers)``; this module only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_AREAS = ("train", "data", "eval", "generate", "models")  # models: convert

# Optional dependencies (pyproject.toml's extras) by the module a command imports when it needs one.
EXTRAS = {"matplotlib": "plot", "tensorboard": "tensorboard", "triton": "triton", "datasets": "data",
          "pyarrow": "data", "lm_eval": "eval"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foxlm", description="The Forgetting Transformer toolkit.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for area in _AREAS:
        importlib.import_module(f"foxlm.{area}.cli").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"foxlm {args.command}: error: this needs {e.name.partition('.')[0]}, which is not installed: "
              f"pip install 'foxlm[{extra}]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

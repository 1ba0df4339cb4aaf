"""``foxlm`` command line: ``foxlm [--debug] {train,data,eval,generate,convert} ...``.

Each subcommand lives beside the code it drives (``foxlm/<area>/cli.py``) and registers itself here
through ``register(subparsers)``; this module dispatches and turns a user's mistake into one line.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path

_AREAS = ("train", "data", "eval", "generate", "models")  # models: convert
# What a user's input causes (a bad argument or device, a missing or existing path); any other
# exception is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
               PermissionError)


def debug_enabled() -> bool:
    """Whether tracebacks are wanted for user errors too (``foxlm --debug`` or ``FOXLM_DEBUG=1``)."""
    return os.environ.get("FOXLM_DEBUG", "") not in ("", "0")


def user_error(command: str, exc: BaseException) -> int:
    """Report ``exc`` as ``foxlm COMMAND: error: ...`` on stderr and return the exit status 2; under ``--debug``
    re-raise it with its traceback."""
    if debug_enabled():
        raise exc
    print(f"foxlm {command}: error: {exc}", file=sys.stderr)
    return 2


# Optional dependencies (pyproject.toml's extras) by the module a command imports when it needs one.
EXTRAS = {"matplotlib": "plot", "tensorboard": "tensorboard", "triton": "triton", "datasets": "data",
          "pyarrow": "data", "lm_eval": "eval", "fastapi": "serve", "uvicorn": "serve", "openai": "serve",
          "pydantic": "serve", "wandb": "wandb"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foxlm", description="The Forgetting Transformer toolkit.")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (also: FOXLM_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for area in _AREAS:
        _area_cli(area).register(sub)
    return parser


def _area_cli(area: str):
    """The ``cli`` module of an area. Importing foxlm.models registers the HF classes (torch and transformers:
    seconds), so its cli module, which needs neither to build its parser, is read from its file instead."""
    if area != "models":
        return importlib.import_module(f"foxlm.{area}.cli")
    name = "foxlm._models_cli"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("models") / "cli.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` ran: ``foxlm eval loss``'s for ``foxlm eval loss ...``."""
    dest = "command"
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, dest, None) if sub is not None else None
        if name not in getattr(sub, "choices", {}):
            return parser
        parser, dest = sub.choices[name], f"{name}_command"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before a command runs: building the parser imports for half a second
        print("foxlm: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    # transformers' "Loading weights" / "Writing model shards" bars on every checkpoint: not what a command shows
    # (read when transformers is first imported, which the command line does only later; =0 brings them back)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    parser = build_parser()
    args, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if unknown:  # argparse's own message names no command and shows the top level's usage
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.debug:
        os.environ["FOXLM_DEBUG"] = "1"  # torchrun's workers and other subprocesses see it too
    command = " ".join(x for x in (args.command, getattr(args, f"{args.command}_command", None)) if x)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").partition(".")[0])
        if extra is None or debug_enabled():
            raise
        print(f"foxlm {command}: error: this needs {e.name.partition('.')[0]}, which is not installed: "
              f"pip install 'foxlm[{extra}]'", file=sys.stderr)
        return 2
    except USER_ERRORS as e:
        return user_error(command, e)
    except KeyboardInterrupt:
        print(f"foxlm {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

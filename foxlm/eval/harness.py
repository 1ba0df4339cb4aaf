"""lm-evaluation-harness adapter: ``--model foxlm`` and ``--model hf`` for foxlm checkpoints.

lm-eval's command line never imports foxlm, so neither the ``fox`` AutoModel registration nor this
module's ``foxlm`` model would exist there. ``foxlm eval harness ARGS`` (or ``python -m foxlm.eval.harness
ARGS``) is lm-eval's own command line with foxlm imported first; ARGS are lm-eval's::

    foxlm eval harness --model foxlm --model_args pretrained=runs/x --tasks lambada_openai --device cuda
    foxlm eval harness --model hf --model_args pretrained=runs/x/checkpoints/step_0001000/model --tasks ...

``--model foxlm`` takes any checkpoint foxlm can load (run dir, checkpoint dir, ``save_pretrained`` dir)
and builds the HF tokenizer from the tokenizer its config records (``hf_tokenizer``), else reads the transformers
tokenizer in its folder as ``--model hf`` does (another library's model); ``--model hf`` needs a
``save_pretrained`` dir that also holds tokenizer files (``save_hf_tokenizer``; ``foxlm train`` writes them).
Both score the same tokens: BOS, then the context and continuation (or a perplexity task's text, BOS once).
From Python, ``import foxlm.eval.harness`` then ``lm_eval.simple_evaluate(model="foxlm", ...)``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import foxlm.models  # noqa: F401  (registers the "fox" model type with the HF Auto classes)


def hf_tokenizer(name: str = "gpt2"):
    """The ``transformers`` tokenizer of ``foxlm.data.get_tokenizer(name)`` (its ``hf_tokenizer()``), offline."""
    from foxlm.data import get_tokenizer

    return _as_hf(get_tokenizer(name))


def _as_hf(tok):
    if not hasattr(tok, "hf_tokenizer"):
        raise ValueError(f"tokenizer: lm-eval needs a transformers tokenizer; the {tok.name} tokenizer has none, "
                         "use a BPE or tokenizer.json one")
    return tok.hf_tokenizer()


def save_hf_tokenizer(model_dir: str | os.PathLike, name: str = "gpt2") -> None:
    """Write the tokenizer files into a ``save_pretrained`` dir, so ``--model hf`` (AutoTokenizer) loads it."""
    from foxlm.data.tokenizer import save_fast_tokenizer

    save_fast_tokenizer(hf_tokenizer(name), model_dir)


@register_model("foxlm")
class FoxLM(HFLM):
    """lm-eval's HF causal-LM wrapper around a foxlm checkpoint (run, checkpoint or ``save_pretrained`` dir).

    model_args: ``pretrained=PATH`` plus any of HFLM's (``max_length``, ...; lm_eval's command line sets
    ``batch_size`` and ``device`` with its own flags). The context window is ``max_length``, else the training length
    the model's config records (``train_length``, or the ``seq_len`` of the run it is in); a foxlm model with neither
    needs ``max_length``, rather than lm-eval's silent 2048 (another architecture gets lm-eval's own reading of its
    config). ``device`` (default ``auto``: CUDA when available) and ``dtype`` (``float32`` | ``bfloat16`` |
    ``float16`` | ``auto``, the saved weights', as lm-eval's ``--model hf`` takes it) place the model; without a
    ``dtype``, on CUDA it runs as the FoX authors' evaluations and ``foxlm eval`` do, fp32 weights under bf16 autocast
    (HFLM's ``mixed_precision_dtype``), and in fp32 elsewhere; ``tokenizer`` (a ``foxlm.data.get_tokenizer`` name or
    folder) defaults to the one the model's config records, else the transformers tokenizer in the model's folder (as
    ``--model hf`` reads it), else GPT-2 BPE. HFLM's arguments for loading by name (``peft``, ``revision``, ...) are
    refused: the model is loaded here.
    """

    def __init__(self, pretrained: str, tokenizer: str | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, **kwargs):
        from transformers import AutoTokenizer

        from foxlm.checkpoint.weights import resolve_model_dir
        from foxlm.data.tokenizer import JSONGPT2Tokenizer, model_tokenizer
        from foxlm.device import resolve_device
        from foxlm.models import load_checkpoint_model

        from .utils import run_train_length

        unknown = sorted(set(kwargs) - _HFLM_ARGS)
        if unknown:  # HFLM hands these to from_pretrained, which a model built here never reaches: silently dropped
            raise ValueError(f"--model_args: --model foxlm takes no {', '.join(unknown)} (expected pretrained, "
                             "tokenizer, device, dtype or another argument of lm-eval's HFLM: max_length, ...)")
        unused = sorted(k for k in set(kwargs) & _LOADING_ARGS if kwargs[k] != _HFLM_DEFAULTS[k])
        if unused:  # HFLM skips them for a model object: peft=... scored the base model, silently
            raise ValueError(f"--model_args: --model foxlm loads {pretrained} itself; {', '.join(unused)} (lm-eval's "
                             "loading of a model by name) would not be used: leave it out (or use --model hf)")
        dev = resolve_device(device)
        if isinstance(dtype, torch.dtype):  # as HFLM takes it from Python (torch.bfloat16)
            dtype = str(dtype).removeprefix("torch.")
        dtype = precision(dev, dtype, kwargs)
        if dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype: expected 'float32', 'bfloat16', 'float16' or 'auto' (the saved weights'), "
                             f"got {dtype!r}")
        # loaded in ``dtype`` rather than cast to it: from_pretrained keeps the forget gate and token shift in fp32
        model = load_checkpoint_model(pretrained, "pretrained",
                                      dtype=dtype if dtype == "auto" else getattr(torch, dtype))
        model = model.to(dev).eval()
        folder = resolve_model_dir(pretrained, "pretrained")
        self._json = None
        if tokenizer is None and getattr(model.config, "foxlm_tokenizer", None) is None and \
                any((folder / name).is_file() for name in _HF_TOKENIZER_FILES):
            # a model of another library with its tokenizer: read as lm-eval's --model hf reads it (its BOS, its
            # chat template), not GPT-2 BPE
            tok = AutoTokenizer.from_pretrained(folder, use_fast=kwargs.get("use_fast_tokenizer", True))
        else:
            # the one `foxlm train` recorded, else GPT-2 BPE; lm_eval's command line takes it in --model_args
            own = model_tokenizer(model.config, tokenizer, what=pretrained,
                                  flag="tokenizer=NAME_OR_FOLDER in --model_args")
            # json-gpt2 (the FoX authors' models) has no transformers twin: GPT-2's, on text escaped here (tok_encode)
            self._json = own if isinstance(own, JSONGPT2Tokenizer) else None
            tok = hf_tokenizer("gpt2") if self._json else _as_hf(own)
        given = kwargs.get("max_length")
        if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
            # 0 read as "not given" (the training length instead), a negative one went on to lm-eval's truncation
            raise ValueError(f"max_length: expected a positive number of tokens in --model_args, got {given!r}")
        if given is None:
            length = getattr(model.config, "train_length", None) or run_train_length(pretrained)
            if length is not None:
                kwargs["max_length"] = length
            elif model.config.model_type == "fox":  # FoxConfig has no maximum length for lm-eval to read
                raise ValueError(f"max_length: {pretrained} records no training length; pass max_length=N in "
                                 "--model_args (the context window, in tokens)")
            # another architecture outside a run: lm-eval reads its config's length (max_position_embeddings, ...)
        with _quiet(logging.getLogger("lm_eval.models.huggingface"), _PASSED_A_MODEL):
            super().__init__(pretrained=model, tokenizer=tok, backend="causal", **kwargs)

    def tok_encode(self, string: str, *args, **kwargs) -> list[int]:
        """HFLM's, on the text the model's tokenizer sees (JSON-escaped for json-gpt2)."""
        return super().tok_encode(self._json.escape(string) if self._json else string, *args, **kwargs)

    def tok_batch_encode(self, strings: list[str], *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """HFLM's, on the texts the model's tokenizer sees (JSON-escaped for json-gpt2)."""
        return super().tok_batch_encode([self._json.escape(s) for s in strings] if self._json else strings,
                                        *args, **kwargs)

    def tok_decode(self, tokens, *args, **kwargs) -> str:
        """HFLM's, unescaped for json-gpt2."""
        text = super().tok_decode(tokens, *args, **kwargs)
        return self._json.unescape(text) if self._json else text

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs) -> torch.Tensor:
        """HFLM's: ``context`` (batch, tokens) and its continuation, up to ``max_length`` tokens. For json-gpt2 the
        ``stop`` sequences are looked for in the text as decoded (unescaped): HFLM looks in the escaped text the model
        writes, where a newline is a backslash and an n, so a stop of "\\n" never matched and every answer ran to
        max_gen_toks (the answer, cut at the stop afterwards, was right)."""
        if self._json is None:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        # HFLM's reading of its generation kwargs: greedy unless a temperature > 0 (or do_sample) asks to sample
        temperature = generation_kwargs.setdefault("temperature", 0.0)
        if temperature == 0.0 and generation_kwargs.get("do_sample") is None:
            generation_kwargs["do_sample"] = False
        if temperature == 0.0 and generation_kwargs["do_sample"] is False:
            del generation_kwargs["temperature"]
        stopping = transformers.StoppingCriteriaList(
            [_StopInText(lambda ids: self._json.unescape(self.tokenizer.decode(ids)), stop, context.shape[1],
                         context.shape[0])])
        with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                            enabled=self.mixed_precision_dtype is not None):
            return self.model.generate(input_ids=context, max_length=max_length, stopping_criteria=stopping,
                                       pad_token_id=self.tokenizer.pad_token_id, use_cache=True, **generation_kwargs)


def _rolling_once(rolling: Callable[..., list[float]]) -> Callable[..., list[float]]:
    """HFLM's ``loglikelihood_rolling`` with each text encoded without the tokenizer's BOS, for ``--model foxlm`` and
    for ``--model hf`` on a foxlm (``fox``) model: lm-eval opens the first window with ``prefix_token_id`` (that same
    end-of-text token) already, so the BOS that foxlm's saved tokenizer adds (and lm-eval's add_bos_token=True asks
    for) was scored as the text's first token behind it, log p(BOS | BOS) counted into every perplexity. Scored once,
    as in every other request: BOS, then the text. Another library's model under ``--model hf`` keeps lm-eval's own
    reading."""

    @functools.wraps(rolling)
    def loglikelihood_rolling(self: HFLM, requests: list, disable_tqdm: bool = False) -> list[float]:
        if not isinstance(self, FoxLM) and getattr(self.config, "model_type", None) != "fox":
            return rolling(self, requests, disable_tqdm=disable_tqdm)
        add_bos, self.add_bos_token = self.add_bos_token, False
        try:
            return rolling(self, requests, disable_tqdm=disable_tqdm)
        finally:
            self.add_bos_token = add_bos

    return loglikelihood_rolling


# ``--model hf`` is lm-eval's HFLM itself (its registry refuses another class under that name): its rolling windows
# are the one place it reads a foxlm folder differently from ``--model foxlm``
HFLM.loglikelihood_rolling = _rolling_once(HFLM.loglikelihood_rolling)


class _StopInText(transformers.StoppingCriteria):
    """Stops a batch's generation once each row's generated text (``decode`` of its tokens after the first
    ``start``) holds one of ``stop`` (as HFLM's criteria: the batch goes on until every row is done)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], start: int, batch: int):
        self.decode, self.stop, self.start, self.done = decode, stop, start, [False] * batch

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> bool:
        for i, row in enumerate(input_ids):  # the whole generated text: an escape is never cut in two here
            self.done[i] = self.done[i] or any(s in self.decode(row[self.start:].tolist()) for s in self.stop)
        return all(self.done)


def precision(device: torch.device, dtype: str | None, kwargs: dict) -> str:
    """The weights' dtype of ``--model foxlm`` on ``device``: ``dtype`` where given; else float32, with HFLM's
    ``mixed_precision_dtype`` set in ``kwargs`` to bfloat16 on CUDA (unless given): the FoX authors' lm-eval runs
    (fp32 weights, bf16 autocast), not bf16 weights, whose rounding moves the log-likelihoods."""
    if dtype is None and device.type == "cuda":
        kwargs.setdefault("mixed_precision_dtype", "bfloat16")
    return dtype or "float32"


# The named arguments of HFLM (lm-eval's own) that a user may set: any other key would go to its from_pretrained,
# never called here; the backend is "causal"
_HFLM_ARGS = frozenset(name for name, p in inspect.signature(HFLM.__init__).parameters.items()
                       if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD) - {"self", "pretrained", "backend"}

_HFLM_DEFAULTS = {name: p.default for name, p in inspect.signature(HFLM.__init__).parameters.items()}

# HFLM's arguments for loading a model (and its tokenizer) by name, which it skips when handed a model object
_LOADING_ARGS = frozenset({"revision", "subfolder", "peft", "delta", "autogptq", "gptqmodel", "gguf_file",
                           "parallelize", "tp_plan", "max_memory_per_gpu", "max_cpu_memory", "offload_folder"})

# the files of a transformers tokenizer in a save_pretrained folder (AutoTokenizer reads them)
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# HFLM's warnings about being handed a model object, which is how this adapter works (it places the model itself and
# passes every other argument on): not the user's doing, nothing to act on
_PASSED_A_MODEL = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model through")


@contextlib.contextmanager
def _quiet(logger: logging.Logger, prefixes: tuple[str, ...]) -> Iterator[None]:
    """Drop ``logger``'s records whose message starts with one of ``prefixes`` inside the block."""
    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(prefixes)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def with_device(argv: list[str]) -> list[str]:
    """lm_eval arguments with ``--device`` resolved as foxlm does (lm-eval's own default is cuda:0, also on a
    machine without CUDA): absent or ``auto``, CUDA when there is a GPU, else the CPU; a GPU that is not here is a
    ``ValueError``. Left to lm-eval: its other commands (``ls``, ``validate``) and a ``--config`` file, which may set
    the device."""
    from foxlm.device import resolve_device

    argv = list(argv)
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if len(name) > 3 and "--device".startswith(name):  # argparse takes an unambiguous prefix: --dev
            if eq:
                argv[i] = f"{name}={resolve_device(value)}"
            elif i + 1 < len(argv):
                argv[i + 1] = str(resolve_device(argv[i + 1]))
            return argv
    # lm-eval runs an evaluation for `run ARGS`, and for ARGS without a command (it puts `run` in front)
    evaluation = len(argv) > 1 and (argv[0] == "run" or argv[0] not in _LM_EVAL_COMMANDS)
    if evaluation and not any(a in ("-C", "--config") or a.startswith(("-C=", "--config=")) for a in argv):
        argv += ["--device", str(resolve_device("auto"))]
    return argv


# lm_eval's subcommands (lm_eval/_cli/harness.py)
_LM_EVAL_COMMANDS = ("run", "ls", "validate")


def check_include_path(argv: list[str]) -> None:
    """Refuse an lm_eval ``--include_path`` (or an abbreviation argparse takes) that is not there: lm-eval skips it
    without a word, and its tasks were then "not found"."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if len(name) > 3 and "--include_path".startswith(name):
            path = value if eq else argv[i + 1] if i + 1 < len(argv) else None
            if path is not None and not os.path.exists(os.path.expanduser(path)):
                raise ValueError(f"--include_path: {path} does not exist (expected a folder of task YAMLs)")


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line, run with foxlm imported (``foxlm`` model and ``fox`` Auto classes registered)."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *with_device(sys.argv[1:] if argv is None else argv)]
    check_include_path(sys.argv[1:])
    try:
        cli_evaluate()
    except TypeError as e:  # lm-eval hands the model its --batch_size, --max_batch_size, --device besides --model_args
        twice = re.search(r"got multiple values for keyword argument '(\w+)'", str(e))
        if twice is None:
            raise
        name = twice.group(1)
        raise ValueError(f"--model_args: {name} is set there and by lm_eval's --{name} (given or its default); set "
                         f"it once, with --{name}") from None
    except ValueError as e:  # lm-eval's own words for a task name it does not know name no flag
        found = re.fullmatch(r"Tasks not found: (.+)", str(e))
        if found is None:
            raise
        raise ValueError(f"--tasks: no task named {found.group(1)}; `foxlm eval harness ls tasks` lists them, and "
                         "--include_path DIR adds the task YAMLs in DIR") from None
    except ConnectionError as e:  # datasets' own, after huggingface_hub's retries (none when offline)
        found = re.search(r"Couldn't reach '([^']+)' on the Hub", str(e))
        if found is None:
            raise
        raise ValueError(f"--tasks: the data of a task asked for, {found.group(1)}, is on the Hugging Face hub, which "
                         "cannot be reached from here and holds no copy in the datasets cache; run where the hub is "
                         "reachable, or evaluate a task whose data is local: --include_path DIR with a task YAML "
                         "there (dataset_path: json, dataset_kwargs: {data_files: ...})") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())

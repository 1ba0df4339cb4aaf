"""``foxlm generate MODEL --prompt TEXT``: text generation with foxlm's fast path, in the model's own tokenizer."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

_TOLERANCE = math.exp(-10)  # --tolerance's default


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text from a checkpoint (paged cache, decode kernel, CUDA graphs, eviction)",
        description="Continue one or more prompts with a foxlm checkpoint and print the generated text.",
    )
    p.add_argument("model", metavar="MODEL", help="run dir, checkpoint dir or save_pretrained dir")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", default=None, help="a file whose whole text is one more prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: all)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="sample among the tokens at least this fraction as likely as the likeliest (default 0: all)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="scale down the logits of tokens already in the prompt or output, greedy or sampling "
                        "(default 1: none; above 1 discourages repeats)")
    p.add_argument("--min-new-tokens", type=int, default=0,
                   help="generate at least this many tokens before <|endoftext|> may stop a prompt (default 0)")
    p.add_argument("--num-return-sequences", type=int, default=1, metavar="N",
                   help="sample N continuations of each prompt (default 1)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--evict", action="store_true",
                   help="forget-gate cache eviction (FoX models with QK-norm, e.g. fox-pro)")
    p.add_argument("--tolerance", type=float, default=_TOLERANCE,
                   help="attention mass an evicted key may still carry (default e^-10)")
    p.add_argument("--page-size", type=int, default=64, help="KV cache page size in tokens (default 64)")
    p.add_argument("--tokenizer", default=None,
                   help="gpt2, json-gpt2, byte, or a tokenizer folder (default: the one the model was trained or "
                        "converted with, as its config records it; GPT-2 BPE for a model that records none)")
    p.add_argument("--no-eos", dest="stop_at_eos", action="store_false", help="do not stop at <|endoftext|>")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="model precision; auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--stats", action="store_true", help="print timings and the cache size to stderr")
    p.set_defaults(func=run)

    p = subparsers.add_parser(
        "serve", help="serve a model behind an OpenAI-compatible API (transformers serve)",
        description="transformers' own OpenAI-compatible server (`transformers serve`: /v1/completions, "
                    "/v1/chat/completions, streaming) for a foxlm model, without trust_remote_code. "
                    "Options after MODEL are transformers serve's (`foxlm serve MODEL --help` lists them), e.g. "
                    "--host, --port, --device, --dtype.",
    )
    p.add_argument("model", metavar="MODEL",
                   help="run dir (its latest checkpoint), checkpoint dir, save_pretrained dir or a hub name")
    p.add_argument("options", nargs=argparse.REMAINDER, help="transformers serve's options")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    # checked before transformers' server is imported (seconds); transformers would name its own extra
    for name in ("fastapi", "uvicorn", "openai", "pydantic"):  # what transformers' is_serve_available checks
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    if "--continuous-batching" in args.options:
        raise ValueError("--continuous-batching: not for FoX models (transformers' paged attention has no forget "
                         "gate); serve without it")
    model, path = args.model, Path(args.model).expanduser()
    if path.exists():  # a local folder, checked against its manifest (else a hub name, which transformers fetches)
        from foxlm.models.loading import resolve_model_dir

        model = str(resolve_model_dir(path, "MODEL"))
        if not (Path(model) / "tokenizer.json").is_file():
            raise ValueError(f"MODEL: {model} has no tokenizer.json (a byte-level model's has none); transformers "
                             f"serve needs a Hugging Face tokenizer")
        if Path(model) != path:
            print(f"foxlm serve: serving {args.model}'s model folder {model}, the model requests name",
                  file=sys.stderr)
    else:
        _check_hub_name(model)
    try:
        from .serve import serve
    except ImportError as e:  # transformers' serve, its ModelLoader in particular, as of 5.25
        if isinstance(e, ModuleNotFoundError) and e.name and not e.name.startswith("transformers"):
            raise
        import transformers

        raise ValueError(f"foxlm serve needs transformers>=5.25 (its `transformers serve`), not "
                         f"{transformers.__version__}: pip install 'foxlm[serve]'") from None
    return serve(model, args.options)


def _check_hub_name(model: str) -> None:
    """A MODEL that is no local path must be a Hugging Face hub name, and the hub must answer (one request, where
    transformers would retry each file five times), unless offline mode is set or the model is in the hub's cache (then
    served in offline mode)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from ..hub import offline_unless_reachable

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ValueError(f"MODEL: {model} does not exist (expected a run, checkpoint or save_pretrained folder, or a "
                         "model name on the Hugging Face hub)") from None
    # a model downloaded before is served from the hub's cache: offline mode, set before huggingface_hub reads it
    # (validate_repo_id reads none of its settings), in this process and the server's model process alike
    if not offline_unless_reachable():
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(model, "config.json"), str):
        raise ValueError(f"MODEL: {model} is not a folder here nor in the Hugging Face hub's cache, and the hub, where "
                         "it would be a model name, cannot be reached; download the model where the hub is reachable "
                         "and pass its folder")
    print(f"foxlm serve: the Hugging Face hub cannot be reached; serving {model} from its cache", file=sys.stderr)


def _check_flags(args: argparse.Namespace) -> None:
    """The decoding flags, named as the user gave them and before the model loads (``generate`` would name its own
    arguments, after the load); sampling flags without --sample would be ignored, greedy decoding given instead."""
    from foxlm.ops.forgetting_attention.acp import check_tolerance

    if not args.temperature > 0:
        raise ValueError(f"--temperature: expected a positive number, got {args.temperature}")
    if args.top_k < 0:
        raise ValueError(f"--top-k: expected 0 (all tokens) or a positive number, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p: expected a probability mass in (0, 1], got {args.top_p}")
    if not 0 <= args.min_p <= 1:
        raise ValueError(f"--min-p: expected a fraction of the likeliest token's probability in [0, 1], got "
                         f"{args.min_p}")
    if args.num_return_sequences < 1:
        raise ValueError(f"--num-return-sequences: expected a positive number, got {args.num_return_sequences}")
    given = [flag for flag, value, default in (("--temperature", args.temperature, 1.0), ("--top-k", args.top_k, 0),
                                               ("--top-p", args.top_p, 1.0), ("--min-p", args.min_p, 0.0),
                                               ("--num-return-sequences", args.num_return_sequences, 1))
             if value != default]
    if given and not args.sample:
        raise ValueError(f"{given[0]}: applies to sampling only; add --sample (without it decoding is greedy)")
    if not 0 < args.repetition_penalty < math.inf:
        raise ValueError(f"--repetition-penalty: expected a positive number (1: no penalty), got "
                         f"{args.repetition_penalty}")
    if not 0 <= args.min_new_tokens <= args.max_new_tokens:
        raise ValueError(f"--min-new-tokens: expected 0 to --max-new-tokens ({args.max_new_tokens}), got "
                         f"{args.min_new_tokens}")
    if args.min_new_tokens and not args.stop_at_eos:  # every prompt runs to --max-new-tokens already
        raise ValueError("--min-new-tokens: holds back the stop at <|endoftext|>, which --no-eos turns off; drop one")
    if args.page_size < 1:
        raise ValueError(f"--page-size: expected a positive number of tokens, got {args.page_size}")
    if not -2**63 <= args.seed < 2**64:  # torch.Generator's range: past it "Overflow when unpacking long long"
        raise ValueError(f"--seed: expected a 64-bit integer, got {args.seed}")
    check_tolerance(args.tolerance, "--tolerance")
    if args.tolerance != _TOLERANCE and not args.evict:  # the bound of eviction only: ignored, every key kept
        raise ValueError("--tolerance: applies to eviction only; add --evict (without it the cache keeps every key)")


def run(args: argparse.Namespace) -> int:
    import torch

    from foxlm.data import model_tokenizer
    from foxlm.device import resolve_device
    from foxlm.models import load_checkpoint_model

    from .decoding import generate

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected a positive number of tokens, got {args.max_new_tokens}")
    _check_flags(args)
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            prompts.append(Path(args.prompt_file).expanduser().read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:  # bare, it named neither the flag nor, at times, the file
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(f"--prompt-file: cannot read {args.prompt_file} as UTF-8 text ({reason})") from None
    if not prompts:
        raise ValueError("--prompt: give at least one --prompt or --prompt-file")
    device = resolve_device(args.device)
    auto = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = auto if args.dtype == "auto" else getattr(torch, args.dtype)
    # loaded in ``dtype`` rather than cast to it: from_pretrained keeps the forget gate and token shift in fp32
    model = load_checkpoint_model(args.model, "MODEL", dtype=dtype).to(device).eval()
    tok = model_tokenizer(model.config, args.tokenizer, what=args.model)
    ids = [[tok.eot_id] + tok.encode(p) for p in prompts]  # as every training document (and the HF tokenizer)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    # every control passed, so that the flags' defaults hold, not the model's generation_config (generate's None);
    # --no-eos is [], no stop (None would stop at the config's eos)
    out = generate(
        model, ids, args.max_new_tokens, do_sample=args.sample, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        min_new_tokens=args.min_new_tokens, eos_token_id=tok.eot_id if args.stop_at_eos else [],
        num_return_sequences=args.num_return_sequences, vocab_size=tok.vocab_size, evict=args.evict,
        tolerance=args.tolerance, page_size=args.page_size, generator=gen,
    )
    n = args.num_return_sequences
    for i, seq in enumerate(out.sequences):  # each prompt's n continuations, one after another
        if len(out.sequences) > 1:
            print(f"=== {i} ===" if n == 1 else f"=== {i // n}.{i % n} ===")  # prompt, or prompt.continuation
        text = tok.decode([t for t in seq if t != tok.eot_id])
        print(prompts[i // n] + text)
    if args.stats:  # the decode's rate leaves out its first step, a warm-up that dominates short runs
        rate = out.decode_tokens_per_s
        steady = f"then {rate:.1f} tokens/s" if rate is not None else "too few steps for a rate"
        print(f"time to first token {out.prefill_seconds:.3f} s (prefill of {sum(map(len, ids)):,} prompt tokens); "
              f"decode {out.decode_steps - 1} steps in {out.decode_seconds:.3f} s: first step "
              f"{out.first_step_seconds:.3f} s (warm-up), {steady}; "
              f"cache {out.cache['live_pages']}/{out.cache['full_pages']} pages "
              f"({100 * out.cache['fraction']:.1f}% of full)", file=sys.stderr)
    return 0

"""foxlm's decoding against HF ``generate()`` on the CPU: greedy, batch 1, one process, best of three, for a trained
model folder (by default the default job's last checkpoint).

    python benchmarks/decode_cpu.py [MODEL] [--new-tokens 64 400]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _results import positive_int
from transformers import AutoModelForCausalLM

import foxlm  # noqa: F401  (registers the Auto classes)
from foxlm.data import get_tokenizer
from foxlm.generate import generate


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="runs/shakespeare-fox-pro-tiny/checkpoints/step_0000120/model",
                        help="a saved model folder (default: the default job's last checkpoint, `foxlm train`)")
    parser.add_argument("--new-tokens", type=positive_int, nargs="+", default=[64, 400],
                        help="lengths to generate, one timing each")
    args = parser.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"argument model: no saved model (config.json) in {args.model}")
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tok = get_tokenizer("gpt2")
    prompt = [tok.eot_id] + tok.encode("To be, or not to be")
    runs = {
        # eos_token_id=[]: all n tokens, as HF's min_new_tokens=n (unset, the model's eos would stop it)
        "foxlm": lambda n: generate(model, [prompt], max_new_tokens=n, eos_token_id=[], vocab_size=tok.vocab_size),
        "foxlm --evict": lambda n: generate(model, [prompt], max_new_tokens=n, evict=True, eos_token_id=[],
                                            vocab_size=tok.vocab_size),
        "HF generate()": lambda n: model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                                  do_sample=False),
    }
    for n in args.new_tokens:
        for name, run in runs.items():
            times = []
            for _ in range(3):
                start = time.perf_counter()
                with torch.no_grad():
                    run(n)
                times.append(time.perf_counter() - start)
            print(f"{n} new tokens, {name}: {min(times):.2f} s (runs {', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()

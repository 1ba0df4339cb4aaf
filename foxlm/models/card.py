"""The README.md model card ``foxlm export`` and ``foxlm convert`` write beside a model: its architecture and size,
tokenizer, and, for a trained run, its training data and steps and the evaluation results the run folder holds."""

from __future__ import annotations

import json
import math
from pathlib import Path

from safetensors import safe_open

from ..checkpoint.run_folder import read_train_config

CARD = "README.md"
# the FoX block's parts a config switches on, in the card's words
PARTS = {"qk_norm": "QK-norm", "output_gate": "output gate", "output_norm": "output norm", "k_shift": "key shift",
         "v_shift": "value shift", "rope": "RoPE"}


def parameter_count(folder: Path) -> int:
    """The number of parameters stored in ``folder``'s safetensors files (read from their headers only)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def _architecture(config: dict) -> list[str]:
    if config.get("model_type") != "fox":
        return [f"- model_type: `{config.get('model_type')}` ({', '.join(config.get('architectures') or [])})"]
    parts = [name for key, name in PARTS.items() if config.get(key)]
    gate = config.get("gate", "data")
    kind = "Transformer (no forget gate)" if gate == "none" else f"Forgetting Transformer (FoX), {gate} forget gate"
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    return [f"- {kind}{'; ' + ', '.join(parts) if parts else ''}",
            f"- {config.get('num_hidden_layers')} layers, hidden size {config.get('hidden_size')}, {heads} heads "
            f"({kv} key/value heads), MLP {config.get('intermediate_size')}, vocabulary {config.get('vocab_size')}"]


def _tokenizer(folder: Path, config: dict) -> str:
    spec = config.get("foxlm_tokenizer")
    if isinstance(spec, dict):
        return f"`{spec.get('name')}` ({spec.get('vocab_size')} tokens, end of text {spec.get('eot_id')})"
    if (folder / "tokenizer_config.json").is_file():
        cls = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
        return f"the folder's own (`{cls}`)"
    return "none recorded"


def _val_loss(run_dir: Path, step: int) -> tuple[int, float] | None:
    """The last validation loss ``foxlm train`` logged at or before ``step``: (its step, the loss), or None."""
    from ..train.logging import read_log

    log = run_dir / "log.jsonl"
    found = [(r["step"], r["val_loss"]) for r in (read_log(log) if log.is_file() else [])
             if isinstance(r.get("val_loss"), (int, float)) and r.get("step", math.inf) <= step]
    return found[-1] if found else None


def _eval_summaries(run_dir: Path) -> list[tuple[str, str]]:
    """``foxlm eval loss`` results kept under the run folder (``--out`` inside it): (folder, its summary.md)."""
    return [(str(p.parent.relative_to(run_dir)), (p.parent / "summary.md").read_text().strip())
            for p in sorted(run_dir.rglob("loss.json")) if (p.parent / "summary.md").is_file()]


def write_model_card(folder: Path, *, title: str, source: str, run_dir: Path | None = None,
                     step: int | None = None) -> None:
    """Write ``folder``'s README.md from its config.json and weights. title: the model's name (the folder it will
    have); source: where the model came from and how it
    loads, in words;
    run_dir and step: the ``foxlm train`` run and checkpoint step it was exported from (training and evaluation)."""
    config = json.loads((folder / "config.json").read_text())
    params = parameter_count(folder)
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- foxlm",
             "- forgetting-transformer", "---", "", f"# {title}", "",
             source, "",
             "## Architecture", "", *_architecture(config),
             f"- {params:,} parameters ({params / 1e6:.1f}M), stored as "
             f"{config.get('dtype') or config.get('torch_dtype')}",
             "", "## Tokenizer", "", _tokenizer(folder, config), ""]
    cfg = read_train_config(run_dir, up=0) if run_dir is not None else None
    if cfg is not None:
        tokens = None if step is None else step * cfg.get("batch_size", 0) * cfg.get("seq_len", 0)
        lines += ["## Training", "",
                  f"- data: `{cfg.get('data')}`",
                  f"- steps: {step} of {cfg.get('max_steps')} (batch {cfg.get('batch_size')} x {cfg.get('seq_len')} "
                  f"tokens{f', {tokens:,} tokens seen' if tokens else ''})",
                  f"- learning rate {cfg.get('lr')}, warmup {cfg.get('warmup_steps')} steps, seed {cfg.get('seed')}",
                  ""]
        results = []
        val = _val_loss(run_dir, step if step is not None else math.inf)
        if val is not None:
            results.append(f"Validation loss at step {val[0]}: {val[1]:.4f} (perplexity {math.exp(val[1]):.2f})")
        for where, summary in _eval_summaries(run_dir):
            results += ["", f"`foxlm eval loss` ({where}/):", "", summary]
        lines += ["## Evaluation", "", *(results or ["None recorded in the run folder."]), ""]
    else:
        lines += ["## Training", "", "Not recorded with the model.", ""]
    (folder / CARD).write_text("\n".join(lines))

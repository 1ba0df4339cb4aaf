"""`foxlm export` and `foxlm convert` write a README.md model card: architecture, parameter count, tokenizer, and
for an export of a trained run its data, steps, validation loss and the `foxlm eval loss` results the run holds."""

from __future__ import annotations

import json

from foxlm.checkpoint.manifest import verify_checkpoint
from foxlm.cli import main
from foxlm.train.logging import read_log


def test_export_and_convert_write_a_model_card(byte_data, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "device=cpu", "arch=fox-pro", "model.hidden_size=32", "model.num_hidden_layers=1",
                 "model.num_attention_heads=2", "model.intermediate_size=64", "tokenizer=byte", "seq_len=16",
                 "batch_size=2", "max_steps=2", "warmup_steps=0", "eval_every=1", "eval_batches=1", "progress=false",
                 "tensorboard=false", "sample_tokens=0", f"data={byte_data}", f"out_dir={run}"]) == 0
    assert main(["eval", "loss", str(run), "--train-length", "16", "--eval-length", "32", "--max-sequences", "2",
                 "--out", str(run / "eval"), "--no-progress", "--device", "cpu"]) == 0
    assert main(["export", str(run), str(tmp_path / "export")]) == 0
    card = (tmp_path / "export" / "README.md").read_text()
    assert verify_checkpoint(tmp_path / "export") is None  # the manifest covers the card
    assert "README.md" in json.loads((tmp_path / "export" / "manifest.json").read_text())["files"]

    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tmp_path / "export").parameters())
    val_step, val_loss = [(r["step"], r["val_loss"]) for r in read_log(run / "log.jsonl") if "val_loss" in r][-1]
    for field in ("# export\n", "Forgetting Transformer (FoX), data forget gate; QK-norm, output gate, output norm, "
                  "key shift, value shift", "1 layers, hidden size 32, 2 heads (2 key/value heads), MLP 64, vocabulary",
                  f"- {params:,} parameters", "`byte`", f"- data: `{byte_data}`",
                  "- steps: 2 of 2 (batch 2 x 16 tokens, 64 tokens seen)",
                  f"Validation loss at step {val_step}: {val_loss:.4f}", "`foxlm eval loss` (eval/)",
                  (run / "eval" / "summary.md").read_text().strip()):
        assert field in card, field

    assert main(["convert", str(tmp_path / "export"), str(tmp_path / "authors"), "--to", "fox-authors"]) == 0
    card = (tmp_path / "authors" / "README.md").read_text()
    assert f"Converted by `foxlm convert` from `{tmp_path / 'export'}` (a foxlm model)" in card
    assert f"- {params:,} parameters" in card and "Not recorded with the model." in card
    assert main(["convert", str(tmp_path / "authors"), str(tmp_path / "authors"), "--overwrite"]) == 2  # its source
    assert main(["convert", str(tmp_path / "authors"), str(tmp_path / "back")]) == 0
    assert main(["convert", str(tmp_path / "authors"), str(tmp_path / "back"), "--overwrite"]) == 0  # holds a card
    assert "`byte`" in (tmp_path / "back" / "README.md").read_text()

"""The README's Python examples run as written, in order, in one namespace (as a reader would paste them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

README = Path(__file__).parents[1] / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)  # the examples save models into the working folder
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
    # what the examples claim, checked on what they computed
    assert namespace["o"].shape == namespace["q"].shape and namespace["log_fgate"].grad is not None
    assert 0.0 <= float(namespace["overall"]) <= 1.0
    assert 3 < namespace["new"].shape[1] <= 3 + 20  # assisted decoding continued the prompt
    cache = namespace["out"].cache  # eviction keeps at most the pages of a full cache
    assert 1 <= len(namespace["out"].sequences[0]) <= 64 and 0 < cache["live_pages"] <= cache["full_pages"]
    assert (tmp_path / "fox-pro-tiny" / "model.safetensors").is_file()
    assert all(torch.isfinite(p).all() for p in namespace["model"].parameters())


def test_import_foxlm_registers_the_auto_classes_without_loading_torch(tmp_path):
    """`import foxlm` is cheap (the command line's --help stays instant) and still makes the Auto classes load a
    foxlm folder, in a fresh process as a user runs it."""
    code = f"""
import sys
import foxlm, foxlm.cli
foxlm.cli.build_parser()
assert "torch" not in sys.modules and "transformers" not in sys.modules, "imported at start-up"
from foxlm.models import FoxConfig, FoxForCausalLM
FoxForCausalLM(FoxConfig.preset("fox-llama", "tiny", num_hidden_layers=1)).save_pretrained({str(tmp_path)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    load = f"""
import foxlm
from transformers import AutoModelForCausalLM
print(type(AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})).__name__)
"""
    proc = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "FoxForCausalLM", proc.stderr

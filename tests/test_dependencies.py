"""Dependencies declared as they are used: every third-party import of foxlm is in pyproject.toml, the optional ones
as extras; the CPU path (model, `foxlm train`) runs without Triton, and a command missing an extra says which one."""

from __future__ import annotations

import ast
import os
import random
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from foxlm.data import prepare
from foxlm.data.assets import shakespeare_plays

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = {"triton", "matplotlib", "tensorboard", "datasets", "pyarrow", "lm-eval", "peft", "wandb", "fastapi",
            "uvicorn", "openai", "onnxscript"}


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _imports() -> set[str]:
    """The top-level modules foxlm's code imports, except the standard library and foxlm itself."""
    found = set()
    for path in (ROOT / "foxlm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != "foxlm"}


def test_every_import_is_declared_and_the_optional_ones_are_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_name(r) for r in project["dependencies"]}
    extras = {name: {_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    declared = base.union(*extras.values())
    dists = packages_distributions()
    for module in _imports():
        names = {_name(d) for d in dists.get(module, [module])}
        assert names & declared, f"foxlm imports {module} (from {names}), which pyproject.toml does not declare"
    assert "tensorboard" in declared  # imported through torch.utils.tensorboard
    assert not base & OPTIONAL, f"hard dependencies that are optional in practice: {base & OPTIONAL}"
    assert OPTIONAL <= extras["test"], f"the [test] extra misses {OPTIONAL - extras['test']}"


# A child with triton, tensorboard and matplotlib unimportable, as on an install without those extras.
CHILD = """
import sys
for name in ("triton", "tensorboard", "matplotlib"):
    sys.modules[name] = None
import torch
from foxlm.cli import main
from foxlm.models import FoxConfig, FoxForCausalLM

config = FoxConfig.preset("fox-pro", "tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=128, vocab_size=256, bos_token_id=0, eos_token_id=0)
ids = torch.randint(0, 256, (2, 24))
model = FoxForCausalLM(config)
model(ids, labels=ids).loss.backward()
assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)
# Triton asked for (the interpreter here; a CUDA tensor on a GPU machine) where it is not installed: the PyTorch paths
import os
os.environ["TRITON_INTERPRET"] = "1"
model(ids, labels=ids).loss.backward()
del os.environ["TRITON_INTERPRET"]
data, run, out = sys.argv[1:4]
assert main(["train", "device=cpu", "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
             "model.intermediate_size=128", "tokenizer=byte", "seq_len=32", "batch_size=2", "max_steps=2",
             "warmup_steps=1", "eval_every=0", "eval_batches=1", "progress=false", "tensorboard=true",
             "sample_tokens=4", f"data={data}", f"out_dir={run}"]) == 0
print("eval status", main(["eval", "loss", run, "--eval-length", "32", "--max-sequences", "1", "--no-progress",
                           "--out", out]))
assert not [m for m, v in sys.modules.items() if m.split(".")[0] == "triton" and v is not None]
"""


def test_cpu_path_runs_without_triton_and_missing_extras_name_themselves(tmp_path):
    data = tmp_path / "bytes"
    prepare(random.Random().sample(shakespeare_plays(), 2), data, tokenizer="byte", val_fraction=0.5, workers=0,
            progress=False)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", CHILD, str(data), str(tmp_path / "run"), str(tmp_path / "eval")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2: train loss" in done.stdout and "--- sample (step 2) ---" in done.stdout
    assert "tensorboard=true: no TensorBoard logs, tensorboard is not installed (the extra [tensorboard]: " \
           "pip install 'foxlm[tensorboard]'" in done.stderr
    assert not (tmp_path / "run" / "tb").exists()
    assert "eval status 2" in done.stdout
    expected = "foxlm eval loss: error: this needs matplotlib, which is not installed: pip install 'foxlm[plot]'"
    assert expected in done.stderr

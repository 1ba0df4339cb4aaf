"""The README's Python examples run as written, in order, in one namespace (as a reader would paste them); its
command lines parse, and the docs' examples run."""

from __future__ import annotations

import os
import re
import shlex
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


def _commands(prefix: str) -> list[list[str]]:
    """The README's shell commands that start with ``prefix``, comments dropped, as argument lists."""
    lines = [line for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
             for line in block.replace("\\\n", " ").splitlines()]  # continued lines joined
    return [shlex.split(line, comments=True) for line in lines if line.startswith(prefix)]


def test_readme_foxlm_commands_parse():
    """Every `foxlm ...` line of the README names options the command line has (lm_eval's own are its business)."""
    from foxlm.cli import build_parser

    commands = _commands("foxlm ")
    assert len(commands) >= 10
    for argv in commands:
        args = build_parser().parse_args(argv[1:])
        assert args.func is not None, argv


def test_readme_eval_and_generate_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """The Evaluation section's commands and the generate line, exactly as written, on a run where the first command
    leaves one (`runs/shakespeare-fox-pro-tiny`, the default out_dir), here trained for two steps at a smaller
    size."""
    from foxlm.cli import main

    monkeypatch.chdir(tmp_path)
    small = ["max_steps=2", "seq_len=64", "batch_size=2", "model.hidden_size=64", "model.num_hidden_layers=2",
             "model.num_attention_heads=2", "model.intermediate_size=128", "eval_every=0", "sample_tokens=0",
             "progress=false", "tensorboard=false", "device=cpu"]
    assert main(["train", *small]) == 0
    assert (tmp_path / "runs" / "shakespeare-fox-pro-tiny" / "checkpoints").is_dir()
    # the commands on the first command's run (the checkpoint section's need the hub's 760M models)
    commands = [c for c in _commands("foxlm eval ") + _commands("foxlm generate ")
                if "runs/shakespeare-fox-pro-tiny" in c and c[2] != "harness"]
    assert [c[1:3] for c in commands] == [["eval", "loss"]] * 2 + [["eval", "niah"], ["eval", "gates"]] + \
        [["generate", "runs/shakespeare-fox-pro-tiny"]]
    for argv in commands:
        assert main(argv[1:]) == 0, argv
    for out in ("loss/per_token_loss.png", "acp/summary.md", "niah/niah.csv", "gates/acp.csv"):
        assert (tmp_path / "out" / out).is_file(), out
    assert "To be, or not to be" in capsys.readouterr().out


def test_context_parallel_doc_example_runs_under_torchrun(tmp_path):
    """docs/context-parallel.md's API example, as written, on 2 CPU processes under torchrun: the gathered output is
    the op's on the whole sequence, every shard gets its gradient and the exchange sent bytes."""
    doc = (Path(__file__).parents[1] / "docs" / "context-parallel.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", doc, re.S)
    checks = """
from foxlm.ops import forgetting_attention
torch.manual_seed(0)
qw, kw, vw = (torch.randn(B, T, H, D) for _ in range(3))
ref = forgetting_attention(qw, kw, vw, F.logsigmoid(torch.randn(B, T, H) + 3.0), prune=True)
torch.testing.assert_close(whole, ref)
assert all(x.grad is not None and x.grad.shape == x.shape for x in (q, k, v, log_fgate))
assert t.sent_bytes > 0 and stats.flops_total.shape == (H,)
dist.destroy_process_group()
"""
    script = tmp_path / "example.py"
    script.write_text(block + checks)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a reader runs it (conftest sets it)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_readme_starts_with_the_two_setup_commands():
    """The README's first command block is the fresh machine's set-up: one line ending in the default job, one the
    tests."""
    first = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    lines = first.replace("\\\n", " ").splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("pip install ") and lines[0].rstrip().endswith("&& foxlm train"), lines[0]
    assert shlex.split(lines[1], comments=True) == ["bash", ".ci/run"]
    assert (README.parent / ".ci" / "run").is_file()


def _doc_commands() -> list[tuple[str, list[str]]]:
    """Every foxlm command line of README.md and docs/*.md (fenced ``bash`` blocks and indented ones; `foxlm ...`,
    `python -m foxlm[.cli] ...`, under torchrun too) as (file, the arguments after the program), the docs' shell
    variables given example values."""
    names = {"$ARCH": "fox-pro", "$R": "runs/x", "$OUT": "out"}
    found = []
    for path in [README, *sorted((README.parent / "docs").glob("*.md"))]:
        text = path.read_text()
        blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
        blocks += re.findall(r"\n\n((?: {4}.*\n)+)", text)  # indented code blocks, after a blank line
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                if "foxlm" not in line:
                    continue
                for name, value in names.items():
                    line = line.replace(name, value)
                argv = shlex.split(line, comments=True)
                for program in (["foxlm"], ["-m", "foxlm"], ["-m", "foxlm.cli"]):
                    n = len(program)
                    at = [i for i in range(len(argv)) if argv[i:i + n] == program]
                    if at and (program != ["foxlm"] or at[0] == 0):
                        found.append((path.name, argv[at[0] + n:]))
                        break
    return found


def test_doc_foxlm_commands_parse_and_their_train_settings_exist():
    """Every foxlm command line of the README and docs/ parses with the command line as it is, and every `train`
    line's config (its --config and key=value settings, model.* fields included) resolves."""
    from foxlm.cli import build_parser
    from foxlm.train.config import load_config, printed_config

    commands = _doc_commands()
    assert sum(f != "README.md" for f, _ in commands) >= 6  # docs/context-parallel.md, serving.md, small-scale.md
    for where, argv in commands:
        args = build_parser().parse_args(argv)
        assert args.func is not None, (where, argv)
        if argv[0] == "train":
            printed_config(load_config(args.config, args.overrides))


def test_readme_backend_switch_as_written():
    """The README's backend override, as written, takes effect inside its block (use_backend is a context manager:
    called bare it changes nothing) and ends with it."""
    import foxlm.ops
    from foxlm.ops import backend

    (line,) = re.findall(r"`(with foxlm\.ops\.use_backend\(\"torch\"\):)`", README.read_text())
    namespace = {"foxlm": foxlm}
    with backend.use_backend("auto"):  # whatever the test session set
        exec(line + "\n    inside = foxlm.ops.backend._backend\n", namespace)
        assert namespace["inside"] == "torch" and backend._backend == "auto"

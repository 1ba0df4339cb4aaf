"""foxlm.train.config: keys, YAML 1.2 typing, --print-config, shipped configs, the default out_dir, --help."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from foxlm.models import FoxConfig
from foxlm.presets import FOX_FIELDS, derived_fields
from foxlm.train import latest_valid_checkpoint, load_config, train
from train.runs import subprocess_env, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_config_errors_name_the_key(tmp_path, capsys):
    errors = {"learning_rate=1": "learning_rate: unknown config key",
              "model.hidden=3": "model.hidden: not a FoxConfig field",
              "max_steps=many": "max_steps: expected",
              "packing=ragged": "packing",
              # it listed foxlm's four architectures only, as if the baselines and hf: models did not exist
              "arch=mamba": r"arch: expected one of fox-llama, fox-pro, transformer-llama, transformer-pro, the "
                            r"baselines mamba2, hgrn2, delta-net, gated-delta-net, hf:MODEL_TYPE or a config.json "
                            r"path, got 'mamba'$",
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


def test_a_misspelt_key_names_the_near_one(tmp_path):
    """A typo of a key (on the command line, in a --config file, or of a model field) names the key it is near,
    rather than only the list of every key."""
    errors = {"lrr=1e-3": r"^lrr: unknown config key; did you mean lr\?",
              "warmup_step=5": r"^warmup_step: unknown config key; did you mean warmup_steps\?",
              "model.hiden_size=64": r"^model.hiden_size: not a FoxConfig field; did you mean model.hidden_size\?"}
    for override, message in errors.items():
        with pytest.raises(ValueError, match=message):
            load_config(None, [override])
    (tmp_path / "c.yaml").write_text("max_step: 10\n")
    with pytest.raises(ValueError, match=r"^max_step: unknown config key; did you mean max_steps\?"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ValueError, match=r"^Lr: unknown config key; did you mean lr\?"):  # keys are lower case
        load_config(None, ["Lr=1e-3"])
    # an override's spelling in a file, where model fields nest under model
    (tmp_path / "d.yaml").write_text("model.hidden_size: 64\n")
    with pytest.raises(ValueError, match=r"^model.hidden_size: unknown config key; in a config file model fields nest "
                                         r"under model: \(model: \{hidden_size: 64\}\)$"):
        load_config(tmp_path / "d.yaml")


def test_a_key_twice_in_a_config_file_is_refused(tmp_path):
    """A key set twice in a --config file (or in its model mapping) ran with the last value, silently: PyYAML keeps
    it. Overrides are applied in order, each over what came before (a script's common overrides, then the run's)."""
    (tmp_path / "c.yaml").write_text("lr: 1.0e-3\nmax_steps: 5\nlr: 2.0e-3\n")
    with pytest.raises(ValueError, match=rf"^config: {tmp_path / 'c.yaml'}: lr is given twice \(lines 1 and 3\)"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "m.yaml").write_text("model:\n  window: 64\n  acp: true\n  window: 32\n")
    with pytest.raises(ValueError, match=r"model.window is given twice \(lines 2 and 4\)"):
        load_config(tmp_path / "m.yaml")
    (tmp_path / "ok.yaml").write_text("lr: 1.0e-3\nmodel: {window: 64}\n")
    cfg = load_config(tmp_path / "ok.yaml", ["lr=2e-3", "model.window=32", "lr=3e-3"])
    assert (cfg.lr, cfg.model) == (3e-3, {"window": 32})


def test_values_a_run_would_divide_by_are_refused_up_front():
    """seq_len=1 leaves no target (the step's token-weighted loss divided by 0), peak_tflops=0 divides the MFU: both
    stopped the run with a ZeroDivisionError after its model was built; a negative peak logged a negative MFU."""
    errors = {"seq_len=1": r"seq_len: expected at least 2 tokens .*got 1$",
              "peak_tflops=0": r"peak_tflops: expected a positive, finite number \(or null\), got 0.0$",
              "peak_tflops=-5": r"peak_tflops: expected a positive, finite number \(or null\), got -5.0$",
              "peak_tflops=.inf": r"peak_tflops: expected a positive, finite number \(or null\), got inf$"}
    for override, message in errors.items():
        with pytest.raises(ValueError, match=message):
            load_config(None, [override])
    assert load_config(None, ["seq_len=2", "peak_tflops=989"]).peak_tflops == 989.0


def test_a_batch_the_micro_batches_do_not_divide_is_refused_up_front():
    """batch_size=10 micro_batch_size=4 can run on no number of processes: refused when the config is read (and by
    --print-config), not when the trainer builds its loader, after the data and the model."""
    for overrides in (["batch_size=10", "micro_batch_size=4"], ["batch_size=8", "micro_batch_size=16"]):
        with pytest.raises(ValueError, match=r"^batch_size: \d+ is not a multiple of micro_batch_size \(\d+\)$"):
            load_config(None, overrides)
    assert load_config(None, ["batch_size=12", "micro_batch_size=4"]).micro_batch_size == 4


def test_a_seed_the_generators_refuse_is_refused_up_front(byte_data, tmp_path):
    """numpy's generators (the data order) take no negative seed and torch's (the model's initialization) none of 64
    bits or more: seed=-1 failed the first step with "expected non-negative integer", naming no key, after the run
    had taken out_dir. Both ends of the range train."""
    for seed in (-1, 2**64):
        with pytest.raises((ValueError, RuntimeError)):  # what the run met: the generators refuse it
            np.random.default_rng([seed, 0]) if seed < 0 else torch.manual_seed(seed)
        with pytest.raises(ValueError, match=rf"^seed: expected an integer in \[0, 2\*\*64\), got {seed}$"):
            load_config(None, [f"seed={seed}"])
    for seed in (0, 2**64 - 1):
        run = tmp_path / str(seed)
        summary = train(tiny_config(byte_data, run, f"seed={seed}", "max_steps=1", "eval_every=0"))
        assert summary["step"] == 1 and math.isfinite(summary["loss"])


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
    assert (mamba["hidden_size"], mamba["num_hidden_layers"], mamba["num_heads"]) == (768, 23, 24)


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
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
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


def test_python_m_foxlm_train_help_lists_every_config_key():
    """`python -m foxlm` is the CLI (as `torchrun -m foxlm` runs it); `train --help` lists each key, its default and
    the help its field declares (a help that spans lines, or that follows a section heading, whole)."""
    import dataclasses

    from foxlm.train import TrainConfig

    done = subprocess.run([sys.executable, "-m", "foxlm", "train", "--help"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("config keys (key=value")[1].splitlines()[1:]
    assert [line.split("=")[0].strip() for line in lines] == [f.name for f in dataclasses.fields(TrainConfig)]
    assert "  seq_len=256  (tokens per training sequence)" in lines
    assert "  sample_prompt=null  (printed sample at the end; None: the data's first tokens)" in lines
    assert any(line.startswith("  cuda_graph=false  (replay each micro-batch's forward + backward") for line in lines)
    assert any(line.startswith("  arch=fox-pro  (fox-llama | fox-pro | transformer-llama") for line in lines)
    assert "  resume=auto  (auto (latest valid checkpoint in out_dir, if any) | never | a checkpoint path; out_dir " \
           "may hold no checkpoint this run does not continue from)" in lines
    assert "  beta1=0.9" in lines  # a key without a help


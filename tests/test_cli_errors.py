"""A user's mistake or a damaged file, through the real command line: exit status 2 and one line on stderr, no
traceback (issue 39, item 9)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from foxlm_cli import ctrl_c_reaches_it, foxlm, one_line_error

from foxlm.data import prepare


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny byte-level foxlm model as a save_pretrained folder."""
    from foxlm.data import get_tokenizer
    from foxlm.models import FoxConfig, FoxForCausalLM

    tok = get_tokenizer("byte")
    cfg = FoxConfig.preset("fox-pro", "tiny", vocab_size=320, num_hidden_layers=1, hidden_size=32,
                           num_attention_heads=2, intermediate_size=64, bos_token_id=tok.eot_id,
                           eos_token_id=tok.eot_id)
    cfg.foxlm_tokenizer = tok.spec()
    folder = tmp_path_factory.mktemp("model") / "m"
    FoxForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    for i in range(8):
        (folder / f"{i}.txt").write_text(f"document {i}: a few words of text\n")
    return folder


@pytest.mark.parametrize("text,message", [
    ("lr: [1\n", r"config: .*c.yaml is not valid YAML: expected ',' or '\]'.* \(line 2, column 1\)"),
    ("a: !!python/object/apply:os.system ['touch {marker}']\n", r"config: .*c.yaml is not valid YAML: could not "
                                                                r"determine a constructor for the tag"),
    ("\udcff\n", r"config: .*c.yaml is not a YAML file"),
])
def test_a_malformed_or_unsafe_config_file_is_one_line(tmp_path, text, message):
    import re

    marker = tmp_path / "marker"
    (tmp_path / "c.yaml").write_bytes(text.format(marker=marker).encode("utf-8", "surrogateescape"))
    line = one_line_error(foxlm("train", "--config", tmp_path / "c.yaml", "--print-config"), "train")
    assert re.search(message, line), line
    assert not marker.exists()


@pytest.mark.parametrize("override,message", [
    ("lr=[1", "train: error: lr: expected float, got '[1', which is not valid YAML"),
    ("max_steps=!!python/object/apply:os.system [true]", "max_steps: expected int, got '!!python"),
    ("model.window=!!python/name:os.system", "model.window: '!!python/name:os.system' is not valid YAML"),
    ("model.hidden_size=abc", "model.hidden_size: expected int, got 'abc'"),  # was a TypeError's traceback
    ("model.qk_norm=1", "model.qk_norm: expected bool, got 1"),
])
def test_a_malformed_or_unsafe_override_is_one_line(override, message):
    assert message in one_line_error(foxlm("train", "--print-config", override), "train")


def _bad_tokenizers(root):
    (root / "invalid-json").mkdir()
    (root / "invalid-json" / "tokenizer.json").write_text("{not json")
    (root / "binary").mkdir()
    (root / "binary" / "tokenizer.json").write_bytes(bytes(range(256)) * 8)
    (root / "broken-bpe").mkdir()
    (root / "broken-bpe" / "encoder.json").write_text('{"a": 0, "b": 1}')
    (root / "broken-bpe" / "vocab.bpe").write_text("#version: 0.2\nzz qq\n")
    return {"invalid-json": "tokenizer.json", "binary": "tokenizer.json", "broken-bpe": "encoder.json + vocab.bpe"}


def test_a_bad_tokenizer_folder_is_one_line(tmp_path, text_folder):
    for name, files in _bad_tokenizers(tmp_path).items():
        run = foxlm("data", "prepare", text_folder, "--out", tmp_path / f"out-{name}", "--tokenizer", tmp_path / name)
        line = one_line_error(run, "data prepare")
        assert f"tokenizer: {tmp_path / name}/{files} is not a valid tokenizer" in line, line
        assert not (tmp_path / f"out-{name}").exists()


@pytest.mark.parametrize("pattern", ["/etc/*", "../*", "sub/../../*"])
def test_a_glob_outside_the_input_folders_is_one_line(tmp_path, text_folder, pattern):
    """--glob selects files inside the input folders; a pattern that could only match outside them is refused (to
    read other files, name them as inputs), where it was a NotImplementedError traceback or silently matched none."""
    line = one_line_error(foxlm("data", "prepare", text_folder, "--out", tmp_path / "o", "--tokenizer", "byte",
                                "--glob", pattern), "data prepare")
    assert "pattern (--glob): expected a pattern inside the input folders" in line and repr(pattern) in line


def test_overwriting_a_dataset_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path, text_folder):
    """--out LINK --overwrite, LINK a symlink to a dataset: was an rmtree traceback that left `.LINK.old-PID` behind
    (a link) and LINK a real folder; now the dataset where the link points is replaced, and the link stays."""
    common = ("--tokenizer", "byte", "--val-fraction", "0", "--workers", "0")
    assert foxlm("data", "prepare", text_folder, "--out", tmp_path / "real", *common).returncode == 0
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (text_folder / "extra.txt").write_text("one more document\n")
    try:
        run = foxlm("data", "prepare", text_folder, "--out", tmp_path / "link", "--overwrite", *common)
    finally:
        (text_folder / "extra.txt").unlink()
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link").resolve() == tmp_path / "real"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    assert '"num_docs": 9' in (tmp_path / "real" / "meta.json").read_text()


def _damage(folder, how: str):
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if how == "header":  # a header length far past the file
        data[:8] = (10**15).to_bytes(8, "little")
    else:
        del data[len(data) // 2:]
    weights.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def byte_dataset(tmp_path_factory, text_folder):
    out = tmp_path_factory.mktemp("ds") / "ds"
    prepare([text_folder], out, tokenizer="byte", val_fraction=0.25, workers=0, progress=False)
    return out


@pytest.mark.parametrize("how", ["header", "truncated"])
def test_a_damaged_safetensors_is_one_line_in_every_command(tmp_path, model_folder, byte_dataset, how):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(model_folder, bad)
    _damage(bad, how)
    runs = {
        "generate": foxlm("generate", bad, "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"),
        "convert": foxlm("convert", bad, tmp_path / "converted"),
        "eval loss": foxlm("eval", "loss", bad, "--data", byte_dataset, "--out", tmp_path / "loss", "--device",
                           "cpu", "--no-progress", "--train-length", "4"),
        "train": foxlm("train", f"init_from={bad}", f"data={byte_dataset}", f"out_dir={tmp_path / 'run'}",
                       "tokenizer=byte", "size=tiny", "model.num_hidden_layers=1", "model.hidden_size=32",
                       "model.num_attention_heads=2", "model.intermediate_size=64", "device=cpu", "seq_len=4",
                       "batch_size=1", "max_steps=1", "progress=false", "sample_tokens=0"),
    }
    names = {"generate": "MODEL", "convert": "src", "eval loss": "CHECKPOINT", "train": "init_from"}  # the argument
    for command, run in runs.items():
        line = one_line_error(run, command)
        assert f"{names[command]}: {bad}" in line and "is damaged or not a weights file" in line, (command, line)


def test_a_pickle_that_weights_only_refuses_is_one_line_and_runs_nothing(tmp_path, model_folder):
    """convert reads pytorch_model.bin with torch.load(weights_only=True): a pickle that would run a command is
    refused (nothing runs) with one line, as is a file that is no pickle or a damaged zip."""
    import shutil

    marker = tmp_path / "marker"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    cases = {"code": lambda p: torch.save({"w": RunsCode()}, p),
             "garbage": lambda p: p.write_bytes(b"garbage" * 100),
             "truncated-zip": lambda p: (torch.save({"w": torch.zeros(1000)}, p),
                                         p.write_bytes(p.read_bytes()[:2000]))}
    for name, write in cases.items():
        src = tmp_path / name
        src.mkdir()
        shutil.copy(model_folder / "config.json", src)
        write(src / "pytorch_model.bin")
        line = one_line_error(foxlm("convert", src, tmp_path / f"out-{name}"), "convert")
        assert f"src: {src / 'pytorch_model.bin'}" in line, line
        assert ("was refused" if name != "truncated-zip" else "is damaged") in line, line
    assert "posix.system" in one_line_error(foxlm("convert", tmp_path / "code", tmp_path / "o"), "convert")
    assert not marker.exists()


def test_ctrl_c_while_the_command_line_starts_is_one_line():
    """Ctrl-C while the parser is built (it imports every command's module: about half a second) exits 130 with one
    line, as Ctrl-C during a command does, not with a KeyboardInterrupt traceback."""
    code = ("import sys; import foxlm.cli; sys.stderr.write('ready\\n'); sys.stderr.flush(); "
            "sys.exit(foxlm.cli.main(['train', '--print-config']))")
    env = {k: v for k, v in os.environ.items() if k != "FOXLM_DEBUG"}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, preexec_fn=ctrl_c_reaches_it)
    assert child.stderr.readline() == "ready\n"
    time.sleep(0.05)  # into main(): the parser takes ten times that to build
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130 and err.strip() == "foxlm: interrupted", (child.returncode, err)


@pytest.mark.parametrize("args,command", [
    (("convert", "src", "dst", "--bogus"), "convert"),
    (("eval", "loss", "ckpt", "--out", "o", "--bogus", "1"), "eval loss"),
    (("data", "prepare", "in", "--out", "o", "--bogus"), "data prepare"),
])
def test_an_unknown_option_is_named_by_its_command(args, command):
    """An unknown option is reported by the (sub)command it was given to, with that command's usage; argparse's own
    message came from the top level (`foxlm: error:`, `usage: foxlm [-h] [--debug] COMMAND ...`)."""
    run = foxlm(*args)
    line = one_line_error(run, command)
    assert line.endswith(f"unrecognized arguments: {' '.join(args[args.index('--bogus'):])}"), line
    assert f"usage: foxlm {command} " in run.stderr, run.stderr


@pytest.mark.parametrize("kind,reason", [("folder", "Is a directory"), ("missing", "No such file or directory"),
                                         ("latin-1", "can't decode byte 0xe9")])
def test_an_unreadable_prompt_file_is_one_line_naming_the_flag(tmp_path, model_folder, capsys, kind, reason):
    """`generate --prompt-file` on a folder, a missing file or a file that is not UTF-8: one line naming the flag and
    the file (it was the bare OSError or UnicodeDecodeError, naming neither the flag nor, for the codec, the file)."""
    from foxlm.cli import main

    path = tmp_path / kind
    if kind == "folder":
        path.mkdir()
    elif kind == "latin-1":
        path.write_bytes("café".encode("latin-1"))
    assert main(["generate", str(model_folder), "--prompt-file", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"foxlm generate: error: --prompt-file: cannot read {path} as UTF-8 text (") and \
        reason in err and err.count("\n") == 1, err

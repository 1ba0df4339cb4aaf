"""No file foxlm reads runs code, and no damaged model is used: a sharded (DCP) checkpoint whose ``.metadata`` or
bytes entries hold a pickle that would run a shell command is refused before anything runs, even with its manifest
recomputed to match; an exported or converted model folder records sha256 hashes that every foxlm command checks.

The checkpoint is a real one: ``torchrun --nproc-per-node 2 -m foxlm train parallel=fsdp`` on gloo (CPU).
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foxlm.checkpoint.files import sha256_file
from foxlm.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

# model.qk_norm_eps as the authors' classes have it, so that `foxlm convert --to fox-authors` takes the model
TINY = ["device=cpu", "model.hidden_size=64", "model.num_hidden_layers=1", "model.num_attention_heads=2",
        "model.intermediate_size=128", "model.qk_norm_eps=1.0e-5", "tokenizer=byte", "seq_len=32", "batch_size=2",
        "micro_batch_size=1",
        "warmup_steps=1", "eval_every=0", "log_every=1", "progress=false", "tensorboard=false", "sample_tokens=0"]


class RunsCode:
    """Unpickles as ``os.system(command)``: what a crafted checkpoint file would hold."""

    def __init__(self, marker: Path):
        self.command = f"touch {shlex.quote(str(marker))}"

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture(scope="module")
def sharded(byte_data, tmp_path_factory) -> Path:
    """A run of 2 processes (FSDP2) of 3 steps, with a sharded checkpoint at step 2."""
    run = tmp_path_factory.mktemp("fsdp") / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "foxlm", "train", *TINY, f"data={byte_data}", "parallel=fsdp", "max_steps=3",
                           "save_every=2", "resume=never", f"out_dir={run}"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def _copy_checkpoint(run: Path, dst: Path) -> Path:
    ckpt = dst / "step_0000002"
    shutil.copytree(run / "checkpoints" / "step_0000002", ckpt)
    return ckpt


def _rehash(ckpt: Path) -> None:
    """Recompute manifest.json as its writer would: the sha256 of every file."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = {name: sha256_file(ckpt / name) for name in manifest["files"]}
    (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _read_metadata(ckpt: Path):
    with open(ckpt / "dcp" / ".metadata", "rb") as f:
        return pickle.load(f)  # this test's own checkpoint, written by torch


def _write_metadata(ckpt: Path, metadata) -> None:
    with open(ckpt / "dcp" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _refused(rc: int, err: str, command: str) -> str:
    """The one-line error of a refused command."""
    lines = [line for line in err.splitlines() if line.strip() and "warn" not in line.lower()]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, (rc, err)
    assert lines[0].startswith(f"foxlm {command}: error: "), err
    return lines[0]


def test_a_sharded_checkpoint_that_would_run_code_is_refused(sharded, byte_data, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    # the metadata: a payload beside DCP's own classes, so the checkpoint would otherwise load as usual
    meta_attack = _copy_checkpoint(sharded, tmp_path / "meta")
    metadata = _read_metadata(meta_attack)
    metadata.storage_meta.modules = [RunsCode(marker)]
    _write_metadata(meta_attack, metadata)
    _rehash(meta_attack)
    # a bytes entry (an optimizer hyperparameter, torch.save'd into a shard): appended, and the metadata points at it
    bytes_attack = _copy_checkpoint(sharded, tmp_path / "bytes")
    metadata = _read_metadata(bytes_attack)
    index = next(i for i in metadata.storage_data if i.fqn == "optimizer.param_groups.0.lr")
    info = metadata.storage_data[index]
    shard = bytes_attack / "dcp" / info.relative_path
    with open(shard, "ab") as f:
        offset = f.tell()
        torch.save(RunsCode(marker), f)
        info.offset, info.length = offset, f.tell() - offset
    _write_metadata(bytes_attack, metadata)
    _rehash(bytes_attack)

    resume = [*TINY, f"data={byte_data}", "max_steps=3", "save_every=0"]
    attempts = [("export", ["export", str(meta_attack), str(tmp_path / "exported")], ".metadata"),
                ("train", ["train", *resume, f"out_dir={tmp_path / 'r1'}", f"resume={meta_attack}"], ".metadata"),
                ("train", ["train", *resume, f"out_dir={tmp_path / 'r2'}", f"resume={bytes_attack}"],
                 "optimizer.param_groups.0.lr")]
    for command, args, what in attempts:
        capsys.readouterr()
        line = _refused(main(args), capsys.readouterr().err, command)
        assert what in line and "posix.system" in line, line
        assert not marker.exists(), f"{args}: the checkpoint ran code"
    assert not (tmp_path / "exported").exists()

    # the real checkpoint still exports, and resumes exactly (in one process: its shards resharded)
    assert main(["export", str(sharded), str(tmp_path / "good")]) == 0
    assert main(["train", *resume, f"out_dir={tmp_path / 'r3'}",
                 f"resume={sharded / 'checkpoints' / 'step_0000002'}"]) == 0
    resumed, original = _losses(tmp_path / "r3"), _losses(sharded)[2:]
    assert [step for step, _ in resumed] == [step for step, _ in original]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in original], rel=1e-5, abs=1e-6)


def _losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def _flip_byte(path: Path, at: int = -100) -> None:
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))


def test_exported_and_converted_models_are_verified_on_load(sharded, byte_data, tmp_path, capsys):
    exported = tmp_path / "exported"
    assert main(["export", str(sharded), str(exported)]) == 0
    manifest = json.loads((exported / "manifest.json").read_text())["files"]
    assert manifest["model.safetensors"] == sha256_file(exported / "model.safetensors")
    assert sorted(manifest) == sorted(p.name for p in exported.iterdir() if p.name != "manifest.json")
    capsys.readouterr()
    line = _refused(main(["export", str(exported), str(tmp_path / "twice")]), capsys.readouterr().err, "export")
    assert "is a save_pretrained folder already" in line, line
    converted = tmp_path / "authors"
    assert main(["convert", str(exported), str(converted), "--to", "fox-authors"]) == 0
    manifest = json.loads((converted / "manifest.json").read_text())["files"]
    assert manifest["model.safetensors"] == sha256_file(converted / "model.safetensors")
    # a folder without a manifest (a model from the hub) loads unchecked; one with it, checked
    hub = tmp_path / "hub"
    shutil.copytree(exported, hub)
    (hub / "manifest.json").unlink()
    for model in (exported, hub):
        assert main(["generate", str(model), "--prompt", "To be", "--max-new-tokens", "2", "--device", "cpu"]) == 0

    _flip_byte(exported / "model.safetensors")
    _flip_byte(hub / "model.safetensors")  # nothing to check it against: it loads
    assert main(["generate", str(hub), "--prompt", "To be", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    attempts = [("generate", ["generate", str(exported), "--prompt", "To be", "--device", "cpu"]),
                ("eval loss", ["eval", "loss", str(exported), "--data", str(byte_data), "--out",
                               str(tmp_path / "eval"), "--train-length", "32", "--device", "cpu", "--no-progress"]),
                ("convert", ["convert", str(exported), str(tmp_path / "again"), "--to", "fox-authors"]),
                ("train", ["train", *TINY, f"data={byte_data}", "max_steps=1", f"out_dir={tmp_path / 'tuned'}",
                           f"init_from={exported}"])]
    for command, args in attempts:
        capsys.readouterr()
        line = _refused(main(args), capsys.readouterr().err, command)
        assert f"{exported}" in line and "model.safetensors does not match its sha256" in line, line
    _flip_byte(converted / "config.json", at=-3)
    capsys.readouterr()
    line = _refused(main(["convert", str(converted), str(tmp_path / "back")]), capsys.readouterr().err, "convert")
    assert "config.json does not match its sha256" in line, line


def test_a_trainer_state_that_would_run_code_is_refused_in_one_line(byte_data, tmp_path, capsys):
    """A one-process checkpoint whose trainer.pt holds a pickle that would run a shell command (its manifest
    recomputed to match), or a truncated one: refused by a one-line error naming resume and the file, nothing run
    (these were torch's traceback, advising to load it again with weights_only=False)."""
    run, marker = tmp_path / "run", tmp_path / "code-ran"
    common = ["train", *TINY, f"data={byte_data}", "save_every=2"]
    assert main([*common, "max_steps=2", f"out_dir={run}"]) == 0
    ckpt = run / "checkpoints" / "step_0000002"
    good = (ckpt / "trainer.pt").read_bytes()
    for name, write in [("code", lambda f: torch.save({"step": RunsCode(marker)}, f)),
                        ("truncated", lambda f: f.write_bytes(good[: len(good) // 2]))]:
        write(ckpt / "trainer.pt")
        _rehash(ckpt)
        capsys.readouterr()
        line = _refused(main([*common, "max_steps=3", f"out_dir={tmp_path / name}", f"resume={ckpt}"]),
                        capsys.readouterr().err, "train")
        assert f"resume: {ckpt / 'trainer.pt'}" in line and not marker.exists(), line


def test_a_model_folder_with_pickled_weights_is_refused_by_name(byte_data, tmp_path, capsys):
    """A save_pretrained folder whose weights are pytorch_model.bin (here a pickle that would run a command): never
    unpickled, and the error says that foxlm reads safetensors only (it said the folder was no save_pretrained
    folder)."""
    from foxlm.models import FoxConfig, FoxForCausalLM

    folder, marker = tmp_path / "bin", tmp_path / "code-ran"
    FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", vocab_size=256, num_hidden_layers=1)).save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save({"lm_head.weight": RunsCode(marker)}, folder / "pytorch_model.bin")
    for command, args in [("generate", ["generate", str(folder), "--prompt", "Hi", "--device", "cpu"]),
                          ("train", ["train", *TINY, f"data={byte_data}", "max_steps=1", f"out_dir={tmp_path / 'r'}",
                                     f"init_from={folder}"])]:
        capsys.readouterr()
        line = _refused(main(args), capsys.readouterr().err, command)
        assert f"{folder} holds no model.safetensors (or its shards); foxlm reads weights from safetensors only" in line
        assert not marker.exists()

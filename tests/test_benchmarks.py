"""The benchmark scripts as a user reruns them: their results files (device, date, settings; a file the docs cite is
never overwritten unasked), a GPU benchmark on a machine without one, and bad flags. Their timings mean nothing here.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


def load(name: str, monkeypatch: pytest.MonkeyPatch):
    """benchmarks/NAME.py (or NAME.py, e.g. recipes/mqar) as a module, benchmarks/ first on sys.path as when a
    benchmark runs as a script."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("PYTHONPATH", str(BENCHMARKS.parent))  # children of the scripts import this checkout's foxlm
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = BENCHMARKS / f"{name}.py" if (BENCHMARKS / f"{name}.py").exists() else BENCHMARKS.parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{Path(name).name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def error_line(capsys: pytest.CaptureFixture, exc: pytest.ExceptionInfo) -> str:
    """The one error line a script exited with (argparse prints its usage above it)."""
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_results_path_keeps_an_existing_file(monkeypatch, tmp_path, capsys):
    results = load("_results", monkeypatch)
    path = tmp_path / "new" / "train-2026-12-05.json"
    assert results.results_path(path) == path and path.parent.is_dir()
    path.write_text("cited")
    assert results.results_path(path) == path.with_name("train-2026-12-05-2.json")
    assert "exists" in capsys.readouterr().out
    path.with_name("train-2026-12-05-2.json").write_text("also cited")
    assert results.results_path(path) == path.with_name("train-2026-12-05-3.json")
    assert results.results_path(path, overwrite=True) == path


def test_attention_cpu_rerun_writes_a_new_file_with_device_date_and_settings(monkeypatch, tmp_path):
    """A rerun on the day of a cited file (and into a folder not made yet) leaves it as it was."""
    attention = load("attention", monkeypatch)
    out = tmp_path / "results"
    out.mkdir()
    cited = out / f"attention-cpu-{datetime.date.today().isoformat()}.json"
    cited.write_text("cited")
    attention.main(["--device", "cpu", "--seqlens", "16", "--rounds", "1", "--out", str(out)])
    assert cited.read_text() == "cited"
    record = json.loads(cited.with_name(cited.stem + "-2.json").read_text())
    assert record["env"]["device"].startswith("cpu") and record["env"]["date"] == cited.stem[-10:]
    assert record["env"]["settings"]["seqlens"] == [16] and record["env"]["settings"]["rounds"] == 1
    assert [r["T"] for r in record["rows"]] == [16]
    attention.main(["--device", "cpu", "--seqlens", "16", "--rounds", "1", "--out", str(tmp_path / "made")])
    assert len(list((tmp_path / "made").glob("attention-cpu-*.json"))) == 1


@no_gpu
@pytest.mark.parametrize("name, argv", [("attention", []), ("train", ["--steps", "1"]),
                                        ("gate_gradient", ["--seqlens", "16"]), ("decode", ["--contexts", "64"]),
                                        ("gluon_dq", ["check"])])
def test_gpu_benchmarks_refuse_at_once_without_a_gpu(monkeypatch, tmp_path, capsys, name, argv):
    script = load(name, monkeypatch)
    with pytest.raises(SystemExit) as exc:
        script.main([*argv, "--out", str(tmp_path)])
    assert "needs a CUDA GPU" in error_line(capsys, exc)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, argv, flag", [
    ("attention", ["--device", "cpu", "--seqlens", "-4"], "--seqlens"),
    ("attention", ["--device", "cpu", "--rounds", "0"], "--rounds"),
    ("train", ["--device", "cpu", "--steps", "-1"], "--steps"),
    ("train", ["--device", "cpu", "--models", "fox-pr"], "--models"),
    ("train", ["--device", "cpu", "--models", "fox-pro+acq"], "--models"),
    ("gate_gradient", ["--device", "cpu", "--heads", "0"], "--heads"),
    ("gate_gradient", ["--device", "cpu", "--dtypes", "bfloat17"], "--dtypes"),
    ("decode", ["--contexts", "4096,-1"], "--contexts"),
    ("decode", ["--batches", "x"], "--batches"),
    ("gluon_dq", ["bench", "--tiles", "64,64,3"], "--tiles"),
    ("trained_gates", ["--out", "unused", "--steps", "0"], "--steps"),
    ("trained_gates", ["--out", "unused", "--tail", "0"], "--tail"),
    ("decode_cpu", ["--new-tokens", "0"], "--new-tokens"),
    ("decode_cpu", ["no-such-model"], "model"),
    ("mqar_learning", ["--out", "unused", "--vocab", "0-48"], "--vocab"),
    ("mqar_learning", ["--out", "unused", "--pairs", "2;4"], "--pairs"),
    ("mqar_learning", ["--out", "unused", "--steps", "0"], "--steps"),
    # the task itself, refused before training (write_dataset's traceback named "vocab", "pairs", "length")
    ("mqar_learning", ["--out", "unused", "--vocab", "0:300"], "--vocab: 0:300 goes past byte's 257 ids"),
    ("mqar_learning", ["--out", "unused", "--pairs", "2,17"], "--pairs: expected 1 to 16"),
    ("mqar_learning", ["--out", "unused", "--length", "12"], "--length: 12 tokens cannot hold 4 pairs"),
])
def test_bad_flags_are_one_line_naming_the_flag(monkeypatch, capsys, name, argv, flag):
    script = load(name, monkeypatch)
    with pytest.raises(SystemExit) as exc:
        script.main(argv)
    assert flag in error_line(capsys, exc)


@pytest.mark.parametrize("name", ["attention", "decode", "gate_gradient", "train", "trained_gates",
                                  "decode_cpu", "mqar_learning", "padding_channels", "kernel_resources", "gluon_dq",
                                  "recipes/mqar", "recipes/debian_corpus"])
def test_every_flag_is_documented(monkeypatch, name):
    """--help says what each flag does: the script's own parser, taken as it parses."""
    parsers = []

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise SystemExit(0)

    script = load(name, monkeypatch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        script.main([])
    undocumented = [a.option_strings or a.dest for a in parsers[0]._actions if not a.help]
    assert not undocumented


def test_mqar_learning_evaluates_a_document_length_that_is_a_multiple_once(monkeypatch, capsys, tmp_path):
    """Documents of 2x the training length: the evaluated lengths are 64 and 128, not 64, 64, 128 (which eval recall
    refuses, after the whole training run)."""
    script = load("mqar_learning", monkeypatch)
    out = tmp_path / "b"
    assert script.main(["--out", str(out), "--length", "64", "--seq-len", "32", "--steps", "1", "--every", "1",
                        "--batch-size", "2", "--hidden", "64", "--layers", "1", "--samples", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [sorted(row["accuracy"]) for row in summary["checkpoints"]] == [["128/2", "128/4", "64/2", "64/4"]]


def test_mqar_learning_refuses_a_folder_with_an_earlier_run(monkeypatch, capsys, tmp_path):
    """A rerun into the same --out would resume the finished run and replace its summary with a training time of
    nothing: refused before anything is written."""
    script = load("mqar_learning", monkeypatch)
    for earlier in ("run", "summary.json"):
        out = tmp_path / earlier
        (out / earlier).mkdir(parents=True)
        with pytest.raises(SystemExit) as exc:
            script.main(["--out", str(out)])
        assert "--out" in error_line(capsys, exc) and sorted(p.name for p in out.iterdir()) == [earlier]

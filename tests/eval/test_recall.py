"""Multi-query associative recall: the generator (foxlm/data/mqar.py, recipes/mqar.py) and `foxlm eval recall`.

Whether a tiny FoX learns the task with `foxlm train` takes longer than a unit test on a CPU: that is measured by
benchmarks/mqar_learning.py. Here the eval runs end to end on a random model (near chance) and, for its scoring, on a
real model whose weights make it a fixed lookup table: its accuracy is known exactly from the documents.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from foxlm.cli import main
from foxlm.data import TokenDataset, get_tokenizer, prepare
from foxlm.data.mqar import MQARSpec, documents, recorded_task, sample, write_dataset
from foxlm.eval import recall
from foxlm.models import FoxConfig, FoxForCausalLM

BYTE = get_tokenizer("byte")


def _check_document(spec: MQARSpec, body: np.ndarray, answers: np.ndarray, length: int, pairs: int) -> None:
    doc = np.concatenate([[BYTE.eot_id], body])
    assert len(doc) == length and len(answers) == pairs
    kv = doc[1:1 + 2 * pairs].reshape(pairs, 2)
    keys, values = kv[:, 0], kv[:, 1]
    assert len(set(keys.tolist())) == pairs and len(set(values.tolist())) == pairs
    assert ((spec.keys[0] <= keys) & (keys < spec.keys[1])).all()
    assert ((spec.values[0] <= values) & (values < spec.values[1])).all()
    filler = doc[1 + 2 * pairs:length - 2 * pairs]
    assert ((spec.filler[0] <= filler) & (filler < spec.filler[1])).all()
    assert len(filler) == length - 1 - 4 * pairs
    truth = dict(zip(keys.tolist(), values.tolist()))
    # every answer is the value of the key just before it, each key queried once, and the queries end the document
    assert sorted(doc[answers - 1].tolist()) == sorted(keys.tolist())
    assert [truth[k] for k in doc[answers - 1].tolist()] == doc[answers].tolist()
    assert answers[-1] == length - 1 and (np.diff(answers) == 2).all()
    for k in keys.tolist():  # a key appears exactly twice: in its pair and in its query
        assert (doc == k).sum() == 2


def test_documents_hold_their_answers_within_the_ranges():
    rng = np.random.default_rng()
    for _ in range(50):
        lo = int(rng.integers(0, 100))
        spec = MQARSpec((lo, lo + int(rng.integers(12, 150))))
        pairs = int(rng.integers(1, spec.third + 1))
        length = 1 + 4 * pairs + int(rng.integers(0, 40))
        body, answers = sample(spec, length, pairs, rng)
        _check_document(spec, body, answers, length, pairs)


def test_generator_is_deterministic_given_the_seed(tmp_path):
    spec = MQARSpec((0, 96))
    take = lambda seed: [next(it) for it in [documents(spec, (20, 60), [2, 5], seed)] for _ in range(30)]  # noqa
    a, b, c = take(7), take(7), take(8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a, c))
    assert {len(x) + 1 for x in a} <= set(range(20, 61)) and len({len(x) for x in a}) > 1
    metas = [write_dataset(tmp_path / name, spec, lengths=(20, 60), pairs=[2, 5], seed=7, tokens=3000,
                           tokenizer="byte") for name in ("a", "b")]
    digests = [[s["sha256"] for split in ("train", "val") for s in m["splits"][split]["shards"]] for m in metas]
    assert digests[0] == digests[1]


def test_dataset_alone_trains_as_a_foxlm_dataset(tmp_path):
    spec = MQARSpec((0, 192))
    meta = write_dataset(tmp_path / "mq", spec, lengths=(30, 50), pairs=[3, 6], seed=1, tokens=5000,
                         val_fraction=0.1, tokenizer="byte")
    for split, least in (("train", 5000), ("val", 500)):
        ds = TokenDataset(tmp_path / "mq", split)
        ds.verify()
        docs = list(ds.documents())
        assert sum(map(len, docs)) == len(ds.tokens) >= least
        assert meta["synthetic"]["written"][split]["tokens"] == len(ds.tokens)
        assert all(d[0] == BYTE.eot_id and BYTE.eot_id not in d[1:] and 30 <= len(d) <= 50 for d in docs)
        assert all(d[1:].max() < 192 for d in docs)
    train, val = (TokenDataset(tmp_path / "mq", s).document(0) for s in ("train", "val"))
    assert not np.array_equal(train[:len(val)], val[:len(train)])  # separate streams
    task = recorded_task(tmp_path / "mq")
    assert task["vocab"] == [0, 192] and task["pairs"] == [3, 6] and task["seed"] == 1
    assert recorded_task(tmp_path) is None


def test_mixed_dataset_keeps_every_document_and_the_share(tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    rng = np.random.default_rng(0)
    for i in range(40):
        (text / f"{i:02d}.txt").write_text(" ".join(rng.choice(["gate", "forget", "keys"], size=rng.integers(50, 400))))
    base = tmp_path / "base"
    prepare([text], base, tokenizer="byte", val_fraction=0.25, workers=0, progress=False)
    spec = MQARSpec((0, 192))
    meta = write_dataset(tmp_path / "mixed", spec, lengths=(30, 50), pairs=[4], seed=3, mix=base, mix_fraction=0.2)
    assert meta["tokenizer"] == TokenDataset(base).meta["tokenizer"] and meta["synthetic"]["mixed_with"]["fraction"]
    for split in ("train", "val"):
        original = [d.tolist() for d in TokenDataset(base, split).documents()]
        out = [d.tolist() for d in TokenDataset(tmp_path / "mixed", split).documents()]
        kept = [d for d in out if d in original]
        assert kept == original  # every document, in order
        synthetic = [d for d in out if d not in original]
        share = sum(map(len, synthetic)) / sum(map(len, out))
        assert abs(share - 0.2) < 50 / sum(map(len, out)) + 1e-9  # within one document of the share
        # spread through the split, not in one block: about the share in each half of its tokens
        half = sum(map(len, out)) / 2
        ends = np.cumsum([len(d) for d in out])
        first = sum(len(d) for d, end in zip(out, ends) if d not in original and end <= half)
        assert 0.1 < first / half < 0.3, first / half


def test_bad_ranges_and_sizes_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="vocab: 200:300 goes past byte's 257 ids"):
        MQARSpec((200, 300)).check(BYTE)
    with pytest.raises(ValueError, match="end-of-text id 256"):
        MQARSpec((250, 257)).check(BYTE)
    with pytest.raises(ValueError, match="vocab: expected a range"):
        MQARSpec((5, 5))
    with pytest.raises(ValueError, match="pairs: expected 1 to 4"):
        sample(MQARSpec((0, 12)), 40, 5, np.random.default_rng())
    with pytest.raises(ValueError, match="length: 16 tokens cannot hold 4 pairs"):
        sample(MQARSpec((0, 12)), 16, 4, np.random.default_rng())
    with pytest.raises(ValueError, match="tokens, mix: expected exactly one"):
        write_dataset(tmp_path / "x", MQARSpec((0, 12)), lengths=(20, 20), pairs=[2])
    with pytest.raises(ValueError, match="mix_fraction"):
        write_dataset(tmp_path / "x", MQARSpec((0, 12)), lengths=(20, 20), pairs=[2], mix=tmp_path, mix_fraction=1.0)


def test_bad_task_is_refused_by_name_before_the_output_or_the_mix_is_touched(tmp_path):
    """A seed numpy refuses, or lengths and pairs no document can hold, are one error naming the argument, raised
    when the documents are asked for (not at the first one drawn) and before ``out_dir`` is looked at: an existing
    dataset there is left as it was and its "already holds" is not what the user reads."""
    spec = MQARSpec((0, 48))
    with pytest.raises(ValueError, match="length: expected 2 <= MIN <= MAX"):
        documents(spec, (1, 1), [2], 0)
    with pytest.raises(ValueError, match="pairs: expected at least one"):
        documents(spec, (20, 20), [], 0)
    with pytest.raises(ValueError, match="seed: expected a non-negative integer, got -1"):
        documents(spec, (20, 20), [2], -1)
    write_dataset(tmp_path / "d", spec, lengths=(16, 24), pairs=[2], tokens=500, tokenizer="byte")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "d").iterdir())
    for kwargs, error, message in [({"seed": -1}, ValueError, "seed: expected a non-negative integer, got -1"),
                                   ({"pairs": [2, 17]}, ValueError, "pairs: expected 1 to 16"),
                                   ({"lengths": (8, 8)}, ValueError, "length: 8 tokens cannot hold 2 pairs"),
                                   ({"mix": tmp_path / "nope", "mix_fraction": 0.1, "tokens": None},
                                    FileNotFoundError, "mix: .*nope is not a prepared dataset")]:
        args = {"lengths": (16, 24), "pairs": [2], "tokens": 500, "tokenizer": "byte"} | kwargs
        with pytest.raises(error, match=message):
            write_dataset(tmp_path / "d", spec, **args)
        with pytest.raises(error, match=message):
            write_dataset(tmp_path / "new", spec, **args)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "d").iterdir()) == before
    assert not (tmp_path / "new").exists()


def test_recipe_writes_a_dataset_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("mqar_recipe", Path(__file__).parents[2] / "recipes/mqar.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert recipe.main(["--out", str(tmp_path / "d"), "--tokens", "2000", "--tokenizer", "byte", "--vocab", "0:48",
                        "--pairs", "2,3", "--length", "16:32"]) == 0
    assert recorded_task(tmp_path / "d")["lengths"] == [16, 32]
    assert recipe.main(["--out", str(tmp_path / "e"), "--tokens", "2000", "--tokenizer", "byte", "--vocab",
                        "0:300"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mqar.py: error: vocab: 0:300 goes past" in err


# ---------------------------------------------------------------- foxlm eval recall


def _model(tmp_path: Path, name: str, seed: int = 0) -> FoxForCausalLM:
    torch.manual_seed(seed)
    model = FoxForCausalLM(FoxConfig.preset("fox-llama", "tiny", vocab_size=320, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=128, bos_token_id=256,
                                            eos_token_id=256, pad_token_id=256))
    model.config.foxlm_tokenizer = BYTE.spec()  # as `foxlm train` records it
    return model


def test_recall_eval_runs_end_to_end_at_chance_on_a_random_model(tmp_path, capsys):
    model = _model(tmp_path, "random", seed=1)
    model.save_pretrained(tmp_path / "random")
    out = tmp_path / "out"
    argv = ["eval", "recall", str(tmp_path / "random"), "--vocab", "0:192", "--pairs", "2,8", "--lengths", "40,80",
            "--samples", "24", "--batch-size", "8", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| pairs | 40 | 80 |" in printed and "wrote" in printed
    result = json.loads((out / "recall.json").read_text())
    cells = result["cells"]
    assert [(c["context_length"], c["pairs"]) for c in cells] == [(40, 2), (40, 8), (80, 2), (80, 8)]
    assert result["task"]["values"] == [64, 128]
    # a model that knows nothing of the documents' values: P(right) = 1/64 a query, whatever it predicts
    n = sum(c["queries"] for c in cells)
    correct = sum(c["correct"] for c in cells)
    assert n == 24 * (2 + 8) * 2 and all(c["chance_values"] == 1 / 64 for c in cells)
    assert correct <= n / 64 + 4 * math.sqrt(n / 64) + 1, (correct, n)
    assert (out / "recall.csv").read_text().count("\n") == 5 and (out / "recall.md").is_file()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "recall.png").stat().st_size > 10_000


def _lookup_model(tmp_path: Path, table: dict[int, int]) -> FoxForCausalLM:
    """A real FoX whose blocks add nothing (zero output projections) and whose embedding and head make it predict
    ``table[x]`` after token ``x``: a model whose every prediction is known."""
    model = _model(tmp_path, "lookup")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        model.model.norm.weight.fill_(1.0)
        for i, x in enumerate(sorted(table)):
            emb[x, i] = 1.0
            head[table[x], i] = 10.0
    return model


def test_recall_scores_exactly_what_the_model_predicts(tmp_path):
    """A lookup model predicts a fixed value per key: right exactly where a document paired the key with it."""
    spec = MQARSpec((0, 12))  # keys 0-3, values 4-7, filler 8-11
    rng = np.random.default_rng(5)
    table = {k: int(rng.integers(4, 8)) for k in range(4)} | {x: 0 for x in range(4, 12)} | {256: 0}
    model = _lookup_model(tmp_path, table).eval()
    cells = recall.run_recall(model, spec, [20, 33], [2, 3], bos_id=256, vocab_size=257, samples=40, seed=9,
                              batch_size=16, show_progress=False)
    for c in cells:
        seqs, _ = recall.cell_sequences(spec, c.context_length, c.pairs, 40, 9, 256)
        # the answers found in each document, not taken from foxlm: the tokens after a key's second occurrence
        found = [[i for i in range(2, len(s)) if s[i - 1] < 4 and s[i - 1] in s[1:i - 1]] for s in seqs]
        assert all(len(f) == c.pairs for f in found)
        expected = sum(int(table[int(s[i - 1])] == s[i]) for s, f in zip(seqs, found) for i in f)
        assert c.correct == expected and c.queries == 40 * c.pairs
        assert 0 < c.correct < c.queries  # both outcomes occur, so an off-by-one would show
    assert "| 3 | " in recall.table(cells, 20) and "20 (1x)" in recall.table(cells, 20)


def test_recall_refuses_an_empty_grid_or_no_documents_by_name():
    """Zero documents in a cell, or no lengths or pairs, are one error naming the argument: cell_sequences said
    "need at least one array to stack", and run_recall returned no cells (an empty table) without a word."""
    spec = MQARSpec((0, 12))
    with pytest.raises(ValueError, match="samples: expected >= 1, got 0"):
        recall.cell_sequences(spec, 20, 2, 0, 9, 256)
    model = _model(Path("."), "m").eval()
    for lengths, pairs, name in (([], [2], "context_lengths"), ([20], [], "pairs")):
        with pytest.raises(ValueError, match=f"{name}: expected at least one"):
            recall.run_recall(model, spec, lengths, pairs, bos_id=256, vocab_size=257, show_progress=False)


def test_recall_cli_reads_the_task_from_the_training_data_and_refuses_without_one(tmp_path, capsys):
    write_dataset(tmp_path / "mq", MQARSpec((0, 48)), lengths=(16, 24), pairs=[2, 3], tokens=2000, tokenizer="byte")
    _model(tmp_path, "m").save_pretrained(tmp_path / "m")
    assert main(["eval", "recall", str(tmp_path / "m"), "--data", str(tmp_path / "mq"), "--train-length", "16",
                 "--samples", "4", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    result = json.loads((tmp_path / "out" / "recall.json").read_text())
    assert result["lengths"] == [16, 32, 48, 64] and result["pairs"] == [2, 3] and result["task"]["vocab"] == [0, 48]
    capsys.readouterr()
    assert main(["eval", "recall", str(tmp_path / "m"), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("foxlm eval recall: error: --vocab: ") and err.count("\n") == 1
    assert main(["eval", "recall", str(tmp_path / "m"), "--vocab", "0:48", "--pairs", "2", "--out",
                 str(tmp_path / "refused"), "--no-progress"]) == 2
    assert "--lengths: " in capsys.readouterr().err


def test_recall_cli_evaluates_a_recorded_count_of_pairs_once(tmp_path):
    """``--pairs 2,3,2`` weights a dataset's draws (a count given twice is drawn twice as often); the recorded list is
    not a grid of cells, and evaluating it as one repeated the cells of 2 pairs in recall.csv and recall.json."""
    write_dataset(tmp_path / "mq", MQARSpec((0, 48)), lengths=(16, 24), pairs=[2, 3, 2], tokens=500, tokenizer="byte")
    _model(tmp_path, "m").save_pretrained(tmp_path / "m")
    assert main(["eval", "recall", str(tmp_path / "m"), "--data", str(tmp_path / "mq"), "--lengths", "16", "--samples",
                 "2", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    result = json.loads((tmp_path / "out" / "recall.json").read_text())
    assert result["pairs"] == [2, 3] and [c["pairs"] for c in result["cells"]] == [2, 3]
    assert (tmp_path / "out" / "recall.csv").read_text().count("\n") == 3


def test_recall_cli_refuses_a_task_recorded_in_another_tokenizer(tmp_path, capsys):
    """A task's id ranges mean those ids of the tokenizer its dataset was written in: ids 0:48 of GPT-2 data are not
    the bytes a byte-level model saw, and were evaluated on it all the same (at chance), as the task it learned."""
    write_dataset(tmp_path / "mq", MQARSpec((0, 48)), lengths=(16, 24), pairs=[2], tokens=500, tokenizer="gpt2")
    _model(tmp_path, "m").save_pretrained(tmp_path / "m")
    capsys.readouterr()
    assert main(["eval", "recall", str(tmp_path / "m"), "--data", str(tmp_path / "mq"), "--lengths", "16", "--samples",
                 "2", "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(r"foxlm eval recall: error: --data: .*mq was written with gpt2, but .*m's "
                                              r"tokenizer is byte", err), err
    assert not (tmp_path / "out").exists()


def test_recall_cli_takes_the_tokenizer_a_model_records_none_of(tmp_path, capsys):
    """A byte-level model saved without a recorded tokenizer: the error says "pass --tokenizer", and recall takes it
    (it had no such option)."""
    model = _model(tmp_path, "m")
    del model.config.foxlm_tokenizer
    model.save_pretrained(tmp_path / "m")
    argv = ["eval", "recall", str(tmp_path / "m"), "--vocab", "0:48", "--pairs", "2", "--lengths", "16", "--samples",
            "2", "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 2
    assert "pass --tokenizer" in capsys.readouterr().err
    assert main(argv + ["--tokenizer", "byte"]) == 0
    assert json.loads((tmp_path / "out" / "recall.json").read_text())["cells"][0]["queries"] == 4


@pytest.mark.parametrize("argv,message", [
    (["--vocab", "5:2"], "--vocab: expected a range LO:HI of at least 3 ids"),  # MQARSpec's "vocab: ..."
    (["--vocab=-3:48"], "--vocab: expected a range LO:HI of at least 3 ids"),
    (["--vocab", "0:300"], "--vocab: 0:300 goes past byte's 257 ids"),
    (["--pairs", "2,17"], r"--pairs: expected 1 to 16 \(the ids in a third of vocab 0:48\), got 17"),
    (["--lengths", "16,8"], r"--lengths: 8 tokens cannot hold 2 pairs and their queries \(1 \+ 4 x 2 = 9 tokens\)"),
    (["--seed", "-1"], "--seed: expected a non-negative integer, got -1"),  # numpy's "expected non-negative integer"
    (["--tokenizer", "nope"], "--tokenizer: expected 'gpt2', 'json-gpt2', 'byte' or a folder"),
    (["--device", "gpu0"], "--device: expected e.g. 'cpu', 'cuda', 'cuda:1' or 'auto', got 'gpu0'"),
    (["--data", "nope"], "--data: nope does not exist"),  # was "records no MQAR task"
])
def test_recall_cli_names_the_flag_and_leaves_out_as_it_was(tmp_path, capsys, monkeypatch, argv, message):
    """A task, seed, tokenizer or device the command refuses: one line naming the flag (MQARSpec names its own
    parameters, as recipes/mqar.py passes them), and --out is neither made nor, if it was there, changed."""
    monkeypatch.chdir(tmp_path)
    _model(tmp_path, "m").save_pretrained(tmp_path / "m")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine.txt").write_text("mine")
    capsys.readouterr()  # save_pretrained's progress bar
    for out in ("new", "kept"):
        assert main(["eval", "recall", "m", "--vocab", "0:48", "--pairs", "2", "--lengths", "16", "--samples", "2",
                     *argv, "--out", out, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and re.match(f"foxlm eval recall: error: {message}", err.splitlines()[-1]), err
    assert not (tmp_path / "new").exists() and [p.name for p in (tmp_path / "kept").iterdir()] == ["mine.txt"]


def test_recall_lengths_past_learned_positions_are_one_line(tmp_path, capsys):
    """A model with a learned position table (GPT-2's n_positions) was given documents past it: an IndexError's
    traceback inside its embedding. Documents as long as the table run."""
    import transformers

    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50257, n_embd=16, n_layer=1, n_head=2,
                                                         n_positions=48)).save_pretrained(tmp_path / "gpt2")
    argv = ["eval", "recall", str(tmp_path / "gpt2"), "--vocab", "1000:1300", "--pairs", "2", "--samples", "2",
            "--no-progress", "--out"]
    assert main([*argv, str(tmp_path / "refused"), "--lengths", "16,49"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1] == (
        "foxlm eval recall: error: --lengths: 49 tokens, but the 'gpt2' model learned position embeddings for 48 only; "
        "evaluate at 48 tokens or fewer")
    assert not (tmp_path / "refused").exists()
    assert main([*argv, str(tmp_path / "out"), "--lengths", "16,48"]) == 0
    cells = json.loads((tmp_path / "out" / "recall.json").read_text())["cells"]
    assert [c["context_length"] for c in cells] == [16, 48]

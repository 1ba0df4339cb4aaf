"""Any Hugging Face causal LM through foxlm's trainer and evaluations: real transformers Llama and Mamba-2 models."""

from __future__ import annotations

import csv
import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from foxlm_cli import foxlm, one_line_error
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from foxlm.cli import main
from foxlm.models import SIZES, FoxConfig, FoxForCausalLM, load_checkpoint_model
from foxlm.models.hf import hf_config, use_chunked_loss
from foxlm.presets import BASELINES
from foxlm.train import load_config, train

COMMON = ["device=cpu", "tokenizer=byte", "seq_len=32", "batch_size=4", "warmup_steps=2", "lr=3e-3", "min_lr=3e-4",
          "eval_batches=1", "eval_every=3", "log_every=1", "progress=false", "tensorboard=false", "sample_tokens=4",
          "max_steps=6", "save_every=3"]
MODELS = {
    "llama": ["arch=hf:llama", "model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
              "model.num_key_value_heads=1", "model.intermediate_size=64"],
    "mamba2": ["arch=hf:mamba2", "model.hidden_size=32", "model.num_hidden_layers=2", "model.num_heads=4",
               "model.head_dim=16", "model.state_size=8", "model.n_groups=1", "model.chunk_size=16"],
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _losses(run) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.parametrize("model_type, fields", [
    ("gemma2", dict(final_logit_softcapping=0.5, head_dim=16)),  # a cap small enough to bite at initialization
    ("cohere", dict(logit_scale=0.25)),
    ("granite", dict(logits_scaling=4.0)),
    # an LM head with a bias (GPT-J's), which linear_cross_entropy lacks: it was a ValueError at the first step
    ("gptj", dict(n_embd=32, n_layer=2, n_head=2, rotary_dim=8)),
])
def test_chunked_loss_keeps_the_models_logit_transforms(model_type, fields):
    """A model whose logits are more than its LM head's output (a soft cap, a scale, a bias) trains on its own loss:
    the wrapped model's loss and gradients equal the model's own, where the raw head's loss would not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    sizes = {} if model_type == "gptj" else dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                 num_key_value_heads=1, intermediate_size=64)
    config = AutoConfig.for_model(model_type, vocab_size=100, **sizes, **fields)
    own = AutoModelForCausalLM.from_config(config)
    head = own.get_output_embeddings()
    if head.bias is not None:  # zeros at initialization; a trained one
        torch.nn.init.normal_(head.bias)
    ours = AutoModelForCausalLM.from_config(config)
    ours.load_state_dict(own.state_dict())
    use_chunked_loss(ours)
    ids = torch.randint(0, 100, (2, 12))
    want, got = own(input_ids=ids, labels=ids).loss, ours(input_ids=ids, labels=ids).loss
    hidden = own.base_model(input_ids=ids).last_hidden_state
    raw = torch.nn.functional.cross_entropy((hidden @ head.weight.T)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert (raw - want).abs() > 1e-3  # the transform matters here
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    for (name, a), b in zip(own.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


@pytest.mark.parametrize("in_config", [True, False])
def test_chunked_loss_keeps_a_mixture_of_experts_router_loss(in_config):
    """A MoE trained with output_router_logits (in its config or in the call) adds its router's load-balancing loss
    to the cross-entropy; the wrapped model's loss and gradients are the model's own, where the chunked
    cross-entropy alone dropped that term, and the router learned nothing of balance."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("mixtral", vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, intermediate_size=64, router_aux_loss_coef=1.0,
                                  output_router_logits=in_config)
    own = AutoModelForCausalLM.from_config(config)
    ours = AutoModelForCausalLM.from_config(config)
    ours.load_state_dict(own.state_dict())
    use_chunked_loss(ours)
    ids = torch.randint(0, 100, (2, 12))
    kwargs = {} if in_config else {"output_router_logits": True}
    want, got = own(input_ids=ids, labels=ids, **kwargs), ours(input_ids=ids, labels=ids, **kwargs)
    assert want.aux_loss > 0.1  # the router's term matters here
    torch.testing.assert_close(got.loss, want.loss)
    got.loss.backward()
    want.loss.backward()
    for (name, a), b in zip(own.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def _llama_and_chunked_copy() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A tiny Llama (seed 0) and a copy of it with the chunked loss (``use_chunked_loss``)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64)
    own, ours = LlamaForCausalLM(config), LlamaForCausalLM(config)
    ours.load_state_dict(own.state_dict())
    return own, use_chunked_loss(ours)


def test_chunked_loss_is_the_models_own_loss():
    """The trainer's loss (linear_cross_entropy on the backbone's hidden states) equals Llama's own, gradients too."""
    own, ours = _llama_and_chunked_copy()
    ids = torch.randint(0, 100, (2, 24))
    labels = ids.clone()
    labels[0, 5:9] = -100
    want, got = own(input_ids=ids, labels=labels).loss, ours(input_ids=ids, labels=labels)
    assert got.logits is None  # no [B, T, V] logits
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    want.backward()
    got.loss.backward()
    for (name, a), b in zip(own.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert ours(input_ids=ids).logits.shape == (2, 24, 100)  # without labels: the model's own forward


def test_chunked_loss_takes_the_models_arguments_as_it_does(tmp_path):
    """The wrapped forward is called as Llama's: positional arguments by Llama's order (model(ids, mask) was a loss
    with the mask as labels), Llama's signature (HF's Trainer keeps the columns it names: attention_mask was
    dropped), return_dict=False a tuple (a crash) and output_hidden_states the hidden states (they were None)."""
    from transformers import Trainer, TrainingArguments

    own, ours = _llama_and_chunked_copy()
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    torch.testing.assert_close(ours(ids, mask).logits, own(ids, mask).logits)
    torch.testing.assert_close(ours(ids, mask, None, None, None, labels).loss,
                               own(ids, mask, None, None, None, labels).loss)
    assert inspect.signature(ours.forward) == inspect.signature(own.forward)
    trainer = Trainer(ours, TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True))
    trainer._set_signature_columns_if_needed()
    assert "attention_mask" in trainer._signature_columns
    got, want = (m(input_ids=ids, labels=labels, return_dict=False) for m in (ours, own))
    assert isinstance(got, tuple)
    torch.testing.assert_close(got[0], want[0])
    got, want = (m(input_ids=ids, labels=labels, output_hidden_states=True).hidden_states for m in (ours, own))
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_train_resume_and_evaluate(name, byte_data, tmp_path):
    """`foxlm train` on a transformers model; a resume from its step-3 checkpoint reproduces steps 4-6 exactly;
    `foxlm eval loss` and `foxlm eval niah` read the result."""
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    summary = train(load_config(None, [*COMMON, *MODELS[name], f"data={byte_data}", f"out_dir={ref}"]))
    assert summary["step"] == 6 and summary["loss"] < summary["first_loss"] and summary["val_loss"] is not None
    model = load_checkpoint_model(ref)
    assert model.config.model_type == name and model.config.foxlm_tokenizer["name"] == "byte"

    train(load_config(None, [*COMMON, *MODELS[name], f"data={byte_data}", f"out_dir={resumed}",
                             f"resume={ref / 'checkpoints' / 'step_0000003'}"]))
    want = _losses(ref)
    assert _losses(resumed) == {step: want[step] for step in (4, 5, 6)}

    assert main(["eval", "loss", str(ref), "--data", str(byte_data), "--train-length", "32", "--eval-length", "64",
                 "--max-sequences", "2", "--out", str(tmp_path / "loss"), "--no-progress"]) == 0
    assert (tmp_path / "loss" / "per_token_loss.csv").read_text().count("\n") > 60
    assert main(["eval", "niah", str(ref), "--data", str(byte_data), "--lengths", "600", "--depths", "0,1",
                 "--modes", "easy", "--train-length", "32", "--out", str(tmp_path / "niah"), "--no-progress"]) == 0
    with open(tmp_path / "niah" / "niah.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["depth"]) for r in rows] == [0.0, 1.0] and all(r["found"] in ("True", "False") for r in rows)


def test_config_json_arch_and_init_from(byte_data, tmp_path):
    """``arch=PATH/config.json`` builds the model a trained run saved; ``init_from`` starts from its weights."""
    base = [*COMMON, f"data={byte_data}", "max_steps=3", "eval_every=0", "sample_tokens=0"]
    train(load_config(None, [*base, *MODELS["llama"], f"out_dir={tmp_path / 'a'}"]))
    config = tmp_path / "a" / "checkpoints" / "step_0000003" / "model" / "config.json"
    summary = train(load_config(None, [*base, f"arch={config}", f"out_dir={tmp_path / 'b'}",
                                       f"init_from={tmp_path / 'a'}"]))
    assert summary["first_loss"] < _losses(tmp_path / "a")[1] - 0.1  # trained weights, not a fresh model
    with pytest.raises(ValueError, match="init_from: .* holds another model"):
        train(load_config(None, [*base, *MODELS["llama"], "model.hidden_size=64", f"out_dir={tmp_path / 'c'}",
                                 f"init_from={tmp_path / 'a'}"]))


def test_what_does_not_apply_is_refused(byte_data, tmp_path):
    base = [*COMMON, f"data={byte_data}"]
    cases = {"model.acp": ["arch=hf:llama", "model.acp=true"],
             "model.num_experts_typo": ["arch=hf:llama", "model.num_experts_typo=2"],
             "packing": ["arch=hf:mamba2", "packing=documents"],
             "cuda_graph": ["arch=hf:llama", "cuda_graph=true"],
             "arch": ["arch=hf:no-such-model"]}
    for key, extra in cases.items():
        with pytest.raises(ValueError, match=key):
            load_config(None, [*base, *extra])
    assert hf_config("hf:llama", {"hidden_size": 48, "num_attention_heads": 4}).hidden_size == 48
    with pytest.raises(ValueError, match="model: LlamaConfig refuses .* not a multiple of the number of attention"):
        hf_config("hf:llama", {"hidden_size": 48})


@pytest.mark.parametrize("model_type, fields", [
    ("llama", dict(hidden_size=32, num_attention_heads=2, intermediate_size=64)),
    ("mistral", dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)),
    ("mamba2", dict(hidden_size=32, num_heads=4, head_dim=16, expand=2, n_groups=1)),
    # the names a config maps to its own (GPT-2's n_embd, n_head, n_layer): "not a field of GPT2Config"
    ("gpt2", dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2)),
])
def test_hf_config_is_the_config_class_with_these_fields(model_type, fields):
    """arch=hf:TYPE with model.* fields is transformers' config of those fields: the fields that a config derives
    from others (Llama's key/value heads and head dim, Mamba-2's time_step_rank) follow them, where they kept the
    values derived from the type's defaults (hf:llama with 2 heads had 32 key/value heads, failing in the forward)."""
    ours = hf_config(f"hf:{model_type}", fields)
    # transformers' own class (fla, when installed, registers its own Mamba2Config for "mamba2" with AutoConfig)
    assert type(ours).__module__.startswith("transformers.models.")
    assert ours.to_dict() == type(ours)(**fields).to_dict()
    assert ours.hidden_size == 32
    model = AutoModelForCausalLM.from_config(ours)
    assert model(input_ids=torch.randint(0, 100, (1, 8))).logits.shape == (1, 8, ours.vocab_size)


def test_gates_of_a_model_without_gates_is_a_clear_error(byte_data, tmp_path):
    path = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64)).save_pretrained(path)
    proc = foxlm("eval", "gates", path, "--data", byte_data, "--out", tmp_path / "g", "--length", "64")
    assert "'llama' model, without forget gates" in one_line_error(proc, "eval gates")


@pytest.mark.parametrize("arch", BASELINES)
def test_baseline_presets_match_fox_pro_parameters(arch):
    """Every baseline preset, built on the meta device, is within 1.1% of fox-pro's parameter count at its size, as the
    README says (the widest: mamba2 at 125m, +0.79%)."""
    vocab = 50304
    for size in SIZES:
        with torch.device("meta"):
            fox = FoxForCausalLM(FoxConfig.preset("fox-pro", size, vocab_size=vocab)).num_parameters()
            config = hf_config(arch, {"vocab_size": vocab}, size)
            model = AutoModelForCausalLM.from_config(config)
        assert model.config.hidden_size == SIZES[size]["hidden_size"]
        assert abs(model.num_parameters() / fox - 1) < 0.011, (arch, size, model.num_parameters(), fox)


def test_baselines_print_their_config_and_fla_needs_a_gpu(byte_data, tmp_path):
    proc = foxlm("train", "arch=gated-delta-net", "size=125m", "--print-config")
    assert proc.returncode == 0 and "arch: gated-delta-net\nsize: 125m\n" in proc.stdout, proc.stderr
    proc = foxlm("train", "arch=delta-net", "device=cpu", "tokenizer=byte", f"data={byte_data}",
                 f"out_dir={tmp_path / 'run'}")
    message = one_line_error(proc, "train")
    assert "fla's Triton kernels, which need a CUDA GPU ('foxlm[baselines]'" in message and "got cpu" in message
    summary = train(load_config(None, [*COMMON, "arch=mamba2", "model.num_hidden_layers=2", "max_steps=2",
                                       "eval_every=0", "sample_tokens=0", f"data={byte_data}",
                                       f"out_dir={tmp_path / 'mamba2'}"]))
    assert summary["step"] == 2 and math.isfinite(summary["loss"])
    assert type(load_checkpoint_model(tmp_path / "mamba2")).__module__.startswith("transformers.")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_harness_adapter_scores_a_transformers_model(name, tmp_path):
    """lm-eval's ``foxlm`` model on a transformers Llama / Mamba-2 folder: its log-likelihoods are the model's own."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from foxlm.eval import utils
    from foxlm.eval.harness import hf_tokenizer

    torch.manual_seed(0)
    fields = dict(arg.removeprefix("model.").split("=") for arg in MODELS[name] if arg.startswith("model."))
    config = hf_config(f"hf:{name}", {k: int(v) for k, v in fields.items()} | dict(vocab_size=50304))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    docs = [{"question": "The capital of France is", "choices": ["Paris", "a banana"], "label": 0},
            {"question": "To be, or not to be:", "choices": ["that is the question", "said nobody"], "label": 1}]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "hf_tiny_mc.yaml").write_text(
        f"task: hf_tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n")
    res = simple_evaluate(model="foxlm", model_args=f"pretrained={tmp_path / 'model'},device=cpu",
                          tasks=["hf_tiny_mc"], log_samples=True,
                          task_manager=TaskManager(include_defaults=False, include_path=str(tasks)))
    scored = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in res["samples"]["hf_tiny_mc"]}
    tok, model = hf_tokenizer(), utils.load_model(tmp_path / "model", torch.device("cpu"))
    for i, d in enumerate(docs):
        ctx = tok(d["question"])["input_ids"]
        for j, choice in enumerate(d["choices"]):
            ids = torch.tensor([ctx + tok(" " + choice, add_special_tokens=False)["input_ids"]])
            direct = float(utils.next_token_logprobs(model, ids, start=len(ctx) - 1).sum())
            assert scored[i][j] == pytest.approx(direct, abs=1e-3)


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_two_processes_match_one(parallel, byte_data, tmp_path):
    """A transformers Llama under torchrun (2 CPU processes on gloo, FSDP2 sharding its decoder layers, or DDP)
    trains with the losses of one process and the same global batch."""
    args = [*COMMON, *MODELS["llama"], f"data={byte_data}", "micro_batch_size=1", "max_steps=3", "eval_every=0",
            "sample_tokens=0"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "foxlm.cli", "train", *args, f"parallel={parallel}", f"out_dir={tmp_path / 'two'}"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    train(load_config(None, [*args, f"out_dir={tmp_path / 'one'}"]))
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert sorted(two) == [1, 2, 3] and two == pytest.approx(one, rel=1e-5)


def test_load_without_progress_shows_no_loading_bar(tmp_path, capsys):
    """``progress=False`` (``foxlm eval ... --no-progress``) loads without transformers' "Loading weights" bar, which
    showed on stderr before any result or one-line error, and leaves transformers' global switch as it was."""
    from transformers.utils import logging as hf_logging

    FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", hidden_size=32, num_hidden_layers=1)).save_pretrained(tmp_path)
    capsys.readouterr()
    load_checkpoint_model(tmp_path, progress=False)
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
    load_checkpoint_model(tmp_path)  # the bar this test looks for, where progress is on
    assert "Loading weights" in capsys.readouterr().err


@pytest.mark.parametrize("model_type, fields, pad", [
    ("opt", dict(ffn_dim=64, word_embed_proj_dim=32), 1),
    ("gemma", dict(num_key_value_heads=1, intermediate_size=64, head_dim=16), 0),
])
def test_trainer_model_learns_every_token_of_its_tokenizer(model_type, fields, pad, tmp_path):
    """The trainer's model takes its token ids from the data's tokenizer, its pad id too (the byte tokenizer has
    none): the model type's default (OPT's 1, Gemma's 0, a byte of the data) was the embedding's padding_idx, a row
    zeroed at initialization that never learns; a config.json's pad id past the vocabulary failed to build."""
    from foxlm.train.model import build_model, model_config

    assert AutoModelForCausalLM.from_config(hf_config(f"hf:{model_type}", {
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, **fields,
    })).get_input_embeddings().padding_idx == pad  # the model type's default pad id, a token of the data
    tok_spec = {"name": "byte", "vocab_size": 257, "eot_id": 256}
    args = ["device=cpu", f"arch=hf:{model_type}", "model.hidden_size=32", "model.num_hidden_layers=1",
            "model.num_attention_heads=2", *(f"model.{k}={v}" for k, v in fields.items())]
    cfg = load_config(None, args)
    model = build_model(cfg, model_config(cfg, tok_spec, torch.device("cpu")), torch.device("cpu"))
    assert model.config.pad_token_id is None
    ids = torch.tensor([[pad, 7, pad, 9, 11, pad]])
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.get_input_embeddings().weight.grad[pad].abs().sum() > 0
    cfg = load_config(None, [*args, f"model.pad_token_id={pad}"])  # asked for: as given
    assert model_config(cfg, tok_spec, torch.device("cpu")).pad_token_id == pad
    path = tmp_path / "config.json"  # a pretrained model's config, with its own tokenizer's pad id
    hf_config(f"hf:{model_type}", {"pad_token_id": 128004, "vocab_size": 128256}).to_json_file(path)
    cfg = load_config(None, ["device=cpu", f"arch={path}", "model.hidden_size=32", "model.num_hidden_layers=1",
                             "model.num_attention_heads=2", *(f"model.{k}={v}" for k, v in fields.items())])
    assert build_model(cfg, model_config(cfg, tok_spec, torch.device("cpu")), torch.device("cpu"))


def test_trainer_model_of_a_bf16_config_json_has_fp32_weights(tmp_path):
    """A pretrained model's config.json often records its weights' dtype (bfloat16), which from_config takes: the
    trainer's model of such a file had bf16 weights, updated by AdamW in bf16, where precision=fp32 (the CPU's
    auto) and bf16 (autocast over fp32 weights) both keep fp32 weights, as for arch=hf:llama."""
    from foxlm.train.model import build_model, model_config

    path = tmp_path / "config.json"
    LlamaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                dtype="bfloat16").to_json_file(path)
    assert next(AutoModelForCausalLM.from_config(hf_config(str(path))).parameters()).dtype == torch.bfloat16
    for precision in ("fp32", "bf16"):
        cfg = load_config(None, ["device=cpu", f"arch={path}", f"precision={precision}"])
        tok_spec = {"name": "byte", "vocab_size": 257, "eot_id": 256}
        model = build_model(cfg, model_config(cfg, tok_spec, torch.device("cpu")), torch.device("cpu"))
        assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_config_json_the_trainer_cannot_read_is_one_line_naming_it(tmp_path):
    """arch=PATH/config.json that is not JSON, fails its config class's checks or needs the custom code of a remote
    repository is one ValueError naming the file (they were an OSError's or a validator's traceback, and a question
    waiting for an answer on stdin: "Do you wish to run the custom code? [y/N]")."""
    cases = {"broken": ("{oops", "not a valid JSON file"),
             "heads": ('{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 3}',
                       r"hidden size \(32\) is not a multiple of the number of attention heads \(3\)"),
             "remote": ('{"model_type": "my_custom", "auto_map": {"AutoConfig": "my.MyConfig"}}',
                        "custom code")}
    for name, (text, reason) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=rf"^arch: {path}: .*{reason}") as info:
            hf_config(str(path))
        assert "\n" not in str(info.value)
    proc = foxlm("train", "device=cpu", f"arch={tmp_path / 'remote.json'}", "--print-config")
    assert "custom code" in one_line_error(proc, "train") and "[y/N]" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("model_type, fields, blocks", [
    ("llama", dict(num_attention_heads=2, intermediate_size=64), "model.layers"),
    ("mamba2", dict(num_heads=4, head_dim=16, n_groups=1), "backbone.layers"),
    ("gpt2", dict(n_embd=32, n_head=2, n_layer=2), "transformer.h"),
    # the blocks one level down, under the backbone's decoder: compile=true and FSDP2 failed to find them
    ("opt", dict(num_attention_heads=2, ffn_dim=64, word_embed_proj_dim=32), "model.decoder.layers"),
])
def test_decoder_layers_are_the_models_blocks(model_type, fields, blocks):
    """What compile=true compiles and FSDP2 shards one by one: the ModuleList of the model's blocks, wherever its
    backbone holds it."""
    from foxlm.models.hf import decoder_layers

    sizes = {} if model_type == "gpt2" else {"hidden_size": 32, "num_hidden_layers": 2}
    model = AutoModelForCausalLM.from_config(hf_config(f"hf:{model_type}", {"vocab_size": 64, **sizes, **fields}))
    assert decoder_layers(model, "compile") is model.get_submodule(blocks)
    with pytest.raises(ValueError, match="^compile: cannot find the blocks of Linear .*; use compile=false"):
        decoder_layers(torch.nn.Linear(2, 2), "compile")

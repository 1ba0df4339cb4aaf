"""FoX models behave like a transformers Llama where transformers' own machinery meets them: the real ``Trainer``
with gradient accumulation and DDP, config-driven outputs and ``return_dict``, ``shift_labels``, gradient
checkpointing, ``generate`` with attentions and with right padding."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers.modeling_utils
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from foxlm.models import FoxConfig, FoxForCausalLM
from foxlm.models.hf import use_chunked_loss

VOCAB = 61
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
            bos_token_id=None, eos_token_id=None)

pytestmark = pytest.mark.usefixtures("one_thread")


def _fox(arch: str = "fox-pro", seed: int = 0, **overrides) -> FoxForCausalLM:
    torch.manual_seed(seed)
    model = FoxForCausalLM(FoxConfig.preset(arch, "tiny", **{**TINY, **overrides}))
    for p in model.parameters():  # off the init point: gates, norms and shifts far from trivial
        p.data += 0.1 * torch.randn_like(p)
    return model


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                        num_hidden_layers=2, num_key_value_heads=2))


def _rows(n: int = 8, T: int = 12) -> list[dict]:
    """Rows with very different numbers of counted labels, so that a mean per micro-batch differs from the mean
    over the whole batch."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (T,), generator=g)
        labels = ids.clone()
        labels[: 1 + (i * 5) % (T - 2)] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _train_one_step(model, out_dir, batch: int, accumulation: int) -> tuple[float, float]:
    """One optimizer step of the real Trainer over the 8 rows; the logged (loss, grad_norm)."""
    args = TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
        max_steps=1, logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_rows())
    trainer.train()
    record = next(r for r in trainer.state.log_history if "loss" in r)
    return record["loss"], record["grad_norm"]


MODELS = {
    "fox-pro": lambda: _fox("fox-pro"),
    "fox-unfused": lambda: _fox("fox-llama", fuse_cross_entropy=False),
    "llama": _llama,  # the reference the accounting must match
    "llama-chunked-loss": lambda: use_chunked_loss(_llama()),  # foxlm's loss for any HF model
}


@pytest.mark.parametrize("name", MODELS)
def test_trainer_gradient_accumulation_keeps_loss_and_gradients(name, tmp_path):
    """8 rows as 8 x 1, 4 x 2 and 2 x 4 (batch x accumulation): the same logged loss and gradient norm, as for a
    Llama. FoX took **kwargs, so the Trainer passed num_items_in_batch and stopped dividing, while FoX returned
    a mean per micro-batch: the loss and gradients grew with the accumulation steps."""
    results = [_train_one_step(MODELS[name](), tmp_path / f"{b}x{a}", b, a) for b, a in ((8, 1), (4, 2), (2, 4))]
    for loss, norm in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-4)
        assert norm == pytest.approx(results[0][1], rel=1e-4)


def test_trainer_ddp_two_processes_equal_one(tmp_path):
    """The real Trainer under torchrun, 2 gloo processes x 4 rows: the loss and gradient norm of 1 process x 8."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           __file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loss, norm = json.loads((tmp_path / "ddp.json").read_text())
    want_loss, want_norm = _train_one_step(_fox(), tmp_path / "single", 8, 1)
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert norm == pytest.approx(want_norm, rel=1e-4)



@pytest.mark.parametrize("training", [True, False], ids=["fused-train", "eval"])
def test_shift_labels_win_over_labels_as_in_llama(training):
    """labels and shift_labels together (what transformers' context- and sequence-parallel training passes):
    shift_labels alone set the loss, as in Llama's ForCausalLMLoss; FoX refused the pair."""
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    shift = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    shift[1, :3] = -100
    other = torch.randint(0, VOCAB, (2, 9))  # labels that, if read, would give another loss
    same = torch.cat([ids[:, :1], shift[:, :-1]], 1)  # the labels whose shift is `shift`
    for model in (_llama(), _fox()):
        model.train(training)
        want = model(ids, labels=same).loss
        torch.testing.assert_close(model(ids, labels=other, shift_labels=shift).loss, want)
    torch.testing.assert_close(model(ids, shift_labels=shift).loss, want)  # FoX: shift_labels alone too


@pytest.mark.parametrize("arch", ["fox-pro", "transformer-pro"])
def test_padding_free_batch_keeps_documents_apart_as_in_llama(arch):
    """transformers' DataCollatorWithFlattening packs rows into one with position_ids restarting at each document
    (no mask): a Llama without a cache keeps the documents apart; FoX attended, decayed and token-shifted across
    them, so the logits and the loss differed from those of the documents alone."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(6)
    docs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 7)]
    batch = DataCollatorWithFlattening()([{"input_ids": d} for d in docs])
    for model in (_llama(), _fox(arch).double()):
        for training in (True, False):
            model.train(training)
            logits = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            alone = [model(torch.tensor([d]), use_cache=False).logits[0] for d in docs]
            torch.testing.assert_close(logits[0], torch.cat(alone), rtol=1e-6, atol=1e-6)
            losses = [model(torch.tensor([d]), labels=torch.tensor([d])).loss * (len(d) - 1) for d in docs
                      if len(d) > 1]
            torch.testing.assert_close(model(**batch, use_cache=False).loss, sum(losses) / (13 - len(docs)))
    rows = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])  # a batch of rows, each packed: the rows' own documents
    got = model(rows, position_ids=torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]]), use_cache=False).logits
    torch.testing.assert_close(got[0, 2:], model(rows[:1, 2:], use_cache=False).logits[0])
    torch.testing.assert_close(got[1], model(rows[1:], use_cache=False).logits[0])


def test_logits_to_keep_as_positions_as_in_llama():
    """logits_to_keep as a tensor lists the positions to keep (transformers' second form), as an int the last n. FoX
    read a one-element tensor as a count (tensor([2]): the last two positions) and refused a longer one."""
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    for model in (_llama().eval(), _fox().eval()):
        full = model(ids, use_cache=False).logits
        for keep in (torch.tensor([2]), torch.tensor([0, 4, 8])):
            torch.testing.assert_close(model(ids, use_cache=False, logits_to_keep=keep).logits, full[:, keep])
        torch.testing.assert_close(model(ids, use_cache=False, logits_to_keep=3).logits, full[:, -3:])


def test_logits_to_keep_two_dimensional_forms_as_in_llama():
    """logits_to_keep as a 2-D tensor (transformers' third and fourth forms): integer [B, K], each row's own
    positions -> [B, K, V]; bool [B, T], the True positions of all rows -> [N, V]. FoX indexed the positions axis
    with it, [B, B, K, V] or an IndexError, where a Llama gives each row its positions."""
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    per_row = torch.tensor([[0, 4, 8], [7, 1, 1]])
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, [2, 5]], mask[1, 8] = True, True
    # Llama reads these forms since transformers' slice_logits_to_keep (after 5.17, which indexes the positions axis
    # with them too): where it is missing, FoX is held to the forms alone
    models = [_llama().eval()] if hasattr(transformers.modeling_utils, "slice_logits_to_keep") else []
    for model in (*models, _fox().eval()):
        full = model(ids, use_cache=False).logits
        want = torch.stack([full[0, per_row[0]], full[1, per_row[1]]])
        torch.testing.assert_close(model(ids, use_cache=False, logits_to_keep=per_row).logits, want)
        torch.testing.assert_close(model(ids, use_cache=False, logits_to_keep=mask).logits,
                                   torch.stack([full[0, 2], full[0, 5], full[1, 8]]))


@pytest.mark.parametrize("arch", ["fox-pro", "transformer-llama"])
@pytest.mark.parametrize("kwargs, name", [
    (dict(input_ids=torch.zeros(7, dtype=torch.long)), "input_ids"),
    (dict(input_ids=torch.zeros(2, 0, dtype=torch.long)), "input_ids"),
    (dict(inputs_embeds=torch.zeros(7, 32)), "inputs_embeds"),
    (dict(inputs_embeds=torch.zeros(2, 7, 5)), "inputs_embeds"),
    (dict(input_ids=torch.zeros(2, 7, dtype=torch.long), position_ids=torch.arange(5)[None]), "position_ids"),
    (dict(input_ids=torch.zeros(2, 7, dtype=torch.long), position_ids=torch.arange(7).expand(3, 7)), "position_ids"),
    (dict(input_ids=torch.zeros(2, 7, dtype=torch.long), position_ids=torch.arange(7)[None, None]), "position_ids"),
    (dict(input_ids=torch.zeros(2, 9, dtype=torch.long), logits_to_keep=torch.tensor([[0, 1]])), "logits_to_keep"),
    (dict(input_ids=torch.zeros(2, 9, dtype=torch.long), logits_to_keep=torch.ones(2, 5, dtype=torch.bool)),
     "logits_to_keep"),
])
def test_misshapen_inputs_give_an_error_naming_the_argument(arch, kwargs, name):
    """Inputs of a wrong shape: a one-line ValueError that names the argument. FoX failed deep inside ("not enough
    values to unpack", "weight: expected [D] ...", "cos: expected shape ...", an IndexError for T = 0) or, in a model
    without RoPE, ran with position_ids of another length, ignored."""
    with pytest.raises(ValueError, match=f"^{name}: ") as error:
        _fox(arch).eval()(**kwargs, use_cache=False)
    assert "\n" not in str(error.value)
    ok = dict(input_ids=torch.zeros(2, 7, dtype=torch.long), use_cache=False)  # the forms that stay accepted
    for positions in (torch.arange(7), torch.arange(7)[None], torch.arange(7).expand(2, 7)):
        assert _fox(arch).eval()(**ok, position_ids=positions).logits.shape == (2, 7, VOCAB)


@pytest.mark.parametrize("path", ["fused-train", "eval", "per-token"])
@pytest.mark.parametrize("name", ["labels", "shift_labels"])
def test_bad_label_values_give_an_error_naming_the_argument(path, name):
    """A label outside [0, V) other than -100, or float labels: the loss's one-line ValueError names the argument on
    every path. The fused training loss did; the unfused one (eval, per-token loss) passed them to F.cross_entropy:
    "IndexError: Target 161 is out of bounds." on the CPU, a bare device-side assert on CUDA."""
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    model = _fox().train(path == "fused-train")
    for bad, message in ((ids + 100, rf"expected values in \[0, {VOCAB}\) or ignore_index=-100$"),
                         (ids - 100, rf"expected values in \[0, {VOCAB}\) or ignore_index=-100$"),
                         (ids.float(), "expected int64 class indices, got torch.float32$")):
        with pytest.raises(ValueError, match=f"^{name}: {message}"):
            model(ids, **{name: bad}, return_per_token_loss=path == "per-token")
    labels = ids.clone()
    labels[:, :3] = -100  # -100 and every class in range stay accepted
    labels[0, 5], labels[1, 6] = 0, VOCAB - 1
    assert model(ids, **{name: labels}, return_per_token_loss=path == "per-token").loss.isfinite()


def test_config_output_flags_and_return_dict(tmp_path):
    """output_hidden_states / output_attentions / use_cache / return_dict from the config (from_pretrained's
    kwargs), and return_dict=False gives the output's fields as a tuple, as for transformers' models."""
    _fox().save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    plain = FoxForCausalLM.from_pretrained(tmp_path).eval()
    out = plain(ids)
    assert out.hidden_states is None and out.attentions is None
    assert out.past_key_values.get_seq_length() == 7  # config.use_cache, as Llama builds a DynamicCache
    loaded = FoxForCausalLM.from_pretrained(tmp_path, output_hidden_states=True, output_attentions=True).eval()
    out = loaded(ids)
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    assert out.attentions[0].shape == (2, 4, 7, 7)
    torch.testing.assert_close(out.hidden_states[-1], loaded.model(ids).last_hidden_state)
    assert loaded(ids, output_hidden_states=False, output_attentions=False).hidden_states is None  # the call wins

    labels = ids.clone()
    as_dict = plain(ids, labels=labels, use_cache=False)
    as_tuple = plain(ids, labels=labels, use_cache=False, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 2
    torch.testing.assert_close(as_tuple[0], as_dict.loss)
    torch.testing.assert_close(as_tuple[1], as_dict.logits)
    assert isinstance(plain.model(ids, return_dict=False), tuple)
    no_cache = FoxForCausalLM.from_pretrained(tmp_path, use_cache=False, return_dict=False).eval()
    got = no_cache(ids)
    assert isinstance(got, tuple) and len(got) == 1  # logits only: no cache
    torch.testing.assert_close(got[0], as_dict.logits)
    assert plain.train()(ids).past_key_values is None  # no decoding follows a training forward


def _greedy(model, ids, mask=None, new=5, use_cache=True):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True, use_cache=use_cache)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1)  # [B, new], [B, new, V]


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("arch", ["fox-pro", "fox-llama", "transformer-pro"])
def test_generate_on_right_padded_batch_equals_rows_alone(arch, use_cache):
    """generate on a right-padded batch: each row's tokens and scores are those of the row alone, unpadded (a pad
    adds no key and no decay, the token shift skips it, its output is the last real token's). FoX raised. Without a
    cache, generate appends after the pads: the forward moves each row's real tokens together."""
    model = _fox(arch).double().eval()
    lengths = [9, 5, 7]
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    tokens, scores = _greedy(model, ids, mask, use_cache=use_cache)
    for i, row in enumerate(rows):
        want_tokens, want_scores = _greedy(model, row[None])
        assert torch.equal(tokens[i], want_tokens[0]), i
        torch.testing.assert_close(scores[i], want_scores[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("chunk", [2, 4])
@pytest.mark.parametrize("arch", ["fox-pro", "transformer-pro"])
def test_generate_with_chunked_prefill_on_right_padded_batch_equals_rows_alone(arch, chunk):
    """generate(prefill_chunk_size=...) on a right-padded batch: a short row's last prefill chunk holds only padding,
    and the next token is read off its last position; it is the row's last real token's output, kept by the cache
    from an earlier call (it was a pad's meaningless one: other tokens and scores)."""
    model = _fox(arch).double().eval()
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(1, VOCAB, (n,), generator=g) for n in (9, 5, 7)]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True, prefill_chunk_size=chunk)
    tokens, scores = out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1)
    for i, row in enumerate(rows):
        want_tokens, want_scores = _greedy(model, row[None])
        assert torch.equal(tokens[i], want_tokens[0]), i
        torch.testing.assert_close(scores[i], want_scores[0], rtol=1e-9, atol=1e-9)


def test_forward_without_cache_keeps_padding_between_real_tokens_inert():
    """A cache-less forward whose rows have padding between real tokens: at every real position the outputs (logits,
    hidden states, gates, attention among real tokens) are those of the row's real tokens alone."""
    model = _fox("fox-pro").double().eval()
    ids = torch.randint(1, VOCAB, (2, 8))
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1, 1]])
    out = model(ids, attention_mask=mask, use_cache=False, output_hidden_states=True, output_attentions=True,
                output_log_fgates=True)
    for i in range(2):
        real = mask[i].bool()
        alone = model(ids[i:i + 1, real], use_cache=False, output_hidden_states=True, output_attentions=True,
                      output_log_fgates=True)
        torch.testing.assert_close(out.logits[i, real], alone.logits[0], rtol=1e-10, atol=1e-10)
        for got, want in zip(out.hidden_states, alone.hidden_states):
            torch.testing.assert_close(got[i, real], want[0], rtol=1e-10, atol=1e-10)
        for got, want in zip(out.log_fgates, alone.log_fgates):
            torch.testing.assert_close(got[i, real], want[0], rtol=1e-10, atol=1e-10)
        for got, want in zip(out.attentions, alone.attentions):
            torch.testing.assert_close(got[i][:, real][:, :, real], want[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", ["fox-pro", "transformer-pro"])
def test_cached_first_call_with_padding_between_real_tokens_as_without_cache(arch):
    """A first cached call whose mask has padding between real tokens (PEFT prompt tuning's virtual tokens before a
    left-padded prompt; any holed mask): the real tokens' logits of the forward without a cache, as for a Llama, and
    generate gives each row's tokens alone. FoX refused it ("padding between real tokens must end a call"), and so
    failed every eval-mode forward of a prompt-tuned model on a left-padded batch (use_cache defaults to True)."""
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0, 1, 1, 0]])
    real = mask.bool()
    for model in (_llama().eval(), _fox(arch).eval()):
        want = model(ids, attention_mask=mask, use_cache=False).logits[real]
        torch.testing.assert_close(model(ids, attention_mask=mask, use_cache=True).logits[real], want)
    got = _greedy(model, ids, mask)[0]
    for i in range(2):  # row 1 ends in padding: generate continues after it (a Llama's RoPE positions do not)
        assert torch.equal(got[i], _greedy(model, ids[i:i + 1, real[i]])[0][0])


def test_cached_padding_a_model_cannot_skip_is_refused():
    """What a cache cannot make inert is a one-line ValueError naming attention_mask: padding between real tokens
    of a later call (the token shift looks back one position), any such padding with a sliding window."""
    model = _fox("fox-pro").eval()
    ids = torch.randint(1, VOCAB, (1, 6))
    cache = model(ids[:, :2], use_cache=True).past_key_values
    with pytest.raises(ValueError, match="attention_mask: with a cache, padding between real tokens must end"):
        model(ids[:, 2:], attention_mask=torch.tensor([[1, 1, 1, 0, 1, 1]]), cache=cache, use_cache=True)
    windowed = _fox("fox-llama", gate="alibi", window=4).eval()
    out = windowed(ids[:, :4], attention_mask=torch.tensor([[1, 1, 1, 0]]), use_cache=True)  # ends in padding: fine
    with pytest.raises(ValueError, match=r"attention_mask: a sliding-window model \(window=4\)"):
        windowed(ids[:, 4:5], attention_mask=torch.tensor([[1, 1, 1, 0, 1]]), cache=out.past_key_values,
                 use_cache=True)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("arch", ["fox-pro", "transformer-pro"])
def test_gradient_checkpointing_reentrant_or_not_keeps_gradients(arch, reentrant):
    """gradient_checkpointing_enable(use_reentrant=True or False): the blocks are transformers'
    GradientCheckpointingLayer and give the gradients of an unchecked forward. Reentrant raised on FoX's keyword
    arguments."""
    model = _fox(arch).double().train()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding: segments, token-shift resets, RoPE positions all go through the checkpoint
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert model.is_gradient_checkpointing
    calls = []
    hooks = [block.attn.register_forward_pre_hook(lambda *_: calls.append(1)) for block in model.model.layers]
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    assert len(calls) == 2 * len(model.model.layers)  # each block ran again in the backward: checkpointed
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("arch", ["fox-llama", "fox-pro"])
def test_gradient_checkpointing_turns_use_cache_off_as_llama(arch):
    """use_cache=True in a checkpointed training forward: as a Llama, no cache and the loss and gradients of a
    forward without one. The blocks dropped the cache while the model laid a left-padded batch out for one, so the
    padding reached attention as flags no block read: another loss."""
    model = _fox(arch).double().train()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    want = model(ids, attention_mask=mask, labels=labels, use_cache=False)
    want.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got = model(ids, attention_mask=mask, labels=labels, use_cache=True)
    got.loss.backward()
    llama = _llama().train()
    llama.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert llama(ids, attention_mask=mask, labels=labels, use_cache=True).past_key_values is None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-10, atol=1e-12, msg=name)
    assert got.past_key_values is None


def test_generate_with_output_attentions_as_llama_sdpa():
    """generate(output_attentions=True, return_dict_in_generate=True): the same tokens as without, and, as a Llama
    on SDPA attention, a warning and an empty attentions entry per step (the cache path computes no weights).
    FoX raised; a forward without a cache still returns the weights."""
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    model = _fox().eval()
    llama = LlamaForCausalLM._from_config(_llama().config, attn_implementation="sdpa").eval()
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(8))
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    want = model.generate(ids, **kwargs)
    logging.get_logger("transformers").warning_once.cache_clear()  # warnings come once per process
    with CaptureLogger(logging.get_logger("foxlm.models.modeling_fox")) as captured:
        got = model.generate(ids, output_attentions=True, **kwargs)
    assert "does not support `output_attentions=True`" in captured.out
    assert torch.equal(got.sequences, want.sequences)
    reference = llama.generate(ids, output_attentions=True, **kwargs)
    assert got.attentions == reference.attentions == ((), (), ())
    assert len(model(ids, output_attentions=True).attentions) == 2


def test_saved_tokenizer_names_a_class_transformers_4_and_5_load(tmp_path):
    """tokenizer_config.json names PreTrainedTokenizerFast, not transformers 5's TokenizersBackend, which
    AutoTokenizer of transformers 4.57 cannot load (a saved tokenizer goes to environments without foxlm, which itself
    needs transformers 5); transformers 5 loads it as before."""
    from transformers import AutoTokenizer

    from foxlm.data import get_tokenizer

    tok = get_tokenizer("gpt2")
    tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf("To be, or not to be").input_ids == [tok.eot_id] + tok.encode("To be, or not to be")

if __name__ == "__main__":  # one torchrun worker: 4 of the 8 rows each, one step
    import torch.distributed as dist

    torch.set_num_threads(1)
    root = sys.argv[1]
    result = _train_one_step(_fox(), os.path.join(root, "ddp"), 4, 1)
    if dist.get_rank() == 0:
        with open(os.path.join(root, "ddp.json"), "w") as f:
            json.dump(result, f)


# What transformers' GenerationTesterMixin checks of a decoder (its file is not in transformers' sdist, so it cannot
# run here): each decoding mode gives the same tokens with FoX's cache as without one, a generation continues from
# the cache it returned, and inputs_embeds generate as the ids they embed.
GENERATION_MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=20),
    "beam search": dict(num_beams=3, do_sample=False),
    "beam sample": dict(num_beams=3, do_sample=True, top_k=20),
    "beams, 2 returned": dict(num_beams=3, num_return_sequences=2, do_sample=False),
}


@pytest.mark.parametrize("arch", ["fox-pro", "fox-llama"])
@pytest.mark.parametrize("mode", GENERATION_MODES)
def test_generate_modes_give_the_same_tokens_with_and_without_cache(arch, mode):
    """Beam search reorders the cache's rows (FoX's attention state and, in Pro, the token shift's last inputs) by
    beam every step: a wrong reorder changes the beams' tokens against the cache-less recomputation."""
    model = _fox(arch, num_key_value_heads=2, pad_token_id=0).eval()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    out = []
    for use_cache in (True, False):
        torch.manual_seed(1)
        out.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                  use_cache=use_cache, **GENERATION_MODES[mode]))
    rows = 4 if mode == "beams, 2 returned" else 2
    assert out[0].shape == (rows, 13) and torch.equal(out[0], out[1])


@pytest.mark.parametrize("arch", ["fox-pro", "fox-llama"])
def test_generate_continues_from_returned_cache_and_from_inputs_embeds(arch):
    model = _fox(arch, pad_token_id=0).eval()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    kw = dict(do_sample=False, min_new_tokens=3)
    full = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, **kw)
    first = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, return_dict_in_generate=True,
                           **kw)
    seq = first.sequences
    more = model.generate(seq, attention_mask=torch.ones_like(seq), past_key_values=first.past_key_values,
                          max_new_tokens=3, **kw)
    assert torch.equal(more, full)
    embeds = model.get_input_embeddings()(ids)
    from_embeds = model.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(ids), max_new_tokens=6, **kw)
    assert torch.equal(from_embeds, full[:, ids.shape[1]:])  # as for a Llama: only the new tokens


def test_prompt_lookup_decoding_matches_greedy():
    model = _fox("fox-pro", pad_token_id=0).eval()
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6)).repeat(1, 2)  # repeats to find
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=3, **kw), model.generate(ids, **kw))


@pytest.mark.parametrize("name", ["llama", "fox-pro", "fox-llama"])
@pytest.mark.parametrize("with_mask", [True, False])
def test_decoding_loop_on_the_cache_it_made_as_in_transformers_docs(name, with_mask):
    """transformers' docs decode by hand passing, at every call, the ``DynamicCache()`` they made, never the output's
    cache: FoX's forward decoded into a FoxCache of its own, so the caller's stayed empty and every call started
    from nothing (each new token alone; with the growing mask, an error). generate on that cache fills it too."""
    from transformers import DynamicCache

    model = (_llama() if name == "llama" else _fox(name)).eval()
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(7))
    cache, tokens, inputs = DynamicCache(), ids, {"input_ids": ids}
    with torch.no_grad():
        for _ in range(4):
            if with_mask:
                inputs["attention_mask"] = torch.ones_like(tokens)
            out = model(**inputs, past_key_values=cache, use_cache=True)
            inputs = {"input_ids": out.logits[:, -1:].argmax(-1)}
            tokens = torch.cat([tokens, inputs["input_ids"]], 1)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, model.generate(ids, **kw))
    assert cache.get_seq_length() == 9  # the prompt and three fed tokens
    given = DynamicCache()
    out = model.generate(ids, past_key_values=given, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, tokens) and out.past_key_values is given and given.get_seq_length() == 9


@pytest.mark.parametrize("name", ["llama", "fox-pro", "fox-unfused"])
def test_trainer_evaluate_reports_loss_and_gives_logits_to_metrics(name, tmp_path):
    """Trainer.evaluate: eval_loss, the mean of the batches' losses, with prediction_loss_only and with compute_metrics,
    which gets the [N, T, V] logits (or what preprocess_logits_for_metrics makes of them) and the labels, as for a
    Llama. FoX's forward named shift_labels, and the Trainer takes every argument named *label* for a label that every
    batch must carry: it computed no loss, no eval_loss came back, and compute_metrics got a tuple."""
    model, rows = MODELS[name](), _rows()
    with torch.no_grad():
        want = sum(model.eval()(**{k: torch.stack([r[k] for r in rows[i:i + 4]]) for k in rows[0]}).loss
                   for i in (0, 4)) / 2
    seen = {}

    def metrics(prediction):
        seen["predictions"], seen["labels"] = prediction.predictions, prediction.label_ids
        return {}

    def argmax(logits, labels):
        seen["logits"] = logits
        return logits.argmax(-1)

    def trainer(loss_only: bool) -> Trainer:
        args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[], use_cpu=True,
                                 dataloader_num_workers=0, disable_tqdm=True, prediction_loss_only=loss_only)
        return Trainer(model=model, args=args, eval_dataset=rows, compute_metrics=metrics,
                       preprocess_logits_for_metrics=argmax)

    assert trainer(loss_only=True).evaluate()["eval_loss"] == pytest.approx(want.item(), rel=1e-5)
    assert not seen
    assert trainer(loss_only=False).evaluate()["eval_loss"] == pytest.approx(want.item(), rel=1e-5)
    assert tuple(seen["logits"].shape) == (4, 12, VOCAB)
    assert seen["predictions"].shape == seen["labels"].shape == (8, 12)
    assert (seen["labels"] == torch.stack([r["labels"] for r in rows]).numpy()).all()


@pytest.mark.parametrize("name", ["llama", "fox-pro", "fox-unfused"])
def test_trainer_label_smoothing_shifts_labels_as_for_llama(name, tmp_path):
    """label_smoothing_factor > 0: the Trainer takes the labels from the batch, calls the model without them and
    smooths the loss on its logits, shifting the labels for the causal LMs in transformers' table of them. FoX was
    not in it: each position was scored against its own token, not the next one."""
    from transformers.trainer_pt_utils import LabelSmoother

    model, rows = MODELS[name](), _rows()
    ids, labels = (torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels"))
    with torch.no_grad():
        want = LabelSmoother(0.1)(model.train()(ids, use_cache=False), labels, shift_labels=True)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=1, logging_steps=1,
                             label_smoothing_factor=0.1, report_to=[], save_strategy="no", use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    assert next(r for r in trainer.state.log_history if "loss" in r)["loss"] == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("name", ["llama", "fox-pro"])
def test_trainer_resume_from_checkpoint_continues_the_uninterrupted_run(name, tmp_path):
    """save_strategy="steps" then resume_from_checkpoint (safetensors weights, optimizer, scheduler, RNG states) with
    gradient accumulation over uneven label counts: the resumed run logs the uninterrupted run's losses, as for a
    Llama; the saved model (Trainer.save_model) loads with from_pretrained to the trained weights."""

    def trainer(model, out) -> Trainer:
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=4, logging_steps=1, learning_rate=1e-2, save_strategy="steps", save_steps=2,
                                 report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0)
        return Trainer(model=model, args=args, train_dataset=_rows())

    def losses(t: Trainer) -> list[float]:  # of steps 3 and 4 (the resumed state holds the checkpoint's log too)
        return [r["loss"] for r in t.state.log_history if "loss" in r and r["step"] > 2]

    whole = trainer(MODELS[name](), tmp_path / "whole")
    whole.train()
    assert (tmp_path / "whole" / "checkpoint-2" / "model.safetensors").is_file()
    resumed = trainer(MODELS[name](), tmp_path / "whole")  # the same checkpoints, read back
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert len(losses(whole)) == 2 and losses(resumed) == pytest.approx(losses(whole), rel=1e-5)
    resumed.save_model(str(tmp_path / "final"))
    loaded = type(resumed.model).from_pretrained(tmp_path / "final")
    for (key, want), got in zip(resumed.model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=key)

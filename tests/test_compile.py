"""torch.compile and torch.export of foxlm models, on foxlm's Triton kernels (on the GPU, else in Triton's interpreter
on CPU) and on the CPU path.

The attention ops are custom ops the compiler keeps opaque (on the CPU path, ``foxlm::attention_from_cumsum``,
which plans its query chunks at run time); the fused norm and token-shift kernels step aside for their PyTorch path
under the compiler, which fuses it itself. So a block, and a whole model's forward with its loss, compile as one
graph (``fullgraph=True``) and train to the eager gradients; ``torch.export`` captures a forward; and HF
``generate`` on compiled blocks compiles a fixed number of graphs, not one per decoded token.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foxlm.models import FoxCache, FoxConfig, FoxForCausalLM
from foxlm.ops import forgetting_attention, gate_cumsum
from foxlm.ops.cross_entropy import linear_cross_entropy
from foxlm.ops.forgetting_attention import sdpa
from foxlm.ops.forgetting_attention import triton_op as ta

needs_triton = [
    pytest.mark.triton,
    pytest.mark.skipif(not (torch.cuda.is_available() or ta._INTERPRETED),
                       reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)"),
]


@needs_triton[0]
@needs_triton[1]
def test_compiled_blocks_match_eager(device):
    config = FoxConfig.preset("fox-pro", "tiny", num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                              intermediate_size=128, vocab_size=256, acp=True)
    torch.manual_seed(0)
    eager = FoxForCausalLM(config).train().to(device)
    compiled = FoxForCausalLM(config).train().to(device)
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.model.layers:
        block.compile(backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, 256, (2, 40), device=device)
    losses, grads = [], []
    for model in (eager, compiled):
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    torch.testing.assert_close(losses[1], losses[0])
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_generate_on_compiled_blocks_compiles_no_graph_per_token():
    """The decode steps' growing cache (keys, gate cumsum, token-shift history) must not make dynamo compile a
    graph per token: after the prefill and the first decode steps (dynamic shapes), the graph count stays put."""
    config = FoxConfig.preset("fox-pro", "tiny", num_hidden_layers=1, hidden_size=64, num_attention_heads=2,
                              intermediate_size=128, vocab_size=256, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = FoxForCausalLM(config).eval()
    eager = model.generate(torch.randint(0, 256, (1, 8)), max_new_tokens=16, do_sample=False)
    for block in model.model.layers:
        block.compile(backend="eager")
    torch._dynamo.reset()
    graphs = []
    for new_tokens in (4, 16):
        torch._dynamo.utils.counters.clear()
        out = model.generate(eager[:, :8], max_new_tokens=new_tokens, do_sample=False)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        torch._dynamo.reset()
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[1] == graphs[0], f"graphs compiled for 4 and 16 new tokens: {graphs}"
    assert torch.equal(out, eager)


# --- the CPU path (the PyTorch path of every op) ----------------------------------------------------------------------
def _tiny() -> FoxConfig:
    """fox-pro (token shift, QK-norm, output gate) with GQA, a sliding window and ACP: every branch of the CPU
    attention's plan (masked chunks, per-head row starts) is in the graph."""
    return FoxConfig.preset("fox-pro", "tiny", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=128, vocab_size=256, window=24, acp=True,
                            bos_token_id=None, eos_token_id=None)


@pytest.fixture
def small_chunks(monkeypatch):
    """Several query chunks per sequence, so that the compiled op plans more than one."""
    monkeypatch.setattr(sdpa, "CHUNK_ROWS", 16)


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def test_cpu_block_compiles_fullgraph_and_matches_eager(small_chunks):
    """A FoX block on the CPU path compiles as one graph and gives eager's outputs and gradients."""
    torch.manual_seed(0)
    model = FoxForCausalLM(_tiny()).train()
    block = model.model.layers[0]
    x = torch.randn(2, 40, 64, requires_grad=True)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (block, compiled):
        y = fn(x)[0]
        results.append((y, torch.autograd.grad(y.square().sum(), [x, *block.parameters()])))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_cpu_training_step_compiles_fullgraph_and_matches_eager(small_chunks):
    """A whole FoxForCausalLM forward with its fused loss compiles as one graph on the CPU path (the attention's
    plan and the cross-entropy's label check make no graph break), and its loss and backward are eager's."""
    torch.manual_seed(0)
    model = FoxForCausalLM(_tiny()).train()
    ids = torch.randint(0, 256, (2, 40))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    (loss, grads), (want, want_grads) = _loss_and_grads(compiled, ids), _loss_and_grads(model, ids)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_cpu_export_forward_matches_eager():
    """torch.export captures a FoxForCausalLM forward (no cache) on the CPU path; the exported program gives
    eager's logits, also for other token ids of the same shape."""
    torch.manual_seed(0)
    model = FoxForCausalLM(_tiny()).eval()
    ids = torch.randint(0, 256, (2, 40))
    exported = torch.export.export(model, (), {"input_ids": ids, "use_cache": False})
    for x in (ids, torch.randint(0, 256, (2, 40))):
        with torch.no_grad():
            want = model(input_ids=x, use_cache=False).logits
        torch.testing.assert_close(exported.module()(input_ids=x, use_cache=False).logits, want, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("case", ["plain", "gqa-window", "varlen-acp", "tail"])
def test_cpu_attention_custom_ops_give_eager_bits(small_chunks, monkeypatch, case):
    """The custom ops that the compiler sees (run here eagerly, as the compiled graph runs them) give the eager
    path's o, lse and gradients to the bit; opcheck holds their fake shapes and autograd registration to theirs."""
    g = torch.Generator().manual_seed(1)
    Hk = 2 if case == "gqa-window" else 4
    q, k, v = (torch.randn(1, 40, h, 16, generator=g) for h in (4, Hk, Hk))
    log_f = F.logsigmoid(3 * torch.randn(1, 40, 4, generator=g))
    kwargs = {
        "plain": {}, "tail": {}, "gqa-window": {"window": 7},
        "varlen-acp": {"cu_seqlens": torch.tensor([0, 9, 9, 40], dtype=torch.int32), "prune": True, "tolerance": 0.3},
    }[case]

    def run():
        ts = [t.clone().requires_grad_() for t in (q, k, v, log_f)]
        if case == "tail":  # a cache's call: queries the last 30 of 40 keys
            c = gate_cumsum(ts[3])
            o, lse = sdpa.attention_from_cumsum(ts[0][:, 10:], ts[1], ts[2], c[:, 10:], c, scale=0.3)
        else:
            o, lse = forgetting_attention(*ts, return_lse=True, **kwargs)
        do, dl = torch.randn(o.shape, generator=g), torch.randn(lse.shape, generator=g)
        return o, lse, *torch.autograd.grad((o * do).sum() + (lse * dl).sum(), ts)

    g.manual_seed(2)
    want = run()
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        g.manual_seed(2)
        got = run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    c = gate_cumsum(log_f)
    leaves = [t.clone().requires_grad_() for t in (q[:, 10:], k, v, c[:, 10:], c)]
    torch.library.opcheck(sdpa._forward_op, (*leaves, None, None, 0.3, 10, 5 if case == "gqa-window" else None, True))


def test_compiled_loss_asserts_bad_labels_eager_raises_one_line():
    """Compiled, a label outside [0, V) fails an in-graph assertion (no host sync); eagerly on the CPU it is a
    one-line ValueError naming the argument."""
    hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    good, bad = torch.tensor([1, 2, 3, -100, 9, 0]), torch.tensor([1, 2, 3, -100, 10, 0])
    compiled = torch.compile(linear_cross_entropy, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(hidden, weight, good), linear_cross_entropy(hidden, weight, good))
    with pytest.raises(RuntimeError, match="labels: expected values in"):
        compiled(hidden, weight, bad)
    with pytest.raises(ValueError, match=r"^labels: expected values in \[0, 10\) or ignore_index=-100$"):
        linear_cross_entropy(hidden, weight, bad)


# --- padded batches (attention_mask) ----------------------------------------------------------------------------------
_MASKS = {  # each with a row of no padding
    "all-ones": [[1] * 9] * 3,
    "left": [[0, 0, 0] + [1] * 6, [1] * 9, [0] * 5 + [1] * 4],  # generate's prompts
    "right": [[1] * 6 + [0] * 3, [1] * 9, [1] * 4 + [0] * 5],  # evaluation's padded batches
    "gaps": [[1, 1, 0, 0] + [1] * 5, [1] * 9, [0] * 5 + [1] * 4],  # generate without a cache on right padding
}


def _padded_model(arch: str, num_hidden_layers: int = 2) -> FoxForCausalLM:
    """A tiny fp64 model of ``arch`` (as tests/models/test_modeling_fox.py's), moved off its init point."""
    torch.manual_seed(0)
    config = FoxConfig.preset(arch, "tiny", vocab_size=97, hidden_size=32, num_attention_heads=4,
                              intermediate_size=64, num_hidden_layers=num_hidden_layers, bos_token_id=None,
                              eos_token_id=None)
    model = FoxForCausalLM(config).double()
    for p in model.parameters():
        p.data += 0.1 * torch.randn_like(p)
    return model


@pytest.mark.parametrize("arch", ["fox-llama", "fox-pro"])
def test_cpu_padded_forward_compiles_fullgraph_and_matches_eager(arch):
    """With an attention_mask (all ones, left or right padding, padding between real tokens) a whole FoxForCausalLM
    forward compiles as one graph, for every mask (no host sync, no recompilation), and gives eager's logits at every
    position, pads too, and eager's loss with HF's labels (-100 at the pads) and its gradients, in eval and in
    training (the fused loss)."""
    model = _padded_model(arch)
    ids = torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for training in (False, True):
        model.train(training)
        for name, mask in _MASKS.items():
            mask = torch.tensor(mask)
            labels = ids.masked_fill(mask == 0, -100)
            got, want = (m(ids, attention_mask=mask, labels=labels, use_cache=False) for m in (compiled, model))
            tol = dict(rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}, training={training}: {m}")
            if not training:
                torch.testing.assert_close(got.logits, want.logits, **tol)
                torch.testing.assert_close(compiled(ids, attention_mask=mask, use_cache=False).logits, want.logits,
                                           **tol)
            torch.testing.assert_close(got.loss, want.loss, **tol)
            for a, b in zip(*(torch.autograd.grad(out.loss, list(model.parameters())) for out in (got, want))):
                torch.testing.assert_close(a, b, **tol)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 3, f"{graphs} graphs: expected one per call kind (eval with and without labels, training), " \
                        f"not one per mask"


def test_cpu_padded_forward_compiles_with_inductor():
    """The default backend (inductor) too: a left-padded batch's logits are eager's."""
    model = _padded_model("fox-pro", num_hidden_layers=1).float().eval()
    ids = torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor(_MASKS["left"])
    with torch.no_grad():
        got = torch.compile(model, fullgraph=True)(ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(got, model(ids, attention_mask=mask, use_cache=False).logits)


@pytest.mark.parametrize("arch", ["fox-llama", "fox-pro"])
def test_generate_on_compiled_forward_with_left_padding_matches_eager(arch):
    """HF generate on a batch of left-padded prompts with the model's forward compiled (fullgraph=True): the cached
    prefill and decode steps with an attention_mask make no host sync, compile a few graphs (not one per token) and
    give eager's tokens and logits."""
    model = _padded_model(arch).eval()
    mask = torch.tensor(_MASKS["left"])
    ids = torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(1)).masked_fill(mask == 0, 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    want = model.generate(ids, **kwargs)
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < graphs < 8, f"{graphs} graphs for 8 new tokens"


def test_compiled_cached_forward_asserts_bad_padding_eager_raises_one_line():
    """Compiled, padding a cached call cannot make inert (between real tokens of a later call) fails an in-graph
    assertion (no host sync); eagerly it is a one-line ValueError naming the argument."""
    model = _padded_model("fox-pro", num_hidden_layers=1).eval()
    ids = torch.randint(1, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    bad = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1], [1] * 8])
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    message = "attention_mask: with a cache, padding between real tokens must end a call"
    for run, error in ((compiled, RuntimeError), (model, ValueError)):
        cache = model(ids[:, :2], cache=FoxCache(), use_cache=True).past_key_values
        with pytest.raises(error, match=("" if run is compiled else "^") + message):
            run(ids[:, 2:], attention_mask=bad, cache=cache, use_cache=True)


@needs_triton[0]
@needs_triton[1]
@pytest.mark.parametrize("acp", [False, True])
def test_padded_forward_compiles_fullgraph_on_the_kernels(device, acp):
    """The compiled padded forward on the Triton kernels: its segments (three a row, empty ones included, and the
    row length as max_seqlen, a bound) give eager's logits at the real tokens and eager's loss, ACP or not."""
    torch.manual_seed(0)
    config = FoxConfig.preset("fox-pro", "tiny", vocab_size=97, hidden_size=64, num_attention_heads=2,
                              intermediate_size=128, num_hidden_layers=1, bos_token_id=None, eos_token_id=None,
                              acp=acp)
    model = FoxForCausalLM(config).eval().to(device)
    ids = torch.randint(1, 97, (3, 24), device=device)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    masks = {"left": [[0] * 7 + [1] * 17, [1] * 24, [0] * 18 + [1] * 6],  # segments across the 16-token tiles
             "right": [[1] * 17 + [0] * 7, [1] * 24, [1] * 6 + [0] * 18]}
    with torch.no_grad():
        for name, mask in masks.items():
            mask = torch.tensor(mask, device=device)
            labels = ids.masked_fill(mask == 0, -100)
            got, want = (m(ids, attention_mask=mask, labels=labels, use_cache=False) for m in (compiled, model))
            real = mask.bool()
            torch.testing.assert_close(got.logits[real], want.logits[real], msg=name)
            torch.testing.assert_close(got.loss, want.loss, msg=name)


def test_generate_on_compiled_forward_with_acp_prunes_as_eager():
    """With ACP on, a compiled forward's decode steps prune as eager's do (not at all: a decode step is not a chunk
    of prefill, though compiled it always gets the call's ``valid``), so generate gives eager's logits; fast gates
    make the prompt's pruning real."""
    model = _padded_model("fox-pro").eval()
    model.config.acp = True
    for layer in model.model.layers:
        layer.attn.fgate_proj.bias.data.fill_(-4.0)  # log f ~ -4: keys a few tokens back fall below delta
    mask = torch.tensor(_MASKS["left"])
    ids = torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(1)).masked_fill(mask == 0, 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    want = model.generate(ids, **kwargs)
    unpruned = model.generate(ids, **kwargs | dict(max_new_tokens=1))  # the prompt with ACP: pruning happens
    model.config.acp = False
    assert not torch.equal(model.generate(ids, **kwargs | dict(max_new_tokens=1)).logits[0], unpruned.logits[0])
    model.config.acp = True
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    got = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)

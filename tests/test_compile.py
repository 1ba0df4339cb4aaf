"""torch.compile of a fox-pro model on foxlm's Triton kernels (on the GPU, else in Triton's interpreter on CPU).

The attention kernels are custom ops the compiler keeps opaque; the fused norm and token-shift kernels step
aside for their PyTorch path under the compiler, which fuses it itself. So a block compiles as one graph
(``fullgraph=True``) and trains to the eager gradients. On the CPU path the attention's chunk plan runs outside
the graph (``torch.compiler.disable``): no fullgraph there, but HF ``generate`` on compiled blocks compiles a
fixed number of graphs, not one per decoded token.
"""

from __future__ import annotations

import pytest
import torch

from foxlm.models import FoxConfig, FoxForCausalLM
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

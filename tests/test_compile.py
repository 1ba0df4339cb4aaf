"""torch.compile of a fox-pro model on foxlm's Triton kernels (on the GPU, else in Triton's interpreter on CPU).

The attention kernels are custom ops the compiler keeps opaque; the fused norm and token-shift kernels step
aside for their PyTorch path under the compiler, which fuses it itself. So a block compiles as one graph
(``fullgraph=True``) and trains to the eager gradients.
"""

from __future__ import annotations

import pytest
import torch

from foxlm.models import FoxConfig, FoxForCausalLM
from foxlm.ops.forgetting_attention import triton_op as ta

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not (torch.cuda.is_available() or ta._INTERPRETED),
                       reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)"),
]


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

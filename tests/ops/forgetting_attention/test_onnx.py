"""foxlm.ops.forgetting_attention.onnx: models and the op exported with torch.onnx (dynamo), run in onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from foxlm.models import FoxConfig, FoxForCausalLM
from foxlm.ops import forgetting_attention, onnx_translation_table

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")


def _export(module: torch.nn.Module, args: tuple, path, dynamic_shapes=None):
    program = torch.onnx.export(module, args, dynamo=True, custom_translation_table=onnx_translation_table(),
                                dynamic_shapes=dynamic_shapes, verbose=False)
    program.save(str(path))
    return ort.InferenceSession(str(path))


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids, use_cache=False).logits


@pytest.mark.parametrize("preset", ["fox-pro", "fox-llama"])
def test_model_exports_and_runs_in_onnxruntime(preset, tmp_path):
    """A FoX model (GQA: 4 query heads on 2 key heads) exported once with a dynamic batch and length gives eager's
    logits in onnxruntime at other batch sizes and lengths."""
    torch.manual_seed(0)
    cfg = FoxConfig.preset(preset, "tiny", vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, bos_token_id=96, eos_token_id=96)
    model = FoxForCausalLM(cfg).eval()
    session = _export(_Logits(model), (torch.randint(0, 97, (2, 21)),), tmp_path / "model.onnx",
                      dynamic_shapes=({0: "batch", 1: "length"},))
    for shape in ((1, 9), (3, 40)):
        ids = torch.randint(0, 97, shape)
        got = session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0]
        with torch.no_grad():
            want = model(ids, use_cache=False).logits.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


class _Attention(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v, log_fgate):
        return forgetting_attention(q, k, v, log_fgate, return_lse=True, **self.kwargs)


@pytest.mark.parametrize("case", ["window", "tq<tk", "acp", "fp64"])
def test_op_exports_with_window_query_offset_acp_and_fp64(case, tmp_path):
    """The op's window, queries at the end of longer keys (a cache's chunk), ACP (whose threshold the ONNX form
    does not apply: what it skips carries < e^-10 of a row's mass) and fp64 inputs (computed in fp64, as the op
    does): o and lse as the op gives them."""
    g = torch.Generator().manual_seed(1)
    Tq = 11 if case == "tq<tk" else 30
    dtype = torch.float64 if case == "fp64" else torch.float32
    q = torch.randn(2, Tq, 4, 16, generator=g, dtype=dtype)
    k, v = (torch.randn(2, 30, 2, 16, generator=g, dtype=dtype) for _ in range(2))
    log_fgate = F.logsigmoid(torch.randn(2, 30, 4, generator=g) + 1)
    kwargs = {"window": dict(window=7), "tq<tk": {}, "acp": dict(prune=True), "fp64": {}}[case]
    module = _Attention(**kwargs)
    session = _export(module, (q, k, v, log_fgate), tmp_path / "op.onnx")
    got = session.run(None, {i.name: x.numpy() for i, x in zip(session.get_inputs(), (q, k, v, log_fgate))})
    with torch.no_grad():
        want = module(q, k, v, log_fgate)
    for a, e in zip(got, want):
        assert a.dtype == e.numpy().dtype
        np.testing.assert_allclose(a, e.numpy(), **(dict(rtol=1e-12, atol=1e-13) if case == "fp64" else
                                                    dict(rtol=1e-4, atol=1e-5)))


def test_packed_sequences_are_refused_at_export(tmp_path):
    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
    log_fgate = F.logsigmoid(torch.randn(1, 12, 2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)

    class Packed(torch.nn.Module):
        def forward(self, q, k, v, log_fgate):
            return forgetting_attention(q, k, v, log_fgate, cu_seqlens=cu, max_seqlen=7)

    with pytest.raises(Exception, match="cu_seqlens"):
        _export(Packed(), (q, k, v, log_fgate), tmp_path / "packed.onnx")

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


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("offsets", [[0, 0, 6, 6, 13, 20, 20], [0, 0, 6, 10, 13, 20, 20]])
def test_packed_sequences_export(window, offsets, tmp_path):
    """Packed sequences (cu_seqlens with empty ones, as a model's padding layout has them; with a window too) export
    and give the op's o and lse: they were refused at export. The second offsets are a padding layout (three
    sequences a row of 10), which the ONNX graph attends row by row; the first cross such rows."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 20, 4, 16, generator=g)
    k, v = (torch.randn(1, 20, 2, 16, generator=g) for _ in range(2))
    log_fgate = F.logsigmoid(torch.randn(1, 20, 4, generator=g) + 1)
    cu = torch.tensor(offsets, dtype=torch.int32)

    class Packed(torch.nn.Module):
        def forward(self, q, k, v, log_fgate, cu_seqlens):
            return forgetting_attention(q, k, v, log_fgate, cu_seqlens=cu_seqlens, max_seqlen=7, window=window,
                                        return_lse=True)

    inputs = (q, k, v, log_fgate, cu)
    session = _export(Packed(), inputs, tmp_path / "packed.onnx")
    got = session.run(None, {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)})
    with torch.no_grad():
        want = Packed()(*inputs)
    for a, e in zip(got, want):
        np.testing.assert_allclose(a, e.numpy(), rtol=1e-4, atol=1e-5)


class _MaskedLogits(_Logits):
    def forward(self, input_ids, attention_mask):
        return self.model(input_ids, attention_mask=attention_mask, use_cache=False).logits


def _with_intermediates(path) -> "ort.InferenceSession":
    """The saved model with every intermediate the exporter typed as an output too, to read their sizes."""
    onnx = pytest.importorskip("onnx")
    model = onnx.load(str(path))
    typed = {v.name: v for v in model.graph.value_info}
    outputs = {o.name for o in model.graph.output}
    model.graph.output.extend(typed[name] for node in model.graph.node for name in node.output
                              if name in typed and name not in outputs)
    onnx.save(model, str(path))
    return ort.InferenceSession(str(path))


@pytest.mark.parametrize("preset", ["fox-pro", "transformer-llama"])
def test_model_with_attention_mask_exports(preset, tmp_path):
    """A model exported with an attention_mask (dynamic batch and length) gives eager's logits on padded batches of
    other shapes: left, right and inner padding, a row of padding only. The export failed: ONNX has no stable sort
    or running maximum (the model's padding layout), and the attention refused the padding's segments. Its
    attention is row by row: no intermediate outgrows a [B, H, T, T] score tensor (the flattened batch's
    [1, H, B*T, B*T] did)."""
    torch.manual_seed(0)
    cfg = FoxConfig.preset(preset, "tiny", vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, bos_token_id=96, eos_token_id=96)
    model = FoxForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (2, 21))
    _export(_MaskedLogits(model), (ids, torch.ones_like(ids)), tmp_path / "model.onnx",
            dynamic_shapes=({0: "batch", 1: "length"}, {0: "batch", 1: "length"}))
    session = _with_intermediates(tmp_path / "model.onnx")
    ids = torch.randint(0, 97, (4, 30))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, 25:] = 0
    mask[2, 10:13] = 0
    mask[3] = 0
    got = session.run(None, {session.get_inputs()[0].name: ids.numpy(), session.get_inputs()[1].name: mask.numpy()})
    with torch.no_grad():
        want = model(ids, attention_mask=mask, use_cache=False).logits.numpy()
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-5)
    assert len(got) > 100  # the intermediates are there to measure
    scores = max(x.size for x in got if x.ndim == 4)  # the attention's tensors are the 4-D ones
    assert scores == 4 * cfg.num_attention_heads * 30 * 30


class _PositionedLogits(_Logits):
    def forward(self, input_ids, position_ids):
        return self.model(input_ids, position_ids=position_ids, use_cache=False).logits


@pytest.mark.parametrize("preset", ["fox-pro", "transformer-llama"])
def test_model_with_packed_position_ids_exports(preset, tmp_path):
    """Documents packed in a row, told by position_ids that restart (DataCollatorWithFlattening's), exported with a
    dynamic batch and length, give eager's logits on other packings and shapes, and plain positions too (one
    document). The export failed: the model asked the host whether any position restarts (a data-dependent guard)."""
    torch.manual_seed(0)
    cfg = FoxConfig.preset(preset, "tiny", vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, bos_token_id=96, eos_token_id=96)
    model = FoxForCausalLM(cfg).eval()

    def packed(*rows):
        return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])

    session = _export(_PositionedLogits(model), (torch.randint(0, 97, (2, 21)), packed((8, 13), (21,))),
                      tmp_path / "model.onnx", dynamic_shapes=({0: "batch", 1: "length"}, {0: "batch", 1: "length"}))
    for positions in (packed((5, 15, 1, 9)), packed((1, 10, 6), (17,), (4, 4, 9))):
        ids = torch.randint(0, 97, positions.shape)
        got = session.run(None, {session.get_inputs()[0].name: ids.numpy(),
                                 session.get_inputs()[1].name: positions.numpy()})[0]
        with torch.no_grad():
            want = model(ids, position_ids=positions, use_cache=False).logits.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("case", ["sort", "sort descending dim 0", "sort bool", "cummax", "cummax dim 0 bool"])
def test_stable_sort_and_cummax_translations(case, tmp_path):
    """The table's aten.sort.stable and aten.cummax give torch's values and indices (ties: a stable order, the
    last maximum) at another length than the export's."""
    fns = {"sort": lambda x: torch.sort(x, dim=1, stable=True),
           "sort descending dim 0": lambda x: torch.sort(x, dim=0, stable=True, descending=True),
           "sort bool": lambda x: torch.sort(x > 1, dim=-1, stable=True),
           "cummax": lambda x: torch.cummax(x, dim=1),
           "cummax dim 0 bool": lambda x: torch.cummax(x > 1, dim=0)}
    module = _Call(fns[case])
    g = torch.Generator().manual_seed(3)
    session = _export(module, (torch.randint(0, 4, (5, 9), generator=g),), tmp_path / "op.onnx",
                      dynamic_shapes=({0: "rows", 1: "length"},))
    x = torch.randint(0, 4, (6, 13), generator=g, dtype=torch.int64)
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    want = module(x)
    for a, e in zip(got, want):
        np.testing.assert_array_equal(a, e.numpy())


def test_float_stable_sort_is_refused_at_export(tmp_path):
    with pytest.raises(Exception, match="aten.sort.stable: only integer"):
        _export(_Call(lambda x: torch.sort(x, stable=True)), (torch.randn(3, 5),), tmp_path / "sort.onnx")

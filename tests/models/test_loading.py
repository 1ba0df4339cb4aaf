"""The edges of a FoX model's life in transformers' machinery: sharded save and load, dtypes, and what
``load_checkpoint_model`` does with a folder whose weights are damaged or do not fit its config.json, each against
what a transformers Llama does in the same place."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from foxlm.models import FoxConfig, FoxForCausalLM, load_checkpoint_model

VOCAB = 61
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
            bos_token_id=None, eos_token_id=None)
SHARD = "20KB"  # a tiny model in several shards

pytestmark = pytest.mark.usefixtures("one_thread")


def _fox(arch: str = "fox-pro") -> FoxForCausalLM:
    torch.manual_seed(0)
    model = FoxForCausalLM(FoxConfig.preset(arch, "tiny", **TINY))
    for p in model.parameters():  # off the init point, so that a re-initialized tensor shows
        p.data += 0.1 * torch.randn_like(p)
    return model.eval()


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                        num_hidden_layers=2)).eval()


def _shards(folder: Path) -> list[str]:
    return sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))


@pytest.mark.parametrize("arch,sharded", [("fox-pro", True), ("fox-llama", True), ("fox-pro", False)])
def test_truncated_shard_is_an_error_naming_the_shard(arch, sharded, tmp_path):
    """A weights file cut short (a copy that stopped): an error naming that file, not only the folder; transformers'
    own (a Llama's too) names neither."""
    _fox(arch).save_pretrained(tmp_path, max_shard_size=SHARD if sharded else "1GB")
    shard = tmp_path / (_shards(tmp_path)[1] if sharded else "model.safetensors")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    damaged = rf"path: {re.escape(str(shard))} is damaged or not a weights file \(.*incomplete"
    with pytest.raises(ValueError, match=damaged):
        load_checkpoint_model(tmp_path, progress=False)


def _drop_tensor(folder: Path, name: str) -> None:
    weights = load_file(folder / "model.safetensors")
    del weights[name]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_refused_where_from_pretrained_reinitializes_it(tmp_path):
    """A tensor missing from the weights: transformers (for a Llama and a FoX model alike) initializes it anew with a
    logged report; ``load_checkpoint_model``, which evaluation and generation load trained models with, refuses the
    half-trained model, naming the tensor."""
    name = "model.layers.1.attn.fgate_proj.weight"
    _fox().save_pretrained(tmp_path / "fox")
    _drop_tensor(tmp_path / "fox", name)
    llama_name = "model.layers.1.self_attn.q_proj.weight"
    _llama().save_pretrained(tmp_path / "llama")
    _drop_tensor(tmp_path / "llama", llama_name)
    for folder, missing in ((tmp_path / "fox", name), (tmp_path / "llama", llama_name)):
        _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert info["missing_keys"] == {missing}
    with pytest.raises(ValueError, match=rf"path: {re.escape(str(tmp_path / 'fox'))}: tensor {re.escape(name)} is "
                                         rf"missing"):
        load_checkpoint_model(tmp_path / "fox", progress=False)


def test_weights_the_config_has_no_place_for_are_refused(tmp_path):
    """config.json edited to one layer fewer than the weights hold: transformers builds the smaller model and drops
    the rest (as for a Llama); ``load_checkpoint_model`` refuses, naming a tensor left over."""
    for model, folder in ((_fox(), tmp_path / "fox"), (_llama(), tmp_path / "llama")):
        model.save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
        loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert loaded.config.num_hidden_layers == 1 and any(k.startswith("model.layers.1.")
                                                            for k in info["unexpected_keys"])
    with pytest.raises(ValueError, match=r"path: .* model\.layers\.1\.\S+ .*no place for"):
        load_checkpoint_model(tmp_path / "fox", progress=False)


def test_loading_info_when_asked_for(tmp_path):
    """``output_loading_info=True`` passed on to from_pretrained: (model, info), as transformers returns them."""
    model = _fox()
    model.save_pretrained(tmp_path, max_shard_size=SHARD)
    loaded, info = load_checkpoint_model(tmp_path, progress=False, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["fox-pro", "fox-llama"])
def test_sharded_round_trip_in_bf16_keeps_gate_and_shift_fp32(arch, tmp_path):
    """Sharded save and load gives the weights and logits back exactly; loaded in bf16 ("auto" then reads the saved
    dtype), the forget gate and token shift stay fp32 through a second sharded save and load, as the README says."""
    model = _fox(arch)
    model.save_pretrained(tmp_path / "fp32", max_shard_size=SHARD)
    assert len(_shards(tmp_path / "fp32")) > 1
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32").eval()
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).eval()
    bf16.save_pretrained(tmp_path / "bf16", max_shard_size=SHARD)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto").eval()
    kept = {name for name, _ in again.named_parameters() if "fgate_proj" in name or "shift.proj" in name}
    assert kept and (arch == "fox-pro") == any("shift" in name for name in kept)
    for name, p in again.named_parameters():
        assert p.dtype == (torch.float32 if name in kept else torch.bfloat16), name
        assert torch.equal(p, model.get_parameter(name).to(p.dtype)), name
    torch.testing.assert_close(again(ids).logits, bf16(ids).logits, rtol=0, atol=0)

"""A FoX model under PEFT and quantization as a Llama is: LoRA with no ``target_modules`` takes Llama's default
projections; the forget gate and the token shift's weights stay fp32 when loaded in bf16 and unquantized under
bitsandbytes 4-bit, and the model runs in both."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, PrefixTuningConfig, TaskType, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

from foxlm.models import FoxConfig, FoxForCausalLM

TINY = dict(vocab_size=61, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
            bos_token_id=None, eos_token_id=None)
FULL_PRECISION = ("fgate_proj", "k_shift.proj", "v_shift.proj")

pytestmark = pytest.mark.usefixtures("one_thread")


def _fox(**overrides) -> FoxForCausalLM:
    torch.manual_seed(0)
    model = FoxForCausalLM(FoxConfig.preset("fox-pro", "tiny", **{**TINY, **overrides})).eval()
    for p in model.parameters():  # off the init point: gates and shifts far from trivial
        p.data += 0.1 * torch.randn_like(p)
    return model


def _lora_targets(model) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def test_lora_without_target_modules_takes_llamas_default():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                         num_hidden_layers=2))
    llama_targets = _lora_targets(get_peft_model(llama, LoraConfig(r=4)))
    assert llama_targets == set(TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["llama"])

    model = get_peft_model(_fox(), LoraConfig(r=4, init_lora_weights=False))  # B != 0: LoRA changes the output
    assert _lora_targets(model) == llama_targets
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    ids = torch.randint(0, 61, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("probe", ["", "importlib.util.find_spec('peft'); from transformers import Trainer; "])
def test_peft_imported_after_foxlm_gets_the_fox_default(probe):
    # the default comes from an import hook: foxlm first, peft second (the test process above may have either order);
    # a find_spec before the import (transformers' check that peft is installed) must leave the hook in place
    code = ("import importlib.util, sys, foxlm; assert 'peft' not in sys.modules; " + probe +
            "from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as m; "
            "assert m['fox'] == m['llama'], m.get('fox')")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gate_and_shift_stay_fp32_when_loaded_in_bf16(tmp_path):
    model = _fox()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 61, (2, 10))
    with torch.no_grad():
        reference = model(ids).logits
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    for name, p in bf16.named_parameters():
        kept = any(part in name for part in FULL_PRECISION)
        assert p.dtype == (torch.float32 if kept else torch.bfloat16), name
    with torch.no_grad():
        logits = bf16(ids).logits
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), reference, atol=0.05, rtol=0.05)
    assert bf16.generate(ids, max_new_tokens=3, do_sample=False).shape == (2, 13)


def test_bitsandbytes_4bit_leaves_gate_and_shift_unquantized(tmp_path):
    bnb = pytest.importorskip("bitsandbytes", reason="in the [test] extra; the GPU lane's machine has none")
    model = _fox(hidden_size=64, intermediate_size=128)  # bitsandbytes' CPU kernels take 64-wide blocks
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 61, (2, 10))
    with torch.no_grad():
        reference = model(ids).logits
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, dtype=torch.bfloat16,
                                                     device_map="cpu").eval()
    for name, module in quantized.named_modules():
        if any(name.endswith(part) for part in FULL_PRECISION):
            assert type(module) is torch.nn.Linear and module.weight.dtype == torch.float32, name
        elif name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")):
            assert isinstance(module, bnb.nn.Linear4bit), name
    with torch.no_grad():
        logits = quantized(ids).logits
    assert torch.isfinite(logits).all()
    # 4-bit weights of a 32-wide model move the logits, but not to another model's
    assert torch.corrcoef(torch.stack([logits.float().flatten(), reference.flatten()]))[0, 1] > 0.9


def test_peft_prefix_tuning_is_refused_naming_it():
    """PEFT prefix tuning hands the model a DynamicCache of its virtual tokens' keys and values, which carries no
    forget-gate sums or token-shift states: a FoX model refuses it with a message that names the cause and the
    adapters that work (it said only that a DynamicCache is no FoxCache). (PEFT 0.21's generate hands transformers
    >= 5.24 the prefix under the old name, which a Llama ignores as a FoX model does.)"""
    model = get_peft_model(_fox(), PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)).train()
    ids = torch.randint(1, 61, (2, 10), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"DynamicCache that holds 4 tokens .* \(PEFT prefix tuning gives one"):
        model(input_ids=ids, labels=ids)

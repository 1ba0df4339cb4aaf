"""transformers' own common model and generation tests (``ModelTesterMixin``, ``GenerationTesterMixin``) on tiny
FoX models (LLaMA and Pro blocks), and on transformers' Llama as the reference of what a model passes.

The mixins are not in the transformers wheel: they live in its source tree's ``tests/``. They are read from
``$FOXLM_TRANSFORMERS_TESTS/tests`` or else from the sdist of the installed version that ``.ci/run`` unpacks into
``~/.cache/foxlm/transformers-src/transformers-<version>/`` (nothing of transformers is kept in this repository).
The sdist ships ``tests/test_modeling_common.py`` but not ``tests/generation/`` nor ``tests/exporters/``; where a
module is missing, its mixin runs no tests here (the generation tests then skip with that reason).

A FoX model is held to what a Llama passes: every skip in ``FOX_SKIPS`` names why the architecture makes the test
not apply; everything else runs.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import unittest
import unittest.mock
from pathlib import Path

import pytest
import torch
import transformers

pytest.importorskip("parameterized", reason="transformers' common tests need parameterized (pip install parameterized)")

from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES  # noqa: E402

from foxlm.models import FoxCache, FoxConfig, FoxForCausalLM, FoxModel  # noqa: E402

_PACKAGE = "transformers_tests"  # transformers' tests/ imported under this name (foxlm's tests/ is no package)
_OPTIONAL = {"exporters.test_export": "ExportTesterMixin", "generation.test_utils": "GenerationTesterMixin"}


def _tests_dir() -> Path:
    root = os.environ.get("FOXLM_TRANSFORMERS_TESTS")
    if root is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        root = cache / "foxlm" / "transformers-src" / f"transformers-{transformers.__version__}"
    return Path(root) / "tests"


def _import_mixins() -> tuple[types.ModuleType | None, set[str], str]:
    """(test_modeling_common or None, the optional modules absent from the tree, why not found)."""
    tests = _tests_dir()
    if not (tests / "test_modeling_common.py").is_file():
        return None, set(), (f"transformers' tests/ not found at {tests} (.ci/run unpacks the sdist there, or set "
                             f"FOXLM_TRANSFORMERS_TESTS to a transformers {transformers.__version__} source tree)")
    package = types.ModuleType(_PACKAGE)
    package.__path__ = [str(tests)]
    sys.modules.setdefault(_PACKAGE, package)
    missing = set()
    for name, mixin in _OPTIONAL.items():
        if not (tests / (name.replace(".", "/") + ".py")).is_file():
            # test_modeling_common imports both; an absent one contributes an empty mixin (no tests), not a failure
            missing.add(name)
            folder, _ = name.split(".")
            sys.modules.setdefault(f"{_PACKAGE}.{folder}", types.ModuleType(f"{_PACKAGE}.{folder}"))
            stand_in = types.ModuleType(f"{_PACKAGE}.{name}")
            setattr(stand_in, mixin, type(mixin, (), {}))
            sys.modules.setdefault(stand_in.__name__, stand_in)
    return importlib.import_module(f"{_PACKAGE}.test_modeling_common"), missing, ""


common, MISSING, NOT_FOUND = _import_mixins()
if common is None:
    pytest.skip(NOT_FOUND, allow_module_level=True)
ModelTesterMixin = common.ModelTesterMixin
GenerationTesterMixin = sys.modules[f"{_PACKAGE}.generation.test_utils"].GenerationTesterMixin
ids_tensor = common.ids_tensor


class TinyTester:
    """transformers' causal-LM tester shape (batch 13 x 7 tokens, 2 layers, width 32, right-padded masks)."""

    batch_size, seq_length, vocab_size, hidden_size = 13, 7, 99, 32
    num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size = 2, 2, 2, 32
    is_training = True
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, parent: unittest.TestCase, make_config):
        self.parent = parent
        self.make_config = make_config

    def get_config(self):
        return self.make_config(self)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = torch.tril(torch.ones_like(input_ids))  # as transformers' CausalLMModelTester: rows of right padding
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


def _llama_config(t: TinyTester):
    return transformers.LlamaConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        intermediate_size=t.intermediate_size, max_position_embeddings=512, pad_token_id=t.pad_token_id,
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id, tie_word_embeddings=False)


def _fox_config(arch: str):
    def make(t: TinyTester) -> FoxConfig:
        return FoxConfig.preset(
            arch, "tiny", vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_hidden_layers=t.num_hidden_layers,
            num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
            intermediate_size=t.intermediate_size, pad_token_id=t.pad_token_id, bos_token_id=t.bos_token_id,
            eos_token_id=t.eos_token_id)
    return make


class _Common(ModelTesterMixin, GenerationTesterMixin):
    make_config = None

    def setUp(self):
        self.model_tester = TinyTester(self, type(self).make_config)

    def test_generation_tester_mixin_present(self):
        if "generation.test_utils" in MISSING:
            self.skipTest(f"transformers {transformers.__version__}'s sdist ships no tests/generation/test_utils.py: "
                          f"set FOXLM_TRANSFORMERS_TESTS to a source tree to run GenerationTesterMixin")


@unittest.skipUnless(os.environ.get("FOXLM_LLAMA_REFERENCE"), "the Llama reference runs with FOXLM_LLAMA_REFERENCE=1 "
                                                             "(a third of this file's time)")
class LlamaCommonTest(_Common, unittest.TestCase):
    """The reference: what transformers' Llama passes in this same setup (FoX skips beyond it: FOX_SKIPS, and what
    transformers skips itself for a model without SDPA / RoPE / a tensor-parallel plan)."""

    all_model_classes = (transformers.LlamaModel, transformers.LlamaForCausalLM)
    all_generative_model_classes = (transformers.LlamaForCausalLM,)
    make_config = staticmethod(_llama_config)


# test name -> why it does not apply to a FoX model (one line each, from the architecture)
FOX_SKIPS: dict[str, str] = {
    "test_keep_in_fp32_modules": "the gate and shift projections are in both fp32 lists: the strict one keeps them "
                                 "fp32 in bf16, and bitsandbytes reads only the other to leave them unquantized",
    "test_retain_grad_hidden_states_attentions": "FoX's attention probabilities are a side output of its fused op, "
                                                 "not on the path to the hidden states, so they get no gradient",
}


def _skip_fox(cls: type) -> type:
    for name, reason in FOX_SKIPS.items():
        if hasattr(cls, name):
            setattr(cls, name, unittest.skip(reason)(getattr(cls, name)))
    return cls


class _FoxCommon(_Common):
    all_model_classes = (FoxModel, FoxForCausalLM)
    all_generative_model_classes = (FoxForCausalLM,)

    def setUp(self):
        super().setUp()
        # the mixins tell a base model (no loss) by transformers' table of its own base models, which
        # AutoModel.register (foxlm's registration) does not enter (the causal-LM table foxlm enters itself)
        patcher = unittest.mock.patch.dict(MODEL_MAPPING_NAMES, {"fox": "FoxModel"})
        patcher.start()
        self.addCleanup(patcher.stop)

    def _check_caches_are_equal(self, cache1: FoxCache, cache2: FoxCache):
        """transformers' check reads its own layered caches; a FoxCache also holds the gate cumsum and the
        token-shift states, compared here alike."""
        self.assertEqual(len(cache1), len(cache2))
        for a, b in zip(cache1.layers, cache2.layers):
            self.assertEqual(a.length, b.length)
            for name in ("k", "v", "c"):
                torch.testing.assert_close(getattr(a, name)[:, :a.length], getattr(b, name)[:, :b.length])
            torch.testing.assert_close(a.c_last, b.c_last)
            self.assertEqual(a.shift.keys(), b.shift.keys())
            for name in a.shift:
                torch.testing.assert_close(a.shift[name], b.shift[name])


@_skip_fox
class FoxLlamaCommonTest(_FoxCommon, unittest.TestCase):
    make_config = staticmethod(_fox_config("fox-llama"))


@_skip_fox
class FoxProCommonTest(_FoxCommon, unittest.TestCase):
    make_config = staticmethod(_fox_config("fox-pro"))

"""What ``arch`` and ``size`` name, importing neither torch nor transformers (reading or printing a training config
needs only these tables): foxlm's own presets (``ARCHS`` x ``SIZES``, built by ``FoxConfig.preset``), the FoX paper's
recurrent baselines (``BASELINES``, built by ``foxlm.models.baselines``) and Hugging Face models (``hf:MODEL_TYPE`` or
a config.json path, ``foxlm.models.hf``).
"""

from __future__ import annotations

import importlib.util
import math

# FoxConfig's fields and their defaults, declared once: ``FoxConfig`` takes exactly these arguments, and a training
# config checks and prints ``model.*`` against them without importing torch or transformers. ``FoxConfig``'s
# docstring says what each one means.
FOX_FIELDS: dict[str, object] = dict(
    vocab_size=50304,  # GPT-2 BPE's 50257 padded to a multiple of 64
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=None,  # None: num_attention_heads (derived_fields)
    head_dim=None,  # None: hidden_size // num_attention_heads
    intermediate_size=None,  # None: 8/3 x hidden_size rounded up to a multiple of 256
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    gate="data",
    qk_norm=False,
    qk_norm_shared=False,
    qk_norm_eps=None,
    output_gate=False,
    output_norm=False,
    k_shift=False,
    v_shift=False,
    rope=False,
    rope_theta=10000.0,
    window=None,
    acp=False,
    acp_tolerance=math.exp(-10),
    fuse_cross_entropy=True,
    deterministic_attention=False,
    train_length=None,
    use_cache=True,
    bos_token_id=50256,
    eos_token_id=50256,
    tie_word_embeddings=False,
)


def derived_fields(fields: dict) -> dict:
    """``fields`` (every ``FOX_FIELDS`` key) with the sizes that default to None derived from the others, as
    ``FoxConfig`` stores them; a size of the wrong type is left for ``FoxConfig``'s checks to name."""
    out = dict(fields)
    heads, hidden = out["num_attention_heads"], out["hidden_size"]
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = heads
    if out["head_dim"] is None and isinstance(heads, int) and heads > 0:
        out["head_dim"] = hidden // heads
    if out["intermediate_size"] is None and isinstance(hidden, int):
        out["intermediate_size"] = 256 * math.ceil(8 * hidden / 3 / 256)
    return out


# The Pro blocks' QK-norm epsilon is the FoX authors' (their QK-norm modules hard-code 1e-5, whatever the config's
# norm_eps), so that a model foxlm trains converts to their format (`foxlm convert --to fox-authors`).
_PRO = dict(qk_norm=True, qk_norm_eps=1e-5, output_gate=True, output_norm=True, k_shift=True, v_shift=True)
# The RoPE baselines' base is the authors' (rope_base 500000 in every one of their Transformer configs).
ARCHS: dict[str, dict] = {
    "fox-llama": dict(gate="data"),
    "fox-pro": dict(gate="data", **_PRO),
    "transformer-llama": dict(gate="none", rope=True, rope_theta=500000.0),
    "transformer-pro": dict(gate="none", rope=True, rope_theta=500000.0, **_PRO),
}
# layers / d_model / heads (head dim 64) from the FoX papers; "tiny" trains on a CPU in minutes.
SIZES: dict[str, dict] = {
    "tiny": dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, intermediate_size=384),
    "125m": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12),
    "360m": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16),
    "760m": dict(num_hidden_layers=24, hidden_size=1536, num_attention_heads=24),
}
# Where an arch departs from SIZES at a size, as the FoX authors' configs/experiment/longcrawl64/ do: their Transformer
# baselines at 760m have 12 heads of 128 (their FoX models 24 of 64), and their Pro models a narrower MLP to make room
# for the output gate (hidden_ratio 3.5 instead of 4: 2/3 x 3.5 x hidden_size, rounded up to a multiple of 256).
ARCH_SIZES: dict[tuple[str, str], dict] = {
    ("fox-pro", "125m"): dict(intermediate_size=1792),
    ("fox-pro", "360m"): dict(intermediate_size=2560),
    ("fox-pro", "760m"): dict(intermediate_size=3584),
    ("transformer-pro", "125m"): dict(intermediate_size=1792),
    ("transformer-pro", "360m"): dict(intermediate_size=2560),
    ("transformer-pro", "760m"): dict(num_attention_heads=12, intermediate_size=3584),
    ("transformer-llama", "760m"): dict(num_attention_heads=12),
}


def preset_fields(arch: str, size: str) -> dict:
    """The ``FoxConfig`` fields that ``arch`` (one of ``ARCHS``) at ``size`` (one of ``SIZES``) sets; the others keep
    their ``FOX_FIELDS`` defaults."""
    return {**SIZES[size], **ARCHS[arch], **ARCH_SIZES.get((arch, size), {})}

# The recurrent baselines. Each keeps fox-pro's width and vocabulary and matches its parameter count within 1.1%
# (tests/models/test_hf.py checks every one): Mamba-2, which has no MLP, by its number of layers; the others by their
# MLP's intermediate_size.
BASELINES = ("mamba2", "hgrn2", "delta-net", "gated-delta-net")
# arch -> the transformers / fla model type it builds
MODEL_TYPES = {"mamba2": "mamba2", "hgrn2": "hgrn2", "delta-net": "delta_net", "gated-delta-net": "gated_deltanet"}
FLA = ("hgrn2", "delta-net", "gated-delta-net")
# fox-pro's sizes: hidden_size, layers and heads come from SIZES; what matches the count is here
_MATCHED = {
    "mamba2": {"tiny": dict(num_hidden_layers=9), "125m": dict(num_hidden_layers=23),
               "360m": dict(num_hidden_layers=48), "760m": dict(num_hidden_layers=47)},
    "hgrn2": {"tiny": dict(intermediate_size=416), "125m": dict(intermediate_size=2048),
              "360m": dict(intermediate_size=2912), "760m": dict(intermediate_size=4128)},
    "delta-net": {"tiny": dict(intermediate_size=416), "125m": dict(intermediate_size=2048),
                  "360m": dict(intermediate_size=2912), "760m": dict(intermediate_size=4096)},
    "gated-delta-net": {"tiny": dict(intermediate_size=256), "125m": dict(intermediate_size=1024),
                        "360m": dict(intermediate_size=1536), "760m": dict(intermediate_size=2048)},
}

HF_PREFIX = "hf:"


def baseline_fields(arch: str, size: str) -> dict:
    """The config fields of baseline ``arch`` (one of ``BASELINES``) at ``size`` (one of ``SIZES``)."""
    if arch not in BASELINES:
        raise ValueError(f"arch: expected one of {BASELINES}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size: expected one of {sorted(SIZES)}, got {size!r}")
    s = SIZES[size]
    d, heads = s["hidden_size"], s["num_attention_heads"]
    head_dim = d // heads
    common = dict(hidden_size=d, num_hidden_layers=s["num_hidden_layers"], tie_word_embeddings=False)
    if arch == "mamba2":  # expand 2 as in the Mamba-2 paper; a 16-dim state at the tiny size, 128 above
        layout = dict(expand=2, head_dim=head_dim, num_heads=2 * d // head_dim, n_groups=1,
                      state_size=16 if size == "tiny" else 128)
    elif arch == "hgrn2":
        layout = dict(expand_ratio=min(128, d))  # the HGRN2 paper's state expansion, 128
    elif arch == "delta-net":
        layout = dict(num_heads=heads)
    else:
        layout = dict(num_heads=heads, head_dim=head_dim)
    return {**common, **layout, **_MATCHED[arch][size]}


def check_fla(arch: str) -> None:
    """For a baseline built by fla, a ValueError naming the extra when flash-linear-attention is not installed
    (looked up, not imported: fla imports torch)."""
    if arch in FLA and importlib.util.find_spec("fla") is None:
        raise ValueError(f"arch: {arch} needs flash-linear-attention: pip install 'foxlm[baselines]'")


def is_hf_arch(arch: str) -> bool:
    """Whether ``arch`` names a Hugging Face model (``hf:MODEL_TYPE``, a ``.json`` config or one of the recurrent
    ``BASELINES``) rather than one of foxlm's own."""
    return arch.startswith(HF_PREFIX) or arch.endswith(".json") or arch in BASELINES


def has_size(arch: str) -> bool:
    """Whether ``size`` (tiny, 125m, ...) applies to ``arch``: foxlm's models and the baselines, not ``hf:...``."""
    return not (arch.startswith(HF_PREFIX) or arch.endswith(".json"))

"""The FoX paper's recurrent baselines at foxlm's sizes: Mamba-2, HGRN2, DeltaNet and Gated DeltaNet.

``arch=mamba2`` is transformers' own ``Mamba2ForCausalLM`` (plain PyTorch on the CPU, its CUDA kernels where
``mamba_ssm`` is installed); ``hgrn2``, ``delta-net`` and ``gated-delta-net`` come from fla (flash-linear-attention,
``pip install 'foxlm[baselines]'``), whose Triton kernels need a CUDA GPU. Each preset keeps fox-pro's width and
vocabulary and matches its parameter count within 5% (``tests/test_hf_models.py`` checks every one): Mamba-2,
which has no MLP, by its number of layers; the others by their MLP's ``intermediate_size``.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from .configuration_fox import SIZES

BASELINES = ("mamba2", "hgrn2", "delta-net", "gated-delta-net")
# arch -> the transformers / fla model type it builds
MODEL_TYPES = {"mamba2": "mamba2", "hgrn2": "hgrn2", "delta-net": "delta_net", "gated-delta-net": "gated_deltanet"}
FLA = ("hgrn2", "delta-net", "gated-delta-net")

# fox-pro's sizes: hidden_size, layers and heads come from foxlm's SIZES; what matches the count is here
_MATCHED = {
    "mamba2": {"tiny": dict(num_hidden_layers=9), "125m": dict(num_hidden_layers=25),
               "360m": dict(num_hidden_layers=51), "760m": dict(num_hidden_layers=50)},
    "hgrn2": {"tiny": dict(intermediate_size=416), "125m": dict(intermediate_size=2304),
              "360m": dict(intermediate_size=3200), "760m": dict(intermediate_size=4608)},
    "delta-net": {"tiny": dict(intermediate_size=416), "125m": dict(intermediate_size=2304),
                  "360m": dict(intermediate_size=3136), "760m": dict(intermediate_size=4608)},
    "gated-delta-net": {"tiny": dict(intermediate_size=256), "125m": dict(intermediate_size=1280),
                        "360m": dict(intermediate_size=1792), "760m": dict(intermediate_size=2560)},
}


def _fields(arch: str, size: str) -> dict:
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


def require_fla(arch: str) -> None:
    """Import fla (registering its models with the Auto classes), or a ValueError naming the extra."""
    try:
        import fla  # noqa: F401
    except ImportError as e:
        raise ValueError(f"arch: {arch} needs flash-linear-attention: pip install 'foxlm[baselines]'") from e


def baseline_config(arch: str, size: str, **overrides) -> PretrainedConfig:
    """The config of baseline ``arch`` (one of ``BASELINES``) at ``size`` (tiny, 125m, 360m, 760m), with
    ``overrides`` (fields of that config) applied."""
    from .hf import hf_config  # hf imports this module

    if arch not in BASELINES:
        raise ValueError(f"arch: expected one of {BASELINES}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size: expected one of {sorted(SIZES)}, got {size!r}")
    if arch in FLA:
        require_fla(arch)
    return hf_config(f"hf:{MODEL_TYPES[arch]}", {**_fields(arch, size), **overrides})


def check_device(arch: str, device_type: str) -> None:
    """fla's kernels are Triton kernels for CUDA: on another device, a ValueError naming the extra and the device."""
    if arch in FLA and device_type != "cuda":
        raise ValueError(f"device: arch={arch} runs fla's Triton kernels, which need a CUDA GPU ('foxlm[baselines]' "
                         f"installed), got {device_type}; arch=mamba2 (transformers' Mamba-2) runs on the CPU")

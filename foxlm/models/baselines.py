"""The FoX paper's recurrent baselines at foxlm's sizes: Mamba-2, HGRN2, DeltaNet and Gated DeltaNet.

``arch=mamba2`` is transformers' own ``Mamba2ForCausalLM`` (plain PyTorch on the CPU, its CUDA kernels where
``mamba_ssm`` is installed); ``hgrn2``, ``delta-net`` and ``gated-delta-net`` come from fla (flash-linear-attention,
``pip install 'foxlm[baselines]'``), whose Triton kernels need a CUDA GPU. The presets themselves (fox-pro's width,
vocabulary and parameter count) are in ``foxlm.presets``, and ``foxlm.models.hf.hf_config`` builds their configs.
"""

from __future__ import annotations

from ..presets import FLA, check_fla


def require_fla(arch: str) -> None:
    """Import fla (registering its models with the Auto classes), or a ValueError naming the extra."""
    check_fla(arch)
    import fla  # noqa: F401


def check_device(arch: str, device_type: str) -> None:
    """fla's kernels are Triton kernels for CUDA: on another device, a ValueError naming the extra and the device."""
    if arch in FLA and device_type != "cuda":
        raise ValueError(f"device: arch={arch} runs fla's Triton kernels, which need a CUDA GPU ('foxlm[baselines]' "
                         f"installed), got {device_type}; arch=mamba2 (transformers' Mamba-2) runs on the CPU")

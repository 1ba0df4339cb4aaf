"""What the trainer measures: training FLOPs, throughput, MFU, and the warning for a GPU-sized run on a CPU."""

from __future__ import annotations

import time

import torch

from ..models import FoxConfig

# Dense bf16 peak TFLOP/s per device, for the MFU estimate.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}

# Training FLOPs per step and process past which a CPU takes about a minute a step, or more (a 2-core CPU trained
# fox-pro 125m at ~20 GFLOP/s in fp32; the default job needs ~3e10 a step).
GPU_SIZED_FLOPS = 1e12


def cpu_warning(flops_per_step: float, device: torch.device, what: str) -> str | None:
    """The warning for a run of ``what`` whose steps (``flops_per_step`` per process) are sized for a GPU but run on
    the CPU; None where they are not."""
    if device.type != "cpu" or flops_per_step < GPU_SIZED_FLOPS:
        return None
    tflop = flops_per_step / 1e12
    size = f"{tflop:,.0f}" if tflop >= 10 else f"{tflop:.1f}"
    return (f"warning: {what} is sized for a GPU: about {size} TFLOP per step, a minute or more per step on a CPU "
            f"(the default job, `foxlm train`, is sized for one); the time per step follows its first step")


def flops_per_token(config: FoxConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (parameters except the embedding) + causal attention 6 x L x T x H x D."""
    embed = config.vocab_size * config.hidden_size
    attn = 6 * config.num_hidden_layers * seq_len * config.num_attention_heads * config.head_dim
    return 6 * (num_params - embed) + attn


class Metrics:
    """A run's FLOP count, and its throughput (tokens per second since the last ``reset``) and MFU."""

    def __init__(self, model_config, num_params: int, seq_len: int, batch_size: int, hf: bool,
                 peak_tflops: float | None, device: torch.device, world: int):
        self.model_config, self.num_params = model_config, num_params
        self.seq_len, self.batch_size = seq_len, batch_size
        self.hf, self.world = hf, world
        if peak_tflops is None and device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        self.peak_tflops = peak_tflops
        self.t0, self.tokens0 = time.perf_counter(), 0

    def step_flops(self) -> float:
        """Training FLOPs of one step (all processes): foxlm's count for its attention models, 6 N per token else."""
        per_token = 6 * self.num_params if self.hf else \
            flops_per_token(self.model_config, self.num_params, self.seq_len)
        return per_token * self.batch_size * self.seq_len

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilization at ``tokens_per_s``; None without a peak or for a Hugging Face model (the FLOP
        count is that of foxlm's attention models)."""
        if self.peak_tflops is None or self.hf:
            return None
        per_token = flops_per_token(self.model_config, self.num_params, self.seq_len)
        return tokens_per_s * per_token / (self.peak_tflops * 1e12 * self.world)

    def reset(self, tokens_seen: int) -> None:
        """Measure throughput from now on (after a log line)."""
        self.t0, self.tokens0 = time.perf_counter(), tokens_seen

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` that were not training (validation, a checkpoint) out of the throughput."""
        self.t0 += seconds

    def throughput(self, tokens_seen: int) -> dict:
        """``tokens_per_s`` since the last ``reset`` and, where it is known, ``mfu``."""
        tps = (tokens_seen - self.tokens0) / max(time.perf_counter() - self.t0, 1e-9)
        mfu = self.mfu(tps)
        return {"tokens_per_s": tps, **({"mfu": mfu} if mfu is not None else {})}


def pace(step: int, took: float, max_steps: int) -> str:
    """The line after a run's first step, ``step``, that took ``took`` seconds: what the rest takes at that pace."""
    left = max_steps - step
    return (f"step {step} took {duration(took)}; the {left:,} steps to max_steps={max_steps:,} at that pace: about "
            f"{duration(took * left)}")


def duration(seconds: float) -> str:
    """``seconds`` as "42 s", "12 min", "3.5 h" or "2.1 days"."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 2 * 86400 else f"{seconds / 86400:.1f} days"

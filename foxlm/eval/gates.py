"""Forget-gate analysis: decay times per layer and head, decay matrices and attention maps, and the ACP report.

With log forget gates log f_t of a head, its decay time is tau = -1 / mean_t log f_t (tokens): the
distance over which attention to a token decays by a factor e. The decay matrix of a sample input is
D_ij = exp(c_i - c_j) = prod_{j<l<=i} f_l (c = cumsum log f), the multiplier the gate puts on attention
from i to j.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..ops import gate_cumsum
from .utils import autocast, progress, pyplot


@dataclass
class HeadDecay:
    layer: int
    head: int
    mean_log_f: float
    decay_time: float  # -1 / mean log f, tokens
    p10: float  # quantiles of the per-token decay time -1 / log f_t
    p50: float
    p90: float


@dataclass
class ACPReport:
    """Fraction of attention-tile FLOPs ACP skips (``foxlm.ops.acp_stats``), for ``sequences`` of ``length`` tokens
    and the kernel's tiles of ``block_m`` queries x ``block_n`` keys."""

    per_head: np.ndarray  # [layers, heads], mean over sequences
    block_m: int
    block_n: int
    tolerance: float
    length: int
    sequences: int

    @property
    def per_layer(self) -> np.ndarray:
        """[layers]: every head does the same attention work, so the layer's fraction is the heads' mean."""
        return self.per_head.mean(1)

    @property
    def overall(self) -> float:
        return float(self.per_head.mean())


@torch.no_grad()
def collect(model, sequences: list[np.ndarray], *, block_m: int = 128, block_n: int = 64,
            tolerance: float = math.exp(-10), batch_size: int = 1, dtype: str = "auto", show_progress: bool = True
            ) -> tuple[list[torch.Tensor], ACPReport]:
    """One pass over equally long ``sequences``: per layer the log forget gates [N, T, H] fp32 (CPU), and the
    ACP report (``FoxPreTrainedModel.probe_acp``: each layer's own logit bound, from the QK-norm weights, else
    scale * max||q|| * max||k||).

    Raises ``ValueError`` for a model without forget gates (a Transformer baseline), from ``probe_acp``.
    """
    device = next(model.parameters()).device
    per_layer: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    skipped: list[torch.Tensor] = []
    batches = range(0, len(sequences), batch_size)
    for a in progress(batches, total=len(batches), desc="gates", enabled=show_progress):
        ids = torch.as_tensor(np.stack(sequences[a:a + batch_size]).astype(np.int64), device=device)
        with autocast(device, dtype), model.probe_acp(tolerance, block_m, block_n) as share:
            out = model(input_ids=ids, output_log_fgates=True, use_cache=False, logits_to_keep=1)
        for i, g in enumerate(out.log_fgates):
            per_layer[i].append(g.float().cpu())
        skipped.append(share.per_head().double().cpu() * ids.shape[0])  # [layers, H]; batches of B weigh B
    per_head = (torch.stack(skipped).sum(0) / len(sequences)).numpy()
    report = ACPReport(per_head, block_m, block_n, tolerance, len(sequences[0]), len(sequences))
    return [torch.cat(acc) for acc in per_layer], report


def decay_stats(log_fgates: list[torch.Tensor]) -> list[HeadDecay]:
    """Decay time per (layer, head) from per-layer log gates [N, T, H]."""
    rows = []
    for layer, g in enumerate(log_fgates):
        flat = g.double().reshape(-1, g.shape[-1])  # [N*T, H]
        per_token = -1.0 / flat.clamp_max(-1e-30)
        # NumPy's: torch.quantile refuses more than 2^24 values per head (tokens, e.g. 128 sequences of 128K)
        q = np.quantile(per_token.clamp_max(1e30).numpy(), [0.1, 0.5, 0.9], axis=0)
        mean = flat.mean(0)
        for h in range(flat.shape[1]):
            tau = float(-1.0 / mean[h]) if mean[h] < 0 else float("inf")
            rows.append(HeadDecay(layer, h, float(mean[h]), tau, *(float(x) for x in q[:, h])))
    return rows


def decay_matrix(log_fgate: torch.Tensor) -> torch.Tensor:
    """log D_ij = c_i - c_j for j <= i, -inf above the diagonal: [T, H] -> [H, T, T] fp64."""
    c = gate_cumsum(log_fgate[None])[0].T  # [H, T]
    d = c[:, :, None] - c[:, None, :]
    T = log_fgate.shape[0]
    return d.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))


@torch.no_grad()
def sample_maps(model, ids: np.ndarray, dtype: str = "auto") -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
    """For one short input [T]: per layer the log decay matrices [H, T, T] (None without gates) and the
    attention probabilities [H, T, T]."""
    device = next(model.parameters()).device
    x = torch.as_tensor(np.asarray(ids, dtype=np.int64)[None], device=device)
    with autocast(device, dtype):
        out = model(input_ids=x, output_log_fgates=True, output_attentions=True, use_cache=False, logits_to_keep=1)
    attn = [a[0].float().cpu() for a in out.attentions]
    decay = None if model.config.gate == "none" else [decay_matrix(g[0].float().cpu()) for g in out.log_fgates]
    return decay, attn


def write_decay_csv(rows: list[HeadDecay], path: str | os.PathLike) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(HeadDecay.__dataclass_fields__))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in asdict(r).items()})


def _grid_ticks(ax, heads: int, layers: int) -> None:
    """Integer head (x) and layer (y) ticks on a layer x head heatmap."""
    ax.set_xticks(range(heads))
    ax.set_yticks(range(layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")


def plot_decay_times(rows: list[HeadDecay], path: str | os.PathLike, context_length: int | None = None) -> None:
    """Left: decay time of every head by layer (log scale); right: the same as a layer x head heatmap."""
    plt = pyplot()
    layers = max(r.layer for r in rows) + 1
    heads = max(r.head for r in rows) + 1
    tau = np.full((layers, heads), np.nan)
    for r in rows:
        tau[r.layer, r.head] = r.decay_time
    fig, (ax, ax_h) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.2, 1]})
    jitter = np.linspace(-0.25, 0.25, heads) if heads > 1 else np.zeros(1)
    for layer in range(layers):
        ax.scatter(layer + jitter, tau[layer], s=14, color="C0",
                   label="head (mean over tokens)" if layer == 0 else None)
        lo = [r.p10 for r in rows if r.layer == layer]
        hi = [r.p90 for r in rows if r.layer == layer]
        ax.vlines(layer + jitter, lo, hi, color="C0", alpha=0.25, lw=1,
                  label="10-90% of per-token -1/log f" if layer == 0 else None)
    if context_length:
        ax.axhline(context_length, color="k", ls="--", lw=1, label=f"sample length ({context_length})")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("decay time tau = -1 / mean log f (tokens)")
    ax.set_title("Forget-gate decay time per head")
    ax.set_xticks(range(layers))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    im = ax_h.imshow(np.log10(tau), aspect="auto", cmap="viridis")
    _grid_ticks(ax_h, heads, layers)
    ax_h.set_title("log10 decay time (tokens)")
    fig.colorbar(im, ax=ax_h, label="log10 tau")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_layer_maps(decay: torch.Tensor | None, attn: torch.Tensor, layer: int, path: str | os.PathLike) -> None:
    """One layer, one column per head: log10 decay matrix (top, if gated) and attention map (bottom)."""
    plt = pyplot()
    from matplotlib.colors import LogNorm

    H, T = attn.shape[0], attn.shape[-1]
    rows = 2 if decay is not None else 1
    fig, axes = plt.subplots(rows, H, figsize=(2.2 * H + 1.2, 2.3 * rows + 0.6), squeeze=False)
    floor = 1e-6
    for h in range(H):
        if decay is not None:
            im_d = axes[0, h].imshow((decay[h] / np.log(10)).clamp_min(np.log10(floor)).numpy(), cmap="magma",
                                     vmin=np.log10(floor), vmax=0, interpolation="nearest")
            axes[0, h].set_title(f"head {h}: decay", fontsize=8)
        im_a = axes[-1, h].imshow(attn[h].clamp_min(floor).numpy(), cmap="viridis", norm=LogNorm(floor, 1),
                                  interpolation="nearest")
        axes[-1, h].set_title(f"head {h}: attention", fontsize=8)
        for ax in axes[:, h]:
            ax.set_xlabel("key j", fontsize=7)
            if h == 0:
                ax.set_ylabel("query i", fontsize=7)
            ax.tick_params(labelsize=6)
    if decay is not None:
        fig.colorbar(im_d, ax=axes[0].tolist(), label="log10 exp(c_i - c_j)", shrink=0.9)
    fig.colorbar(im_a, ax=axes[-1].tolist(), label="attention probability", shrink=0.9)
    fig.suptitle(f"Layer {layer}: forget-gate decay matrix and attention map ({T}-token sample)")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_acp(report: ACPReport, out: str | os.PathLike) -> None:
    """``acp.csv`` (per layer and head, per layer, overall) and ``acp.png`` (layer x head heatmap, per-layer bars)."""
    out = os.fspath(out)
    L, H = report.per_head.shape
    with open(os.path.join(out, "acp.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "head", "skipped_fraction"])
        for layer in range(L):
            for h in range(H):
                w.writerow([layer, h, f"{report.per_head[layer, h]:.6f}"])
            w.writerow([layer, "all", f"{report.per_layer[layer]:.6f}"])
        w.writerow(["all", "all", f"{report.overall:.6f}"])
    plt = pyplot()
    fig, (ax_h, ax_l) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1.2, 1]})
    im = ax_h.imshow(report.per_head, vmin=0, vmax=1, cmap="Blues", aspect="auto")
    for layer in range(L):
        for h in range(H):
            if L * H <= 256:
                ax_h.text(h, layer, f"{report.per_head[layer, h]:.0%}", ha="center", va="center", fontsize=6)
    _grid_ticks(ax_h, H, L)
    ax_h.set_title("Attention FLOPs skipped per head")
    fig.colorbar(im, ax=ax_h, label="skipped fraction")
    ax_l.bar(range(L), report.per_layer, color="C0", label="per layer")
    ax_l.axhline(report.overall, color="k", ls="--", lw=1, label=f"overall {report.overall:.1%}")
    ax_l.set_ylim(0, 1)
    ax_l.set_xticks(range(L))
    ax_l.set_xlabel("layer")
    ax_l.set_ylabel("fraction of attention FLOPs skipped")
    ax_l.set_title("Per layer")
    ax_l.legend(fontsize=8)
    fig.suptitle(f"ACP: {report.sequences} sequences of {report.length} tokens, tiles of {report.block_m} queries x "
                 f"{report.block_n} keys, "
                 f"tolerance {report.tolerance:.3g}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "acp.png"), dpi=120)
    plt.close(fig)

"""The Forgetting Attention layer, with every switch the FoX papers ablate.

Data flows: x -> q, k~, v~ projections -> token shift (k, v) -> QK-norm -> RoPE -> attention with the
forget gate -> output norm -> output gate -> o_proj. The attention itself, and the token shift's look-back,
go through one back-end object, ``attention_backend`` (``foxlm.layers.attention_backend``): by default whole
sequences through ``foxlm.ops.sequence_attention`` or a KV cache (``foxlm.models.cache.KVCache``); context
parallelism replaces it from outside (``foxlm.parallel.apply_context_parallel``). The layer holds no attention
math and does not know which back-end it calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import ACP, apply_rotary
from .attention_backend import AttentionBackend
from .norm import RMSNorm
from .segments import Segments
from .token_shift import TokenShift

GATES = ("data", "bias", "alibi", "none")


@dataclass
class ACPConfig:
    """ACP's switch and epsilon, read by the layer at every forward. ``FoxConfig`` has the same two fields and
    is what a model's layers read, so that the config is the one place ACP is set."""

    acp: bool = False
    acp_tolerance: float = math.exp(-10)


class ACPProbe:
    """What ACP skips (or, with ACP off, would skip) in the cache-less forwards of one attention layer while
    ``active``: per forward, the share of attention tiles per head (the back-end's ``tile_stats``, with the layer's
    logit bound, ``tolerance`` and ``block_m`` x ``block_n`` tiles), [H] fp32 on the layer's device, in ``records``;
    in a context-parallel layer, the same share over the whole sequence, so that it is one number whatever ``cp``.
    Turned on by ``FoxPreTrainedModel.probe_acp``; one object per layer for its lifetime, so that a compiled block
    sees only two values of ``active``."""

    def __init__(self):
        self.active, self.tolerance, self.block_m, self.block_n = False, None, 128, 64
        self.records: list[torch.Tensor] = []

    @torch.compiler.disable  # bookkeeping outside any compiled graph
    def record(self, attn: "ForgettingAttention", q, k, log_fgate, segments: "Segments | None") -> None:
        tolerance = attn.acp_config.acp_tolerance if self.tolerance is None else self.tolerance
        self.records.append(attn.attention_backend.tile_stats(
            q.detach(), k.detach(), log_fgate.detach(), segments=segments, scale=attn.scale, tolerance=tolerance,
            logit_bound=attn.logit_bound(q.dtype), block_m=self.block_m, block_n=self.block_n))


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes m_h = 2^(-8h/H), h = 1..H (fp32 [H]); log f_h = -m_h is the matching fixed gate."""
    return torch.exp2(-8.0 * torch.arange(1, num_heads + 1, dtype=torch.float32) / num_heads)


class ForgettingAttention(nn.Module):
    """Multi-head softmax attention with a forget gate (FoX), and the Pro / baseline switches.

    Args:
        hidden_size: C, the model width.
        num_heads: query heads H; num_kv_heads: key/value heads (GQA, default H); head_dim: D (default C / H).
        gate: "data" (f_t = sigmoid(w . x_t + b) per head, FoX), "bias" (a learned per-head constant,
            initialised at the ALiBi slopes), "alibi" (fixed ALiBi slopes) or "none" (plain softmax attention).
        qk_norm: per-head RMSNorm of q and k (one weight vector per head); qk_norm_shared: one weight vector
            [head_dim] for all heads instead (the FoX authors' released models); qk_norm_eps: its epsilon
            (default norm_eps).
        output_norm: per-head RMSNorm of the attention output; output_gate: multiply it by sigmoid(W_g x).
        k_shift, v_shift: data-dependent token shift of the key / value projections (before QK-norm).
        rope: rotary position embedding (the Transformer baselines): the forward rotates q and k by the cos and sin
            it is given (``RotaryEmbedding``, computed once per model forward).
        window: sliding-window attention over the last ``window`` tokens (None: full causal).
        acp_config: where the layer reads ``acp`` (Adaptive Computation Pruning in the forward pass) and
            ``acp_tolerance`` (its epsilon) at every forward: a ``FoxConfig`` in a model, default ``ACPConfig()``
            (off). The logit bound comes from the QK-norm weights when ``qk_norm`` is on, from the data otherwise.
        deterministic: FlashAttention's flag, passed on (``forgetting_attention``: every backward is deterministic).
        layer_idx: the index under which the layer talks to a KV cache.

    ``attention_backend`` (an ``AttentionBackend`` by default) runs the attention and the token shift's look-back;
    ``foxlm.parallel.apply_context_parallel`` replaces it.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        gate: str = "data",
        qk_norm: bool = False,
        qk_norm_shared: bool = False,
        qk_norm_eps: float | None = None,
        output_gate: bool = False,
        output_norm: bool = False,
        k_shift: bool = False,
        v_shift: bool = False,
        rope: bool = False,
        window: int | None = None,
        acp_config: ACPConfig | None = None,
        deterministic: bool = False,
        norm_eps: float = 1e-6,
        layer_idx: int = 0,
    ):
        super().__init__()
        # checked before they divide: 0 heads ended in a ZeroDivisionError, and a bool or float window was kept
        for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("window", window)):
            if (n is not None or name == "num_heads") and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name}: expected a positive int{'' if name == 'num_heads' else ' or None'}, "
                                 f"got {n!r}")
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size: expected a positive int, got {hidden_size!r}")
        # the default head dim C // H is 0 for C < H: its scale 0 ** -0.5 ended in a ZeroDivisionError
        if head_dim is None and hidden_size < num_heads:
            raise ValueError(f"hidden_size: {hidden_size} is less than num_heads={num_heads}; give head_dim")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        if gate not in GATES:
            raise ValueError(f"gate: expected one of {GATES}, got {gate!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads: must divide num_heads={num_heads}, got {num_kv_heads}")
        acp_config = ACPConfig() if acp_config is None else acp_config
        if acp_config.acp and gate == "none":
            raise ValueError("acp_config: pruning needs a forget gate, but gate='none'")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.gate, self.window, self.layer_idx = gate, window, layer_idx
        self.acp_config, self.deterministic = acp_config, deterministic
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        # at least fp32 whatever the default dtype (fp64 models stay fp64): the gates are in
        # FoxPreTrainedModel._keep_in_fp32_modules_strict
        gate_dtype = torch.promote_types(torch.get_default_dtype(), torch.float32)
        self.fgate_proj = nn.Linear(hidden_size, num_heads, bias=True, dtype=gate_dtype) if gate == "data" else None
        self.fgate_bias = None
        if gate == "bias":
            self.fgate_bias = nn.Parameter(self.bias_gate_init(num_heads).to(gate_dtype))
        qk_eps = norm_eps if qk_norm_eps is None else qk_norm_eps
        self.q_norm = RMSNorm(head_dim if qk_norm_shared else (num_heads, head_dim), qk_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim if qk_norm_shared else (num_kv_heads, head_dim), qk_eps) if qk_norm else None
        self.k_shift = TokenShift(hidden_size, num_kv_heads) if k_shift else None
        self.v_shift = TokenShift(hidden_size, num_kv_heads) if v_shift else None
        self.rope = rope
        self.o_norm = RMSNorm((num_heads, head_dim), norm_eps) if output_norm else None
        self.g_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False) if output_gate else None
        self.acp_probe = ACPProbe() if gate != "none" else None
        self.attention_backend: nn.Module = AttentionBackend()

    @staticmethod
    def bias_gate_init(num_heads: int) -> torch.Tensor:
        """Initial logits b_h of the "bias" gate: logsigmoid(b_h) = -m_h, the ALiBi slopes."""
        return -torch.log(torch.expm1(alibi_slopes(num_heads)))

    def log_fgate(self, x: torch.Tensor) -> torch.Tensor | None:
        """log f_t: [B, T, H] fp32 (fp64 for fp64 inputs) from x: [B, T, C]; None when gate == "none"."""
        dt = torch.promote_types(x.dtype, torch.float32)
        B, T = x.shape[:2]
        if self.gate == "data":
            w = self.fgate_proj.weight  # fp32 in a model loaded in bf16 (FoxPreTrainedModel._keep_in_fp32_modules)
            return F.logsigmoid(self.fgate_proj(x.to(w.dtype)).to(dt))
        if self.gate == "bias":
            return F.logsigmoid(self.fgate_bias.to(dt)).expand(B, T, -1)
        if self.gate == "alibi":
            return -alibi_slopes(self.num_heads).to(device=x.device, dtype=dt).expand(B, T, -1)
        return None

    def logit_bound(self, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """U_h >= |scale * q_i . k_j| for every token under QK-norm ([H] fp32), else None; ``dtype``: that of the q
        and k attention is given (default: the QK-norm weight's).

        RMS-normalised vectors have norm sqrt(D), so |scale * q_i . k_j| <= max|w_q,h| * max|w_k,h| * D * scale, now
        and in the future (RoPE rotations keep norms): the bound ACP and cache eviction rely on. q and k reach the
        kernels rounded to ``dtype`` (once by the norm, again by RoPE), each rounding growing a norm by up to a unit
        roundoff, and their dot accumulates in fp32: U allows for both, so that the pruned mass stays below the
        tolerance (in bf16 the rounding alone lifted logits up to 0.8% past the exact bound).
        """
        if self.q_norm is None:
            return None
        # max |w| per head as one kernel each (the inf-norm, exact in any dtype); called per layer and step under ACP
        wq = torch.linalg.vector_norm(self.q_norm.weight.detach(), math.inf, dim=-1).float()
        wk = torch.linalg.vector_norm(self.k_norm.weight.detach(), math.inf, dim=-1).float()
        if wq.dim() == 0:  # qk_norm_shared: one weight vector, one bound for every head
            wq, wk = wq.expand(self.num_heads), wk.expand(self.num_heads)
        elif self.num_heads != self.num_kv_heads:
            wk = wk.repeat_interleave(self.num_heads // self.num_kv_heads)
        unit = torch.finfo(self.q_norm.weight.dtype if dtype is None else dtype).eps / 2
        roundings = 2 * (2 if self.rope else 1)  # q's and k's, by the norm and by RoPE
        # the dot's fp32 accumulation (D terms) and the norm's own fp32 arithmetic
        margin = (1 + unit) ** roundings * (1 + (self.head_dim + 8) * 2.0 ** -24)
        return (wq * wk).mul_(self.head_dim * self.scale * margin)

    def forward(
        self,
        x: torch.Tensor,
        *,
        segments: Segments | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        reset: torch.Tensor | None = None,
        cache=None,
        valid: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x: [B, T, C] -> (y [B, T, C], log_fgate [B, T, H] fp32 or None, probs [B, H, T, T] or None).

        segments: packed documents / padding of a cache-less forward. rotary: RoPE's cos, sin [B or 1, T, D/2]
            (``RotaryEmbedding`` of the positions), needed with ``rope``.
        reset: [B, T] bool, where the token shift must not look back (segment starts, after padding).
        cache: a KV cache (``foxlm.models.cache.KVCache``): the new tokens attend to everything cached.
        valid: [B, T] bool, False at padding (with a cache only).
        Context-parallel (``foxlm.parallel.apply_context_parallel``): x is this rank's shard of the sequence, as
        ``foxlm.parallel.shard_sequence(x, dim=1)`` makes it, and so are y and log_fgate.
        """
        B, T, _ = x.shape
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D)
        k = self.k_proj(x).view(B, T, Hk, D)
        v = self.v_proj(x).view(B, T, Hk, D)
        if self.k_shift is not None:
            k = self._shift(self.k_shift, "k", k, x, reset, cache, valid)
        if self.v_shift is not None:
            v = self._shift(self.v_shift, "v", v, x, reset, cache, valid)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            if rotary is None:
                raise ValueError("rotary: this layer applies RoPE and needs the (cos, sin) of its positions")
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        log_fgate = self.log_fgate(x)
        acp = ACP(self.acp_config.acp_tolerance, self.logit_bound(q.dtype)) if self.acp_config.acp else None
        if cache is None and self.acp_probe is not None and self.acp_probe.active:
            self.acp_probe.record(self, q, k, log_fgate, segments)
        o, probs = self.attention_backend.attend(
            q, k, v, log_fgate, scale=self.scale, window=self.window, prune=acp, segments=segments, cache=cache,
            valid=valid, layer_idx=self.layer_idx, output_attentions=output_attentions,
            deterministic=self.deterministic,
        )
        gate = None if self.g_proj is None else self.g_proj(x)
        if self.o_norm is not None:  # the output norm and the output gate in one fused op
            o, gate = self.o_norm(o, gate=None if gate is None else gate.view(B, T, H, D)), None
        o = o.reshape(B, T, H * D)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o), log_fgate, probs

    def _shift(self, shift: TokenShift, name: str, x, h, reset, cache, valid) -> torch.Tensor:
        """Token shift of x: [B, T, Hk, D] (stream ``name``), looking back through the attention back-end."""
        return self.attention_backend.shift(shift, x, h, reset=reset, cache=cache, valid=valid,
                                            layer_idx=self.layer_idx, name=name)

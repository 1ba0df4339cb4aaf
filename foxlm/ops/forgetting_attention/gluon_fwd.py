"""A warp-specialized forward of Forgetting Attention for Hopper, in Gluon (Triton's explicit-layout language).

GPU-only (sm_90, the Triton version it was tested with): ``triton_op`` picks it where
``tests/ops/forgetting_attention/test_gluon.py`` passed on the device (see ``triton_op.GLUON_TESTED``) and keeps its
Triton twin, ``triton_kernels._attn_fwd_kernel``, everywhere else; the backward is the Triton one for both (this
forward's o and lse are the same quantities). It covers the plain causal case: Tq == Tk, no packed sequences, no
window, no ACP. Design (FlashAttention-3's, docs/benchmarks.md):

* one program per (128-query block, head): a 1-warp producer TMA-loads the two 64-row Q tiles once, then K and V
  tiles into a ring of STAGES slots (ready / empty mbarriers); two consumer warpgroups take one Q tile each;
* a consumer issues the next tile's S = Q K^T and this tile's O += P V as async wgmma, then runs the next tile's
  softmax while P V is in flight; P stays in registers as the second wgmma's operand;
* ping-pong: the two warpgroups take turns to issue their GEMMs (a pair of mbarriers), so one's softmax runs while
  the other's GEMMs use the tensor cores;
* the logits leave out c_i, as the Triton forward's (the query's own c joins its lse at the end), and take the keys'
  c relative to the warpgroup's first query in fp64 before rounding to fp32;
* launch order: (head, sequence) pairs in groups whose K/V fit in L2 together, longest programs first (as the
  Triton forward's ``_grid_position``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
# Tiles per head dim: (query rows per warpgroup, keys per tile, K/V stages), as timed (docs/benchmarks.md).
TILES = {128: (64, 128, 2)}


@gluon.constexpr_function
def _mma(n):
    """The wgmma accumulator layout of one warpgroup for an n-wide tile."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, q_row, q_col, k_row,
              k_col, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    for w in gl.static_range(2):
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * BLOCK_M, q_col], q_bar.index(w), q_smem.index(w))
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, k_col], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [k_row + j * BLOCK_N, k_col], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _key_c(j, c_base, c_ref, T, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """log2(e) (c_j - c_ref) for the keys of tile j, in fp32 from an fp64 difference."""
    cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    return ((gl.load(c_base + cols, mask=cols < T, other=0.0) - c_ref) * LOG2E).to(gl.float32)


@gluon.jit
def _logits(s_acc, ck, j, n_full, r0, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """log2(e) (scale q.k - c_j + c_ref), causally masked on the tiles from n_full on."""
    x = s_acc * qk_scale - gl.expand_dims(ck, 0)
    if j >= n_full:
        rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        x = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0), x, float("-inf"))
    return x


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, c_base, o_base, lse_base, r0, T,
              n_tiles, n_other, n_all, o_stride, qk_scale, W: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """Warpgroup W: the BLOCK_M query rows from r0 over key tiles [0, n_tiles) of the n_all loaded; n_other: the
    other warpgroup's count of loop iterations (its n_tiles - 1), for the turns."""
    s_layout: gl.constexpr = _mma(BLOCK_N)
    o_layout: gl.constexpr = _mma(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    q_tile = q_smem.index(W)
    c_ref = gl.load(c_base + gl.minimum(r0, T - 1))
    n_full = r0 // BLOCK_N  # tiles left of the diagonal: no mask
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    mbarrier.wait(q_bar.index(W), 0)
    if n_tiles > 0:
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        x = _logits(s_acc, _key_c(0, c_base, c_ref, T, BLOCK_N, s_layout), 0, n_full, r0, qk_scale, BLOCK_M, BLOCK_N,
                    s_layout)
        m_i = gl.max(x, axis=1)
        p = gl.exp2(x - gl.expand_dims(m_i, 1))
        l_i = gl.sum(p, axis=1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(n_tiles - 1):
            s = j % STAGES
            s1 = (j + 1) % STAGES
            ck = _key_c(j + 1, c_base, c_ref, T, BLOCK_N, s_layout)  # its latency hides behind the waits
            if j < n_other + 1 - W:  # my turn: after the other warpgroup's issue of the same (W=1) or last (W=0) step
                mbarrier.wait(turn.index(W), (j + 1 - W) & 1)
            mbarrier.wait(k_ready.index(s1), ((j + 1) // STAGES) & 1)
            s_tok = warpgroup_mma(q_tile, k_smem.index(s1).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(s), (j // STAGES) & 1)
            o_tok = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - W))
            s_acc, p_op = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, p_op))  # S ready, P V in flight
            x = _logits(s_acc, ck, j + 1, n_full, r0, qk_scale, BLOCK_M, BLOCK_N, s_layout)
            m_new = gl.maximum(m_i, gl.max(x, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(x - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            p_next = gl.convert_layout(p.to(dtype), p_layout)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
            mbarrier.arrive(kv_empty.index(s))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p_op = p_next
        last = (n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))
        mbarrier.arrive(kv_empty.index(last))
    for j in range(n_tiles, n_all):  # tiles only the other warpgroup reads (none past T here): free them unread
        mbarrier.wait(k_ready.index(j % STAGES), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
        mbarrier.arrive(kv_empty.index(j % STAGES))
    rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    ptrs = o_base + gl.expand_dims(rows.to(gl.int64) * o_stride, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, o.to(dtype), mask=gl.expand_dims(rows < T, 1))
    rows_s = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    cq = ((gl.load(c_base + rows_s, mask=rows_s < T, other=0.0) - c_ref) * LOG2E).to(gl.float32)
    gl.store(lse_base + rows_s, (m_i + gl.log2(l_i) + cq) * LN2, mask=rows_s < T)


@gluon.jit
def _attn_fwd_gluon(q_desc, k_desc, v_desc, c_ptr, o_ptr, lse_ptr, T, Hq, NB, HG, qk_scale, G: gl.constexpr,
                    D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    pid = gl.program_id(0)
    in_group = pid % (HG * NB)
    hb = (pid // (HG * NB)) * HG + in_group % HG
    i0 = (NB - 1 - in_group // HG) * (2 * BLOCK_M)
    hq = hb % Hq
    b = hb // Hq
    c_base = c_ptr + hb.to(gl.int64) * T
    o_base = o_ptr + (b.to(gl.int64) * T * Hq + hq) * D
    lse_base = lse_ptr + hb.to(gl.int64) * T
    r1 = i0 + BLOCK_M
    n0 = gl.cdiv(gl.minimum(i0 + BLOCK_M, T), BLOCK_N)
    n1 = gl.where(r1 < T, gl.cdiv(gl.minimum(r1 + BLOCK_M, T), BLOCK_N), 0)
    n_all = gl.maximum(n0, n1)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_bar.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)  # one arrival per consumer warpgroup (an elected thread each)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, c_base, o_base, lse_base, i0, T,
                     n0, n1 - 1, n_all, Hq * D, qk_scale, 0, BLOCK_M, BLOCK_N, D, STAGES)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, c_base, o_base, lse_base, r1, T,
                     n1, n0 - 1, n_all, Hq * D, qk_scale, 1, BLOCK_M, BLOCK_N, D, STAGES)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, b * T + i0,
                     hq * D, b * T, (hq // G) * D, n_all, BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [240, 24])
    for w in gl.static_range(2):
        mbarrier.invalidate(q_bar.index(w))
        mbarrier.invalidate(turn.index(w))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(s))
        mbarrier.invalidate(v_ready.index(s))
        mbarrier.invalidate(kv_empty.index(s))


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, scale: float,
                  head_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal forward: q [B, T, Hq, D], k and v [B, T, Hk, D] contiguous bf16/fp16, c [B, Hq, T] fp64 (the gate
    cumsum, contiguous), head_group: (head, sequence) pairs launched together -> o [B, T, Hq, D], lse [B, Hq, T]
    fp32 (natural log, c included), as ``triton_op._forward_impl``'s."""
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    block_m, block_n, stages = TILES[D]
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, D], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], dtype)
    q_desc = TensorDescriptor.from_tensor(q.view(B * T, Hq * D), [block_m, D], q_layout)
    k_desc = TensorDescriptor.from_tensor(k.view(B * T, Hk * D), [block_n, D], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v.view(B * T, Hk * D), [block_n, D], kv_layout)
    o = torch.empty_like(q)
    lse = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32)
    n_blocks = triton.cdiv(T, 2 * block_m)
    _attn_fwd_gluon[(n_blocks * B * Hq,)](q_desc, k_desc, v_desc, c, o, lse, T, Hq, n_blocks, head_group,
                                          scale * LOG2E.value, Hq // Hk, D, block_m, block_n, stages, num_warps=4)
    return o, lse

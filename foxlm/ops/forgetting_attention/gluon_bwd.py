"""A warp-specialized dK/dV backward of Forgetting Attention for Hopper, in Gluon (Triton's explicit-layout language).

GPU-only (sm_90, the Triton version it was tested with): ``triton_op`` picks it where
``tests/ops/forgetting_attention/test_gluon.py`` passed on the device (see ``triton_op.GLUON_BWD_TESTED``) and keeps
its Triton twin, ``triton_kernels._attn_bwd_dkdv_kernel``, everywhere else. dQ and the gate gradient's row sums stay
with the Triton dQ kernel (no atomics: the backward stays deterministic). It covers Tq == Tk without packed sequences
or a window, with or without ACP, and GQA. Design (FlashAttention-3's backward without its dQ, docs/benchmarks.md):

* one program per (2 x BLOCK_N keys, sequence, key head); two consumer warpgroups own BLOCK_N keys each (K and V in
  shared memory, dK and dV accumulated in registers); a 1-warp producer TMA-loads K and V once, then the Q and dO
  tiles of every query tile that sees the keys, for each query head of the group, into a ring of STAGES slots;
* per query tile: S^T = K Q^T and dP^T = V dO^T issued together as async wgmma; P^T = exp2(...) runs while dP^T is in
  flight, dV += P^T dO is issued, dS^T = P^T (dP^T - delta) runs while dV's wgmma is in flight, then dK += dS^T Q;
* the logits take the query side's c_rel (``_attn_bwd_preprocess``, -log2(e) lse folded in) plus one fp64 difference
  per tile, as the Triton kernel's unmasked tiles (``_c_tile``); the diagonal's and the last tiles convert from fp64;
  the loads are issued before the tile's barrier waits;
* -colsum(dS) per query head into DCK, summed as the Triton dQ kernel sums its rows (rounded to q's dtype where the
  dQ kernel takes its sums as dots: ``triton_op.DOT_SUMS``), so that the gate gradient's two sums cancel alike;
* ACP: each program binary-searches, per query head, the last query tile its last key keeps (c is monotone), as the
  Triton kernel; the first warpgroup stops at its own keys' end.
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

from .gluon_fwd import LOG2E, _mma

# Tiles per head dim: (keys per warpgroup, query rows per tile, Q/dO stages), as timed (docs/benchmarks.md).
TILES = {128: (64, 32, 4)}


@gluon.jit
def _q_end(cb, thr_ptr, k_last, lo, T, n_tiles, BLOCK_M: gl.constexpr, PRUNE: gl.constexpr):
    """The end of the query tiles that see keys up to ``k_last``: all of them, or with ACP up to the tile holding the
    first row i with c_i - c[k_last] below the threshold."""
    end = n_tiles
    if PRUNE:
        target = gl.load(cb + k_last) + gl.load(thr_ptr).to(gl.float64)
        hi = T
        while lo < hi:
            mid = (lo + hi) // 2
            right = gl.load(cb + mid) >= target
            lo = gl.where(right, mid + 1, lo)
            hi = gl.where(right, hi, mid)
        end = gl.minimum(end, gl.cdiv(lo, BLOCK_M))
    return end


@gluon.jit
def _producer(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty,
              k_row, k_col, q_row, q_col, t0, n_tiles, c_base, thr_base, k_last, T, G: gl.constexpr,
              D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
              PRUNE: gl.constexpr):
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [k_row + w * BLOCK_N, k_col], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [k_row + w * BLOCK_N, k_col], kv_bar, v_smem.index(w))
    i = 0
    for g in range(G):
        end = _q_end(c_base + g * T, thr_base + g, k_last, t0 * BLOCK_M, T, n_tiles, BLOCK_M, PRUNE)
        for t in range(t0, end):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row + t * BLOCK_M, q_col + g * D], q_ready.index(s),
                                            q_smem.index(s))
            mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [q_row + t * BLOCK_M, q_col + g * D], do_ready.index(s),
                                            do_smem.index(s))
            i += 1


@gluon.jit
def _consumer(k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty, c_base, crq_base, lse_base,
              delta_base, dck_base, dk_base, dv_base, thr_base, T, n0, t0, n_tiles, k_last, kv_stride, qk_scale,
              scale, W: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_M: gl.constexpr, STAGES: gl.constexpr, C_BLOCK: gl.constexpr, PRUNE: gl.constexpr,
              ROUND_SUMS: gl.constexpr):
    st_layout: gl.constexpr = _mma(BLOCK_M)
    acc_layout: gl.constexpr = _mma(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    k0 = n0 + W * BLOCK_N
    keys = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    kvalid = keys < T
    dk = gl.zeros([BLOCK_N, D], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, D], gl.float32, layout=acc_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
    mbarrier.wait(kv_bar, 0)
    k_tile = k_smem.index(W)
    v_tile = v_smem.index(W)
    i = 0
    for g in range(G):
        cb = c_base + g * T
        end = _q_end(cb, thr_base + g, k_last, t0 * BLOCK_M, T, n_tiles, BLOCK_M, PRUNE)  # the producer's tiles
        end_w = _q_end(cb, thr_base + g, gl.minimum(k0 + BLOCK_N, T) - 1, t0 * BLOCK_M, T, n_tiles, BLOCK_M, PRUNE)
        c_ref = gl.load(cb + gl.minimum(k0, T - 1))
        ck = ((gl.load(cb + keys, mask=kvalid, other=0.0) - c_ref) * LOG2E).to(gl.float32)
        colsum = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, st_layout))
        for t in range(t0, end):
            s = i % STAGES
            ph = (i // STAGES) & 1
            q0 = t * BLOCK_M
            cols = q0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
            qvalid = cols < T
            masked = (q0 < k0 + BLOCK_N) | (q0 + BLOCK_M > T)  # the diagonal's tiles, and rows past the end
            b0 = (q0 // C_BLOCK) * C_BLOCK
            if masked | (b0 < k0):  # c_rel and c_ref's difference would differ in sign: from fp64
                cq = ((gl.load(cb + cols, mask=qvalid, other=0.0) - c_ref) * LOG2E).to(gl.float32) \
                    - gl.load(lse_base + g * T + cols, mask=qvalid, other=0.0) * LOG2E
                delta = gl.load(delta_base + g * T + cols, mask=qvalid, other=0.0)
            else:
                cq = gl.load(crq_base + g * T + cols) + ((gl.load(cb + b0) - c_ref) * LOG2E).to(gl.float32)
                delta = gl.load(delta_base + g * T + cols)
            mbarrier.wait(q_ready.index(s), ph)
            mbarrier.wait(do_ready.index(s), ph)
            if (q0 + BLOCK_M > k0) & (t < end_w):  # the tile reaches this warpgroup's keys, and ACP keeps it
                st_tok = warpgroup_mma(k_tile, q_smem.index(s).permute((1, 0)), st_zero, use_acc=False,
                                       is_async=True)
                dpt_tok = warpgroup_mma(v_tile, do_smem.index(s).permute((1, 0)), st_zero, use_acc=False,
                                        is_async=True)
                st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok, ))
                x = st * qk_scale + gl.expand_dims(cq, 0) - gl.expand_dims(ck, 1)
                if masked:
                    keep = (gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1)) & gl.expand_dims(qvalid, 0)
                    x = gl.where(keep, x, float("-inf"))
                pt = gl.exp2(x)
                pt_op = gl.convert_layout(pt.to(dtype), op_layout)
                dv_tok = warpgroup_mma(pt_op, do_smem.index(s), dv, is_async=True)
                dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok, ))  # dP^T ready, dV in flight
                dst = pt * (dpt - gl.expand_dims(delta, 0))
                if ROUND_SUMS:
                    rounded = dst.to(dtype)
                    colsum += gl.sum(rounded.to(gl.float32), axis=1)
                    ds_op = gl.convert_layout(rounded, op_layout)
                else:
                    colsum += gl.sum(dst, axis=1)
                    ds_op = gl.convert_layout(dst.to(dtype), op_layout)
                dv, pt_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, pt_op))
                dk_tok = warpgroup_mma(ds_op, q_smem.index(s), dk, is_async=True)
                dk, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok, ds_op))
            mbarrier.arrive(empty.index(s))
            i += 1
        gl.store(dck_base + g * T + keys, -colsum, mask=kvalid)
    rows = k0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    dcols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    offs = gl.expand_dims(rows.to(gl.int64) * kv_stride, 1) + gl.expand_dims(dcols, 0)
    rmask = gl.expand_dims(rows < T, 1)
    gl.store(dk_base + offs, (dk * scale).to(dtype), mask=rmask)
    gl.store(dv_base + offs, dv.to(dtype), mask=rmask)


@gluon.jit
def _attn_bwd_dkdv_gluon(k_desc, v_desc, q_desc, do_desc, c_ptr, crq_ptr, lse_ptr, delta_ptr, dck_ptr, dk_ptr, dv_ptr,
                         thr_ptr, T, Hk, NB, qk_scale, scale, G: gl.constexpr, D: gl.constexpr,
                         BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, C_BLOCK: gl.constexpr,
                         PRUNE: gl.constexpr, ROUND_SUMS: gl.constexpr):
    pid = gl.program_id(0)
    hb = pid // NB
    n0 = (pid % NB) * (2 * BLOCK_N)  # a head's first keys (the longest programs) first
    hk = hb % Hk
    b = hb // Hk
    Hq = Hk * G
    head0 = (b * Hq + hk * G).to(gl.int64) * T  # [B, Hq, T] vectors: the group's first query head
    t0 = n0 // BLOCK_M
    n_tiles = gl.cdiv(T, BLOCK_M)
    kv_base = (b.to(gl.int64) * T * Hk + hk) * D
    thr_base = thr_ptr + b * Hq + hk * G  # [B, Hq]
    k_last = gl.minimum(n0 + 2 * BLOCK_N, T) - 1

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty, c_ptr + head0,
                     crq_ptr + head0, lse_ptr + head0, delta_ptr + head0, dck_ptr + head0, dk_ptr + kv_base,
                     dv_ptr + kv_base, thr_base, T, n0, t0, n_tiles, k_last, Hk * D, qk_scale, scale, 0, G, D,
                     BLOCK_N, BLOCK_M, STAGES, C_BLOCK, PRUNE, ROUND_SUMS)),
        (_consumer, (k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty, c_ptr + head0,
                     crq_ptr + head0, lse_ptr + head0, delta_ptr + head0, dck_ptr + head0, dk_ptr + kv_base,
                     dv_ptr + kv_base, thr_base, T, n0, t0, n_tiles, k_last, Hk * D, qk_scale, scale, 1, G, D,
                     BLOCK_N, BLOCK_M, STAGES, C_BLOCK, PRUNE, ROUND_SUMS)),
        (_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready,
                     empty, b * T + n0, hk * D, b * T, hk * G * D, t0, n_tiles, c_ptr + head0, thr_base, k_last, T,
                     G, D, BLOCK_N, BLOCK_M, STAGES, PRUNE)),
    ], [4, 1], [240, 24])
    mbarrier.invalidate(kv_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(q_ready.index(s))
        mbarrier.invalidate(do_ready.index(s))
        mbarrier.invalidate(empty.index(s))


def gluon_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, c: torch.Tensor,
               crq: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, threshold: torch.Tensor | None,
               scale: float, c_block: int, round_sums: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dK, dV and -colsum(dS) of Forgetting Attention.

    q, do: [B, T, Hq, D], k, v: [B, T, Hk, D], contiguous, bf16 or fp16; c: [B, Hq, T] fp64 (the gate cumsum);
    crq: [B, Hq, T] fp32, lse, delta: [B, Hq, T] fp32 (``triton_op._bwd_preprocess``'s, with ``c_block``);
    threshold: ACP's [B, Hq] or None; round_sums: sum dS rounded to q's dtype (as the dQ kernel's dot sums).
    Returns dk, dv: [B, T, Hk, D] and dck: [B, Hq, T] fp32.
    """
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    block_n, block_m, stages = TILES[D]
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], dtype)
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, D], dtype)
    k_desc = TensorDescriptor.from_tensor(k.view(B * T, Hk * D), [block_n, D], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v.view(B * T, Hk * D), [block_n, D], kv_layout)
    q_desc = TensorDescriptor.from_tensor(q.view(B * T, Hq * D), [block_m, D], q_layout)
    do_desc = TensorDescriptor.from_tensor(do.view(B * T, Hq * D), [block_m, D], q_layout)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dck = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32)
    thr = threshold.float().contiguous() if threshold is not None else lse  # lse: unused placeholder
    nb = triton.cdiv(T, 2 * block_n)
    _attn_bwd_dkdv_gluon[(nb * B * Hk,)](
        k_desc, v_desc, q_desc, do_desc, c, crq, lse, delta, dck, dk, dv, thr, T, Hk, nb, scale * LOG2E.value, scale,
        Hq // Hk, D, block_n, block_m, stages, c_block, threshold is not None, round_sums, num_warps=4)
    return dk, dv, dck

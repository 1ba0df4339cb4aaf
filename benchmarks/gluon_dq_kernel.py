"""The Gluon dQ kernel of ``gluon_dq.py`` (Hopper, Triton 3.6), imported by it once a GPU is there: Gluon cannot
be imported into a process whose Triton runs interpreted."""

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

from foxlm.ops.forgetting_attention.gluon_fwd import LOG2E, _mma

# Tiles per head dim: (query rows per warpgroup, keys per tile, K/V stages, consumer warpgroups); --tiles overrides.
DQ_TILES = {64: (64, 64, 3, 3), 128: (64, 64, 2, 2)}


@gluon.jit
def _key_start(cb, thr_ptr, p0, BLOCK_N: gl.constexpr, PRUNE: gl.constexpr):
    """The first key tile that query row p0 (and the rows after it) sees: 0, or with ACP the tile of the first key j
    with c_j <= c_p0 - threshold (c is non-increasing), at most p0's own tile."""
    lo = p0 * 0
    if PRUNE:
        target = gl.load(cb + p0) - gl.load(thr_ptr).to(gl.float64)
        hi = p0 + 1
        while lo < hi:
            mid = (lo + hi) // 2
            right = gl.load(cb + mid) > target
            lo = gl.where(right, mid + 1, lo)
            hi = gl.where(right, hi, mid)
        lo = gl.minimum(lo // BLOCK_N, p0 // BLOCK_N)
    return lo


@gluon.jit
def _dq_producer(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, q_bar, k_ready, v_ready, empty,
                 k_row, k_col, q_row, q_col, j0, n_all, NW: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(q_bar, NW * (q_desc.block_type.nbytes + do_desc.block_type.nbytes))
    for w in gl.static_range(NW):
        tma.async_copy_global_to_shared(q_desc, [q_row + w * BLOCK_M, q_col], q_bar, q_smem.index(w))
        tma.async_copy_global_to_shared(do_desc, [q_row + w * BLOCK_M, q_col], q_bar, do_smem.index(w))
    for j in range(j0, n_all):
        i = j - j0
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, k_col], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [k_row + j * BLOCK_N, k_col], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, cb, crk_base, lse_base, delta_base,
                 dcq_base, dq_base, thr_ptr, T, r0, j0, n_all, q_stride, qk_scale, scale, W: gl.constexpr,
                 D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 C_BLOCK: gl.constexpr, PRUNE: gl.constexpr, ROUND_SUMS: gl.constexpr):
    """Warpgroup W: dQ and rowsum(dS) of the BLOCK_M query rows from r0, over its key tiles among [j0, n_all)."""
    s_layout: gl.constexpr = _mma(BLOCK_N)
    acc_layout: gl.constexpr = _mma(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    p0 = gl.minimum(r0, T - 1)
    rows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    qvalid = rows < T
    c_ref = gl.load(cb + p0)
    lse = gl.load(lse_base + rows, mask=qvalid, other=float("inf"))
    cq = ((gl.load(cb + rows, mask=qvalid, other=0.0) - c_ref) * LOG2E).to(gl.float32) - lse * LOG2E
    delta = gl.load(delta_base + rows, mask=qvalid, other=0.0)
    lo = _key_start(cb, thr_ptr, p0, BLOCK_N, PRUNE)
    hi = gl.where(r0 < T, gl.cdiv(gl.minimum(r0 + BLOCK_M, T), BLOCK_N), 0)  # up to the tile of the last row
    mask_lo = gl.maximum(((p0 // C_BLOCK) * C_BLOCK) // BLOCK_N, lo)  # tiles from here convert c from fp64
    dq = gl.zeros([BLOCK_M, D], gl.float32, layout=acc_layout)
    rs = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    q_tile = q_smem.index(W)
    do_tile = do_smem.index(W)
    mbarrier.wait(q_bar, 0)
    for j in range(j0, lo):  # tiles only the warpgroups before this one read: free them unread
        i = j - j0
        mbarrier.wait(k_ready.index(i % STAGES), (i // STAGES) & 1)
        mbarrier.wait(v_ready.index(i % STAGES), (i // STAGES) & 1)
        mbarrier.arrive(empty.index(i % STAGES))
    for j in range(lo, hi):
        i = j - j0
        s = i % STAGES
        keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        masked = j >= mask_lo
        if masked:  # the diagonal's tiles, and those of p0's C_BLOCK-long block: from fp64
            ck = ((gl.load(cb + keys, mask=keys < T, other=0.0) - c_ref) * LOG2E).to(gl.float32)
        else:  # inside one C_BLOCK-long block that ends at or before p0: its c_rel plus one fp64 difference
            b_end = ((j * BLOCK_N) // C_BLOCK + 1) * C_BLOCK
            ck = gl.load(crk_base + keys) + ((gl.load(cb + b_end) - c_ref) * LOG2E).to(gl.float32)
        mbarrier.wait(k_ready.index(s), (i // STAGES) & 1)
        mbarrier.wait(v_ready.index(s), (i // STAGES) & 1)
        s_tok = warpgroup_mma(q_tile, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do_tile, v_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        x = st * qk_scale + gl.expand_dims(cq, 1) - gl.expand_dims(ck, 0)
        if masked:
            keep = (gl.expand_dims(rows, 1) >= gl.expand_dims(keys, 0)) & gl.expand_dims(qvalid, 1)
            x = gl.where(keep, x, float("-inf"))
        p = gl.exp2(x)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
        ds = p * (dp - gl.expand_dims(delta, 1))
        if ROUND_SUMS:
            rounded = ds.to(dtype)
            rs += gl.sum(rounded.to(gl.float32), axis=1)
            ds_op = gl.convert_layout(rounded, op_layout)
        else:
            rs += gl.sum(ds, axis=1)
            ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        dq_tok = warpgroup_mma(ds_op, k_smem.index(s), dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ds_op))
        mbarrier.arrive(empty.index(s))
    for j in range(gl.maximum(hi, lo), n_all):  # tiles only the warpgroups after this one read
        i = j - j0
        mbarrier.wait(k_ready.index(i % STAGES), (i // STAGES) & 1)
        mbarrier.wait(v_ready.index(i % STAGES), (i // STAGES) & 1)
        mbarrier.arrive(empty.index(i % STAGES))
    gl.store(dcq_base + rows, rs, mask=qvalid)
    drows = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    dcols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    offs = gl.expand_dims(drows.to(gl.int64) * q_stride, 1) + gl.expand_dims(dcols, 0)
    gl.store(dq_base + offs, (dq * scale).to(dtype), mask=gl.expand_dims(drows < T, 1))


@gluon.jit
def _attn_bwd_dq_gluon(q_desc, do_desc, k_desc, v_desc, c_ptr, crk_ptr, lse_ptr, delta_ptr, dcq_ptr, dq_ptr, thr_ptr,
                       T, Hq, NB, qk_scale, scale, G: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NW: gl.constexpr, C_BLOCK: gl.constexpr,
                       PRUNE: gl.constexpr, ROUND_SUMS: gl.constexpr):
    pid = gl.program_id(0)
    hb = pid // NB
    i0 = (NB - 1 - pid % NB) * (NW * BLOCK_M)  # a head's last queries (the longest programs) first
    hq = hb % Hq
    b = hb // Hq
    head0 = hb.to(gl.int64) * T  # [B, Hq, T] vectors
    cb = c_ptr + head0
    thr = thr_ptr + hb  # [B, Hq]
    q_base = (b.to(gl.int64) * T * Hq + hq) * D
    j0 = _key_start(cb, thr, i0, BLOCK_N, PRUNE)  # the first warpgroup's first tile: the earliest
    n_all = gl.cdiv(gl.minimum(i0 + NW * BLOCK_M, T), BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NW] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NW] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=NW)  # one arrival per consumer warpgroup
    fence_async_shared()
    if NW == 2:
        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, cb, crk_ptr + head0,
                            lse_ptr + head0, delta_ptr + head0, dcq_ptr + head0, dq_ptr + q_base, thr, T, i0, j0, n_all,
                            Hq * D, qk_scale, scale, 0, D, BLOCK_M, BLOCK_N, STAGES, C_BLOCK, PRUNE, ROUND_SUMS)),
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, cb, crk_ptr + head0,
                            lse_ptr + head0, delta_ptr + head0, dcq_ptr + head0, dq_ptr + q_base, thr, T, i0 + BLOCK_M,
                            j0, n_all, Hq * D, qk_scale, scale, 1, D, BLOCK_M, BLOCK_N, STAGES, C_BLOCK, PRUNE,
                            ROUND_SUMS)),
            (_dq_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, q_bar, k_ready,
                            v_ready, empty, b * T, (hq // G) * D, b * T + i0, hq * D, j0, n_all, NW, BLOCK_M,
                            BLOCK_N, STAGES)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, cb, crk_ptr + head0,
                            lse_ptr + head0, delta_ptr + head0, dcq_ptr + head0, dq_ptr + q_base, thr, T, i0, j0, n_all,
                            Hq * D, qk_scale, scale, 0, D, BLOCK_M, BLOCK_N, STAGES, C_BLOCK, PRUNE, ROUND_SUMS)),
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, cb, crk_ptr + head0,
                            lse_ptr + head0, delta_ptr + head0, dcq_ptr + head0, dq_ptr + q_base, thr, T, i0 + BLOCK_M,
                            j0, n_all, Hq * D, qk_scale, scale, 1, D, BLOCK_M, BLOCK_N, STAGES, C_BLOCK, PRUNE,
                            ROUND_SUMS)),
            (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, cb, crk_ptr + head0,
                            lse_ptr + head0, delta_ptr + head0, dcq_ptr + head0, dq_ptr + q_base, thr, T, i0 + 2 *
                            BLOCK_M, j0, n_all, Hq * D, qk_scale, scale, 2, D, BLOCK_M, BLOCK_N, STAGES, C_BLOCK, PRUNE,
                            ROUND_SUMS)),
            (_dq_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, q_bar, k_ready,
                            v_ready, empty, b * T, (hq // G) * D, b * T + i0, hq * D, j0, n_all, NW, BLOCK_M,
                            BLOCK_N, STAGES)),
        ], [4, 4, 1], [160, 160, 24])
    mbarrier.invalidate(q_bar)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(s))
        mbarrier.invalidate(v_ready.index(s))
        mbarrier.invalidate(empty.index(s))


def gluon_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, c: torch.Tensor,
             crk: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, threshold: torch.Tensor | None, scale: float,
             c_block: int, round_sums: bool, dq: torch.Tensor, dcq: torch.Tensor) -> None:
    """dQ and rowsum(dS) of Forgetting Attention.

    q, do: [B, T, Hq, D], k, v: [B, T, Hk, D], contiguous, bf16 or fp16; c: [B, Hq, T] fp64 (the gate cumsum);
    crk: [B, Hq, T] fp32 (the key side's c_rel, ``triton_op._relative_c`` with ``c_block``); lse, delta: [B, Hq, T]
    fp32; threshold: ACP's [B, Hq] or None; round_sums: sum dS rounded to q's dtype (as the dK/dV kernel's sums).
    Writes dq: [B, T, Hq, D] and dcq: [B, Hq, T] fp32 (the Triton dQ kernel's buffers).
    """
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    block_m, block_n, stages, nw = DQ_TILES[D]
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, D], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], dtype)
    q_desc = TensorDescriptor.from_tensor(q.view(B * T, Hq * D), [block_m, D], q_layout)
    do_desc = TensorDescriptor.from_tensor(do.view(B * T, Hq * D), [block_m, D], q_layout)
    k_desc = TensorDescriptor.from_tensor(k.view(B * T, Hk * D), [block_n, D], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v.view(B * T, Hk * D), [block_n, D], kv_layout)
    thr = threshold.float().contiguous() if threshold is not None else lse  # lse: unused placeholder
    nb = triton.cdiv(T, nw * block_m)
    _attn_bwd_dq_gluon[(nb * B * Hq,)](
        q_desc, do_desc, k_desc, v_desc, c, crk, lse, delta, dcq, dq, thr, T, Hq, nb, scale * LOG2E.value, scale,
        Hq // Hk, D, block_m, block_n, stages, nw, c_block, threshold is not None, round_sums, num_warps=4)

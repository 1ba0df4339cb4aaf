"""Does Triton's automatic warp specialization speed up a gated attention forward on Hopper?

FlashAttention-3 and cuDNN hide the latency of the chain QK^T -> softmax -> PV with warp specialization (producer
warps load tiles while consumer warps compute); Triton exposes it as ``tl.range(..., warp_specialize=True)``, which
on Hopper compiles only for loops that load through tensor descriptors (TMA). This times a minimal gated forward,
the core of ``foxlm``'s (one loop of unmasked 128-row tiles that stops before the diagonal block, the bias read as
``c_rel`` like the shipped kernel), in three forms on the same inputs: pointer loads (as shipped), descriptor loads,
and descriptor loads with warp specialization; 1 x 16k x 12 heads of 64 (the 125m training step) and 4 x 16k x 32
heads of 64 (the protocol). ``triton.testing.do_bench`` (50 ms warm-up, 300 ms of runs); each output is compared with
the first kernel's (the minimal kernels have no fp64 reference: they leave out the diagonal block). An experiment, not
a kernel of the package.

``--compile-backward`` compiles the dK/dV loop of a gated backward with warp specialization for sm_90a, on any
machine (no GPU): which of its forms the compiler accepts.

    python benchmarks/warp_specialization.py   # on a GPU; writes $OUT/warp_specialization.json (or ./)
    python benchmarks/warp_specialization.py --compile-backward
"""

import datetime
import json
import os
import sys

import torch
import triton
import triton.language as tl


def alloc(size, align, stream):  # device-side tensor descriptors need scratch memory
    return torch.empty(size, device="cuda", dtype=torch.int8)


triton.set_allocator(alloc)


@triton.jit
def fwd_desc(Q, K, V, CR, O, T, qk_scale, HD: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, WS: tl.constexpr, NT: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    qd = tl.make_tensor_descriptor(Q, shape=[NT, HD], strides=[HD, 1], block_shape=[BM, D])
    kd = tl.make_tensor_descriptor(K, shape=[NT, HD], strides=[HD, 1], block_shape=[BN, D])
    vd = tl.make_tensor_descriptor(V, shape=[NT, HD], strides=[HD, 1], block_shape=[BN, D])
    od = tl.make_tensor_descriptor(O, shape=[NT, HD], strides=[HD, 1], block_shape=[BM, D])
    row0 = b * T + pid_m * BM
    q = qd.load([row0, h * D])
    m_i = tl.zeros([BM], tl.float32) - float("inf")
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    crb = CR + bh.to(tl.int64) * T
    for start_n in tl.range(0, pid_m * BM, BN, warp_specialize=WS):
        k = kd.load([b * T + start_n, h * D])
        ck = tl.load(crb + start_n + tl.arange(0, BN))
        s = tl.dot(q, k.T) * qk_scale - ck[None, :]
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = vd.load([b * T + start_n, h * D])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_ij
    l_i = tl.where(l_i == 0, 1.0, l_i)  # the first block's rows see no key here
    od.store([row0, h * D], (acc / l_i[:, None]).to(tl.bfloat16))

@triton.jit
def fwd_ptr(Q, K, V, CR, O, T, qk_scale, HD: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
            BN: tl.constexpr, WS: tl.constexpr, NT: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_d = tl.arange(0, D)
    rows = b * T + pid_m * BM + tl.arange(0, BM)
    q = tl.load(Q + rows.to(tl.int64)[:, None] * HD + h * D + offs_d[None, :])
    m_i = tl.zeros([BM], tl.float32) - float("inf")
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    crb = CR + bh.to(tl.int64) * T
    for start_n in range(0, pid_m * BM, BN):
        kr = b * T + start_n + tl.arange(0, BN)
        k = tl.load(K + kr.to(tl.int64)[:, None] * HD + h * D + offs_d[None, :])
        ck = tl.load(crb + start_n + tl.arange(0, BN))
        s = tl.dot(q, k.T) * qk_scale - ck[None, :]
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kr.to(tl.int64)[:, None] * HD + h * D + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_ij
    l_i = tl.where(l_i == 0, 1.0, l_i)
    tl.store(O + rows.to(tl.int64)[:, None] * HD + h * D + offs_d[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


@triton.jit
def bwd_desc(Q, K, V, DO, CRQ, CRK, DELTA, DQ, DK, DV, T, qk_scale, H: tl.constexpr, D: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr, DV_DOT: tl.constexpr, DK_DOT: tl.constexpr,
             DQ_DOT: tl.constexpr, ATOMIC_DQ: tl.constexpr, DCK: tl.constexpr):
    """The dK/dV loop of a gated backward (one key block, the unmasked query blocks below it), descriptor loads;
    the constexpr flags leave out its dots, dQ's atomics (a plain store instead) and the gate's column sums, to find
    what warp specialization compiles. Compiled only (``--compile-backward``)."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    qd = tl.make_tensor_descriptor(Q, shape=[T, H * D], strides=[H * D, 1], block_shape=[BM, D])
    dod = tl.make_tensor_descriptor(DO, shape=[T, H * D], strides=[H * D, 1], block_shape=[BM, D])
    kd = tl.make_tensor_descriptor(K, shape=[T, H * D], strides=[H * D, 1], block_shape=[BN, D])
    vd = tl.make_tensor_descriptor(V, shape=[T, H * D], strides=[H * D, 1], block_shape=[BN, D])
    cqd = tl.make_tensor_descriptor(CRQ, shape=[H * T], strides=[1], block_shape=[BM])
    dld = tl.make_tensor_descriptor(DELTA, shape=[H * T], strides=[1], block_shape=[BM])
    start_n = pid_n * BN
    k = kd.load([start_n, h * D])
    v = vd.load([start_n, h * D])
    ck = tl.load(CRK + h * T + start_n + tl.arange(0, BN))
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    dck = tl.zeros([BN], tl.float32)
    offs_d = tl.arange(0, D)
    for start_m in tl.range(start_n + BN, T, BM, warp_specialize=WS):
        q = qd.load([start_m, h * D])
        do = dod.load([start_m, h * D])
        cq = cqd.load([h * T + start_m])
        dl = dld.load([h * T + start_m])
        pt = tl.math.exp2(tl.dot(k, q.T) * qk_scale - ck[:, None] + cq[None, :])
        if DV_DOT:
            dv = tl.dot(pt.to(tl.bfloat16), do, dv)
        dst = pt * (tl.dot(v, do.T) - dl[None, :])
        if DK_DOT:
            dk = tl.dot(dst.to(tl.bfloat16), q, dk)
        if DCK:
            dck += tl.sum(dst, 1)
        if DQ_DOT:
            dq = tl.dot(dst.T.to(tl.bfloat16), k)
            dq_ptrs = DQ + (start_m + tl.arange(0, BM))[:, None] * (H * D) + h * D + offs_d[None, :]
            if ATOMIC_DQ:
                tl.atomic_add(dq_ptrs, dq)
            else:
                tl.store(dq_ptrs, dq)
    dkd = tl.make_tensor_descriptor(DK, shape=[T, H * D], strides=[H * D, 1], block_shape=[BN, D])
    dvd = tl.make_tensor_descriptor(DV, shape=[T, H * D], strides=[H * D, 1], block_shape=[BN, D])
    dkd.store([start_n, h * D], (dk + dck[:, None]).to(tl.bfloat16))
    dvd.store([start_n, h * D], dv.to(tl.bfloat16))


def compile_backward() -> list[dict]:
    """Compile ``bwd_desc`` for sm_90a (no GPU needed) with warp specialization, at 4 and 8 warps, in forms that leave
    out more and more of the loop; whether it compiles and whether it specialized (``setmaxnreg`` in the PTX)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = bwd_desc.arg_names
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "DO": "*bf16", "CRQ": "*fp32", "CRK": "*fp32",
                "DELTA": "*fp32", "DQ": "*fp32", "DK": "*bf16", "DV": "*bf16"}
    forms = {"the whole loop (5 dots, atomic dQ, column sums)": dict(DV_DOT=1, DK_DOT=1, DQ_DOT=1, ATOMIC_DQ=1, DCK=1),
             "dQ stored, not added": dict(DV_DOT=1, DK_DOT=1, DQ_DOT=1, ATOMIC_DQ=0, DCK=1),
             "no dQ": dict(DV_DOT=1, DK_DOT=1, DQ_DOT=0, ATOMIC_DQ=0, DCK=1),
             "no dQ, no column sums": dict(DV_DOT=1, DK_DOT=1, DQ_DOT=0, ATOMIC_DQ=0, DCK=0),
             "no dQ, no dK (3 dots)": dict(DV_DOT=1, DK_DOT=0, DQ_DOT=0, ATOMIC_DQ=0, DCK=0),
             "the two logit dots alone": dict(DV_DOT=0, DK_DOT=0, DQ_DOT=0, ATOMIC_DQ=0, DCK=0)}
    rows = []
    for form, flags in forms.items():
        for warps in (4, 8):
            constexprs = dict(H=12, D=64, BM=64, BN=128, WS=True, **flags)
            signature = {n: pointers.get(n) or ("constexpr" if n in constexprs else "fp32" if n == "qk_scale"
                                                else "i32") for n in names}
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*pointers, "T"]}
            src = ASTSource(fn=bwd_desc, signature=signature, attrs=attrs,
                            constexprs={(names.index(k),): v for k, v in constexprs.items()})
            try:
                kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                        options=dict(num_warps=warps, num_stages=2))
                row = dict(form=form, warps=warps, compiles=True, specialized="setmaxnreg" in kernel.asm["ptx"])
            except Exception as e:  # the compiler's assertion
                row = dict(form=form, warps=warps, compiles=False, error=str(e).splitlines()[-1][:200])
            print(row, flush=True)
            rows.append(row)
    return rows


def run(fn, q, k, v, cr, B, T, H, D, BM, BN, ws, warps, stages):
    o = torch.empty_like(q)
    grid = (T // BM, B * H)

    def go():
        fn[grid](q, k, v, cr, o, T, 0.125 * 1.4426950408889634, HD=H * D, H=H, D=D, BM=BM, BN=BN, WS=ws, NT=B * T,
                 num_warps=warps, num_stages=stages)
    go()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(go, warmup=50, rep=300)
    return o, ms


def main() -> None:
    if "--compile-backward" in sys.argv:
        json.dump({"triton": triton.__version__, "rows": compile_backward()}, sys.stdout, indent=1)
        return
    out = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "rows": []}
    for B, T, H in [(1, 16384, 12), (4, 16384, 32)]:
        D = 64
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B * T, H * D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        logf = torch.nn.functional.logsigmoid(torch.randn(B * H, T, device="cuda", generator=g) + 4)
        c = logf.cumsum(-1) * 1.4426950408889634
        cr = (c - c.view(B * H, T // 128, 128)[:, :, -1:].expand(-1, -1, 128).reshape(B * H, T)).contiguous()
        flops = 4 * B * H * T * T * D / 2
        ref = None
        for name, fn, BM, BN, ws, warps, stages in [
            ("ptr 128x64 w4 s3", fwd_ptr, 128, 64, False, 4, 3),
            ("ptr 128x128 w8 s3", fwd_ptr, 128, 128, False, 8, 3),
            ("desc 128x64 w4 s3", fwd_desc, 128, 64, False, 4, 3),
            ("desc 128x128 w8 s3", fwd_desc, 128, 128, False, 8, 3),
            ("desc WS 128x64 w4 s2", fwd_desc, 128, 64, True, 4, 2),
            ("desc WS 128x64 w4 s3", fwd_desc, 128, 64, True, 4, 3),
            ("desc WS 128x128 w4 s2", fwd_desc, 128, 128, True, 4, 2),
            ("desc WS 128x128 w4 s3", fwd_desc, 128, 128, True, 4, 3),
        ]:
            try:
                o, ms = run(fn, q, k, v, cr, B, T, H, D, BM, BN, ws, warps, stages)
                if ref is None:
                    ref = o.float()
                err = ((o.float() - ref).norm() / ref.norm()).item()
                row = dict(shape=f"{B}x{T}x{H}x{D}", kernel=name, ms=ms, tflops=flops / ms / 1e9, rel_err_vs_first=err)
            except Exception as e:
                row = dict(shape=f"{B}x{T}x{H}x{D}", kernel=name, error=str(e).splitlines()[-1][:300])
            print(row, flush=True)
            out["rows"].append(row)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "warp_specialization.json"), "w"), indent=1)


if __name__ == "__main__":
    main()

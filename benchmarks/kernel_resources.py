"""Registers, spills, shared memory and the loops' machine code of the attention kernels' tuned tiles, without a GPU.

Triton compiles for a target architecture offline (``triton.compile`` with a ``GPUTarget``) and its wheel ships
``ptxas`` and ``nvdisasm``. This builds the forward and the two backward kernels (dK/dV, dQ) of
``foxlm.ops.forgetting_attention.triton_op`` at every tile of their autotuning lists for one head dim (bf16, full
causal, no ACP), specialized as Triton's launcher
specializes them at the training shapes (16-byte aligned pointers; strides and lengths multiples of 16: without
that, loads are not vectorized and the register counts are those of another kernel). It prints what ptxas reports
(registers, spills, shared memory, whether it serialized the wgmma instructions), then per loop of the SASS (the
tile loops: a backward branch each) the instruction count, tensor-core (HGMMA), exp2 (MUFU) and spill (LDL/STL)
instructions: spills matter in the loops, not around them. With ``--kernels gluon`` (or ``all``, at a head dim the
Gluon kernels have tiles for, with the Triton release they were tested on) it compiles the Gluon forward
(``gluon_fwd``) and dK/dV (``gluon_bwd``, with ACP and without) too, and reports their partitions' register budgets
(``setmaxnreg``). It times nothing.

    python benchmarks/kernel_resources.py [--head-dim 64] [--arch 90] [--kernels all|triton|gluon]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from foxlm.ops.forgetting_attention import triton_kernels as tk
from foxlm.ops.forgetting_attention import triton_op as ta

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DK": "*bf16", "DV_": "*bf16",
            "C": "*fp64", "CR": "*fp32", "CRK": "*fp32", "CRQ": "*fp32", "THR": "*fp32", "LSE": "*fp32",
            "DELTA": "*fp32", "DQ": "*fp32", "DCK": "*fp32", "DCQ": "*fp32", "CU": "*i32"}
FLOATS = {"qk_scale", "scale"}
# Integer arguments divisible by 16 at the training shapes (strides, lengths; window 0 when unused); Triton's launcher
# marks such arguments (and 16-byte aligned pointers) ``tt.divisibility = 16`` and compiles for that.
ALIGNED_INTS = re.compile(r"s[a-z]{2}|T[qk]|window")
INSTRUCTIONS = r"(wgmma\.mma_async|mma\.sync|ex2\.approx|atom\.global|red\.global\.add)"
LOOP_INSTRUCTIONS = {"HGMMA": r"\bHGMMA\.", "MUFU": r"\bMUFU\.", "LDL": r"\bLDL\b", "STL": r"\bSTL\b"}  # SASS


def compile_kernel(fn, constexprs: dict, num_warps: int, num_stages: int, arch: int):
    """The kernel compiled for sm_``arch`` with these constexprs (other integers i32, tensors as POINTERS)."""
    names = fn.arg_names
    signature = {n: POINTERS.get(n) or ("constexpr" if n in constexprs else "fp32" if n in FLOATS else "i32")
                 for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n not in constexprs and (n in POINTERS or ALIGNED_INTS.fullmatch(n))}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def resources(kernel, arch: int) -> dict:
    """ptxas -v of the kernel's PTX: registers per thread and spill bytes; shared memory; whether ptxas serialized the
    wgmma instructions; instruction counts."""
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    counts = collections.Counter(re.findall(INSTRUCTIONS, ptx))
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spill_stores": int(re.search(r"(\d+) bytes spill stores", report).group(1)),
            "spill_loads": int(re.search(r"(\d+) bytes spill loads", report).group(1)),
            "shared": kernel.metadata.shared,
            # ptxas C7515: it serializes every wgmma of the kernel (each waited for before the next is issued)
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in report, **counts}


def loops(kernel, arch: int) -> list[dict]:
    """The SASS loops of the kernel (a backward branch each, in the order of those branches): instructions, HGMMA
    (wgmma), MUFU (exp2), LDL/STL (spill loads/stores) in each."""
    nvdisasm = os.path.join(os.path.dirname(get_ptxas(arch).path), "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    code, label_at, pending = [], {}, []
    for line in sass.splitlines():
        if m := re.match(r"\s*\.(L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            address = int(m.group(1), 16)
            label_at.update((name, address) for name in pending)
            pending = []
            code.append((address, m.group(2)))
    found = []
    for address, text in code:
        m = re.search(r"\bBRA\b.*\.(L_x_\d+)", text)
        if m and label_at.get(m.group(1), address) < address:
            body = [t for a, t in code if label_at[m.group(1)] <= a <= address]
            found.append({"instructions": len(body)} | {name: sum(bool(re.search(pattern, t)) for t in body)
                                                        for name, pattern in LOOP_INSTRUCTIONS.items()})
    return found


def compile_gluon_forward(d: int, arch: int):
    """The Gluon forward (``gluon_fwd``) at head dim d, bf16, as its launcher specializes it (descriptors of its
    tiles; aligned pointers and T)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from foxlm.ops.forgetting_attention import gluon_fwd as gf

    block_m, block_n, stages = gf.TILES[d]

    def descriptor(rows: int) -> str:  # as the launcher writes a TensorDescriptor's type
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)
        return f"tensordesc<bf16[{rows},{d}],{layout!r}>"

    fn = gf._attn_fwd_gluon
    constexprs = dict(G=1, D=d, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages)
    types = {"q_desc": descriptor(block_m), "k_desc": descriptor(block_n), "v_desc": descriptor(block_n),
             "c_ptr": "*fp64", "o_ptr": "*bf16", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in ("c_ptr", "o_ptr", "lse_ptr", "T")}
    src = GluonASTSource(fn=fn, signature=signature, attrs=aligned,
                         constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return f"gluon forward {block_m}x{block_n} (2 warpgroups)", triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4)), stages


def compile_gluon_backward(d: int, arch: int, prune: bool):
    """The Gluon dK/dV (``gluon_bwd``) at head dim d, bf16, one query head per key head, with ACP or without, as its
    launcher specializes it."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from foxlm.ops.forgetting_attention import gluon_bwd as gb

    block_n, block_m, stages = gb.TILES[d]

    def descriptor(rows: int) -> str:
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)
        return f"tensordesc<bf16[{rows},{d}],{layout!r}>"

    fn = gb._attn_bwd_dkdv_gluon
    constexprs = dict(G=1, D=d, BLOCK_N=block_n, BLOCK_M=block_m, STAGES=stages, C_BLOCK=ta.C_BLOCK, PRUNE=prune,
                      ROUND_SUMS=ta.DOT_SUMS["acp" if prune else "plain"])
    vectors = ("c_ptr", "crq_ptr", "lse_ptr", "delta_ptr", "dck_ptr", "dk_ptr", "dv_ptr", "thr_ptr")
    types = {"k_desc": descriptor(block_n), "v_desc": descriptor(block_n), "q_desc": descriptor(block_m),
             "do_desc": descriptor(block_m), "c_ptr": "*fp64", "dk_ptr": "*bf16", "dv_ptr": "*bf16",
             "qk_scale": "fp32", "scale": "fp32"}
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "*fp32" if n in vectors else "i32")
                 for n in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in (*vectors, "T")}
    src = GluonASTSource(fn=fn, signature=signature, attrs=aligned,
                         constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return (f"gluon dK/dV{', ACP,' if prune else ''} {2 * block_n}x{block_m} (2 warpgroups)",
            triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4)), stages)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=64, help="head dim of the compiled kernels")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--kernels", choices=["all", "triton", "gluon"], default="all",
                   help="the Triton kernels, the Gluon ones (at their head dims, with their tested Triton), or both")
    args = p.parse_args(argv)
    if ta._INTERPRETED:
        raise SystemExit("TRITON_INTERPRET=1 is set: the kernels are interpreted, unset it to compile them")
    d = args.head_dim
    block_d = max(16, triton.next_power_of_2(d))
    bucket = ta._tiles_bucket({"BLOCK_D": block_d, "BLOCK_DV": block_d})
    common = dict(G=1, D=d, DV=d, BLOCK_D=block_d, BLOCK_DV=block_d, VARLEN=False, PRUNE=False, WINDOWED=False,
                  PRECISION="tf32", INTERPRET=False, TILES=bucket, C_BLOCK=ta.C_BLOCK)
    cases = [(f"forward {m}x{n}", tk._attn_fwd_kernel, dict(BLOCK_M=m, BLOCK_N=n), w, s)
             for m, n, w, s in ta._FWD_TILES[bucket]]
    backward = ((tk._attn_bwd_dkdv_kernel, ta._DKDV_TILES, "1", "dK/dV"),
                (tk._attn_bwd_dq_kernel, ta._DQ_TILES, "2", "dQ"))
    for kernel, table, side, name in backward:
        for m, n, w, s in table[bucket]:
            tiles = {f"BLOCK_M{side}": m, f"BLOCK_N{side}": n}
            cases.append((f"backward {name} {m}x{n}", kernel, dict(tiles, DOT_SUMS=ta.DOT_SUMS["plain"]), w, s))
            acp = dict(tiles, DOT_SUMS=ta.DOT_SUMS["acp"], PRUNE=True)
            cases.append((f"backward {name}, ACP, {m}x{n}", kernel, acp, w, s))
    print(f"sm_{args.arch}a, head dim {d}, bf16")
    built = []
    if args.kernels != "gluon":
        built = ((name, compile_kernel(fn, {**common, **tiles}, warps, stages, args.arch), f"warps {warps}", stages)
                 for name, fn, tiles, warps, stages in cases)
    gluon = triton.__version__ == ta.GLUON_TESTED["triton"] and d in ta.GLUON_TESTED["head_dims"]
    if args.kernels != "triton" and gluon:
        name, kernel, stages = compile_gluon_forward(d, args.arch)
        built = [*built, (name, kernel, "warps 4+4+1", stages)]
    if args.kernels != "triton" and triton.__version__ == ta.GLUON_BWD_TESTED["triton"] and d in ta.GLUON_BWD_TESTED[
            "head_dims"]:
        for prune in (False, True):
            name, kernel, stages = compile_gluon_backward(d, args.arch, prune)
            built = [*built, (name, kernel, "warps 4+4+1", stages)]
    for name, kernel, warps, stages in built:
        r = resources(kernel, args.arch)
        r["setmaxnreg"] = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                              kernel.asm["ptx"])})
        print(f"{name:45s} {warps} stages {stages}: " + ", ".join(f"{k} {v}" for k, v in r.items()), flush=True)
        for i, loop in enumerate(loops(kernel, args.arch)):
            print(f"    loop {i}: " + ", ".join(f"{k} {v}" for k, v in loop.items()), flush=True)


if __name__ == "__main__":
    main()

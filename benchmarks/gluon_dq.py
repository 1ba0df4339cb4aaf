"""A warp-specialized dQ for the d64 backward, in Gluon (Hopper, Triton 3.6): the prototype of issue 45's last lead,
timed against the Triton dQ kernel it would replace, and kept here because it lost (docs/benchmarks.md, "The Gluon
dQ at d64").

The dQ half of the backward is where the d64 gap to the tree before the gate gradient's row sums lies (issue 38: the
row sums are ALU work in a loop that has none to spare). This is the Gluon dK/dV kernel's mirror image
(``foxlm/ops/forgetting_attention/gluon_bwd.py``; the kernel is in ``gluon_dq_kernel.py``):

* one program per (NW x BLOCK_M queries, sequence, query head), a head's last queries first; NW consumer warpgroups
  own BLOCK_M rows each (Q and dO in shared memory, dQ and rowsum(dS) in registers); a 1-warp producer TMA-loads the
  Q and dO tiles once, then the K and V tiles of the key head into a ring of STAGES slots;
* per key tile: S = Q K^T and dP = dO V^T issued together, P = exp2(...) while dP is in flight, dS = P (dP - delta),
  its row sums (summed as the dK/dV kernel sums its columns), then dQ += dS K with dS from registers. Leaving that
  wgmma in flight into the next tile made ptxas serialize every wgmma of the kernel (C7512), so it is waited for;
* the logits take the key side's c_rel plus one fp64 difference per tile before the block of the warpgroup's first
  row, and convert from fp64 on the others (the Triton kernel's rule);
* ACP: each warpgroup binary-searches the first key tile its first row keeps; the producer loads from the first
  warpgroup's, and a warpgroup frees the tiles outside its own range unread.

It checks itself against the fp64 reference and the Triton dQ (``check``) and times the op's forward + backward at the
protocol's 16k shape with its dQ in place of the Triton one, the rest unchanged (``bench``); in both the op runs as
shipped except for that one launch. On an H100 it matched the Triton backward's errors to three digits (gate gradient
included) and was deterministic, but was slower in every tiling tried.

    PYTHONPATH=. python benchmarks/gluon_dq.py check --head-dim 64 [--tiles 64,64,3,3]
    PYTHONPATH=. python benchmarks/gluon_dq.py bench --head-dim 64 --tiles triton 64,64,3,2 64,64,3,3 64,128,2,2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import triton
from _results import require_cuda, results_path
from attention import standard_log_fgate, time_ms

from foxlm.ops import ACP, forgetting_attention
from foxlm.ops.forgetting_attention import triton_op as ta
from foxlm.ops.forgetting_attention.reference import forgetting_attention_reference


@contextlib.contextmanager
def gluon_dq_in_place(tiles: tuple[int, int, int, int] | None):
    """The op with this dQ in place of the Triton dQ kernel (None: as shipped): its launch, and only it, replaced."""
    if tiles is None:
        yield
        return
    from gluon_dq_kernel import DQ_TILES, gluon_dq  # Gluon: only once a GPU is there

    real = ta._launch

    def launch(kernel, grid, interpret_meta, q, k, v, c, crk, thr, do, lse, delta, dq, dcq, *args, **kwargs):
        if kernel is not ta._bwd_dq:
            return real(kernel, grid, interpret_meta, q, k, v, c, crk, thr, do, lse, delta, dq, dcq, *args, **kwargs)
        D = q.shape[-1]
        old, DQ_TILES[D] = DQ_TILES.get(D), tiles
        try:
            gluon_dq(q, k, v, do, c, crk, lse, delta, None if thr is lse else thr, q.shape[-1] ** -0.5,
                     kwargs["C_BLOCK"], kwargs["DOT_SUMS"], dq, dcq)
        finally:
            DQ_TILES[D] = old

    ta._launch = launch
    try:
        yield
    finally:
        ta._launch = real


def _grads(B, T, Hq, Hk, D, dtype, prune, seed, tiles):
    torch.manual_seed(seed)
    q = torch.randn(B, T, Hq, D, device="cuda").to(dtype).requires_grad_()
    k = torch.randn(B, T, Hk, D, device="cuda").to(dtype).requires_grad_()
    v = torch.randn(B, T, Hk, D, device="cuda").to(dtype).requires_grad_()
    log_fgate = standard_log_fgate(B, T, Hq, "cuda").requires_grad_()
    do = torch.randn(B, T, Hq, D, device="cuda").to(dtype)
    with gluon_dq_in_place(tiles):
        o = forgetting_attention(q, k, v, log_fgate, prune=ACP() if prune else None)
        grads = torch.autograd.grad(o, (q, k, v, log_fgate), do)
    return (q, k, v, log_fgate, do), grads


CASES = [(2, 1000, 4, 2, torch.bfloat16, False), (2, 1000, 4, 2, torch.bfloat16, True),
         (1, 1034, 2, 2, torch.float16, False), (1, 2048, 4, 4, torch.bfloat16, True),
         (1, 17, 2, 2, torch.bfloat16, False), (2, 333, 4, 1, torch.bfloat16, False)]


def check(D: int, tiles: tuple[int, int, int, int]) -> list[dict]:
    """Relative errors of dq, dk, dv and the gate gradient against fp64, with this dQ and with the Triton one (GQA,
    ACP, fp16, T off the tiles, T below one tile), and whether two runs are bitwise equal."""
    rows = []
    for B, T, Hq, Hk, dtype, prune in CASES:
        inputs, gluon_grads = _grads(B, T, Hq, Hk, D, dtype, prune, T + D, tiles)
        _, triton_grads = _grads(B, T, Hq, Hk, D, dtype, prune, T + D, None)
        _, again = _grads(B, T, Hq, Hk, D, dtype, prune, T + D, tiles)
        ref_in = [t.detach().double().requires_grad_() for t in inputs[:4]]
        ref = torch.autograd.grad(forgetting_attention_reference(*ref_in), ref_in, inputs[4].double())
        err = [[((a.double() - e).norm() / e.norm()).item() for a, e in zip(g, ref)]
               for g in (gluon_grads, triton_grads)]
        row = dict(case=[B, T, Hq, Hk, str(dtype).removeprefix("torch."), prune], gluon=err[0], triton=err[1],
                   deterministic=all(torch.equal(a, b) for a, b in zip(gluon_grads, again)))
        print(D, tiles, row, flush=True)
        rows.append(row)
    return rows


def bench(D: int, all_tiles: list, rounds: int = 3, T: int = 16384) -> dict:
    """Forward + backward TF/s of the op at the protocol's shape (B T = 64k, H D = 2048, the standard gate profile),
    plain and with ACP, per dQ tiling (None: the Triton dQ), in interleaved rounds."""
    B, H = 65536 // T, 2048 // D
    flops = 3.5 * 4 * B * H * T * T * D / 2
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    log_fgate = standard_log_fgate(B, T, H, "cuda").requires_grad_()
    do = torch.randn_like(q)
    out: dict[str, list[float]] = {}
    for r in range(rounds):
        for tiles in all_tiles:
            for prune in (False, True):
                def step(prune=prune):
                    o = forgetting_attention(q, k, v, log_fgate, prune=prune)
                    torch.autograd.grad(o, (q, k, v, log_fgate), do)
                with gluon_dq_in_place(tiles):
                    tflops = flops / time_ms(step) / 1e9
                key = f"{'triton' if tiles is None else ','.join(map(str, tiles))} {'acp' if prune else 'plain'}"
                out.setdefault(key, []).append(tflops)
                print(D, r, key, round(tflops, 1), flush=True)
    return {key: dict(tflops=v, median=statistics.median(v)) for key, v in out.items()}


def tiling(text: str) -> tuple[int, int, int, int] | None:
    """argparse type: BLOCK_M,BLOCK_N,STAGES,NW (positive integers), or triton (None: the shipped dQ)."""
    if text == "triton":
        return None
    parts = text.split(",")
    if len(parts) != 4 or not all(x.isdigit() and int(x) > 0 for x in parts):
        raise argparse.ArgumentTypeError(f"expected BLOCK_M,BLOCK_N,STAGES,NW (four positive integers) or triton, "
                                         f"got {text!r}")
    return tuple(int(x) for x in parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["check", "bench"], help="check: errors against fp64; bench: TF/s at 16k")
    p.add_argument("--head-dim", type=int, choices=[64, 128], default=64, help="head dim")
    p.add_argument("--tiles", type=tiling, nargs="+", default=None,
                   help="tilings to check or time: BLOCK_M,BLOCK_N,STAGES,NW each, or triton (the shipped dQ); "
                        "default: gluon_dq_kernel.DQ_TILES' for the head dim")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the results file ($OUT or .)")
    args = p.parse_args(argv)
    require_cuda(p, " (the kernel is Hopper's)")
    from gluon_dq_kernel import DQ_TILES

    D = args.head_dim
    tiles = args.tiles or [DQ_TILES[D]]
    if args.mode == "check":
        results = {str(t): check(D, t) for t in tiles if t is not None}
    else:
        results = bench(D, tiles)
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d"))
    path = results_path(os.path.join(args.out, f"gluon-dq-{args.mode}-d{D}-{env['date']}.json"))
    with open(path, "w") as f:
        json.dump(dict(env=env, results=results), f, indent=1)
    print(path)


if __name__ == "__main__":
    main()

"""A/B of the Forgetting Attention kernels: the working tree's against a git revision's, in one process, on the GPU.

Machines differ by a few percent from call to call, so a kernel change is judged against the kernels it replaces,
timed in the same process. The revision's ``foxlm/ops/triton_attention.py`` is loaded beside the working tree's as
its own module (its relative imports made absolute, its custom ops renamed so the two can be registered together);
both run on the same inputs:

- ``--kernels``: forward and backward (through ``torch.autograd.grad``) at the training shape (1 x 16k, 12 heads of
  64) and the protocol's (4 x 16k, 32 heads of 64); median of 10 after 3 warm-ups, in 3 rounds that alternate the
  two versions; the relative difference of the gradients between them; the first listed tile of each (or ``--tiles``);
- ``--host``: host time per forward + backward at a short length (1 x 256, 12 heads of 64), where the GPU waits on the
  host: 200 calls without a sync, wall time per call; SDPA's in the same run.

Before timing, the working tree's kernels are checked against the fp64 reference (``attention.check``).

    PYTHONPATH=. python benchmarks/attention_ab.py [--rev main] [--kernels] [--host] [--tiles 64 128 128 64 8 3]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
MODULE = "foxlm/ops/triton_attention.py"
SHAPES = {"train 1x16k h12": (1, 16384, 12), "protocol 4x16k h32": (4, 16384, 32)}


def load_revision(rev: str, name: str = "foxlm_rev") -> ModuleType:
    """The attention kernels' module as of git revision ``rev``, importable beside foxlm's own."""
    git = ["git", "show", f"{rev}:{MODULE}"]
    src = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    src = re.sub(r"^from \.", "from foxlm.ops.", src, flags=re.M).replace('"foxlm::', f'"{name}::')
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton's JIT looks its kernels' globals up through the module
    spec.loader.exec_module(module)
    return module


def first_tiles(module: ModuleType, tiles: list[int] | None) -> None:
    """Restrict both kernels to their first listed tile per head dim, or the backward to ``tiles``."""
    import triton

    from attention import first_per_bucket

    module._fwd.configs = first_per_bucket(module._fwd.configs)
    if tiles is None:
        module._bwd.configs = first_per_bucket(module._bwd.configs)
    else:
        m1, n1, m2, n2, warps, stages = tiles
        module._bwd.configs = [triton.Config(dict(BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2, TILES=64),
                                             num_warps=warps, num_stages=stages)]


def time_kernels(module: ModuleType, B: int, T: int, H: int, D: int = 64, reps: int = 10) -> dict:
    """Forward and backward ms (medians) and the gradients, for one version at one shape."""
    from attention import standard_log_fgate

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = standard_log_fgate(B, T, H, q.device).requires_grad_()

    def forward():
        return module.triton_forgetting_attention(q, k, v, g, scale=D ** -0.5, cu_seqlens=None, max_seqlen=None)[0]

    o = forward()
    do = torch.randn_like(o)
    out = {}
    def backward():
        return torch.autograd.grad(o, (q, k, v, g), do, retain_graph=True)

    for name, fn in (("fwd_ms", forward), ("bwd_ms", backward)):
        times = []
        for i in range(3 + reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end))
        out[name] = statistics.median(times)
    out["grads"] = [x.float() for x in torch.autograd.grad(o, (q, k, v, g), do)]
    return out


def host_us(module: ModuleType | None, calls: int = 200) -> float:
    """Host time (us) per forward + backward at 1 x 256, 12 heads of 64: ``module``'s op, or SDPA's for None."""
    q, k, v = (torch.randn(1, 256, 12, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = F.logsigmoid(torch.randn(1, 256, 12, device="cuda") + 3).requires_grad_()
    if module is None:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

        def one():
            torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), (qt, kt, vt), qt)
    else:
        def one():
            o = module.triton_forgetting_attention(q, k, v, g, scale=0.125, cu_seqlens=None, max_seqlen=None)[0]
            torch.autograd.grad(o, (q, k, v, g), o)
    for _ in range(20):
        one()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        one()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="main", help="git revision of the kernels to compare against")
    parser.add_argument("--kernels", action="store_true", help="time the kernels at the two 16k shapes")
    parser.add_argument("--host", action="store_true", help="time the host per call at a short length")
    parser.add_argument("--tiles", type=int, nargs=6, metavar=("M1", "N1", "M2", "N2", "WARPS", "STAGES"),
                        help="the backward's tile for both versions (default: each version's first listed d64 tile)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for attention-ab-DATE.json")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import triton

    from attention import check

    from foxlm.ops import triton_attention as new

    old = load_revision(args.rev)
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.date.today().isoformat(), "rev": args.rev}
    print(env, flush=True)
    for module in (new, old):
        first_tiles(module, None)
    result = {"env": env, "check_rel_err": check(torch.device("cuda"))}
    versions = {"rev": old, "tree": new}
    if args.kernels:
        for module in (new, old):
            first_tiles(module, args.tiles)
        result["kernels"] = {}
        for shape, (B, T, H) in SHAPES.items():
            flops = 4 * B * H * T * T * 64 / 2
            runs = {name: [] for name in versions}
            grads = {}
            for _ in range(3):
                for name, module in versions.items():
                    r = time_kernels(module, B, T, H)
                    grads[name] = r.pop("grads")
                    runs[name].append(r)
            diff = [((a - b).norm() / b.norm()).item() for a, b in zip(grads["tree"], grads["rev"])]
            row = {name: {key: statistics.median(r[key] for r in rs) for key in ("fwd_ms", "bwd_ms")}
                   for name, rs in runs.items()}
            for name, r in row.items():
                r["fwd_tflops"], r["bwd_tflops"] = flops / r["fwd_ms"] / 1e9, 2.5 * flops / r["bwd_ms"] / 1e9
                print(f"{shape:20s} {name:4s} fwd {r['fwd_ms']:.3f} ms ({r['fwd_tflops']:.0f} TF/s)  "
                      f"bwd {r['bwd_ms']:.3f} ms ({r['bwd_tflops']:.0f} TF/s)", flush=True)
            print(f"{shape:20s} gradients tree vs rev (dq dk dv dg): " + " ".join(f"{x:.1e}" for x in diff), flush=True)
            result["kernels"][shape] = {**row, "grad_rel_diff": diff}
    if args.host:
        result["host_us"] = {name: [] for name in (*versions, "sdpa")}
        for _ in range(3):
            for name, module in (*versions.items(), ("sdpa", None)):
                result["host_us"][name].append(host_us(module))
        print("host us per forward + backward: "
              + ", ".join(f"{n} {' / '.join(f'{x:.0f}' for x in v)}" for n, v in result["host_us"].items()), flush=True)
    path = Path(args.out) / f"attention-ab-{env['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

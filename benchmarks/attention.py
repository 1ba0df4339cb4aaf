"""Forgetting Attention speed on the GPU, with the protocol of the peers' published kernel figures.

q, k, v: [B, T, H, D] bf16 randn with B*T = 65,536 and H*D = 2048; the "standard" gate profile (per-head decay
times log-spaced from 16 to 16,384 tokens); FLOPs = 4*B*H*T^2*D/2 forward, 3.5x that forward+backward; median
of 10 timed runs after 3 warm-ups, CUDA events. Compared in the same run: foxlm, foxlm with ACP (effective
TF/s: the unpruned FLOPs over the pruned time), PyTorch SDPA
flash and cuDNN (no gate), fla's parallel_forgetting_attn when importable, and flash-attn-4 when importable (plain
causal; the gate as a score_mod, without and with the gate gradient from padding channels; the gate as channels:
fa4_gate.py). Before timing, the
kernels are checked against the fp64 reference.

    PYTHONPATH=. python benchmarks/attention.py [--out DIR] [--dims 64 128] [--seqlens 2048 8192 16384]

CPU section (``--device cpu``): fp32, B=1, H=8, D=64, the same gate profile; foxlm against SDPA causal (no
gate) in interleaved rounds of one process, each in a shuffled order (median of ``--rounds``), forward (no grad)
and forward+backward (grads of q, k, v and the gates); then the peak resident memory each adds over its inputs, in a
fresh process per length.

    PYTHONPATH=. python benchmarks/attention.py --device cpu [--seqlens 1024 4096 16384] [--rounds 3] [--no-warmup]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from _results import positive_int, require_cuda, results_path
from torch.nn.attention import SDPBackend, sdpa_kernel

from foxlm.ops import acp_stats, forgetting_attention, forgetting_attention_reference

TOKENS, WIDTH = 65536, 2048


def standard_log_fgate(B: int, T: int, H: int, device) -> torch.Tensor:
    """log f = logsigmoid(b_h + 0.5 randn), b_h = -log(expm1(1/tau_h)), tau_h log-spaced 16..16384: [B, T, H] fp32."""
    tau = torch.logspace(math.log10(16), math.log10(16384), H, dtype=torch.float64, device=device)
    b = -torch.log(torch.expm1(1.0 / tau)).float()
    return F.logsigmoid(b + 0.5 * torch.randn(B, T, H, device=device))


def time_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median over ``reps`` CUDA-event timings after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


QUICK_CASES = {  # the benchmark's own kernel specializations (no extra compiles)
    "d64 bf16 acp": dict(B=2, Tq=1024, Tk=1024, Hq=4, Hk=4, D=64, dtype=torch.bfloat16, prune=True),
    "d64 bf16": dict(B=2, Tq=1024, Tk=1024, Hq=4, Hk=4, D=64, dtype=torch.bfloat16),
    "d128 bf16": dict(B=2, Tq=1024, Tk=1024, Hq=2, Hk=2, D=128, dtype=torch.bfloat16),
}


def check(device, quick: bool = False) -> dict:
    """Relative error (vs the fp64 reference) of o, lse and the four gradients on small random cases,
    and whether two backward passes agree bitwise."""
    cases = QUICK_CASES if quick else {
        "d64 bf16 gqa2 acp": dict(B=2, Tq=777, Tk=777, Hq=4, Hk=2, D=64, dtype=torch.bfloat16, prune=True),
        "d128 bf16 varlen": dict(B=1, Tq=900, Tk=900, Hq=2, Hk=2, D=128, dtype=torch.bfloat16,
                                 cu=[0, 1, 250, 251, 900]),
        "d64 bf16 varlen": dict(B=1, Tq=900, Tk=900, Hq=2, Hk=2, D=64, dtype=torch.bfloat16,
                                cu=[0, 1, 250, 251, 900]),
        "d80 fp16 tq<tk": dict(B=2, Tq=300, Tk=701, Hq=4, Hk=1, D=80, dtype=torch.float16),
        "d256 bf16": dict(B=1, Tq=200, Tk=200, Hq=2, Hk=2, D=256, dtype=torch.bfloat16),
    }
    out = {}
    for name, c in cases.items():
        B, Tq, Tk, Hq, Hk, D, dt = c["B"], c["Tq"], c["Tk"], c["Hq"], c["Hk"], c["D"], c["dtype"]
        cu = torch.tensor(c["cu"], dtype=torch.int32, device=device) if "cu" in c else None
        q = torch.randn(B, Tq, Hq, D, device=device, dtype=dt, requires_grad=True)
        k = torch.randn(B, Tk, Hk, D, device=device, dtype=dt, requires_grad=True)
        v = torch.randn(B, Tk, Hk, D, device=device, dtype=dt, requires_grad=True)
        g = standard_log_fgate(B, Tk, Hq, device).requires_grad_()
        o, lse = forgetting_attention(q, k, v, g, cu_seqlens=cu, prune=c.get("prune", False), return_lse=True)
        do, dl = torch.randn_like(o), torch.randn_like(lse)
        grads = torch.autograd.grad((o.float() * do).sum() + (lse * dl).sum(), (q, k, v, g), retain_graph=True)
        again = torch.autograd.grad((o.float() * do).sum() + (lse * dl).sum(), (q, k, v, g))
        deterministic = all(torch.equal(a, b) for a, b in zip(grads, again))
        x = [t.detach().double().requires_grad_() for t in (q, k, v, g)]
        o2, lse2 = forgetting_attention_reference(*x, cu_seqlens=cu, return_lse=True)
        grads2 = torch.autograd.grad((o2 * do.double()).sum() + (lse2 * dl.double()).sum(), x)
        errs = {
            n: ((a.double() - b).norm() / b.norm()).item()
            for n, a, b in zip(("o", "lse", "dq", "dk", "dv", "dg"), (o, lse, *grads), (o2, lse2, *grads2))
        }
        out[name] = {**errs, "deterministic": deterministic}
        print(f"check {name:18s} " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()) +
              f" bitwise-deterministic={deterministic}", flush=True)
    return out


def check_fa4(fa4: dict, device) -> dict:
    """Relative error (vs the fp64 reference) of FA4's gated attention (padding channels for the gate gradient)."""
    out = {}
    for D, T in ((64, 1024), (128, 1024), (64, 4096)):
        B, H = 2, 4
        q, k, v = (torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = standard_log_fgate(B, T, H, device).requires_grad_()
        do = torch.randn_like(q)
        x = [t.detach().double().requires_grad_() for t in (q, k, v, g)]
        o2 = forgetting_attention_reference(*x)
        grads2 = torch.autograd.grad(o2, x, do.double())
        for name in ("foxlm", "fa4+gate+dg", "fa4+ch", "fa4+ch(v padded)"):
            key = f"{name} d{D} T={T}"
            try:
                o = forgetting_attention(q, k, v, g) if name == "foxlm" else fa4[name](q, k, v, g)
                grads = torch.autograd.grad(o, (q, k, v, g), do)
            except Exception as e:
                out[key] = {"error": repr(e)[:300]}
                print(f"check {key}: {out[key]}", flush=True)
                continue
            out[key] = {n: ((a.double() - b).norm() / b.norm()).item()
                        for n, a, b in zip(("o", "dq", "dk", "dv", "dg"), (o, *grads), (o2, *grads2))}
            print(f"check {key} bf16 " + " ".join(f"{n}={e:.1e}" for n, e in out[key].items()), flush=True)
    return out


def bench(D: int, T: int, device, fla, fa4=None) -> dict:
    B, H = TOKENS // T, WIDTH // D
    flops_fwd = 4 * B * H * T * T * D / 2
    q, k, v = (torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = standard_log_fgate(B, T, H, device).requires_grad_()
    do = torch.randn_like(q)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()
    impls = {
        "foxlm": (lambda: forgetting_attention(q, k, v, g), (q, k, v, g), do),
        "foxlm+acp": (lambda: forgetting_attention(q, k, v, g, prune=True), (q, k, v, g), do),
    }
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        impls[name] = (sdpa, (qt, kt, vt), dot)
    if fla is not None:
        impls["fla"] = (lambda: fla(q, k, v, g, scale=D ** -0.5), (q, k, v, g), do)
    for name, fn in (fa4 or {}).items():
        impls[name] = (lambda fn=fn: fn(q, k, v, g), (q, k, v) if name in ("fa4", "fa4+gate") else (q, k, v, g), do)
    row = {"D": D, "T": T, "B": B, "H": H, "flops_fwd": flops_fwd}
    for name, (fwd, inputs, grad_out) in impls.items():
        try:
            def fwd_bwd(fwd=fwd, inputs=inputs, grad_out=grad_out):
                torch.autograd.grad(fwd(), inputs, grad_out)
            with torch.no_grad():
                ms_f = time_ms(fwd)
            ms = time_ms(fwd_bwd)
            row[name] = {"ms": ms, "tflops": 3.5 * flops_fwd / ms / 1e9, "fwd_ms": ms_f,
                         "fwd_tflops": flops_fwd / ms_f / 1e9}
        except Exception as e:  # a peer that fails (e.g. a backend not built for this GPU) is reported, not fatal
            row[name] = {"error": repr(e)[:300]}
        print(f"D={D} T={T} {name}: {row[name]}", flush=True)
    per_head, overall = acp_stats(q, k, g)
    row["acp_skipped_fraction"] = overall.item()
    row["acp_skipped_per_head"] = per_head.tolist()
    return row


KERNEL_NAMES = ("fwd", "bwd_dkdv", "bwd_dq")


def record_tuning(kernels) -> list:
    """Log every (kernel, key, tile, median ms) the autotuner measures."""
    log = []
    for name, kernel in zip(KERNEL_NAMES, kernels):
        def bench(*args, config, _orig=kernel._bench, _name=name, **kwargs):
            ms = _orig(*args, config=config, **kwargs)
            key = {k: kwargs[k] for k in ("LEN_BUCKET", "BLOCK_D", "PRUNE")}
            log.append({"kernel": _name, **key, "config": str(config), "ms": ms[0]})
            return ms
        kernel._bench = bench
    return log


def first_per_bucket(configs: list) -> list:
    """The first listed tile of each head-dim bucket."""
    seen = {}
    for c in configs:
        seen.setdefault(c.kwargs["TILES"], c)
    return list(seen.values())


def load_fla():
    try:
        from fla.ops.forgetting_attn import parallel_forgetting_attn
        return parallel_forgetting_attn
    except Exception as e:
        print(f"fla not available: {e!r}")
        return None


def load_fa4():
    try:
        import fa4_gate
        return fa4_gate.load()
    except Exception as e:
        print(f"flash-attn-4 not available: {e!r}")
        return None


def peak_rss_mib(fn) -> float:
    """Peak resident memory fn adds over what the process held before it (Linux: VmHWM reset via clear_refs)."""
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    before = status("VmRSS:")
    fn()
    return (status("VmHWM:") - before) / 1024


def cpu_steps(T: int) -> dict:
    """{(impl, "fwd" | "fwd+bwd"): step}: foxlm and SDPA causal on the CPU at [1, T, 8, 64] fp32."""
    B, H, D = 1, 8, 64
    q, k, v = (torch.randn(B, T, H, D, requires_grad=True) for _ in range(3))
    g = standard_log_fgate(B, T, H, "cpu").requires_grad_()
    do = torch.randn_like(q)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()
    impls = {
        "foxlm": (lambda: forgetting_attention(q, k, v, g), (q, k, v, g), do),
        "sdpa": (lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), (qt, kt, vt), dot),
    }
    steps = {}
    for name, (fwd, inputs, grad_out) in impls.items():
        def no_grad(fwd=fwd):
            with torch.no_grad():
                fwd()
        steps[name, "fwd"] = no_grad
        steps[name, "fwd+bwd"] = lambda fwd=fwd, inputs=inputs, grad_out=grad_out: torch.autograd.grad(
            fwd(), inputs, grad_out)
    return steps


def bench_cpu(T: int, rounds: int, warmup: bool = True) -> dict:
    """foxlm vs SDPA causal on the CPU at [1, T, 8, 64] fp32: fwd / fwd+bwd seconds, interleaved rounds."""
    steps = cpu_steps(T)
    times = {key: [] for key in steps}
    for key, fn in steps.items() if warmup else ():
        fn()
    order, shuffle = list(steps), random.Random(0).shuffle
    for _ in range(rounds):  # interleaved, so that load from elsewhere hits both alike; shuffled, so that no step
        shuffle(order)       # always runs after the same one (a step that follows another's backward ran slower)
        for key in order:
            start = time.perf_counter()
            steps[key]()
            times[key].append(time.perf_counter() - start)
    row = {"T": T, "B": 1, "H": 8, "D": 64, "dtype": "float32", "rounds": rounds}
    for (name, mode), ts in times.items():
        row.setdefault(name, {})[f"{mode}_s"] = statistics.median(ts)
        row[name][f"{mode}_all_s"] = ts
    for mode in ("fwd", "fwd+bwd"):
        row[f"{mode}_ratio"] = row["foxlm"][f"{mode}_s"] / row["sdpa"][f"{mode}_s"]
    print(f"T={T}: {row}", flush=True)
    return row


def cpu_peak_mib(T: int) -> dict:
    """{"impl mode": MiB}: the peak resident memory each CPU step adds over its inputs. Every buffer of 1 MiB or more
    gets its own mmap and goes back to the OS when freed (set before the first allocation), so each reading is
    the call's own."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
    peaks = {}
    for (name, mode), fn in cpu_steps(T).items():
        fn()
        peaks[f"{name} {mode}"] = peak_rss_mib(fn)
    return peaks


def cpu_main(args) -> None:
    torch.manual_seed(0)
    env = {"device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                     f"{torch.get_num_threads()} torch threads", "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "settings": settings(args)}
    print(env, flush=True)
    path = results_path(os.path.join(args.out, f"attention-cpu-{env['date']}.json"), args.overwrite)
    rows = [bench_cpu(T, args.rounds, not args.no_warmup) for T in args.seqlens or [1024, 4096, 16384]]
    # Peak memory in a fresh process per length (cpu_peak_mib). Timings keep glibc's default allocator, which reuses
    # freed memory as a long-running program does.
    for row in rows:
        out = subprocess.run([sys.executable, __file__, "--device", "cpu", "--peak-mib", str(row["T"])],
                             capture_output=True, text=True, check=True).stdout
        for key, mib in json.loads(out.splitlines()[-1]).items():
            name, mode = key.split(" ")
            row[name][f"{mode}_peak_mib"] = mib
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    print(f"CPU, fp32, B=1, H=8, D=64, median of {args.rounds} interleaved rounds, {env['device']}, {env['date']}")
    print("| T | foxlm fwd / fwd+bwd | SDPA causal fwd / fwd+bwd | ratio fwd / fwd+bwd "
          "| peak MiB foxlm / SDPA (fwd+bwd) |")
    print("|---|---|---|---|---|")
    for r in rows:
        fox, sd = r["foxlm"], r["sdpa"]
        print(f"| {r['T']} | {fox['fwd_s'] * 1e3:.0f} / {fox['fwd+bwd_s'] * 1e3:.0f} ms | {sd['fwd_s'] * 1e3:.0f} / "
              f"{sd['fwd+bwd_s'] * 1e3:.0f} ms | {r['fwd_ratio']:.2f}x / {r['fwd+bwd_ratio']:.2f}x | "
              f"{fox['fwd+bwd_peak_mib']:.0f} / {sd['fwd+bwd_peak_mib']:.0f} |")


def settings(args: argparse.Namespace) -> dict:
    """The run's flags, for its results file."""
    return {k: v for k, v in vars(args).items() if k != "peak_mib"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."),
                        help="directory for attention-DATE.json (cpu: attention-cpu-DATE.json); default $OUT or .")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace that day's results file (default: write NAME-2.json, NAME-3.json, ...)")
    parser.add_argument("--dims", type=positive_int, nargs="+", default=[64, 128], help="head dims (GPU only)")
    parser.add_argument("--seqlens", type=positive_int, nargs="+",
                        help="sequence lengths; default 2048 8192 16384 (cpu: 1024 4096 16384)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda (default) or cpu (see above)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="cpu: interleaved timing rounds")
    parser.add_argument("--no-warmup", action="store_true", help="cpu: time the first calls (for one long run)")
    parser.add_argument("--peak-mib", type=int, metavar="T", help=argparse.SUPPRESS)  # cpu_main's memory child
    parser.add_argument("--tune", choices=["all", "first"], default="all",
                        help="autotune over the listed tiles, or take the first per head dim (fast compile)")
    parser.add_argument("--quick-check", action="store_true", help="check only the benchmark's specializations")
    parser.add_argument("--no-fla", action="store_true", help="leave fla out (saves its compile time)")
    parser.add_argument("--no-fa4", action="store_true", help="leave flash-attn-4 out (saves its compile time)")
    args = parser.parse_args(argv)
    if args.peak_mib:
        print(json.dumps(cpu_peak_mib(args.peak_mib)))
        return
    if args.device == "cpu":
        cpu_main(args)
        return
    require_cuda(parser, " (--device cpu runs the CPU section)")
    device = torch.device("cuda")
    torch.manual_seed(0)
    import triton

    from foxlm.ops.forgetting_attention import triton_op

    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.date.today().isoformat(), "settings": settings(args)}
    print(env, flush=True)
    path = results_path(os.path.join(args.out, f"attention-{env['date']}.json"), args.overwrite)
    kernels = (triton_op._fwd, triton_op._bwd_dkdv, triton_op._bwd_dq)
    listed = [kernel.configs for kernel in kernels]
    for kernel in kernels:  # the correctness check needs no tuning
        kernel.configs = first_per_bucket(kernel.configs)
    errors = check(device, quick=args.quick_check)
    if args.tune == "all":
        for kernel, configs in zip(kernels, listed):
            kernel.configs = configs
    timings = record_tuning(kernels)
    fla = None if args.no_fla else load_fla()
    fa4 = None if args.no_fa4 else load_fa4()
    if fa4 is not None:
        errors["fa4+gate+dg"] = check_fa4(fa4, device)
    rows = []
    for D in args.dims:
        for T in args.seqlens or [2048, 8192, 16384]:
            rows.append(bench(D, T, device, fla, fa4))
            torch.cuda.empty_cache()
            with open(path, "w") as f:  # after every shape, so that a run cut short still reports
                json.dump({"env": env, "check_rel_err": errors, "rows": rows, "tuning_ms": timings}, f, indent=1)
    tuned = {
        name: {str(key): str(cfg) for key, cfg in kernel.cache.items()} for name, kernel in zip(KERNEL_NAMES, kernels)
    }
    result = {"env": env, "check_rel_err": errors, "rows": rows, "autotuned": tuned, "tuning_ms": timings}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    print(table(rows, env))


def table(rows: list[dict], env: dict) -> str:
    """Markdown table of fwd+bwd TF/s (ratio to SDPA flash) per implementation and shape."""
    names = [n for n in ("foxlm", "foxlm+acp", "foxlm-det", "foxlm+acp-det", "sdpa-flash", "sdpa-cudnn", "fla", "fa4",
                           "fa4+gate", "fa4+gate+dg", "fa4+ch", "fa4+ch(v padded)")
             if any(n in r for r in rows)]
    head = "| impl | " + " | ".join(f"d{r['D']} T={r['T'] // 1024}k" for r in rows) + " |"
    lines = [f"fwd+bwd TF/s (x SDPA flash), {env['device']}, {env['date']}", head, "|---" * (len(rows) + 1) + "|"]
    for n in names:
        cells = []
        for r in rows:
            x = r.get(n, {})
            flash = r.get("sdpa-flash", {}).get("tflops")
            cells.append("-" if "tflops" not in x else
                         f"{x['tflops']:.0f}" + (f" ({x['tflops'] / flash:.2f}x)" if flash else ""))
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    fwd = [f"{r['foxlm']['fwd_tflops']:.0f}" if "fwd_tflops" in r.get("foxlm", {}) else "-" for r in rows]
    lines.append("| foxlm fwd only | " + " | ".join(fwd) + " |")
    lines.append("| ACP skipped tiles | " + " | ".join(f"{r['acp_skipped_fraction']:.0%}" for r in rows) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Training throughput on the GPU: fox-pro 125m vs Transformer baselines, with and without ACP, and MFU.

Protocol (that of the peers' published training figures): ~160M-parameter models (12 layers, d_model 768, 12
heads of 64, SwiGLU 2048, the Pro models' 1792 as the FoX authors' Pro, untied 50,304 vocabulary), fp32 weights,
bf16 autocast, fused AdamW with foxlm's parameter groups, gradient clipping, one sequence of ``--seq-len`` (16,384)
random tokens per step; median step time over ``--steps`` timed steps after ``--warmup``, CUDA events.
Compared in the same run:

- ``hf-llama``: transformers ``LlamaForCausalLM`` on SDPA (the RoPE Transformer peer)
- ``transformer-pro``: foxlm's Transformer (Pro) baseline (SDPA)
- ``fox-pro``: FoX (Pro), no ACP
- ``fox-pro+acp``: FoX (Pro) with ACP, forget-gate biases set to the attention benchmark's "standard" profile
  (per-head decay times log-spaced 16..16,384 tokens: a stand-in for trained gates; at initialization, f ~ 0.5 decays so
  fast that ACP would prune almost everything, which is reported as ``fox-pro+acp@init`` for reference only)

MFU = tokens/s x (6 x non-embedding parameters + 6 x layers x T x heads x head_dim) / peak (989 TF/s bf16 dense
for H100/H200); ACP runs count the unpruned FLOPs (effective MFU).

``--cuda-graph`` replays each step's forward + backward from a CUDA graph (``foxlm.train.cuda_graph``, the trainer's
``cuda_graph=true``): eager steps at this size wait on the host that launches their kernels, by an amount that
varies from machine to machine; replayed ones take their GPU time.

    PYTHONPATH=. python benchmarks/train.py [--seq-len 16384] [--steps 10] [--cuda-graph] [--out benchmarks/results]

``--device cpu``: the ``tiny`` size (4 layers, d_model 128, 4 heads of 32) in fp32, fox-pro against an HF Llama of the
same shape, batches of ``--batch`` x ``--seq-len`` (default 8 x 256, the embedded default job's); the models' steps
are interleaved so that load from elsewhere on the machine hits them alike; median step time, wall clock.

    PYTHONPATH=. python benchmarks/train.py --device cpu [--steps 10]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
from pathlib import Path

import torch
from _results import non_negative_int, positive_int, require_cuda, results_path

from foxlm.models import FoxConfig, FoxForCausalLM
from foxlm.models.configuration_fox import ARCHS
from foxlm.train.cuda_graph import GraphedMicroStep
from foxlm.train.metrics import PEAK_TFLOPS, flops_per_token
from foxlm.train.optim import param_groups

VOCAB = 50304


def standard_gate_bias(model: FoxForCausalLM) -> None:
    """Forget-gate biases b_h = -log(expm1(1/tau_h)), tau_h log-spaced 16..16384 over the heads of each layer."""
    for block in model.model.layers:
        proj = block.attn.fgate_proj
        H = proj.bias.numel()
        tau = torch.logspace(math.log10(16), math.log10(16384), H, dtype=torch.float64)
        with torch.no_grad():
            proj.bias.copy_(-torch.log(torch.expm1(1.0 / tau)))


def check_name(name: str) -> tuple[str, list[str]]:
    """``ARCH[+OPTION...]`` of a ``--models`` name: the architecture and options; ValueError for unknown ones."""
    arch, *options = name.split("+")
    if name != "hf-llama" and arch not in ARCHS:
        raise ValueError(f"--models: unknown model {name!r} (expected hf-llama or one of {sorted(ARCHS)})")
    unknown = set(options) - {"acp", "acp@init"}
    if unknown:
        raise ValueError(f"--models: unknown option(s) {sorted(unknown)} in {name!r}")
    return arch, options


def build(name: str, seq_len: int, size: str = "125m") -> tuple[torch.nn.Module, FoxConfig | None]:
    """``hf-llama``, or ``ARCH`` with options: ``+acp`` (standard gate biases), ``+acp@init`` (ACP, gates at
    initialization)."""
    if name == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        ref = FoxConfig.preset("transformer-llama", size)  # the same shape as foxlm's models of this size
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=ref.hidden_size, intermediate_size=ref.intermediate_size,
                          num_hidden_layers=ref.num_hidden_layers, num_attention_heads=ref.num_attention_heads,
                          num_key_value_heads=ref.num_key_value_heads, max_position_embeddings=seq_len,
                          rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa")
        return LlamaForCausalLM(cfg), None
    arch, options = check_name(name)
    config = FoxConfig.preset(arch, size, acp=any(o.startswith("acp") for o in options))
    model = FoxForCausalLM(config)
    if "acp" in options:
        standard_gate_bias(model)
    return model, config


# Attention kernels of the compared models: foxlm's (``_attn_*``) and those behind SDPA (flash, cuDNN, efficient).
_ATTENTION_KERNELS = ("_attn_", "flash", "fmha", "sdpa", "attention")


def kernel_ms(prof) -> dict:
    """GPU time of one profiled step, summed over its kernels: in all (``gpu_ms``; less than the step's wall time
    when the host cannot launch kernels as fast as the GPU runs them) and in attention (``attention_gpu_ms``)."""
    from torch.autograd import DeviceType

    total = attention = 0.0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            us = e.time_range.elapsed_us()
            total += us
            if any(s in e.name.lower() for s in _ATTENTION_KERNELS):
                attention += us
    return {"gpu_ms": total / 1e3, "attention_gpu_ms": attention / 1e3}


def _variant(compile: bool, cuda_graph: bool) -> str:
    """The name suffix of a run's rows: `` (compiled)``, `` (CUDA graph)``, both, or none."""
    return (" (compiled)" if compile else "") + (" (CUDA graph)" if cuda_graph else "")


def bench(name: str, seq_len: int, steps: int, warmup: int, peak: float | None, compile: bool = False,
          profile: Path | None = None, cuda_graph: bool = False) -> dict:
    """Time ``steps`` training steps of one model; ``compile``: torch.compile each decoder block (foxlm's
    ``compile=true``, and the same for the Llama layers); ``profile``: write the step's top CUDA kernels there;
    ``cuda_graph``: forward + backward replayed from a CUDA graph, as the trainer's ``cuda_graph=true``."""
    torch.manual_seed(0)
    model, config = build(name, seq_len)
    model = model.cuda().train()
    if compile:
        for block in model.model.layers:
            block.compile()
    num_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), fused=True)
    ids = torch.randint(0, 50257, (1, seq_len), device="cuda")

    def loss_fn(input_ids, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=input_ids, labels=labels).loss

    graphed = GraphedMicroStep(loss_fn, list(model.parameters())) if cuda_graph else None

    def step():
        if graphed is not None:
            loss = graphed(ids, ids)
        else:
            loss = loss_fn(ids, ids)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=graphed is None)
        return loss

    for _ in range(warmup):
        loss = step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    if profile is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        profile.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=70)
        stem = re.sub(r"[^\w.-]+", "_", name + _variant(compile, cuda_graph)).strip("_")
        (profile / f"profile-{stem}.txt").write_text(table)
        gpu = kernel_ms(prof)
    ms = statistics.median(times)
    tps = seq_len / (ms / 1e3)
    fox_config = config or FoxConfig.preset("transformer-llama", "125m")
    per_token = flops_per_token(fox_config, num_params, seq_len)
    result = {"name": name + _variant(compile, cuda_graph), "ms_per_step": ms, "tokens_per_s": tps,
              "params_m": num_params / 1e6,
              # a replayed graph's tensors live in its private pool, which the allocator counts as reserved only
              "peak_mem_gib": None if cuda_graph else torch.cuda.max_memory_allocated() / 2**30,
              "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
              "loss": loss.item(),
              "mfu": tps * per_token / (peak * 1e12) if peak else None}
    if profile is not None:
        result.update(gpu)
    return result


def bench_cpu(names: list[str], batch: int, seq_len: int, steps: int, warmup: int) -> list[dict]:
    """Tokens/s of ``names`` at the tiny size on the CPU, fp32; steps of the models interleaved."""
    import time

    runs = {}
    for name in names:
        torch.manual_seed(0)
        model = build(name, seq_len, "tiny")[0].train()
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95))
        runs[name] = (model, opt, [])
    ids = torch.randint(0, 50257, (batch, seq_len))

    def step(model, opt):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(warmup + steps):
        for model, opt, times in runs.values():
            start = time.perf_counter()
            step(model, opt)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    results = []
    for name, (model, _, times) in runs.items():
        s = statistics.median(times)
        results.append({"name": name, "ms_per_step": s * 1e3, "tokens_per_s": batch * seq_len / s,
                        "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "steps_s": times})
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda (default) or cpu (tiny models)")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence; default 16384 (cpu: 256)")
    p.add_argument("--batch", type=positive_int, default=8, help="cpu: sequences per step")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per model")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps before them")
    p.add_argument("--models", nargs="+", help="default hf-llama transformer-pro fox-pro fox-pro+acp fox-pro+acp@init "
                   "(cpu: hf-llama fox-pro); ARCH, ARCH+acp or ARCH+acp@init, or hf-llama")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder block of every model")
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay every model's forward + backward from a CUDA graph (no host launch overhead)")
    p.add_argument("--profile", type=Path,
                   help="also write each model's top CUDA kernels of one step here, and record its GPU time")
    p.add_argument("--out", default="benchmarks/results", help="directory for train[-cpu]-DATE[-TAG].json")
    p.add_argument("--overwrite", action="store_true",
                   help="replace that day's results file (default: write NAME-2.json, NAME-3.json, ...)")
    args = p.parse_args(argv)
    for name in args.models or []:
        try:
            check_name(name)
        except ValueError as e:
            p.error(str(e))
    if args.device == "cpu":
        main_cpu(args)
        return
    args.seq_len = args.seq_len or 16384
    args.models = args.models or ["hf-llama", "transformer-pro", "fox-pro", "fox-pro+acp", "fox-pro+acp@init"]
    if args.compile and args.cuda_graph:
        p.error("--cuda-graph: not with --compile (as the trainer's cuda_graph=true, it graphs the eager step)")
    require_cuda(p, " (--device cpu times the tiny models)")
    date = datetime.date.today().isoformat()
    tag = "".join(t for t, on in (("-compiled", args.compile), ("-cuda-graph", args.cuda_graph)) if on)
    path = results_path(Path(args.out) / f"train-{date}{tag}.json", args.overwrite)

    device = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    results = []
    for name in args.models:
        r = bench(name, args.seq_len, args.steps, args.warmup, peak, args.compile, args.profile, args.cuda_graph)
        torch.cuda.empty_cache()  # the model and optimizer of one case are gone before the next
        results.append(r)
        memory = f"{r['peak_mem_gib']:5.1f} GiB" if r["peak_mem_gib"] else f"{r['peak_reserved_gib']:5.1f} GiB reserved"
        print(f"{r['name']:>18}: {r['tokens_per_s']:>9,.0f} tok/s  {r['ms_per_step']:7.1f} ms/step  {memory}  "
              f"MFU {100 * (r['mfu'] or 0):4.1f}%"
              + (f"  GPU {r['gpu_ms']:.1f} ms/step, attention {r['attention_gpu_ms']:.1f}" if "gpu_ms" in r else ""),
              flush=True)
    by_name = {r["name"]: r for r in results}
    for r in results:
        for peer in ("hf-llama", "transformer-pro"):
            other = by_name.get(peer + _variant(args.compile, args.cuda_graph))
            if other is not None:
                r[f"vs_{peer}"] = r["tokens_per_s"] / other["tokens_per_s"]
                if "gpu_ms" in r:  # the same ratio without the host: GPU time per step
                    r[f"vs_{peer}_by_gpu_time"] = other["gpu_ms"] / r["gpu_ms"]
    import transformers

    record = {"benchmark": "train", "date": date, "device": device, "torch": torch.__version__,
              "transformers": transformers.__version__, "seq_len": args.seq_len, "steps": args.steps,
              "warmup": args.warmup, "models": args.models, "compile": args.compile, "cuda_graph": args.cuda_graph,
              "peak_tflops": peak, "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    for r in results:
        ratios = ("vs_hf-llama", "vs_transformer-pro", "vs_hf-llama_by_gpu_time", "vs_transformer-pro_by_gpu_time")
        print(f"{r['name']:>18}: " + "  ".join(f"{k} {r[k]:.3f}" for k in ratios if k in r))


def main_cpu(args) -> None:
    import os
    import platform

    import transformers

    seq_len, names = args.seq_len or 256, args.models or ["hf-llama", "fox-pro"]
    date = datetime.date.today().isoformat()
    path = results_path(Path(args.out) / f"train-cpu-{date}.json", args.overwrite)
    results = bench_cpu(names, args.batch, seq_len, args.steps, args.warmup)
    base = next((r for r in results if r["name"] == "hf-llama"), None)
    for r in results:
        if base is not None:
            r["vs_hf-llama"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['name']:>10} tiny: {r['tokens_per_s']:>8,.0f} tok/s  {r['ms_per_step']:7.1f} ms/step"
              + (f"  vs hf-llama {r['vs_hf-llama']:.3f}" if "vs_hf-llama" in r else ""), flush=True)
    device = (f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"{torch.get_num_threads()} threads")
    record = {"benchmark": "train-cpu", "date": date, "device": device, "torch": torch.__version__,
              "transformers": transformers.__version__, "size": "tiny", "batch": args.batch, "seq_len": seq_len,
              "steps": args.steps, "warmup": args.warmup, "models": names, "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Decoding speed: foxlm's generation path against transformers' LlamaForCausalLM (SDPA) with HF generate.

Protocol (that of the peers' published decoding figures, extended): greedy decoding, tokens/s = batch * steps /
time of ``steps`` decode steps after a cache of ``ctx`` tokens (4k / 32k / 128k; batch 1 and 16), 125m models in
bf16 on one GPU:
- foxlm fox-pro and transformer-pro through ``foxlm.generate.CachedDecoder`` (paged cache, Triton decode
  kernel, CUDA graph), with and without forget-gate eviction (fox-pro);
- transformers ``LlamaForCausalLM`` (SDPA) through ``model.generate``, the peers' baseline.
A decode step costs the same whatever the cached values, so the caches are filled with random keys and values
(RMS-normalised, as QK-norm makes them) instead of running a prefill; the gate cumsums follow the standard
gate profile (as in benchmarks/attention.py: tau_h log-spaced 16..16384, log f = logsigmoid(b_h + 0.5 randn)), and
the fox-pro's gate biases are set to b_h so the gates of the new tokens follow it too. The eviction cache size is
reported against the full cache at the same lengths (N of the bound = the final length).
Correctness first: the decode kernel against the fp64 PyTorch path, graph replay against eager steps, and
foxlm's generate() against HF generate on real prompts (which also exercises the prefill through the op).

Usage: python benchmarks/decode.py [--out DIR] [--contexts 4096,32768,131072] [--batches 1,16] [--sweep] [--overwrite]

It writes DIR/decode-DATE.json (``--sweep``: decode-sweep-DATE.json), or DIR/decode-DATE-2.json, ... where that
file is there already.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from _results import positive_int, require_cuda, results_path

from foxlm.generate import CachedDecoder, PagedFoxCache, generate
from foxlm.models import FoxConfig, FoxForCausalLM
from foxlm.ops.forgetting_attention.decode import decode_attention_torch, forgetting_attention_decode

DTYPE = torch.bfloat16
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # main needs a GPU; the functions run on the CPU


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEV.type == "cuda" else float("nan")


def standard_bias(num_heads: int) -> torch.Tensor:
    """b_h = -log(expm1(1/tau_h)), tau_h log-spaced from 16 to 16384 tokens (the standard profile)."""
    tau = torch.logspace(math.log10(16), math.log10(16384), num_heads, dtype=torch.float64)
    return (-torch.log(torch.expm1(1.0 / tau))).float()


def fox_model(arch: str) -> FoxForCausalLM:
    torch.manual_seed(0)
    model = FoxForCausalLM(FoxConfig.preset(arch, "125m")).to(DEV, DTYPE).eval()
    if model.config.gate == "data":
        with torch.no_grad():
            for block in model.model.layers:
                block.attn.fgate_proj.bias.copy_(standard_bias(model.config.num_attention_heads))
    return model


def fill(cache: PagedFoxCache, model, ctx: int, gen: torch.Generator) -> None:
    """Give every row ``ctx`` cached tokens: random QK-normed keys, random values, standard-profile gates."""
    cfg = model.config
    B, Hk, Hq, D = cache.batch_size, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    cache.begin(ctx)
    bias = standard_bias(Hq).to(DEV)
    for layer in range(cfg.num_hidden_layers):
        k = F.rms_norm(torch.randn(B, ctx, Hk, D, device=DEV, dtype=DTYPE, generator=gen), (D,))
        v = torch.randn(B, ctx, Hk, D, device=DEV, dtype=DTYPE, generator=gen)
        log_f = None
        if cfg.gate == "data":
            log_f = F.logsigmoid(bias + 0.5 * torch.randn(B, ctx, Hq, device=DEV, generator=gen))
        cache.store(layer, k, v, log_f)
        for name in ("k", "v"):
            cache.set_shift_state(layer, name, torch.randn(B, 1, Hk, D, device=DEV, dtype=DTYPE, generator=gen))


def time_ours(model, B: int, ctx: int, steps: int, evict: bool) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(ctx + B)
    cache = PagedFoxCache.from_model(model, B, ctx + steps + 8)
    fill(cache, model, ctx, gen)
    freed = cache.evict() if evict else 0
    size_after_fill = cache.stats()
    decoder = CachedDecoder(model, cache)  # a CUDA graph on the GPU
    tokens = torch.randint(0, 50257, (B,), device=DEV, generator=gen)
    graph_error = None
    try:
        for _ in range(3):  # eager warm-up, capture, first replay
            tokens = decoder.step(tokens).argmax(-1)
    except RuntimeError as e:  # measure the eager steps rather than nothing; the error is in the results
        graph_error = f"{type(e).__name__}: {e}"[:300]
        decoder = CachedDecoder(model, cache, cuda_graph=False)
        tokens = decoder.step(tokens).argmax(-1)
    _sync()
    t = time.perf_counter()
    for i in range(steps):
        tokens = decoder.step(tokens).argmax(-1)
        if evict and i % cache.page_size == 0:
            cache.evict()
    _sync()
    ms = 1e3 * (time.perf_counter() - t)
    stats = cache.stats()
    out = dict(tokens_per_s=B * steps / (ms / 1e3), ms_per_step=ms / steps, steps=steps, pages_freed=freed,
               cache_fraction=stats["fraction"], cache_fraction_after_fill=size_after_fill["fraction"],
               cache_fraction_per_layer=stats["per_layer"], peak_gib=_peak_gib(), cuda_graph=graph_error is None)
    if graph_error:
        out["graph_error"] = graph_error
    del decoder, cache
    return out


def llama_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=50304, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=262144,
                      tie_word_embeddings=False, rms_norm_eps=1e-6, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(DEV, DTYPE).eval()


def time_hf(model, B: int, ctx: int, steps: int) -> dict:
    """HF generate greedy after a (random) DynamicCache of ctx tokens: time per new token."""
    from transformers import DynamicCache

    cfg = model.config
    gen = torch.Generator(device=DEV).manual_seed(ctx + B)
    D = cfg.hidden_size // cfg.num_attention_heads

    def run(n):
        cache = DynamicCache()
        for layer in range(cfg.num_hidden_layers):
            kv = [torch.randn(B, cfg.num_key_value_heads, ctx, D, device=DEV, dtype=DTYPE, generator=gen) for _ in "kv"]
            cache.update(kv[0], kv[1], layer)
        ids = torch.randint(0, 50257, (B, ctx + 1), device=DEV, generator=gen)
        _sync()
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        _sync()
        return time.perf_counter() - t

    run(2)  # warm-up
    seconds = run(steps)
    return dict(tokens_per_s=B * steps / seconds, ms_per_step=1e3 * seconds / steps, steps=steps,
                peak_gib=_peak_gib())


def checks() -> dict:
    """Correctness on the GPU before any timing."""
    res = {}
    # 1. Decode kernel (bf16) against the fp64 PyTorch path, GQA, Tq = 1 and 4, shuffled pages, evicted prefix.
    gen = torch.Generator(device=DEV).manual_seed(0)
    for tq in (1, 4):
        cache = PagedFoxCache(num_layers=1, num_heads=12, num_kv_heads=4, head_dim=64, batch_size=3, max_length=5000,
                              device=DEV, dtype=DTYPE, page_size=64)
        cache.begin(4000)
        cache.store(0, torch.randn(3, 4000, 4, 64, device=DEV, dtype=DTYPE, generator=gen),
                    torch.randn(3, 4000, 4, 64, device=DEV, dtype=DTYPE, generator=gen),
                    F.logsigmoid(4 + torch.randn(3, 4000, 12, device=DEV, generator=gen)))
        cache.lengths.copy_(torch.tensor([4000, 2500, 3333], device=DEV, dtype=torch.int32))
        cache.cache_start[0, 1, 2] = 7
        q = torch.randn(3, tq, 12, 64, device=DEV, dtype=DTYPE, generator=gen)
        args = (cache.k_pool, cache.v_pool, cache.c_pool, cache.page_table[0], cache.cache_start[0], cache.lengths)
        o = forgetting_attention_decode(q, *args)
        ref, _ = decode_attention_torch(q.double(), args[0].double(), args[1].double(), *args[2:], 64 ** -0.5)
        res[f"kernel_rel_err_tq{tq}"] = float((o.double() - ref).norm() / ref.norm())
        assert res[f"kernel_rel_err_tq{tq}"] < 1e-2, res
    # 2. Graph replay equals eager steps; 3. generate() against HF generate (FoxCache) on real prompts.
    model = fox_model("fox-pro")
    logits = []
    for graph in (False, True):
        g = torch.Generator(device=DEV).manual_seed(5)
        cache = PagedFoxCache.from_model(model, 2, 1200)
        fill(cache, model, 1000, g)
        dec = CachedDecoder(model, cache, cuda_graph=graph and DEV.type == "cuda")
        toks = torch.tensor([11, 12], device=DEV)
        logits.append(torch.stack([dec.step(toks + i).float().clone() for i in range(6)]))
    res["graph_vs_eager_max_abs_logit_diff"] = float((logits[0] - logits[1]).abs().max())
    assert res["graph_vs_eager_max_abs_logit_diff"] < 1e-2, res
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 50257, (n,), generator=g).tolist() for n in (700, 1500)]
    ours = generate(model, prompts, 16)
    width = 1500
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=DEV)
    pad = torch.tensor([width - len(p) for p in prompts], device=DEV)
    mask = (torch.arange(width, device=DEV)[None] >= pad[:, None]).long()
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    same = sum(a == b for s, t in zip(ours.sequences, hf[:, width:].tolist()) for a, b in zip(s, t))
    res["generate_vs_hf_token_agreement"] = same / 32  # bf16: an argmax near-tie may flip a token
    return res


def sweep(path: str, steps: int) -> None:
    """Launch tuning of the decode kernel (``foxlm.ops.forgetting_attention.decode._TILE``, ``_SPLIT_KEYS``) on one
    layer's cache, full and evicted, each variant checked against the fp64 PyTorch path; then the fox-pro rows again
    with the best variant."""
    import triton

    from foxlm.ops.forgetting_attention import decode as dec

    tiles = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 8, 4)]
    split_keys = [1 << 30, 8192, 2048]
    result = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), steps=steps, timings=[])
    gen = torch.Generator(device=DEV).manual_seed(0)
    H, D = 12, 64
    for B, ctx in ((1, 32768), (16, 32768), (16, 131072)):
        cache = PagedFoxCache(num_layers=1, num_heads=H, num_kv_heads=H, head_dim=D, batch_size=B, max_length=ctx + 64,
                              device=DEV, dtype=DTYPE, logit_bounds=[torch.full((H,), D * D ** -0.5)])
        cache.begin(ctx)
        cache.store(0, F.rms_norm(torch.randn(B, ctx, H, D, device=DEV, dtype=DTYPE, generator=gen), (D,)),
                    torch.randn(B, ctx, H, D, device=DEV, dtype=DTYPE, generator=gen),
                    F.logsigmoid(standard_bias(H).to(DEV) + 0.5 * torch.randn(B, ctx, H, device=DEV, generator=gen)))
        q = torch.randn(B, 1, H, D, device=DEV, dtype=DTYPE, generator=gen)
        for evicted in (False, True):
            if evicted:
                cache.evict()
            args = (q, cache.k_pool, cache.v_pool, cache.c_pool, cache.page_table[0], cache.cache_start[0],
                    cache.lengths)
            ref = None
            if B == 1:
                ref, _ = decode_attention_torch(q.double(), args[1].double(), args[2].double(), *args[3:], D ** -0.5)
            live_bytes = cache.stats()["live_pages"] * cache.page_size * D * 2 * 2
            for tile in tiles:
                for sk in split_keys:
                    dec._TILE, dec._SPLIT_KEYS = tile, sk
                    S = dec.default_num_splits(B, H, ctx + 64, DEV)
                    fn = lambda: forgetting_attention_decode(*args, num_splits=S)  # noqa: E731
                    err = None if ref is None else float((fn().double() - ref).norm() / ref.norm())
                    ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                    row = dict(batch=B, ctx=ctx, evicted=evicted, tile=tile, split_keys=sk, splits=S, ms=ms,
                               tb_per_s=live_bytes / ms / 1e9, rel_err=err)
                    result["timings"].append(row)
                    print(json.dumps(row), flush=True)
        del cache
        torch.cuda.empty_cache()
    # Best variant: the smallest geometric mean of time over the best time, across shapes.
    rows = result["timings"]
    best_ms = {}
    for r in rows:
        key = (r["batch"], r["ctx"], r["evicted"])
        best_ms[key] = min(best_ms.get(key, math.inf), r["ms"])
    score = {}
    for r in rows:
        v = (tuple(r["tile"]), r["split_keys"])
        score[v] = score.get(v, 0.0) + math.log(r["ms"] / best_ms[(r["batch"], r["ctx"], r["evicted"])])
    (tile, sk), _ = min(score.items(), key=lambda kv: kv[1])
    dec._TILE, dec._SPLIT_KEYS = tile, sk
    result["best"] = dict(tile=tile, split_keys=sk)
    print("best", result["best"], flush=True)
    model = fox_model("fox-pro")
    result["rows"] = []
    for ctx in (32768, 131072):
        for B in (1, 16):
            for evict in (False, True):
                torch.cuda.empty_cache()
                row = dict(impl="foxlm fox-pro" + (" +evict" if evict else ""), batch=B, ctx=ctx,
                           **time_ours(model, B, ctx, steps, evict))
                result["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "cache_fraction_per_layer"}), flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _sizes(text: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."),
                    help="directory for decode-DATE.json (--sweep: decode-sweep-DATE.json); default $OUT or .")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace that day's results file (default: write NAME-2.json, NAME-3.json, ...)")
    ap.add_argument("--contexts", type=_sizes, default=[4096, 32768, 131072],
                    help="cached tokens before the timed steps (default 4096,32768,131072)")
    ap.add_argument("--batches", type=_sizes, default=[1, 16], help="batch sizes (default 1,16)")
    ap.add_argument("--steps", type=positive_int, default=64, help="timed decode steps of foxlm's decoder")
    ap.add_argument("--hf-steps", type=positive_int, default=8, help="timed new tokens of HF generate")
    ap.add_argument("--sweep", action="store_true", help="tune the decode kernel's launch instead (see sweep)")
    args = ap.parse_args(argv)
    require_cuda(ap)
    date = time.strftime("%Y-%m-%d")
    path = results_path(os.path.join(args.out, f"decode{'-sweep' if args.sweep else ''}-{date}.json"), args.overwrite)
    if args.sweep:
        return sweep(path, args.steps)
    contexts, batches = args.contexts, args.batches
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=date, dtype=str(DTYPE),
                  model_size="125m", settings={k: v for k, v in vars(args).items() if k != "out"}, rows=[])
    import transformers
    import triton

    result.update(transformers=transformers.__version__, triton=triton.__version__)

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    t0 = time.perf_counter()
    result["checks"] = checks()
    print("checks", result["checks"], f"{time.perf_counter() - t0:.1f}s", flush=True)
    save()

    def record(impl, B, ctx, fn):
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        try:
            row = dict(impl=impl, batch=B, ctx=ctx, **fn())
        except torch.OutOfMemoryError:
            row = dict(impl=impl, batch=B, ctx=ctx, error="out of memory")
        except Exception as e:  # keep measuring the other rows; the error is in the results
            row = dict(impl=impl, batch=B, ctx=ctx, error=f"{type(e).__name__}: {e}"[:300])
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
        row["wall_s"] = time.perf_counter() - t
        result["rows"].append(row)
        save()
        print(json.dumps(row), flush=True)

    for arch in ("fox-pro", "transformer-pro"):
        model = fox_model(arch)
        for ctx in contexts:
            for B in batches:
                record(f"foxlm {arch}", B, ctx, lambda: time_ours(model, B, ctx, args.steps, evict=False))
                if arch == "fox-pro":
                    record(f"foxlm {arch} +evict", B, ctx, lambda: time_ours(model, B, ctx, args.steps, evict=True))
    llama = llama_model()
    for ctx in contexts:
        for B in batches:
            if B * ctx > 16 * 32768:  # DynamicCache grows by torch.cat: > 2 x 40 GB at 16 x 128k
                result["rows"].append(dict(impl="HF Llama SDPA generate", batch=B, ctx=ctx,
                                           error="skipped: cache > 40 GB"))
                continue
            record("HF Llama SDPA generate", B, ctx, lambda: time_hf(llama, B, ctx, args.hf_steps))
    result["total_s"] = time.perf_counter() - t0
    save()
    print(f"{'impl':32s} {'B':>3s} {'ctx':>7s} {'tok/s':>10s} {'ms/step':>8s} {'cache':>6s}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['impl']:32s} {r['batch']:3d} {r['ctx']:7d} {r['error']}")
        else:
            frac = f"{100 * r['cache_fraction']:.0f}%" if "cache_fraction" in r else ""
            print(f"{r['impl']:32s} {r['batch']:3d} {r['ctx']:7d} {r['tokens_per_s']:10.1f} {r['ms_per_step']:8.2f} "
                  f"{frac:>6s}")
    print(f"total {result['total_s']:.0f}s")


if __name__ == "__main__":
    main()

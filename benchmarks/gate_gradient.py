"""Accuracy of Forgetting Attention's gradients in bf16/fp16 against the fp64 reference, on every backward variant
of foxlm's kernels and on fla's ``parallel_forgetting_attn`` when it is importable (same inputs, same run).

Inputs: q, k, v randn in the dtype, log f = logsigmoid(2 randn + 2) in fp32 (about -0.3 per token), a random dO in
the dtype; the loss is <o, dO>. The reported number is ||x - x_ref|| / ||x_ref|| (Frobenius) per output.

    PYTHONPATH=. python benchmarks/gate_gradient.py [--seqlens 1024 4096 16384] [--dims 64 128] [--out DIR]

On a machine without CUDA, ``--device cpu`` runs the kernels in Triton's interpreter (small ``--seqlens`` only).

``--model``: one training step of a small FoX (Pro) in bf16 on the kernels against the same model in fp64 on the
PyTorch path: the relative error of the forget-gate projections' gradients beside that of all other parameters.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.nn.functional as F
from _results import positive_int, require_cuda, results_path

VARIANTS = {  # name: forgetting_attention keyword arguments
    "foxlm": dict(),
    "foxlm-acp": dict(prune=True),
    "foxlm-window": dict(window=512),
}


def _inputs(T: int, H: int, D: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator(device).manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, D, generator=g, device=device).to(dtype) for _ in range(3))
    log_fgate = F.logsigmoid(2 * torch.randn(1, T, H, generator=g, device=device) + 2)
    do = torch.randn(1, T, H, D, generator=g, device=device).to(dtype)
    return q, k, v, log_fgate, do


def _grads(fn, q, k, v, log_fgate, do, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v, log_fgate)]
    o = fn(*leaves)
    grads = torch.autograd.grad(o, leaves, do.to(o.dtype))
    return [o.detach(), *grads]


def _fla():
    try:
        from fla.ops.forgetting_attn import parallel_forgetting_attn
    except ImportError:
        return None
    return lambda q, k, v, g: parallel_forgetting_attn(q, k, v, g, scale=q.shape[-1] ** -0.5)


def model_check(T: int, device: str) -> None:
    """The forget gates' parameter gradients of one step, bf16 model on the kernels against fp64 (see --model)."""
    from foxlm.models import FoxConfig, FoxForCausalLM
    from foxlm.ops import use_backend

    torch.manual_seed(0)
    cfg = FoxConfig.preset("fox-pro", "tiny", vocab_size=512, hidden_size=128, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=256)
    ref = FoxForCausalLM(cfg).double().to(device)
    with torch.no_grad():  # a trained model's spread of decay rates
        for name, p in ref.named_parameters():
            if name.endswith("fgate_proj.bias"):
                p.copy_(torch.linspace(0, 6, p.numel()))
    ids = torch.randint(0, 512, (2, T), device=device)
    low = FoxForCausalLM(cfg).to(device)
    low.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    low = low.to(torch.bfloat16)
    grads = []
    for model, backend in ((ref, "torch"), (low, "auto")):
        with use_backend(backend):
            loss = model(ids, labels=ids).loss
        grads.append(dict(zip([n for n, _ in model.named_parameters()],
                              torch.autograd.grad(loss, list(model.parameters())))))

    def rel(names):
        num = sum(((grads[1][n].double() - grads[0][n]) ** 2).sum() for n in names)
        return (num / sum((grads[0][n] ** 2).sum() for n in names)).sqrt().item()

    gates = [n for n in grads[0] if "fgate" in n]
    print(f"T={T}: relative error of the gradients, forget-gate projections {rel(gates):.2e} (biases "
          f"{rel([n for n in gates if n.endswith('bias')]):.2e}), all other parameters "
          f"{rel([n for n in grads[0] if n not in gates]):.2e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", type=positive_int, nargs="+", default=[1024, 4096, 16384],
                        help="sequence lengths (--model: of the training step)")
    parser.add_argument("--dims", type=positive_int, nargs="+", default=[64, 128], help="head dims")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"],
                        help="the inputs' dtypes")
    parser.add_argument("--heads", type=positive_int, default=2, help="attention heads")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (default), or cpu: the kernels in Triton's interpreter")
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="directory for gate-gradient-DATE.json (default $OUT; unset: print only)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace that day's results file (default: write NAME-2.json, NAME-3.json, ...)")
    parser.add_argument("--model", action="store_true", help="one training step of a small model instead")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        require_cuda(parser, " (--device cpu runs the kernels in Triton's interpreter)")
    path = None
    if args.out and not args.model:
        path = results_path(os.path.join(args.out, f"gate-gradient-{datetime.date.today()}.json"), args.overwrite)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if args.model:
        from foxlm.ops.forgetting_attention import triton_op

        triton_op.SMALL_TILES = args.device == "cpu"
        for T in args.seqlens:
            model_check(T, args.device)
        return
    from foxlm.ops import forgetting_attention, forgetting_attention_reference, use_backend

    fla = _fla() if args.device == "cuda" else None
    rows = []
    print(f"{'case':<26} {'variant':<13} {'o':>8} {'dq':>8} {'dk':>8} {'dv':>8} {'dlog_f':>8}")
    for T in args.seqlens:
        for D in args.dims:
            for dtype in (getattr(torch, name) for name in args.dtypes):
                q, k, v, lf, do = _inputs(T, args.heads, D, dtype, args.device, seed=T + D)
                paths = {name: (lambda kw: lambda *x: forgetting_attention(*x, **kw))(kw)
                         for name, kw in VARIANTS.items()}
                if fla is not None:
                    paths["fla"] = fla
                ref_paths = {"window": lambda *x: forgetting_attention_reference(*x, window=512)}
                refs = {}
                for name, fn in paths.items():
                    kind = "window" if name.endswith("window") else "full"
                    if kind not in refs:  # the reference in fp64 (ACP skips < e^-10 of the mass: compared unpruned)
                        refs[kind] = _grads(ref_paths.get(kind, forgetting_attention_reference), q, k, v, lf,
                                            do.double(), torch.float64)
                    with use_backend("auto"):
                        got = _grads(fn, q, k, v, lf, do)
                    errs = [((a.double() - e).norm() / e.norm()).item() for a, e in zip(got, refs[kind])]
                    case = f"T={T} d{D} {str(dtype).split('.')[-1]}"
                    rows.append(dict(T=T, D=D, dtype=str(dtype), variant=name, **dict(zip(
                        ("o", "dq", "dk", "dv", "dlog_fgate"), errs))))
                    print(f"{case:<26} {name:<13} " + " ".join(f"{e:8.1e}" for e in errs), flush=True)
                del refs
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    if path:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
        with open(path, "w") as f:
            json.dump(dict(device=device, date=datetime.date.today().isoformat(), torch=torch.__version__,
                           settings={k: v for k, v in vars(args).items() if k != "out"}, rows=rows), f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()

"""Why the backward sums dS's rows in its kernel: a PyTorch model of the kernels' arithmetic (the forward's fp32
scores, P rounded to the inputs' dtype for its PV product, o rounded on the way out; the backward's fp32 P and dP)
that takes the gate gradient's query side three ways, each against the fp64 reference:

- ``delta from o``: rowsum(dS) taken as dlse (0 here), i.e. delta = dO . o with o as stored (bf16): the error of o's
  rounding adds up along the reverse cumsum (the defect of issue 38);
- ``delta from fp32 o``: the same with the forward's fp32 accumulator (as if o were kept in fp32, or as two bf16
  halves): still short, since the forward rounded P for its PV product and sum_j P_ij dP_ij != dO_i . o_i by that too;
- ``row sums``: rowsum(dS) from the same dS as the column sums (what the kernels do).

    PYTHONPATH=. python benchmarks/gate_gradient_delta.py [--seqlens 1024 2048 4096] [--dim 64]

CPU, minutes at 4k (dense T x T matrices in fp64).
"""

from __future__ import annotations

import argparse
import math

import torch
from _results import positive_int

from benchmarks.gate_gradient import _inputs


def errors(T: int, D: int, H: int = 2, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, float]:
    """Relative (Frobenius) error of d(log f) against fp64 for the three ways, one random case."""
    q, k, v, log_fgate, do = (x.transpose(1, 2) for x in _inputs(T, H, D, dtype, "cpu", seed))  # [1, H, T, ...]
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    ref = [x.double().requires_grad_() for x in (q, k, v, log_fgate)]
    c = ref[3].cumsum(-1)
    s = ref[0] @ ref[1].transpose(-1, -2) / math.sqrt(D) + c[..., :, None] - c[..., None, :]
    (s.masked_fill(~causal, -math.inf).softmax(-1) @ ref[2]).backward(do.double())
    g_ref = ref[3].grad

    c = log_fgate.cumsum(-1)
    s = (q.float() @ k.float().transpose(-1, -2) / math.sqrt(D) + c[..., :, None] - c[..., None, :])
    s = s.masked_fill(~causal, -math.inf)
    m = s.amax(-1, keepdim=True)
    p = (s - m).exp()
    o32 = (p.to(dtype).float() @ v.float()) / p.sum(-1, keepdim=True)  # the forward's accumulator
    P = (s - m - p.sum(-1, keepdim=True).log()).exp()  # the backward's, from lse
    dP = do.float() @ v.float().transpose(-1, -2)

    def gate_grad_error(delta: torch.Tensor, rows: bool) -> float:
        dS = P * (dP - delta[..., None])
        dc = (dS.sum(-1) if rows else 0) - dS.sum(-2)
        g = dc.double().flip(-1).cumsum(-1).flip(-1)
        return ((g - g_ref).norm() / g_ref.norm()).item()

    delta_o = (do.float() * o32.to(dtype).float()).sum(-1)
    return {"delta from o": gate_grad_error(delta_o, False),
            "delta from fp32 o": gate_grad_error((do.float() * o32).sum(-1), False),
            "row sums": gate_grad_error(delta_o, True)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=positive_int, nargs="+", default=[1024, 2048, 4096],
                        help="sequence lengths (dense T x T matrices in fp64: minutes at 4096)")
    parser.add_argument("--dim", type=positive_int, default=64, help="head dim")
    args = parser.parse_args(argv)
    for T in args.seqlens:
        print(f"T={T} d{args.dim}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors(T, args.dim).items()), flush=True)


if __name__ == "__main__":
    main()

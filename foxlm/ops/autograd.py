"""``first_order_only``: for the backward of a custom autograd Function that has no derivative of its own."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


class _NoSecondDerivative(torch.autograd.Function):
    """Passes gradients through unchanged; differentiating them raises, naming the op."""

    @staticmethod
    def forward(ctx, op, *grads):
        ctx.op = op
        return tuple(g.detach() for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(f"{ctx.op}: cannot differentiate twice (its backward is not differentiable): a gradient "
                           "taken with create_graph=True, as for a gradient penalty, has no derivative")


def first_order_only(op: str) -> Callable:
    """Decorate the backward of an autograd.Function whose backward is not made of differentiable torch ops (Triton
    kernels, out=, in-place or detached math), ``op`` naming it in the error: the backward runs without a graph, and
    with create_graph=True its gradients carry a node that raises if they are differentiated.

    torch's ``once_differentiable`` adds that node only when an incoming gradient requires grad; but a backward's
    result depends on the saved inputs too, so under a constant incoming gradient (a loss's own) the gradient came
    back without a graph and a penalty on it silently lost its second-order term."""

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            if not torch.is_grad_enabled():  # create_graph=False: the plain first-order gradients
                return grads
            single = not isinstance(grads, tuple)
            grads = (grads,) if single else grads
            where = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
            if not where:
                return grads[0] if single else grads
            wrapped = _NoSecondDerivative.apply(op, *(grads[i].detach().requires_grad_() for i in where))
            out = list(grads)
            for i, g in zip(where, wrapped):
                out[i] = g
            return out[0] if single else tuple(out)

        return wrapper

    return decorate

"""A training micro-step (forward + backward) captured once in a CUDA graph and replayed.

An eager step launches a few thousand kernels; on a fast GPU a small model's step is bound by the host that
launches them (the 125m models at 16k tokens: 5-40 ms a step of host time the GPU waits for). A replayed
graph launches them all at once. What stays eager is cheap in launches: gradient clipping, the optimizer step,
zeroing the gradients.

Constraints, as for any CUDA graph: every micro-batch has the captured shape, the forward and backward make
no host sync (foxlm's models make none without ``cu_seqlens`` or an attention mask), and the gradients live at
fixed addresses: they are created before the capture and must be zeroed in place
(``optimizer.zero_grad(set_to_none=False)``), never set to None.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch

from ..ops.backend import use_triton
from .config import TrainConfig


class GraphedMicroStep:
    """``step(input_ids, labels, weight) -> loss``: adds ``weight * grad(loss)`` into the parameters' ``.grad``.

    Args:
        loss_fn: ``(input_ids [B, T], labels [B, T]) -> scalar loss``; enters its own autocast, if any.
        params: the parameters whose gradients accumulate (all of them must receive one).
        warmup: eager micro-steps (on a side stream, as capture wants) before the capture: they compile and
            autotune the kernels and settle the allocator. They train like any other micro-step.

    The returned loss is a detached fp32 scalar that the next call overwrites.
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 params: list[torch.nn.Parameter], warmup: int = 2):
        if not params or any(not p.is_cuda for p in params):
            raise ValueError("cuda_graph: the parameters must be CUDA tensors (CUDA graphs need a GPU)")
        if warmup < 1:
            raise ValueError(f"warmup: expected at least one eager micro-step before the capture, got {warmup}")
        self.loss_fn, self.params, self.warmup = loss_fn, list(params), warmup
        self.device = self.params[0].device
        self._calls = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._ids = self._labels = self._weight = self._loss = None

    def _micro_step(self) -> torch.Tensor:
        loss = self.loss_fn(self._ids, self._labels)
        (loss * self._weight).backward()
        return loss.detach().float()

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """input_ids, labels: [B, T] on the parameters' device, the same shape at every call."""
        if self._ids is None:
            self._ids, self._labels = torch.empty_like(input_ids), torch.empty_like(labels)
            self._weight = torch.ones((), device=self.device)
        elif input_ids.shape != self._ids.shape or labels.shape != self._labels.shape:
            raise ValueError(f"input_ids: the CUDA graph was captured for batches of shape {tuple(self._ids.shape)}, "
                             f"got {tuple(input_ids.shape)} (cuda_graph needs one batch shape)")
        self._ids.copy_(input_ids, non_blocking=True)
        self._labels.copy_(labels, non_blocking=True)
        self._weight.fill_(weight)
        self._calls += 1
        if self._calls <= self.warmup:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                loss = self._micro_step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            return loss
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._loss

    def _capture(self) -> None:
        missing = [i for i, p in enumerate(self.params) if p.requires_grad and p.grad is None]
        if len(missing) == len(self.params):  # zeroed with set_to_none: recreate them, as zeros
            for p in self.params:
                p.grad = torch.zeros_like(p)
        elif missing:
            raise ValueError(f"params: {len(missing)} of them received no gradient in the eager micro-steps; a CUDA "
                             f"graph needs every gradient at a fixed address")
        grads = [p.grad.data_ptr() for p in self.params]
        # The capture records the work without running it: keep the gradients, replay once to run it.
        # A dead reference cycle holding an earlier graph (a finished Trainer and its GraphedMicroStep) is collected
        # now, not by the cyclic GC during the capture: destroying a graph there invalidates the capture.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._loss = self._micro_step()
        finally:
            if collecting:
                gc.enable()
        if [p.grad.data_ptr() for p in self.params] != grads:
            raise RuntimeError("cuda_graph: the captured backward replaced a gradient instead of adding into it")


def graph_micro_step(cfg: TrainConfig, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     model: torch.nn.Module, device: torch.device, world: int, hf: bool) -> GraphedMicroStep | None:
    """The trainer's micro-step replayed from a CUDA graph, as ``cfg.cuda_graph`` asks (``auto``: where one GPU, one
    process, fixed shapes, eager blocks and the Triton kernels allow it); None: eager. A ValueError where ``true``
    cannot be met. ``loss_fn`` must not hold the trainer: no reference cycle may keep a finished run's graph."""
    on_gpu = device.type == "cuda"
    # the PyTorch paths of the ops size their work on the host (not capturable): graphs need the Triton kernels
    kernels = on_gpu and use_triton(torch.empty(0, device=device))
    use_graph = cfg.cuda_graph
    if use_graph == "auto":
        use_graph = on_gpu and world == 1 and cfg.packing == "windows" and not cfg.compile and kernels and not hf
    if not use_graph:
        return None
    if not on_gpu or world > 1:
        raise ValueError(f"cuda_graph: needs one CUDA device and one process, got {device} x {world}")
    if not kernels:
        raise ValueError("cuda_graph: needs foxlm's Triton kernels (the PyTorch paths sync with the host), "
                         "got use_backend('torch')")
    return GraphedMicroStep(loss_fn, [p for p in model.parameters() if p.requires_grad])

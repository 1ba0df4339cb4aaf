"""The trainer's processes: device choice, process group and ``DeviceMesh``, FSDP2 / DDP wrapping, gradient sync.

One process, or one per device under ``torchrun`` (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``). The processes form a
``DeviceMesh`` whose dimensions are named in ``MESH_DIMS``: ``"dp"`` (data parallel: each process trains on its share of
the global batch) × ``"cp"`` (context parallel: the processes of one ``"dp"`` index each hold a zigzag shard of the
same sequences). Every process holds different tokens, so gradients are reduced (FSDP2 / DDP) over both dims.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..device import resolve_device

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("dp", "cp")


@dataclass
class Dist:
    """This process's place among the trainer's processes."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    owns_group: bool = False  # this trainer initialized the process group (and so tears it down)
    mesh: DeviceMesh | None = None  # dims MESH_DIMS; None in one process

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which share of the global batch this process trains on."""
        return 0 if self.mesh is None else self.mesh.get_local_rank("dp")

    @property
    def dp_size(self) -> int:
        """Over how many processes the global batch is split."""
        return 1 if self.mesh is None else self.mesh.size(MESH_DIMS.index("dp"))

    @property
    def cp_size(self) -> int:
        """Over how many processes each sequence is split."""
        return 1 if self.mesh is None else self.mesh.size(MESH_DIMS.index("cp"))

    @property
    def cp_rank(self) -> int:
        """Which shard of each sequence this process holds."""
        return 0 if self.mesh is None else self.mesh.get_local_rank("cp")

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The processes that hold the other shards of this process's sequences (None without context parallel)."""
        return None if self.cp_size == 1 else self.mesh.get_group("cp")

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over all processes (each holds different tokens: its dp share, its cp shard), in place."""
        if self.mesh is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` holds on any process (one all-reduce; none in a single process)."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return bool(t.item())


def setup(device: str, cp: int = 1) -> tuple[Dist, torch.device]:
    """This process's ``Dist`` and device (``device``: auto | cpu | cuda | cuda:N; auto and cuda take the GPU of
    ``LOCAL_RANK``); under ``torchrun`` the process group (NCCL on GPUs, gloo on the CPU) and the mesh, whose ``"cp"``
    dim has ``cp`` processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % cp:
        raise ValueError(f"cp: {cp} must divide the number of processes ({world}; run under torchrun "
                         f"--nproc-per-node with a multiple of cp)")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    where = resolve_device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device(f"cuda:{local_rank}")
    if where.type == "cuda":
        if where.index >= torch.cuda.device_count():
            hint = f" for LOCAL_RANK={local_rank} (one process per GPU, or device=cpu)" if world > 1 else ""
            raise ValueError(f"device: {where} is not one of the {torch.cuda.device_count()} visible GPUs{hint}")
        torch.cuda.set_device(where)
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend="nccl" if where.type == "cuda" else "gloo")
    return Dist(rank, local_rank, world, owns_group, build_mesh(where, world, cp)), where


def build_mesh(device: torch.device, world: int, cp: int = 1) -> DeviceMesh | None:
    """The processes as a ``DeviceMesh`` (world / cp) x cp with dims ``MESH_DIMS`` (None in one process), on the
    trainer's device type: FSDP2's default mesh takes the GPU whenever one is visible, even for gloo."""
    if world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=MESH_DIMS)


def _replica_mesh(d: Dist) -> DeviceMesh:
    """The 1-D mesh of all processes that hold different tokens (dp x cp, flattened): FSDP2 shards, and both
    FSDP2 and DDP reduce gradients, over it."""
    return d.mesh["dp"] if d.cp_size == 1 else d.mesh["dp", "cp"]._flatten("dp_cp")


def wrap(model: torch.nn.Module, parallel: str, d: Dist, device: torch.device) -> torch.nn.Module:
    """``model`` for training over ``d``'s processes: FSDP2 (``fully_shard`` per block, then the whole) or DDP
    (``parallel``: fsdp | ddp); unchanged in one process."""
    if d.mesh is None:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       process_group=_replica_mesh(d).get_group())
    from torch.distributed.fsdp import fully_shard

    mesh = _replica_mesh(d)
    from ..models.hf import decoder_layers

    for block in decoder_layers(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def parallelize(model: torch.nn.Module, compile: bool, parallel: str, d: Dist, device: torch.device) -> torch.nn.Module:
    """``model`` ready to train over ``d``'s processes, in torchtitan's order: its attention split over the ``"cp"``
    processes where there are several, each block compiled (``compile``), then ``wrap``ped (``parallel``)."""
    if d.cp_size > 1:
        from ..parallel import apply_context_parallel

        apply_context_parallel(model, d.cp_group)
    if compile:
        from ..models.hf import decoder_layers

        for block in decoder_layers(model, "compile"):
            block.compile()
    return wrap(model, parallel, d, device)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (FSDP2 shards it in place)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def grad_sync(model: torch.nn.Module, sync: bool):
    """Context for one micro-batch's backward: reduce gradients over processes only when ``sync``."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()

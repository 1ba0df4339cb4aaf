"""How a sequence is split over the ranks of a context-parallel group, and the two ops that move it.

``zigzag`` cuts the sequence into 2P chunks and gives rank r chunks r and 2P-1-r, so every rank holds as much
causal work; ``contiguous`` gives rank r the r-th of P equal chunks.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# torch >= 2.12's name; there all_gather_into_tensor warns that it is deprecated, and torch 2.11 has only the old one
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

LAYOUTS = ("zigzag", "contiguous")
# Every dtype this torch has, in one order on every process: check_same_on_ranks compares them by index, and
# gather_sequence gathers any tensor (token ids, masks), not only the attention's float dtypes
_ALL_DTYPES = tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str))


def chunks_per_rank(layout: str) -> int:
    """How many chunks of the sequence one rank holds."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return 2 if layout == "zigzag" else 1


def rank_chunks(rank: int, world: int, layout: str) -> list[int]:
    """Global chunk indices of ``rank``'s shard, in the order it holds them."""
    return [rank, 2 * world - 1 - rank] if chunks_per_rank(layout) == 2 else [rank]


def check_group(group) -> None:
    """Refuse a ``group`` that is neither a ProcessGroup nor None by name: torch's own error for one (a DeviceMesh,
    say) is that the group "is not registered". ``new_group``'s answer on a process outside the group passes, for
    ``_world`` to name."""
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER \
            and not isinstance(group, dist.ProcessGroup):
        hint = " (a 1-D mesh's is mesh.get_group())" if isinstance(group, DeviceMesh) else ""
        raise ValueError(f"group: expected a ProcessGroup or None, got {type(group).__name__}{hint}")


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    check_group(group)
    if not dist.is_initialized():
        raise RuntimeError("foxlm.parallel: torch.distributed is not initialised (call init_process_group first)")
    rank = dist.get_rank(group)
    if rank < 0:  # torch.distributed's answer outside the group: positions and shards would come out wrong
        raise ValueError(f"group: this process (rank {dist.get_rank()} of the world) is not a member of it; call "
                         f"context-parallel ops on the ranks of the group only")
    return rank, dist.get_world_size(group)


def check_same_on_ranks(group: dist.ProcessGroup | None, device: torch.device, fields: dict) -> None:
    """Refuse, on every rank alike, arguments that differ between the ranks of ``group``: ``fields`` maps what the
    message names to a shape (a tuple of ints), a dtype, a layout, a bool, or a setting that is a float, a tensor or
    None (a tensor compared by its shape and values). A collective (one all-gather of a few integers, read on the
    host): without it, shards of different shapes abort one process inside the communication library and let
    another return a wrong result."""
    rank, world = _world(group)
    if world == 1:
        return
    codes = {name: _encode(value) for name, value in fields.items()}
    local = torch.tensor([c for code in codes.values() for c in code], dtype=torch.int64, device=device)
    gathered = local.new_empty(world * local.numel())
    all_gather_single(gathered, local, group=group)
    per_rank = gathered.view(world, -1).tolist()
    start = 0
    for name, code in codes.items():
        got = [tuple(row[start:start + len(code)]) for row in per_rank]
        if len(set(got)) > 1:
            shown = ", ".join(f"rank {r}: {_decode(fields[name], g)}" for r, g in enumerate(got))
            raise ValueError(f"{name}: expected the same on every rank of the context-parallel group, got {shown}")
        start += len(code)


def _is_setting(value) -> bool:
    return value is None or isinstance(value, (float, torch.Tensor))


def _encode(value) -> tuple[int, ...]:
    if isinstance(value, torch.dtype):
        return (_ALL_DTYPES.index(value),)
    if isinstance(value, str):
        return (LAYOUTS.index(value),)
    if isinstance(value, bool):
        return (int(value),)
    if _is_setting(value):  # (kind, payload), as long for every kind: the ranks' codes must line up
        if value is None:
            return (0, 0)
        if isinstance(value, float):
            return (1, struct.unpack("<q", struct.pack("<d", value))[0])
        values = value.detach().to("cpu", torch.float64).contiguous()
        digest = hashlib.blake2b(repr(tuple(values.shape)).encode() + values.numpy().tobytes(), digest_size=7)
        return (2, int.from_bytes(digest.digest(), "little"))
    return tuple(int(d) for d in value)


def _decode(like, code: tuple[int, ...]):
    if isinstance(like, torch.dtype):
        return _ALL_DTYPES[code[0]]
    if isinstance(like, str):
        return repr(LAYOUTS[code[0]])
    if isinstance(like, bool):
        return bool(code[0])
    if _is_setting(like):  # another rank's may be of another kind
        kind, payload = code
        if kind == 0:
            return None
        if kind == 1:
            return struct.unpack("<d", struct.pack("<q", payload))[0]
        return f"a tensor #{payload:014x}"
    return code


def shard_sequence(
    x: torch.Tensor, *, dim: int, group: dist.ProcessGroup | None = None, layout: str = "zigzag"
) -> torch.Tensor:
    """This rank's shard of the whole sequence ``x`` along ``dim`` (e.g. [B, T, H, D] -> [B, T/P, H, D], dim=1).

    The length must divide into P chunks (``contiguous``) or 2P chunks (``zigzag``). Differentiable.
    """
    rank, world = _world(group)
    n = chunks_per_rank(layout) * world
    if x.shape[dim] % n:
        raise ValueError(f"x: its length {x.shape[dim]} along dim {dim} must be a multiple of {n} "
                         f"({layout} layout over {world} ranks)")
    size = x.shape[dim] // n
    return torch.cat([x.narrow(dim, c * size, size) for c in rank_chunks(rank, world, layout)], dim=dim)


def gather_sequence(
    x_local: torch.Tensor, *, dim: int, group: dist.ProcessGroup | None = None, layout: str = "zigzag"
) -> torch.Tensor:
    """The whole sequence on every rank from the ranks' shards of it (the inverse of ``shard_sequence``).

    Not differentiable: it is for outputs and evaluation, and a gradient through it would depend on whether
    the ranks then compute the same loss or different ones. The ranks compare the shards' shapes and dtypes and the
    layout first (a collective of a few integers): shards that differ aborted one process in gloo and gave another a
    wrong sequence, and layouts that differ gave each rank another sequence.
    """
    rank, world = _world(group)
    if torch.is_grad_enabled() and x_local.requires_grad:
        raise ValueError("x_local: gather_sequence is not differentiable; call it under torch.no_grad() or on a "
                         "detached tensor")
    per = chunks_per_rank(layout)
    check_same_on_ranks(group, x_local.device, {"x_local.shape": tuple(x_local.shape), "x_local.dtype": x_local.dtype,
                                                "layout": layout})
    if x_local.shape[dim] % per:
        raise ValueError(f"x_local: its length {x_local.shape[dim]} along dim {dim} must be a multiple of {per} "
                         f"({layout} layout)")
    x_local = x_local.contiguous()
    shards = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(shards, x_local, group=group)
    size = x_local.shape[dim] // per
    chunks: dict[int, torch.Tensor] = {}
    for r, shard in enumerate(shards):
        for a, c in enumerate(rank_chunks(r, world, layout)):
            chunks[c] = shard.narrow(dim, a * size, size)
    return torch.cat([chunks[c] for c in range(per * world)], dim=dim)


@dataclass(frozen=True)
class ContextParallel:
    """How a model runs context-parallel: its inputs are this rank's shards (``layout``) of sequences split over
    ``group`` (None: the default group). Installed on a model with ``apply_context_parallel``."""

    group: dist.ProcessGroup | None = None
    layout: str = "zigzag"

    def __post_init__(self):
        chunks_per_rank(self.layout)

    def check_shard(self, name: str, shape: tuple[int, int], device: torch.device, fields: dict | None = None) -> None:
        """Refuse a model input ``name`` of ``shape`` [B, T/P] that is no shard of this layout, or whose shape, the
        layout (or any of ``fields``, as ``check_same_on_ranks`` takes them) differs between the ranks (a collective:
        ranks passing shards of different lengths would otherwise abort in the communication library or compute with
        each other's wrong tokens, and ranks of different layouts wait in the token shift's exchange for a token no
        rank sends). The comparison comes first, so that a bad shard on one rank is an error on all."""
        _, world = _world(self.group)
        per = chunks_per_rank(self.layout)
        check_same_on_ranks(self.group, device, {f"{name}.shape": tuple(shape), "layout": self.layout,
                                                 **(fields or {})})
        if shape[1] == 0 or shape[1] % per:
            raise ValueError(f"{name}: a {self.layout} shard holds {per} equal chunks, so its length {shape[1]} must "
                             f"be a positive multiple of {per} (the whole sequence a multiple of {per * world}: "
                             f"shard_sequence(x, dim=1) makes such shards)")

    def mean_loss(self, local_sum: torch.Tensor, local_count: torch.Tensor) -> torch.Tensor:
        """The mean token loss of the whole rows from this rank's sum over its shard's ``local_count`` targets (a
        collective): its value is one process's on every rank, and its gradient is P times this rank's share, so
        that DDP / FSDP2, which average gradients over the ranks (the dp x cp mesh, as foxlm's trainer and
        torchtitan), give one process's gradient. Summing the gradients over the ranks instead gives P times it."""
        world = dist.get_world_size(self.group)
        stats = torch.stack([local_sum.detach().double(), local_count.double()])
        dist.all_reduce(stats, group=self.group)
        scaled = local_sum * world
        return (scaled + (stats[0] - scaled.detach()).to(scaled.dtype)) / stats[1].clamp_min(1).to(scaled.dtype)

    def check(self, *, segments=None, cache=None, window=None, output_attentions=False, reset=None) -> None:
        """Refuse, by name, what a shard of a sequence cannot do: packed documents or padding, a KV cache, a
        sliding window, attention probabilities and a token shift's resets."""
        for name, used in (("cu_seqlens / attention_mask", segments is not None), ("cache", cache is not None),
                           ("window", window is not None), ("output_attentions", output_attentions),
                           ("reset", reset is not None)):
            if used:
                raise ValueError(f"{name}: not available while the model runs context-parallel (one whole sequence "
                                 f"per row is split over the ranks; remove_context_parallel(model) for whole "
                                 f"sequences)")

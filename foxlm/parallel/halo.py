"""What a shard needs from its neighbours beyond attention: the token before each of its chunks, and positions.

FoX Pro's token shift mixes x_{t-1} into x_t, so the first token of every chunk needs the last token of the chunk
before it, which another rank holds (zigzag: rank r - 1 for chunk r, rank r + 1 for chunk 2P-1-r). RoPE needs
each token's position in the whole sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.autograd import first_order_only
from .layout import _world, check_same_on_ranks, chunks_per_rank, rank_chunks


def sequence_positions(
    local_len: int, *, group: dist.ProcessGroup | None = None, layout: str = "zigzag",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Positions in the whole sequence of this rank's ``local_len`` tokens: [T/P] int64 (e.g. for RoPE)."""
    rank, world = _world(group)
    per = chunks_per_rank(layout)
    if local_len % per:
        raise ValueError(f"local_len: a {layout} shard holds {per} equal chunks, so {local_len} must be a multiple "
                         f"of {per}")
    size = local_len // per
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in rank_chunks(rank, world, layout)])


class _PreviousTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, layout):
        rank, world = _world(group)
        per = chunks_per_rank(layout)
        size = x.shape[1] // per
        owner = {c: (r, a) for r in range(world) for a, c in enumerate(rank_chunks(r, world, layout))}
        prev = x.new_zeros(per, x.shape[0], *x.shape[2:])
        sends, recvs = [], []
        for a, c in enumerate(rank_chunks(rank, world, layout)):
            if c > 0:  # the last token of chunk c - 1
                r, a_prev = owner[c - 1]
                if r == rank:
                    prev[a] = x[:, (a_prev + 1) * size - 1]
                else:
                    recvs.append((prev[a], r, c - 1))
            if c + 1 < per * world and owner[c + 1][0] != rank:  # this chunk's last token goes to chunk c + 1
                sends.append((x[:, (a + 1) * size - 1].contiguous(), owner[c + 1][0], c))
        _exchange(sends, recvs, group)
        ctx.group, ctx.layout, ctx.shape = group, layout, x.shape
        return prev

    @staticmethod
    @first_order_only("previous_tokens")  # the gradients received from other ranks come without a graph
    def backward(ctx, dprev):
        group, layout = ctx.group, ctx.layout
        rank, world = _world(group)
        per = chunks_per_rank(layout)
        size = ctx.shape[1] // per
        owner = {c: (r, a) for r in range(world) for a, c in enumerate(rank_chunks(r, world, layout))}
        dx = dprev.new_zeros(ctx.shape)
        sends, recvs, received = [], [], []
        for a, c in enumerate(rank_chunks(rank, world, layout)):
            if c > 0:  # the gradient of chunk c - 1's last token goes back to its owner
                r, a_prev = owner[c - 1]
                if r == rank:
                    dx[:, (a_prev + 1) * size - 1] += dprev[a]
                else:
                    sends.append((dprev[a].contiguous(), r, c - 1))
            if c + 1 < per * world and owner[c + 1][0] != rank:
                buf = dprev.new_empty(dprev.shape[1:])
                recvs.append((buf, owner[c + 1][0], c))
                received.append((a, buf))
        _exchange(sends, recvs, group)
        for a, buf in received:
            dx[:, (a + 1) * size - 1] += buf
        return dx, None, None


def _exchange(sends, recvs, group) -> None:
    """Post (tensor, group rank, tag) sends and receives as one batch and wait for them."""
    ops = []
    for fn, items in ((dist.isend, sends), (dist.irecv, recvs)):
        for t, peer, tag in items:
            ops.append(dist.P2POp(fn, t, peer=peer, tag=tag) if group is None
                       else dist.P2POp(fn, t, group=group, group_peer=peer, tag=tag))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def previous_tokens(
    x_local: torch.Tensor, *, group: dist.ProcessGroup | None = None, layout: str = "zigzag", check: bool = True
) -> torch.Tensor:
    """For each chunk of this rank's shard, the token just before it in the whole sequence (zeros before the first).

    x_local: [B, T/P, ...] as ``shard_sequence(x, dim=1)`` makes it -> [chunks per rank, B, ...] (one chunk for
    ``contiguous``, two for ``zigzag``), e.g. ``token_shift``'s ``prev`` for each chunk. Differentiable: the
    gradient goes back to the rank that holds the token. check: compare the shards' shapes and the layout between the
    ranks first (a collective; shards of different lengths exchanged the wrong tokens without an error, and ranks of
    different layouts waited for a token no rank sent); False for a caller that vouches for them, as a foxlm model's
    layers do (the model compares its input shards and the layout once a forward).
    """
    if check:
        check_same_on_ranks(group, x_local.device, {"x_local.shape": tuple(x_local.shape), "layout": layout})
    per = chunks_per_rank(layout)
    if x_local.dim() < 2 or x_local.shape[1] % per or x_local.shape[1] == 0:
        raise ValueError(f"x_local: expected [B, T/P, ...] with T/P a positive multiple of {per} ({layout} layout), "
                         f"got {tuple(x_local.shape)}")
    return _PreviousTokens.apply(x_local, group, layout)

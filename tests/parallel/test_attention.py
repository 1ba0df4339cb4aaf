"""Context parallelism on real torch.distributed (gloo, 2 to 4 CPU processes) against the single-process op.

Each test spawns its processes once and runs several cases in them: every rank builds the same whole-sequence
inputs, runs ``forgetting_attention`` on all of it, and compares its shard of the outputs and of all four
gradients with ``cp_forgetting_attention`` on the shards.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

TIMEOUT_S = 120


def _inputs(B, T, Hq, Hk, D, Dv, dtype, seed, gate_bias=(3.0,)):
    """Random inputs; gate_bias per query head (cycled): low biases forget fast, high ones remember."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, T, Hk, D, generator=g).to(dtype)
    v = torch.randn(B, T, Hk, Dv, generator=g).to(dtype)
    bias = torch.tensor([gate_bias[h % len(gate_bias)] for h in range(Hq)])
    log_f = F.logsigmoid(torch.randn(B, T, Hq, generator=g) + bias)
    return q, k, v, log_f, torch.randn(B, T, Hq, Dv, generator=g).to(dtype)


def _check(layout, world, *, B=2, Hq=4, Hk=2, D=16, Dv=8, L=8, dtype=torch.float64, prune=False, gate_bias=(3.0,),
           seed=0, tol=1e-5, logit_bound=None):
    from foxlm.ops import forgetting_attention
    from foxlm.parallel import cp_forgetting_attention, gather_sequence, record_traffic, shard_sequence

    T = L * world * (2 if layout == "zigzag" else 1)
    q, k, v, log_f, do = _inputs(B, T, Hq, Hk, D, Dv, dtype, seed, gate_bias)
    full = [t.clone().requires_grad_() for t in (q, k, v, log_f)]
    ref = forgetting_attention(*full, prune=prune, logit_bound=logit_bound)
    ref_grads = torch.autograd.grad((ref.float() * do.float()).sum(), full)
    local = [shard_sequence(t, dim=1, layout=layout).requires_grad_() for t in (q, k, v, log_f)]
    with record_traffic() as fwd:
        o = cp_forgetting_attention(*local, layout=layout, prune=prune, logit_bound=logit_bound)
    with record_traffic() as bwd:
        grads = torch.autograd.grad((o.float() * shard_sequence(do, dim=1, layout=layout).float()).sum(), local)
    case = f"{layout} P={world} {dtype} prune={prune}"
    assert o.dtype == dtype and o.shape == (B, T // world, Hq, Dv)
    torch.testing.assert_close(o, shard_sequence(ref, dim=1, layout=layout), rtol=tol, atol=tol, msg=case)
    torch.testing.assert_close(gather_sequence(o.detach(), dim=1, layout=layout), ref.detach(), rtol=tol, atol=tol)
    for name, got, want in zip(("dq", "dk", "dv", "dlog_f"), grads, ref_grads):
        torch.testing.assert_close(got, shard_sequence(want, dim=1, layout=layout), rtol=tol, atol=tol,
                                   msg=f"{case}: {name}")
    return fwd, bwd


def _worker(rank: int, world: int, init: str, body: str) -> None:
    from foxlm.ops import use_backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        with use_backend("torch"):  # the reference: the single-process op's CPU path
            globals()[body](rank, world)
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, world: int, body: str) -> None:
    # forkserver, not fork: where CUDA is present, a process that has run a backward has started autograd's device
    # threads, and autograd refuses to run in a child forked from it ("Unable to handle autograd's threading in
    # combination with fork-based multiprocessing"); the server is a fresh process that imports torch and foxlm
    # once (seconds each under spawn), and the workers fork from it. One intra-op thread in each worker.
    # A deadline: a rank left waiting in a collective fails the test instead of hanging it.
    mp.get_context("forkserver").set_forkserver_preload(["torch", "foxlm.parallel", "foxlm.models"])
    ctx = mp.start_processes(_worker, args=(world, str(tmp_path / "rendezvous"), body), nprocs=world, join=False,
                             start_method="forkserver")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"{body}: the {world} processes did not finish within {TIMEOUT_S} s")


def _exact(rank, world):
    """Outputs and all four gradients equal the single-process op's: both layouts, GQA and MHA, low precision."""
    from foxlm.ops.forgetting_attention import sdpa as sdpa_path

    for layout in ("zigzag", "contiguous"):
        _check(layout, world)
        _check(layout, world, Hq=2, Hk=2, D=8, Dv=16, L=5, seed=1)
    _check("zigzag", world, dtype=torch.float32, seed=2, tol=1e-4)
    sdpa_path.CHUNK_ROWS = 16  # several query chunks per block (this forked worker's copy only)
    _check("zigzag", world, B=1, L=40, seed=5)
    _check("contiguous", world, dtype=torch.bfloat16, seed=3, tol=3e-2)


def _exact_fp64(rank, world):
    """In fp64 the shards' result is one process's to fp64's rounding, not fp32's: outputs and all four gradients
    within 1e-12 for both layouts, GQA, chunks of odd length (one token too) and ACP. The blocks' lse, rounded to
    fp32 before their merge, cost ~1e-8 where the one-process op is exact to ~1e-15."""
    for layout in ("zigzag", "contiguous"):
        _check(layout, world, tol=1e-12)
        _check(layout, world, Hq=4, Hk=1, D=8, Dv=16, L=5, seed=1, tol=1e-12)
        _check(layout, world, prune=True, gate_bias=(6.0, -4.0), seed=4, tol=1e-12)
        _check(layout, world, L=1, prune=True, gate_bias=(6.0, -8.0), seed=3, tol=1e-12)  # one token a chunk


def _half_precision(rank, world):
    """bf16 over a few hundred tokens: outputs and all four gradients, the gate's included, within 5e-3 of the fp64
    reference (what the peers' kernels reach), and as close to it as the one-process op on the same inputs: the merge
    of the blocks through their lse must carry the blocks' outputs unrounded, or the gate gradient's row sums pick up
    bf16's rounding along the sequence (a relative error of ~1e-3 where the op's is ~1e-6)."""
    from foxlm.ops import forgetting_attention
    from foxlm.ops.forgetting_attention.reference import forgetting_attention_reference
    from foxlm.parallel import cp_forgetting_attention, gather_sequence, shard_sequence

    for layout, prune in (("zigzag", False), ("contiguous", True)):
        B, T, Hq, Hk, D = 1, 64 * world * (2 if layout == "zigzag" else 1), 4, 2, 32
        q, k, v, _, do = _inputs(B, T, Hq, Hk, D, D, torch.bfloat16, seed=11)
        log_f = F.logsigmoid(2 * torch.randn(B, T, Hq, generator=torch.Generator().manual_seed(12)) + 2)
        full = [t.double().requires_grad_() for t in (q, k, v, log_f)]
        ref = forgetting_attention_reference(*full)
        ref_grads = torch.autograd.grad((ref * do.double()).sum(), full)
        local = [shard_sequence(t, dim=1, layout=layout).requires_grad_() for t in (q, k, v, log_f)]
        o = cp_forgetting_attention(*local, layout=layout, prune=prune)
        grads = torch.autograd.grad((o.double() * shard_sequence(do, dim=1, layout=layout).double()).sum(), local)
        one = [t.clone().requires_grad_() for t in (q, k, v, log_f)]
        o_one = forgetting_attention(*one, prune=prune)
        one_grads = torch.autograd.grad((o_one.double() * do.double()).sum(), one)
        for name, got, alone, want in zip(("o", "dq", "dk", "dv", "dlog_f"), (o, *grads), (o_one, *one_grads),
                                          (ref, *ref_grads)):
            got = gather_sequence(got.detach(), dim=1, layout=layout).double()
            err = ((got - want).norm() / want.norm()).item()
            assert err < 5e-3, f"{layout} prune={prune} {name}: relative error {err:.1e}"
            err_one = ((alone.detach().double() - want).norm() / want.norm()).item()
            assert err < 1.1 * err_one + 1e-5, f"{layout} prune={prune} {name}: relative error {err:.1e}, one " \
                                               f"process's {err_one:.1e}"


def _autocast_on_the_math_kernel(rank, world):
    """Off the CPU the blocks run on the plain-matmul kernel (run here on the CPU), and a GPU model trains under bf16
    autocast: its matmuls must not round the logits, which carry the gate channels, to bf16. They did: the outputs'
    error to the fp64 reference grew 2.5x and the gate gradient's to 5e-3 (3e-6 without autocast)."""
    from foxlm.ops.forgetting_attention import sdpa as sdpa_path
    from foxlm.ops.forgetting_attention.reference import forgetting_attention_reference
    from foxlm.parallel import cp_forgetting_attention, gather_sequence, shard_sequence

    sdpa_path._fused = lambda device: False  # the kernel GPU tensors take (this forked worker's copy only)
    T = 128 * world
    q, k, v, log_f, do = _inputs(1, T, 4, 2, 32, 32, torch.bfloat16, seed=11)
    full = [t.double().requires_grad_() for t in (q, k, v, log_f)]
    ref = forgetting_attention_reference(*full)
    ref_grads = torch.autograd.grad((ref * do.double()).sum(), full)
    errors = {}
    for autocast in (False, True):
        local = [shard_sequence(t, dim=1).requires_grad_() for t in (q, k, v, log_f)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o = cp_forgetting_attention(*local)
        grads = torch.autograd.grad((o.double() * shard_sequence(do, dim=1).double()).sum(), local)
        for name, got, want in zip(("o", "dq", "dk", "dv", "dlog_f"), (o, *grads), (ref, *ref_grads)):
            got = gather_sequence(got.detach(), dim=1).double()
            errors[name, autocast] = ((got - want).norm() / want.norm()).item()
    for name in ("o", "dq", "dk", "dv", "dlog_f"):
        assert errors[name, True] < 1.1 * errors[name, False] + 1e-5, (name, errors)


def _hard_resets(rank, world):
    """Gates far below the op's floor (-1e12, fp32's min: finite, so the gate check lets them through), one of them at
    a shard's first token: the output and all four gradients are those of the fp64 reference cut into sequences at
    the resets (where a sequence's first gate is unused: 0 there). An fp64 c of 1e12 keeps no usable differences,
    so the blocks' c must be summed from the floored gates, as the single-process op sums them."""
    from foxlm.ops.forgetting_attention.reference import forgetting_attention_reference
    from foxlm.parallel import cp_forgetting_attention, gather_sequence, shard_sequence

    for layout, prune, reset in (("zigzag", False, -1.0e12), ("contiguous", True, torch.finfo(torch.float32).min)):
        B, T = 1, 16 * world * (2 if layout == "zigzag" else 1)
        q, k, v, log_f, do = _inputs(B, T, 2, 1, 8, 8, torch.float64, seed=21)
        resets = [3, 16, T - 5]  # 16: the first token of a shard in both layouts
        log_f[:, resets] = reset
        local = [shard_sequence(t, dim=1, layout=layout).requires_grad_() for t in (q, k, v, log_f)]
        o = cp_forgetting_attention(*local, layout=layout, prune=prune)
        grads = torch.autograd.grad((o * shard_sequence(do, dim=1, layout=layout)).sum(), local)
        full = [t.clone().requires_grad_() for t in (q, k, v, log_f)]
        opened = torch.where(torch.isin(torch.arange(T), torch.tensor(resets))[None, :, None], 0.0, full[3])
        cut = torch.tensor(sorted({0, T, *resets}), dtype=torch.int32)
        ref = forgetting_attention_reference(*full[:3], opened, cu_seqlens=cut)
        ref_grads = torch.autograd.grad((ref * do).sum(), full)
        for name, got, want in zip(("o", "dq", "dk", "dv", "dlog_f"), (o, *grads), (ref, *ref_grads)):
            got = gather_sequence(got.detach(), dim=1, layout=layout)
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6, msg=f"{layout} prune={prune} {name}")


def _acp(rank, world):
    """ACP on a gate profile where KV head 1's query heads forget fast and KV head 0's remember: the pruned op
    equals the single-process pruned op, the skipped chunks are really not sent (the P2P counters, summed over
    the ranks, match the plan's bytes), and nothing is skipped for the remembering heads."""
    from foxlm.parallel import cp_acp_stats, shard_sequence

    bias = (6.0, 6.0, -4.0, -4.0)
    for layout in ("contiguous", "zigzag"):
        sent = {}
        for prune in (False, True):
            fwd, bwd = _check(layout, world, prune=prune, gate_bias=bias, seed=4)
            counts = torch.tensor([fwd.sent_bytes, fwd.recv_bytes, bwd.sent_bytes], dtype=torch.float64)
            dist.all_reduce(counts)
            sent[prune] = counts
            # fp64: the backward receives the keys again and returns gradients of the same size
            assert counts[0] == counts[1] and counts[2] == 2 * counts[0], (layout, prune, counts)
        q, k, _, log_f, _ = _inputs(2, 8 * world * (2 if layout == "zigzag" else 1), 4, 2, 16, 8, torch.float64, 4,
                                    bias)
        stats = cp_acp_stats(*(shard_sequence(t, dim=1, layout=layout) for t in (q, k, log_f)), layout=layout,
                             value_dim=8)
        assert sent[False][0] == stats.bytes_total.sum()
        assert sent[True][0] == stats.bytes_total.sum() - stats.bytes_skipped.sum()
        assert stats.bytes_skipped[0] == 0 and stats.bytes_skipped[1] > 0, stats
        assert stats.flops_skipped[:2].eq(0).all() and stats.flops_skipped[2:].gt(0).all(), stats
        assert (stats.flops_fraction < 1).all()
    fwd, _ = _check("zigzag", world, prune=True, gate_bias=bias, seed=5, logit_bound=2.0)  # a given U, as QK-norm's
    given = torch.tensor([fwd.sent_bytes], dtype=torch.float64)
    dist.all_reduce(given)
    assert given[0] < sent[True][0]  # U = 2 is below the data's bound: more is skipped


def _halo(rank, world):
    """FoX Pro's token shift on the shards, each chunk given the token before it by ``previous_tokens``, is the
    shift of the whole sequence, gradients included; ``sequence_positions`` are the shard's global positions."""
    from foxlm.ops.token_shift import token_shift
    from foxlm.parallel import gather_sequence, previous_tokens, sequence_positions, shard_sequence

    g = torch.Generator().manual_seed(7)
    B, H, D, L = 2, 3, 4, 3
    for layout in ("zigzag", "contiguous"):
        per = 2 if layout == "zigzag" else 1
        T = L * per * world
        x, alpha = torch.randn(B, T, H, D, generator=g, dtype=torch.float64), torch.randn(B, T, H, generator=g)
        dy = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
        full = [x.clone().requires_grad_(), alpha.clone().requires_grad_()]
        ref = token_shift(*full)
        ref_grads = torch.autograd.grad((ref * dy).sum(), full)
        local = [shard_sequence(t, dim=1, layout=layout).requires_grad_() for t in (x, alpha)]
        prev = previous_tokens(local[0], layout=layout)
        y = torch.cat([token_shift(local[0][:, a * L:(a + 1) * L], local[1][:, a * L:(a + 1) * L], prev=prev[a])
                       for a in range(per)], dim=1)
        torch.testing.assert_close(y, shard_sequence(ref, dim=1, layout=layout), rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad((y * shard_sequence(dy, dim=1, layout=layout)).sum(), local)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, shard_sequence(want, dim=1, layout=layout), rtol=1e-12, atol=1e-12)
        assert torch.equal(sequence_positions(T // world, layout=layout),
                           shard_sequence(torch.arange(T), dim=0, layout=layout))
        # gather_sequence takes any tensor, not only attention's float dtypes: token ids and masks came back as
        # "tuple.index(x): x not in tuple"
        for whole in (torch.randint(0, 97, (B, T), generator=g), torch.rand(B, T, generator=g) < 0.5):
            assert torch.equal(gather_sequence(shard_sequence(whole, dim=1, layout=layout), dim=1, layout=layout),
                               whole)


def _double_backward(rank, world):
    """A gradient penalty differentiates cp_forgetting_attention's and previous_tokens' backward, which have no
    derivative (detached block gradients, received buffers): their gradients came back without a graph, or with
    only part of it, and the penalty silently lost its dependence on the inputs. They must raise on every rank,
    first order unchanged."""
    from foxlm.parallel import cp_forgetting_attention, shard_sequence

    q, k, v, log_f, _ = _inputs(1, 4 * world, 2, 2, 8, 8, torch.float64, 0)
    local = [shard_sequence(t, dim=1).requires_grad_() for t in (q, k, v, log_f)]
    o = cp_forgetting_attention(*local)
    grads = torch.autograd.grad(o.sum(), local, create_graph=True)
    for got, want in zip(grads, torch.autograd.grad(cp_forgetting_attention(*local).sum(), local)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="cp_forgetting_attention: cannot differentiate twice"):
        (o.sum() + sum(g.square().sum() for g in grads)).backward()

    from foxlm.parallel import previous_tokens

    # previous_tokens' backward adds the gradients other ranks send, which come without a graph: a penalty lost
    # their dependence on x (the local ones kept theirs, so nothing raised)
    for layout in ("zigzag", "contiguous"):
        x = shard_sequence(torch.randn(2, 4 * world, 3, dtype=torch.float64), dim=1, layout=layout).requires_grad_()
        prev = previous_tokens(x, layout=layout)
        (dx,) = torch.autograd.grad(prev.square().sum(), x, create_graph=True)
        (want,) = torch.autograd.grad(previous_tokens(x, layout=layout).square().sum(), x)
        torch.testing.assert_close(dx, want, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="previous_tokens: cannot differentiate twice"):
            (prev.sum() + dx.square().sum()).backward()


def _acp_settings_differ(rank, world):
    """ACP's settings that differ between the ranks (a logit bound each rank takes from its own shard, a tolerance or a
    scale): each rank planned the chunk pairs it skips from its own threshold, so a rank waited for keys that their
    owner had pruned (3 contiguous ranks: rank 2 wanted chunk 0, rank 0 did not send it) and hung, while the others
    returned. An error naming the setting on every rank; the same bound on every rank runs."""
    from foxlm.parallel import cp_forgetting_attention, shard_sequence

    q, k, v, log_f, _ = _inputs(1, 16 * world, 2, 2, 8, 8, torch.float64, seed=0, gate_bias=(-4.0,))
    local = [shard_sequence(t, dim=1, layout="contiguous") for t in (q, k, v, log_f)]
    own = 0.5 * local[0].norm(dim=-1).amax() * local[1].norm(dim=-1).amax()  # U from this rank's shard alone
    same = "expected the same on every rank of the context-parallel group, got rank 0: "
    for kwargs, match in (({"logit_bound": 0.0 if rank == 0 else 50.0}, rf"logit_bound: {same}0\.0, rank 1: 50\.0, "
                                                                         rf"rank 2: 50\.0$"),
                          ({"logit_bound": own}, f"logit_bound: {same}a tensor"),
                          ({"tolerance": 0.1 if rank == 0 else 0.01}, rf"tolerance: {same}0\.1, rank 1: 0\.01"),
                          ({"scale": 0.5 if rank == 0 else 0.25}, rf"scale: {same}0\.5, rank 1: 0\.25")):
        with pytest.raises(ValueError, match=f"^{match}"):
            cp_forgetting_attention(*local, layout="contiguous", prune=True, **kwargs)
    bound = torch.tensor(own.item())
    dist.broadcast(bound, 0)  # one bound for all: runs
    assert cp_forgetting_attention(*local, layout="contiguous", prune=True, logit_bound=bound).isfinite().all()


def _layouts_differ(rank, world):
    """Ranks that disagree on the layout (one zigzag, one contiguous), each a shard of the same length: the token
    shift's exchange waited for a token no rank sent (a hang, previous_tokens' own check and a model's alike), and
    gather_sequence gave each rank another whole sequence. An error naming the layout on every rank."""
    from foxlm.models import FoxConfig, FoxForCausalLM
    from foxlm.parallel import apply_context_parallel, gather_sequence, previous_tokens

    layout = "zigzag" if rank == 0 else "contiguous"
    match = "^layout: expected the same on every rank of the context-parallel group, got rank 0: 'zigzag', " \
            "rank 1: 'contiguous'$"
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        previous_tokens(x, layout=layout)
    with pytest.raises(ValueError, match=match):
        gather_sequence(x, dim=1, layout=layout)
    torch.manual_seed(0)
    config = FoxConfig.preset("fox-pro", "tiny", vocab_size=97, hidden_size=32, num_hidden_layers=1,
                              num_attention_heads=2, intermediate_size=64)
    model = apply_context_parallel(FoxForCausalLM(config).double(), layout=layout)
    with pytest.raises(ValueError, match=match):
        model(torch.zeros(2, 4, dtype=torch.long))


def _values_out_of_range_on_one_rank(rank, world):
    """An id or a target outside the vocabulary in one rank's shard only: that rank raised (the embedding's IndexError,
    the labels' check) and the others waited in the next collective, a hang. An error naming it on every rank; where
    every shard's are out of range, each rank's own error."""
    from foxlm.models import FoxConfig, FoxForCausalLM
    from foxlm.parallel import apply_context_parallel

    torch.manual_seed(0)
    config = FoxConfig.preset("fox-pro", "tiny", vocab_size=97, hidden_size=32, num_hidden_layers=1,
                              num_attention_heads=2, intermediate_size=64)
    model = apply_context_parallel(FoxForCausalLM(config).double())
    ids = torch.randint(0, 97, (2, 4))
    with pytest.raises(ValueError, match=r"^input_ids within \[0, 97\): expected the same on every rank of the "
                                         r"context-parallel group, got rank 0: True, rank 1: False$"):
        model(ids if rank == 0 else torch.full_like(ids, 97))
    bad = ids.clone()
    bad[0, 1] = 200 if rank == 0 else -100  # -100 is ignored: in range
    with pytest.raises(ValueError, match=r"^shift_labels within \[0, 97\): expected the same on every rank .*, got "
                                         r"rank 0: False, rank 1: True$"):
        model(ids, shift_labels=bad)
    with pytest.raises(ValueError, match=r"^shift_labels: expected values in \[0, 97\)"):
        model(ids, shift_labels=ids + 200)
    assert model(ids, shift_labels=bad if rank == 1 else ids).loss.isfinite()


def _errors(rank, world):
    from foxlm.parallel import (
        cp_forgetting_attention,
        gather_sequence,
        previous_tokens,
        sequence_positions,
        shard_sequence,
    )

    x = torch.randn(1, 6, 2, 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_sequence(x, dim=1)  # zigzag over 2 ranks: 4 chunks
    with pytest.raises(ValueError, match="layout"):
        shard_sequence(x, dim=1, layout="striped")
    with pytest.raises(ValueError, match="not differentiable"):
        gather_sequence(x.requires_grad_(), dim=1, layout="contiguous")
    q = torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match="T/P=3 must be a multiple of 2"):
        cp_forgetting_attention(q, q, q, torch.full((1, 3, 2), -0.1))
    with pytest.raises(ValueError, match="log_fgate"):
        cp_forgetting_attention(q, q, q, torch.full((1, 3, 2), 0.5), layout="contiguous")
    # shards of different lengths on the ranks: an error on every rank, not an abort in gloo on one rank and a
    # wrong output on the other
    q = torch.randn(1, 4 + 2 * rank, 2, 4)
    with pytest.raises(ValueError, match=r"q.shape: expected the same on every rank .* rank 0: \(1, 4, 2, 4\), "
                                         r"rank 1: \(1, 6, 2, 4\)"):
        cp_forgetting_attention(q, q, q, torch.full(q.shape[:3], -0.1))
    # gathering shards of different lengths (or dtypes): the same error on every rank; gloo aborted one process and
    # gave the other a wrong sequence
    with pytest.raises(ValueError, match=r"x_local.shape: expected the same on every rank .* rank 0: \(1, 4, 2, 4\), "
                                         r"rank 1: \(1, 6, 2, 4\)"):
        gather_sequence(q, dim=1)
    with pytest.raises(ValueError, match=r"x_local.dtype: expected the same on every rank"):
        gather_sequence(q[:, :4].to(torch.float64 if rank else torch.float32), dim=1)
    # previous_tokens too: chunks of different lengths exchanged their tokens and gave both ranks a wrong result
    with pytest.raises(ValueError, match=r"x_local.shape: expected the same on every rank .* rank 0: \(1, 4, 2, 4\), "
                                         r"rank 1: \(1, 6, 2, 4\)"):
        previous_tokens(q)
    # a bad gate or a bad length on one rank only: an error on every rank, none left waiting in a collective
    with pytest.raises(ValueError, match=r"log_fgate finite and <= 0: expected the same on every rank"):
        cp_forgetting_attention(q[:, :4], q[:, :4], q[:, :4], torch.full((1, 4, 2), -0.1 if rank else float("nan")))
    with pytest.raises(ValueError, match=r"q.shape: expected the same on every rank .* rank 0: \(1, 3, 2, 4\)"):
        cp_forgetting_attention(q[:, :3 + rank], q[:, :3 + rank], q[:, :3 + rank], torch.full((1, 3 + rank, 2), -0.1))
    with pytest.raises(ValueError, match="prune: expected the same on every rank"):
        cp_forgetting_attention(q[:, :4], q[:, :4], q[:, :4], torch.full((1, 4, 2), -0.1), prune=rank == 0)
    # a layer called with a token shift's resets: refused by name, not dropped (the shift crossed them)
    from foxlm.layers import TokenShift
    from foxlm.parallel import ContextParallelAttention
    from foxlm.parallel.layout import ContextParallel

    backend = ContextParallelAttention(ContextParallel(), torch.nn.Identity())
    ks, h = torch.randn(1, 4, 2, 4), torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="^reset: not available while the model runs context-parallel"):
        backend.shift(TokenShift(8, 2), ks, h, reset=torch.ones(1, 4, dtype=torch.bool), cache=None, valid=None,
                      layer_idx=0, name="k")
    # a DeviceMesh (apply_context_parallel's group may be one) or another object: refused by the argument's name,
    # not torch's "Group ... is not registered, please create group with torch.distributed.new_group API"
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for bad, shown in ((mesh, r"DeviceMesh \(a 1-D mesh's is mesh.get_group\(\)\)"), ("cp", "str")):
        for call in (lambda: sequence_positions(4, group=bad), lambda: previous_tokens(x, group=bad),
                     lambda: shard_sequence(x, dim=1, group=bad),
                     lambda: gather_sequence(x[:, :4], dim=1, group=bad),
                     lambda: cp_forgetting_attention(q[:, :4], q[:, :4], q[:, :4], torch.full((1, 4, 2), -0.1),
                                                     group=bad)):
            with pytest.raises(ValueError, match=f"^group: expected a ProcessGroup or None, got {shown}$"):
                call()
    # a process outside the group: torch.distributed gives it rank -1, which made wrong positions and tokens
    outside = dist.new_group([1])
    if rank == 0:
        for call in (lambda: sequence_positions(4, group=outside), lambda: previous_tokens(x, group=outside),
                     lambda: shard_sequence(x, dim=1, group=outside),
                     lambda: cp_forgetting_attention(q, q, q, torch.full(q.shape[:3], -0.1), group=outside)):
            with pytest.raises(ValueError, match=r"group: this process \(rank 0 of the world\) is not a member"):
                call()


def _model(rank, world):
    """A tiny FoxForCausalLM run context-parallel on the shards (FoX Pro's token shift and QK-norm, ACP; a RoPE
    baseline) gives the whole sequence's per-token losses and every parameter's gradient, summed over the ranks;
    what a shard cannot do is refused by name."""
    from foxlm.layers import AttentionBackend
    from foxlm.models import FoxConfig, FoxForCausalLM
    from foxlm.parallel import ContextParallelAttention, apply_context_parallel, remove_context_parallel, shard_sequence

    cases = [("fox-pro", {"acp": True, "num_key_value_heads": 1}, "zigzag"), ("transformer-pro", {}, "contiguous")]
    for seed, (arch, extra, layout) in enumerate(cases):
        torch.manual_seed(seed)
        config = FoxConfig.preset(arch, "tiny", vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, **extra)
        model = FoxForCausalLM(config).double()
        ids = torch.randint(0, 97, (2, 8 * world), generator=torch.Generator().manual_seed(seed))
        ref = model(ids, labels=ids, return_per_token_loss=True)
        ref_grads = torch.autograd.grad(ref.per_token_loss.sum(), list(model.parameters()))
        targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        assert apply_context_parallel(model, layout=layout) is model
        out = model(shard_sequence(ids, dim=1, layout=layout), shift_labels=shard_sequence(targets, dim=1,
                    layout=layout), return_per_token_loss=True)
        want = shard_sequence(F.pad(ref.per_token_loss.detach(), (0, 1)), dim=1, layout=layout)
        # fp64 throughout, as one process: the blocks' lse rounded to fp32 before their merge cost ~1e-7 here
        torch.testing.assert_close(out.per_token_loss, want, rtol=1e-12, atol=1e-12, msg=arch)
        grads = torch.autograd.grad(out.per_token_loss.sum(), list(model.parameters()))
        for (name, _), got, expected in zip(model.named_parameters(), grads, ref_grads):
            got = got.clone()
            dist.all_reduce(got)
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12 * float(expected.abs().max()),
                                       msg=f"{arch}: {name}")
    # labels ignored unevenly over the shards: .loss is the whole rows' mean on every rank, and the gradients
    # averaged over the ranks (as DDP / FSDP2 do) are one process's; with num_items_in_batch, HF's sum over it
    labels = ids.clone()
    labels[0, :5 * world] = -100
    remove_context_parallel(model)
    ref = model(ids, labels=labels)
    ref_grads = torch.autograd.grad(ref.loss, list(model.parameters()))
    apply_context_parallel(model, layout=layout)
    shift = shard_sequence(torch.cat([labels[:, 1:], torch.full_like(ids[:, :1], -100)], 1), dim=1, layout=layout)
    count = int((labels[:, 1:] != -100).sum())
    for kwargs, reduce in (({}, world), ({"num_items_in_batch": count}, 1)):
        out = model(shard_sequence(ids, dim=1, layout=layout), shift_labels=shift, **kwargs)
        value = out.loss.detach().clone()
        dist.all_reduce(value)
        torch.testing.assert_close(value / reduce, ref.loss.detach(), rtol=1e-9, atol=1e-9, msg=str(kwargs))
        for got, expected in zip(torch.autograd.grad(out.loss, list(model.parameters())), ref_grads):
            got = got.clone()
            dist.all_reduce(got)
            torch.testing.assert_close(got / reduce, expected, rtol=1e-10,
                                       atol=1e-12 * float(expected.abs().max()))
    # packed documents marked by restarting position_ids (padding-free batches) would be crossed: refused, on
    # every rank even where only one rank's shard holds a restart
    pos = shard_sequence(torch.arange(8 * world), dim=0, layout=layout)
    with pytest.raises(ValueError, match="position_ids: under context parallelism expected the shard's positions"):
        model(shard_sequence(ids, dim=1, layout=layout), position_ids=pos % 4)
    model(shard_sequence(ids, dim=1, layout=layout), position_ids=pos)  # the shard's own positions are fine
    with pytest.raises(ValueError, match=r"position_ids are the shard's: expected the same on every rank"):
        model(shard_sequence(ids, dim=1, layout=layout), position_ids=pos if rank else pos * 0)
    with pytest.raises(ValueError, match="labels: a context-parallel shard"):
        model(ids[:, :8], labels=ids[:, :8])
    with pytest.raises(ValueError, match="cu_seqlens / attention_mask: not available"):
        model(ids[:, :8], attention_mask=torch.ones(2, 8).index_fill_(1, torch.tensor([0]), 0))
    # a right-padded batch's mask, sharded: only the rank holding the last chunk sees padding. It raised alone, and
    # left the other ranks in the shards' comparison (gloo: "Connection closed by peer"; NCCL: a hang)
    mask = torch.ones(2, 8 * world, dtype=torch.long)
    mask[1, -3:] = 0
    with pytest.raises(ValueError, match=r"cu_seqlens / attention_mask with padding: expected the same on every "
                                         r"rank .* rank 0: False, rank 1: True"):  # contiguous: rank 1's last
        model(shard_sequence(ids, dim=1, layout=layout), attention_mask=shard_sequence(mask, dim=1, layout=layout))
    with pytest.raises(ValueError, match="window: not available"):
        model.model.layers[0].attn.window = 4
        model(ids[:, :8], shift_labels=ids[:, :8])
    model.model.layers[0].attn.window = None
    # a shard the layout cannot split, and shards whose shapes differ between the ranks, by the input's name
    apply_context_parallel(model)  # zigzag
    with pytest.raises(ValueError, match="input_ids: a zigzag shard holds 2 equal chunks, so its length 3 must"):
        model(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="inputs_embeds: a zigzag shard"):
        model(inputs_embeds=torch.zeros(1, 3, 32, dtype=torch.float64), position_ids=torch.arange(3)[None])
    with pytest.raises(ValueError, match=r"input_ids.shape: expected the same on every rank .* rank 0: \(1, 4\), "
                                         r"rank 1: \(2, 4\)"):
        model(torch.zeros(1 + rank, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids.shape: expected the same on every rank .* rank 0: \(1, 3\)"):
        model(torch.zeros(1, 3 + rank, dtype=torch.long))  # a bad length on one rank: no rank waits for it
    with pytest.raises(ValueError, match="group: expected a ProcessGroup, a 1-D DeviceMesh or None, got int"):
        apply_context_parallel(model, 0)
    # the ranks compare their shards once a forward, not once a layer: each comparison is a collective and a host
    # sync, which would stall the device queue at every layer (a GPU model syncs only where ACP plans its blocks)
    from foxlm.parallel import attention as attention_module
    from foxlm.parallel import layout as layout_module

    compared = []

    def counted(group, device, fields, compare=layout_module.check_same_on_ranks):
        compared.append(sorted(fields))
        return compare(group, device, fields)

    layout_module.check_same_on_ranks = attention_module.check_same_on_ranks = counted
    try:
        model(shard_sequence(ids, dim=1), labels=None)
    finally:
        layout_module.check_same_on_ranks = attention_module.check_same_on_ranks = counted.__defaults__[0]
    assert compared == [["cu_seqlens / attention_mask with padding", "input_ids.shape", "layout",
                         "position_ids are the shard's"]], compared
    backends = [block.attn.attention_backend for block in model.model.layers]
    assert all(isinstance(b, ContextParallelAttention) for b in backends)
    remove_context_parallel(model)
    assert all(type(block.attn.attention_backend) is AttentionBackend for block in model.model.layers)
    model(ids, labels=ids)


def _model_loss(rank, world):
    """The model on more ranks than two (each zigzag shard's chunks then border other ranks' on both sides): with
    labels ignored unevenly over the shards and chunks of 3 tokens, .loss on every rank and the parameters' gradients
    averaged over the ranks (as DDP / FSDP2 average them) are one process's, to fp64's rounding."""
    from foxlm.models import FoxConfig, FoxForCausalLM
    from foxlm.parallel import apply_context_parallel, remove_context_parallel, shard_sequence

    cases = [("fox-pro", {"acp": True, "num_attention_heads": 4, "num_key_value_heads": 2}, "zigzag"),
             ("transformer-llama", {}, "contiguous")]
    for seed, (arch, extra, layout) in enumerate(cases):
        torch.manual_seed(seed)
        config = FoxConfig.preset(arch, "tiny", **{"vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2,
                                                   "num_attention_heads": 2, "intermediate_size": 64, **extra})
        model = FoxForCausalLM(config).double()
        T = 3 * world * (2 if layout == "zigzag" else 1)
        ids = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(seed))
        labels = ids.clone()
        labels[1, :T // 2 + 1] = -100
        ref = model(ids, labels=labels)
        ref_grads = torch.autograd.grad(ref.loss, list(model.parameters()))
        targets = torch.cat([labels[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        apply_context_parallel(model, layout=layout)
        try:
            out = model(shard_sequence(ids, dim=1, layout=layout),
                        shift_labels=shard_sequence(targets, dim=1, layout=layout))
            grads = torch.autograd.grad(out.loss, list(model.parameters()))
        finally:
            remove_context_parallel(model)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12, msg=arch)
        for (name, _), got, expected in zip(model.named_parameters(), grads, ref_grads):
            got = got.clone()
            dist.all_reduce(got)
            torch.testing.assert_close(got / world, expected, rtol=1e-10, atol=1e-12 * float(expected.abs().max()),
                                       msg=f"{arch}: {name}")


def _acp_share(rank, world):
    """The ACP share ``probe_acp`` records (what validation logs as val_acp_skipped) is the same number under
    context parallelism as in one process, for both layouts: one definition, the share of the whole sequence's
    causal attention tiles."""
    from foxlm.layers.attention import ForgettingAttention
    from foxlm.models import FoxConfig, FoxForCausalLM
    from foxlm.parallel import apply_context_parallel, remove_context_parallel, shard_sequence

    torch.manual_seed(0)
    config = FoxConfig.preset("fox-pro", "tiny", vocab_size=97, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=64)
    model = FoxForCausalLM(config).double()
    for proj in (m.fgate_proj for m in model.modules() if isinstance(m, ForgettingAttention)):
        proj.bias.data = torch.tensor([-4.0, 3.0], dtype=torch.float64)  # a head forgetting within a few tokens
    ids = torch.randint(0, 97, (2, 32 * world), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), model.probe_acp(block_m=8, block_n=4) as one:
        model(ids)
    for layout in ("zigzag", "contiguous"):
        apply_context_parallel(model, layout=layout)
        with torch.no_grad(), model.probe_acp(block_m=8, block_n=4) as cp:
            model(shard_sequence(ids, dim=1, layout=layout))
        remove_context_parallel(model)
        assert 0 < float(one.per_head().mean()) < 1, one.per_head()
        torch.testing.assert_close(cp.per_head(), one.per_head(), rtol=0, atol=1e-6, msg=layout)


def _sample_keeps_cp(rank, world):
    """The trainer's sample decodes whole sequences, so it takes context parallelism off the model: it must put it
    back, or a run that samples and trains on (its loader still gives shards) takes each shard for a whole sequence,
    with no error and a wrong loss."""
    from foxlm.models import FoxConfig, FoxForCausalLM
    from foxlm.parallel import apply_context_parallel, shard_sequence
    from foxlm.train.evaluation import sample

    torch.manual_seed(0)
    config = FoxConfig.preset("fox-pro", "tiny", vocab_size=97, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=64)
    model = FoxForCausalLM(config).double()
    ids = torch.randint(0, 97, (1, 8 * world), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    ref = model(ids, labels=ids).loss
    apply_context_parallel(model)
    shards = dict(input_ids=shard_sequence(ids, dim=1), shift_labels=shard_sequence(targets, dim=1))
    # the token shift computes in fp32, so its rounding is the limit
    torch.testing.assert_close(model(**shards).loss, ref, rtol=1e-6, atol=1e-6)
    assert len(sample(model, [1, 2, 3], 2, 0, torch.device("cpu"), False, 0, False)) == 4
    assert model.training
    torch.testing.assert_close(model(**shards).loss, ref, rtol=1e-6, atol=1e-6)


def test_two_processes_sample_keeps_context_parallel(tmp_path):
    _spawn(tmp_path, 2, "_sample_keeps_cp")


def test_two_processes_acp_share_is_that_of_one(tmp_path):
    _spawn(tmp_path, 2, "_acp_share")


def test_two_processes_model(tmp_path):
    _spawn(tmp_path, 2, "_model")


def test_four_processes_model(tmp_path):
    _spawn(tmp_path, 4, "_model_loss")


def test_two_processes(tmp_path):
    _spawn(tmp_path, 2, "_exact")


def test_three_processes(tmp_path):
    """An odd number of ranks, both layouts: every step sends to one peer and receives from another (with an even P,
    step P / 2 sends to and receives from the same rank)."""
    _spawn(tmp_path, 3, "_exact")


def test_four_processes_exact_in_fp64(tmp_path):
    _spawn(tmp_path, 4, "_exact_fp64")


def test_two_processes_half_precision(tmp_path):
    _spawn(tmp_path, 2, "_half_precision")


def test_two_processes_autocast_on_the_math_kernel(tmp_path):
    _spawn(tmp_path, 2, "_autocast_on_the_math_kernel")


def test_two_processes_hard_resets(tmp_path):
    _spawn(tmp_path, 2, "_hard_resets")


def test_four_processes_acp_skips_sends(tmp_path):
    _spawn(tmp_path, 4, "_acp")


def test_four_processes_token_shift_and_positions(tmp_path):
    _spawn(tmp_path, 4, "_halo")


def test_errors_are_named(tmp_path):
    _spawn(tmp_path, 2, "_errors")


def test_two_processes_layouts_that_differ_are_named(tmp_path):
    _spawn(tmp_path, 2, "_layouts_differ")


def test_three_processes_acp_settings_that_differ_are_named(tmp_path):
    _spawn(tmp_path, 3, "_acp_settings_differ")


def test_two_processes_values_out_of_range_on_one_rank_are_named(tmp_path):
    _spawn(tmp_path, 2, "_values_out_of_range_on_one_rank")


def test_two_processes_double_backward_raises(tmp_path):
    _spawn(tmp_path, 2, "_double_backward")

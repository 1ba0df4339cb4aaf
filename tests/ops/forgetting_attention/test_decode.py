"""The decode kernel (Triton: compiled on a GPU, the interpreter on the CPU) and its PyTorch path against the fp64
oracle. Problems are built on the CPU (the oracle runs there) and the kernel's inputs moved to ``device``."""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from foxlm.ops import forgetting_attention_reference, forgetting_attention_with_kvcache, gate_cumsum, use_backend
from foxlm.ops.forgetting_attention.decode import decode_attention_torch, evictable_pages, forgetting_attention_decode

pytestmark = pytest.mark.usefixtures("one_thread")


def _to(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def _paged(k, v, c, lengths, page_size, extra_pages=3, gen=None):
    """Scatter contiguous k [B, T, Hk, D], v, c [B, T, Hq] into shuffled pages; unused slots hold NaN."""
    B, T, Hk, D = k.shape
    G = c.shape[-1] // Hk
    max_pages = math.ceil(T / page_size)
    num_pages = B * Hk * max_pages + extra_pages
    perm = torch.randperm(num_pages, generator=gen)
    page_table = torch.zeros(B, Hk, max_pages, dtype=torch.int32)
    k_cache = torch.full((num_pages, page_size, D), float("nan"), dtype=k.dtype)
    v_cache = torch.full((num_pages, page_size, v.shape[-1]), float("nan"), dtype=v.dtype)
    c_cache = torch.full((num_pages, page_size, G), float("nan"), dtype=torch.float64)
    i = 0
    for b in range(B):
        for h in range(Hk):
            for p in range(math.ceil(int(lengths[b]) / page_size)):
                page = int(perm[i])
                i += 1
                page_table[b, h, p] = page
                a, e = p * page_size, min((p + 1) * page_size, int(lengths[b]))
                k_cache[page, : e - a] = k[b, a:e, h]
                v_cache[page, : e - a] = v[b, a:e, h]
                c_cache[page, : e - a] = c[b, a:e, h * G:(h + 1) * G]
    return k_cache, v_cache, c_cache, page_table


def _problem(B, T, Hq, Hk, D, Dv, dtype, gen, gate_scale=1.0):
    q = torch.randn(B, 4, Hq, D, generator=gen).to(dtype)
    k = torch.randn(B, T, Hk, D, generator=gen).to(dtype)
    v = torch.randn(B, T, Hk, Dv, generator=gen).to(dtype)
    log_fgate = F.logsigmoid(3.0 + gate_scale * torch.randn(B, T, Hq, generator=gen))
    return q, k, v, log_fgate


def _oracle(q, k, v, log_fgate, lengths, first_key, scale):
    """Per sequence: the fp64 reference on keys [first_key, length) (evicted prefix dropped)."""
    out = []
    for b in range(q.shape[0]):
        L = int(lengths[b])
        f = int(first_key[b])
        out.append(forgetting_attention_reference(
            q[b:b + 1].double(), k[b:b + 1, f:L].double(), v[b:b + 1, f:L].double(),
            log_fgate[b:b + 1, f:L].double(), scale=scale,
        ))
    return torch.cat(out)


@pytest.mark.triton
@pytest.mark.parametrize("tq, group, dtype", [(1, 1, torch.float32), (3, 2, torch.float32), (2, 3, torch.bfloat16)])
def test_decode_matches_reference(small_tiles, tq, group, dtype, device):
    gen = torch.Generator().manual_seed(100 + tq + group)
    B, T, Hk, D, Dv, page = 3, 100, 2, 24, 40, 16
    q, k, v, log_fgate = _problem(B, T, Hk * group, Hk, D, Dv, dtype, gen)
    q = q[:, :tq]
    lengths = torch.tensor([100, 37, 71], dtype=torch.int32)
    c = gate_cumsum(log_fgate) - 1e4  # a large offset: only differences matter, and fp64 keeps them
    kc, vc, cc, pt = _paged(k, v, c, lengths, page, gen=gen)
    start = torch.zeros(B, Hk, dtype=torch.int32)
    ref = _oracle(q, k, v, log_fgate, lengths, [0] * B, D ** -0.5)  # fp64
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    inputs = _to(device, q, kc, vc, cc, pt, start, lengths)
    for splits in (1, 4):
        o, lse = forgetting_attention_decode(*inputs, num_splits=splits, return_lse=True)
        assert o.dtype == dtype and not o.isnan().any()
        err = (o.double().cpu() - ref).norm() / ref.norm()
        assert err < tol, (splits, err)
    o2 = forgetting_attention_decode(*inputs, num_splits=4)
    assert torch.equal(o, o2)  # deterministic combine
    # The PyTorch path in fp64 is exact.
    o64, lse64 = decode_attention_torch(q.double(), kc.double(), vc.double(), cc, pt, start, lengths, D ** -0.5)
    assert (o64 - ref).abs().max() < 1e-10
    assert (lse.double().cpu() - lse64.double()).abs().max() < 1e-2


@pytest.mark.triton
@pytest.mark.parametrize("tq, window", [(2, None), (1, 30)])
def test_decode_skips_evicted_pages(small_tiles, tq, window, device):
    """Keys before cache_start (and outside the window) are never read: NaN there must not leak."""
    gen = torch.Generator().manual_seed(7)
    B, T, Hk, G, D, page = 2, 120, 2, 2, 16, 8
    q, k, v, log_fgate = _problem(B, T, Hk * G, Hk, D, D, torch.float32, gen)
    q = q[:, :tq]
    lengths = torch.tensor([120, 70], dtype=torch.int32)
    kc, vc, cc, pt = _paged(k, v, gate_cumsum(log_fgate), lengths, page, gen=gen)
    start = torch.tensor([[3, 5], [0, 2]], dtype=torch.int32)
    for b in range(B):
        for h in range(Hk):
            kc[pt[b, h, : start[b, h]].long()] = float("nan")
            vc[pt[b, h, : start[b, h]].long()] = float("nan")
    kernel = forgetting_attention_decode(*_to(device, q, kc, vc, cc, pt, start, lengths), window=window).cpu()
    for o in (kernel, decode_attention_torch(q, kc, vc, cc, pt, start, lengths, D ** -0.5, window=window)[0]):
        for b in range(B):
            for h in range(Hk):
                heads = slice(h * G, (h + 1) * G)
                first = int(start[b, h]) * page
                if window is not None:  # a single query: its window is a key range
                    first = max(first, int(lengths[b]) - window)
                ref = _oracle(q[b:b + 1, :, heads], k[b:b + 1, :, h:h + 1], v[b:b + 1, :, h:h + 1],
                              log_fgate[b:b + 1, :, heads], lengths[b:b + 1], [first], D ** -0.5)
                assert (o[b:b + 1, :, heads].double() - ref).abs().max() < 1e-4


@pytest.mark.triton
def test_eviction_within_tolerance(small_tiles, device):
    """QK-norm bound U: evicted keys change the output by at most the tolerance (times 2 max|v|)."""
    gen = torch.Generator().manual_seed(11)
    B, T, Hk, G, D, page, tol = 2, 256, 2, 2, 16, 8, math.exp(-3)
    Hq = Hk * G
    w_q, w_k = 0.5 + torch.rand(Hq, D, generator=gen), 0.5 + torch.rand(Hk, D, generator=gen)
    q = F.rms_norm(torch.randn(B, 1, Hq, D, generator=gen), (D,)) * w_q
    k = F.rms_norm(torch.randn(B, T, Hk, D, generator=gen), (D,)) * w_k
    v = torch.randn(B, T, Hk, D, generator=gen)
    # Heads of very different decay speed: the fast ones lose most of their cache.
    rate = torch.tensor([0.8, 0.3, 0.1, 0.01])
    log_fgate = -rate * torch.rand(B, T, Hq, generator=gen) * 2
    scale = D ** -0.5
    U = w_q.amax(-1) * w_k.amax(-1).repeat_interleave(G) * D * scale  # [Hq]
    lengths = torch.tensor([256, 200], dtype=torch.int32)
    kc, vc, cc, pt = _paged(k, v, gate_cumsum(log_fgate), lengths, page, gen=gen)
    start0 = torch.zeros(B, Hk, dtype=torch.int32)
    start = evictable_pages(cc, pt, start0, lengths, U, max_length=T, tolerance=tol)
    assert (start[:, 0] > 0).all() and (start[:, 1] < start[:, 0]).all()  # kv head 0 forgets faster
    # Every evicted key is past delta for all its query heads; the first kept page is not.
    delta = -(2 * U + math.log(T)) + math.log(tol)
    c = gate_cumsum(log_fgate)
    for b in range(B):
        t = int(lengths[b]) - 1
        for h in range(Hk):
            decay = c[b, t, h * G:(h + 1) * G] - c[b, : int(start[b, h]) * page, h * G:(h + 1) * G]
            assert (decay < delta[h * G:(h + 1) * G]).all()
            first_kept = c[b, t, h * G:(h + 1) * G] - c[b, int(start[b, h]) * page + page - 1, h * G:(h + 1) * G]
            assert not (first_kept < delta[h * G:(h + 1) * G]).all()
    # The evicted keys held some attention mass (fp64), less than the tolerance; the output moves by at most that.
    for b in range(B):
        L = int(lengths[b])
        kb = k[b, :L].double().repeat_interleave(G, dim=1)  # [L, Hq, D]
        logits = scale * torch.einsum("hd,lhd->hl", q[b, 0].double(), kb) + (c[b, L - 1, :, None] - c[b, :L].T)
        first = (start[b] * page).repeat_interleave(G)  # [Hq]
        evicted = torch.arange(L)[None, :] < first[:, None]
        mass = (logits.softmax(-1) * evicted).sum(-1)
        assert (mass < tol).all() and (mass[:G] > 0).all(), mass  # kv head 0 lost keys
    full = _oracle(q, k, v, log_fgate, lengths, [0] * B, scale)
    kept = forgetting_attention_decode(*_to(device, q, kc, vc, cc, pt, start, lengths)).cpu()
    assert (kept.double() - full).abs().amax() <= 2 * tol * v.abs().max()
    # Re-running eviction from the new start changes nothing (idempotent).
    assert torch.equal(evictable_pages(cc, pt, start, lengths, U, max_length=T, tolerance=tol), start)


@pytest.mark.triton
def test_decode_default_tiles(device):
    """The kernel's default tiles, nothing patched, walk their key tiles; under TRITON_INTERPRET=1 too, where
    Triton 3.6's interpreter breaks on range() over run-time bounds with NumPy >= 2.4 (triton-lang/triton#9171)."""
    gen = torch.Generator().manual_seed(5)
    B, T, Hk, G, D, page = 1, 300, 1, 2, 16, 16  # 300 keys: three tiles of 128, the last one partial
    q, k, v, log_fgate = _problem(B, T, Hk * G, Hk, D, D, torch.float32, gen)
    q = q[:, :2]
    lengths = torch.tensor([T], dtype=torch.int32)
    kc, vc, cc, pt = _paged(k, v, gate_cumsum(log_fgate), lengths, page, gen=gen)
    start = torch.zeros(B, Hk, dtype=torch.int32)
    o = forgetting_attention_decode(*_to(device, q, kc, vc, cc, pt, start, lengths), num_splits=1).cpu()
    ref = _oracle(q, k, v, log_fgate, lengths, [0], D ** -0.5)
    assert (o.double() - ref).abs().max() < 1e-4


def test_decode_bad_input():
    q = torch.randn(1, 1, 4, 8)
    kc, vc = torch.randn(5, 4, 8), torch.randn(5, 4, 8)
    cc = torch.zeros(5, 4, 2, dtype=torch.float64)
    pt = torch.zeros(1, 2, 3, dtype=torch.int32)
    start, lengths = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    forgetting_attention_decode(q, kc, vc, cc, pt, start, lengths)
    with pytest.raises(ValueError, match="c_cache"):
        forgetting_attention_decode(q, kc, vc, cc.float(), pt, start, lengths)
    with pytest.raises(ValueError, match="page_table"):
        forgetting_attention_decode(q, kc, vc, cc, pt.long(), start, lengths)
    with pytest.raises(ValueError, match="k_cache"):
        forgetting_attention_decode(q, kc[..., :4], vc, cc, pt, start, lengths)
    with pytest.raises(ValueError, match="heads"):
        forgetting_attention_decode(q[:, :, :3], kc, vc, cc, pt, start, lengths)
    with pytest.raises(ValueError, match="lengths"):
        forgetting_attention_decode(q, kc, vc, cc, pt, start, lengths.long())
    # the kernel reads pages and lengths with stride 1: strided views read other entries (NaN pages, wrong lengths)
    with pytest.raises(ValueError, match="page_table"):
        forgetting_attention_decode(q, kc, vc, cc, pt.repeat_interleave(2, dim=2)[..., ::2], start, lengths)
    with pytest.raises(ValueError, match="lengths"):
        strided = torch.tensor([3, 0, 3, 0], dtype=torch.int32)[::2]
        forgetting_attention_decode(q.expand(2, -1, -1, -1), kc, vc, cc, pt.expand(2, -1, -1),
                                    start.expand(2, -1).contiguous(), strided)


@pytest.mark.parametrize("window", [0, -3, True, 2.5])
def test_decode_bad_window_names_the_argument(window):
    """A window that is not a positive int gets forgetting_attention's one-line error, not a Triton type error deep
    in the kernel's launch (bool, float) or, on the PyTorch path, a float window silently taken as one."""
    q = torch.randn(1, 1, 2, 8)
    kc, vc = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    cc = torch.zeros(2, 4, 2, dtype=torch.float64)
    pt = torch.zeros(1, 1, 2, dtype=torch.int32)
    start, lengths = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="window: expected a positive number of tokens"):
        forgetting_attention_decode(q, kc, vc, cc, pt, start, lengths, window=window)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors take the kernel only in Triton's interpreter"))])
@pytest.mark.parametrize("change, match", [
    (dict(num_splits=0), "num_splits: expected a positive int"),  # the kernel's rows were NaN
    (dict(num_splits=-1), "num_splits: expected a positive int"),
    (dict(num_splits=2.5), "num_splits: expected a positive int"),
    (dict(num_splits=True), "num_splits: expected a positive int"),
    (dict(scale=float("nan")), "scale: expected a finite number"),  # every row NaN
    (dict(scale=True), "scale: expected a finite number"),  # taken as 1.0
    (dict(scale="0.5"), "scale: expected a finite number"),
])
def test_decode_bad_num_splits_or_scale_names_the_argument(backend, change, match):
    """num_splits and scale get forgetting_attention's one-line errors on either path: 0 splits gave NaN rows on the
    kernel, other bad splits failed in its launch, and a NaN, bool or string scale was taken as float(scale)."""
    q = torch.randn(1, 1, 4, 8)
    kc, vc = torch.randn(8, 4, 8), torch.randn(8, 4, 8)
    cc = -torch.rand(8, 4, 2, dtype=torch.float64).cumsum(1)
    pt = torch.arange(6, dtype=torch.int32).reshape(1, 2, 3)
    start, lengths = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    with use_backend(backend):
        forgetting_attention_decode(q, kc, vc, cc, pt, start, lengths, num_splits=np.int64(2), scale=-0.5)
        with pytest.raises(ValueError, match=match):
            forgetting_attention_decode(q, kc, vc, cc, pt, start, lengths, **change)


@pytest.mark.parametrize("shape", [dict(B=0), dict(Hq=0), dict(D=0), dict(Hk=0), dict(page=0)])
def test_decode_empty_dims_raise_value_error(shape):
    """An empty batch, head, head dim or page gets a one-line error, as in forgetting_attention (flash_attn refuses
    an empty batch too): they ended in a RuntimeError of min() or a ZeroDivisionError."""
    B, Hq, D, Hk, page = (shape.get(n, d) for n, d in (("B", 1), ("Hq", 4), ("D", 8), ("Hk", 2), ("page", 4)))
    q = torch.randn(B, 1, Hq, D)
    kc, vc = torch.randn(8, page, D), torch.randn(8, page, 8)
    cc = torch.zeros(8, page, 2, dtype=torch.float64)
    pt = torch.zeros(B, Hk, 3, dtype=torch.int32)
    start, lengths = torch.zeros(B, Hk, dtype=torch.int32), torch.full((B,), 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="expected at least one batch row, head, head dim, kv head and page slot"):
        forgetting_attention_decode(q, kc, vc, cc, pt, start, lengths)


def test_decode_output_is_contiguous():
    """o is contiguous on the PyTorch path too, as the kernel's and flash_attn_with_kvcache's are: with Tq > 1 it was
    a permuted view, which a port's o.view(B, Tq, -1) refused."""
    q = torch.randn(1, 2, 4, 8)
    kc, vc = torch.randn(5, 4, 8), torch.randn(5, 4, 8)
    cc = torch.zeros(5, 4, 2, dtype=torch.float64)
    pt = torch.zeros(1, 2, 3, dtype=torch.int32)
    start, lengths = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    assert forgetting_attention_decode(q, kc, vc, cc, pt, start, lengths).is_contiguous()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors take the kernel only in Triton's interpreter"))])
@pytest.mark.parametrize("change, match", [
    (dict(lengths=[1, 9]), r"lengths: .* got lengths\[0\] = 1"),  # fewer keys than the Tq = 2 new tokens
    (dict(lengths=[0, 9]), r"lengths: .* got lengths\[0\] = 0"),
    (dict(lengths=[3, 13]), r"lengths: .* 12 slots, got lengths\[1\] = 13"),  # past the page table
    (dict(start=[[0, 0], [0, 2]]), r"cache_start: .* 1, got cache_start\[1, 1\] = 2"),  # queries on evicted pages
    (dict(start=[[0, -1], [0, 0]]), r"cache_start: .* got cache_start\[0, 1\] = -1"),
    (dict(page=(1, 0, 2, 8)), r"page_table: expected live pages in \[0, 8\).* page_table\[1, 0, 2\] = 8"),
], ids=["length-below-tq", "length-zero", "length-past-table", "start-past-queries", "start-negative", "page-outside"])
def test_decode_positions_out_of_range_raise_on_the_cpu(backend, change, match):
    """Lengths, first live pages and live page-table entries the cache cannot hold raise a ValueError naming the
    argument on either path: the PyTorch path raised an IndexError (or returned NaN) and the kernel returned NaN or
    read other pages. A stale entry past a row's length is never read, so it may hold anything."""
    q = torch.randn(2, 2, 4, 8)
    kc, vc = torch.randn(8, 4, 8), torch.randn(8, 4, 8)
    cc = -torch.rand(8, 4, 2, dtype=torch.float64).cumsum(1)
    pt = torch.arange(12, dtype=torch.int32).reshape(2, 2, 3) % 8
    pt[0, :, 2] = -1  # stale: row 0 has 3 keys, one page
    start = torch.tensor(change.get("start", [[0, 0], [0, 0]]), dtype=torch.int32)
    lengths = torch.tensor(change.get("lengths", [3, 9]), dtype=torch.int32)
    with use_backend(backend):
        forgetting_attention_decode(q, kc, vc, cc, pt, torch.zeros(2, 2, dtype=torch.int32),
                                    torch.tensor([3, 9], dtype=torch.int32))
        if "page" in change:
            *where, value = change["page"]
            pt[tuple(where)] = value
        with pytest.raises(ValueError, match=match):
            forgetting_attention_decode(q, kc, vc, cc, pt, start, lengths)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors take the kernel only in Triton's interpreter"))])
def test_decode_and_eviction_ignore_page_table_entries_of_pages_not_live(backend):
    """Entries of evicted pages and of pages past a row's length are never read, so they may hold anything (a pool
    index that is no longer there, -1): the PyTorch path and evictable_pages indexed the pool with them, an IndexError
    for an entry past the pool's end. Results against the fp64 oracle, and eviction as with clean entries."""
    gen = torch.Generator().manual_seed(3)
    B, T, Hk, G, D, page = 3, 50, 2, 2, 16, 8
    q, k, v, log_fgate = _problem(B, T, Hk * G, Hk, D, D, torch.float32, gen)
    q = q[:, :2]
    lengths = torch.tensor([50, 20, 33], dtype=torch.int32)
    kc, vc, cc, pt = _paged(k, v, gate_cumsum(log_fgate), lengths, page, gen=gen)
    start = torch.tensor([[2, 0], [0, 1], [0, 0]], dtype=torch.int32)
    U = torch.full((Hk * G,), 2.0)
    clean = evictable_pages(cc, pt, start, lengths, U, max_length=T, tolerance=math.exp(-3))
    stale = pt.clone()
    stale[0, 0, :2] = 10 ** 6  # evicted
    stale[1, 1, 0] = -1
    stale[1, :, 3:] = 10 ** 6  # past the row's 20 keys (3 pages)
    stale[2, :, 5:] = -(10 ** 6)
    with use_backend(backend):
        o = forgetting_attention_decode(q, kc, vc, cc, stale, start, lengths)
    for b in range(B):
        for h in range(Hk):
            heads = slice(h * G, (h + 1) * G)
            ref = _oracle(q[b:b + 1, :, heads], k[b:b + 1, :, h:h + 1], v[b:b + 1, :, h:h + 1],
                          log_fgate[b:b + 1, :, heads], lengths[b:b + 1], [int(start[b, h]) * page], D ** -0.5)
            assert (o[b:b + 1, :, heads].double() - ref).abs().max() < 1e-5
    assert torch.equal(evictable_pages(cc, stale, start, lengths, U, max_length=T, tolerance=math.exp(-3)), clean)


def _kvcache_problem(layout: str, T: int = 1):
    """Two rows of 10 cached tokens and T new ones, for forgetting_attention_with_kvcache: (call, oracle output), where
    call(cache_seqlens, **changes) runs it with the layout's arguments (a paged layout's changed or dropped, None)."""
    gen = torch.Generator().manual_seed(4)
    B, N, Hq, Hk, D, page = 2, 32, 4, 2, 8, 4
    k, v = torch.randn(B, N, Hk, D, generator=gen), torch.randn(B, N, Hk, D, generator=gen)
    log_fgate = F.logsigmoid(2.0 + torch.randn(B, N, Hq, generator=gen))
    q = torch.randn(B, T, Hq, D, generator=gen)
    c = gate_cumsum(log_fgate)
    lengths = torch.full((B,), 10 + T, dtype=torch.int32)
    caches, extra = (k, v, c), {}
    if layout == "paged":
        kc, vc, cc, pt = _paged(k, v, c, lengths, page, gen=gen)
        caches = (kc, vc, cc)
        extra = dict(block_table=pt, cache_start=torch.zeros(B, Hk, dtype=torch.int32),
                     cache_start_host=np.zeros((B, Hk), dtype=np.int64), cache_lengths=lengths)

    def call(cache_seqlens, **changes):
        kwargs = {name: x for name, x in {**extra, **changes}.items() if x is not None}
        return forgetting_attention_with_kvcache(q, *caches, k=k[:, 10:10 + T], v=v[:, 10:10 + T],
                                                 log_fgate=log_fgate[:, 10:10 + T], cache_seqlens=cache_seqlens,
                                                 scale=D ** -0.5, **kwargs)

    return call, _oracle(q, k, v, log_fgate, lengths, [0] * B, D ** -0.5)


@pytest.mark.parametrize("layout, before", [
    ("contiguous", 9.5), ("contiguous", [10, 10]), ("contiguous", 32), ("contiguous", -1), ("contiguous", True),
    ("paged", [9.5, 10]), ("paged", [-1, 10]), ("paged", [10]), ("paged", 10),
], ids=str)
def test_with_kvcache_bad_cache_seqlens_names_the_argument(layout, before):
    """forgetting_attention_with_kvcache's cache_seqlens (an int for a contiguous cache, a host int >= 0 per row for
    a paged one; a contiguous cache holds them and the new tokens): anything else is a one-line error naming it. A
    float was cut to an int (the new token attended as if it sat at position 9: a wrong output, no error), a list or a
    value past the cache failed naming nothing or c_q, and a paged cache's negative length was taken."""
    call, ref = _kvcache_problem(layout)
    assert (call(10 if layout == "contiguous" else [10, 10]).double() - ref).abs().max() < 1e-5
    with pytest.raises(ValueError, match="cache_seqlens: expected"):
        call(before)


@pytest.mark.parametrize("T", [1, 3, 20], ids=["decode", "speculative", "chunk"])
@pytest.mark.parametrize("change, match", [
    (dict(cache_start=None), "cache_start: a paged cache .* needs cache_start, cache_start_host and cache_lengths"),
    (dict(cache_start_host=None), "cache_start_host: a paged cache"),
    (dict(cache_lengths=None), "cache_lengths: a paged cache"),
    (dict(cache_start_host=np.zeros(2, dtype=np.int64)), r"cache_start_host: expected .* got the shape \[2\]"),
], ids=["no-start", "no-host-start", "no-lengths", "host-start-shape"])
def test_with_kvcache_paged_arguments_missing_name_the_argument(T, change, match):
    """A paged cache's cache_start, its host copy and the lengths: one missing (or the host copy of another shape) is a
    one-line error naming it, on every path; they failed as None deep inside (an AttributeError, a TypeError)."""
    call, ref = _kvcache_problem("paged", T)
    assert (call([10, 10]).double() - ref).abs().max() < 1e-5
    with pytest.raises(ValueError, match=match):
        call([10, 10], **change)


@pytest.mark.parametrize("change, match", [
    (lambda k, v, c: (k[:, :, :1], v, c), r"k_cache: expected \[B, N, Hk, D\] = \[2, 32, 2, 8\]"),
    (lambda k, v, c: (k, v[:, :5], c), r"v_cache: expected \[B, N, Hk, Dv\] = \[2, 32, 2, 8\]"),
    (lambda k, v, c: (k, v, c[..., :2]), r"c_cache: expected \[B, N, Hq\] = \[2, 32, 4\]"),
    (lambda k, v, c: (k, v, c[:, :12]), r"c_cache: expected \[B, N, Hq\] = \[2, 32, 4\]"),
    (lambda k, v, c: (k, v, c.float()), "c_cache: expected the fp64 gate cumsum, got torch.float32"),
], ids=["k-heads", "v-length", "c-heads", "c-length", "c-fp32"])
def test_with_kvcache_contiguous_cache_of_another_shape_names_it(change, match):
    """A contiguous cache's k_cache, v_cache or c_cache of another shape than q and k say (or a c_cache not fp64): a
    one-line error naming it: they failed naming the op's internals (c_q, v), or were taken (an fp32 c_cache, whose
    differences lose digits as |c| grows; a c_cache shorter than k_cache)."""
    gen = torch.Generator().manual_seed(4)
    B, N, Hq, Hk, D = 2, 32, 4, 2, 8
    k, v = torch.randn(B, N, Hk, D, generator=gen), torch.randn(B, N, Hk, D, generator=gen)
    log_fgate = F.logsigmoid(2.0 + torch.randn(B, N, Hq, generator=gen))
    q = torch.randn(B, 1, Hq, D, generator=gen)
    c = gate_cumsum(log_fgate)

    def call(k_cache, v_cache, c_cache):
        return forgetting_attention_with_kvcache(q, k_cache, v_cache, c_cache, k=k[:, 10:11], v=v[:, 10:11],
                                                 log_fgate=log_fgate[:, 10:11], cache_seqlens=10, scale=D ** -0.5)

    ref = _oracle(q, k, v, log_fgate, torch.full((B,), 11), [0] * B, D ** -0.5)
    assert (call(k, v, c).double() - ref).abs().max() < 1e-5
    with pytest.raises(ValueError, match=match):
        call(*change(k, v, c))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors take the kernel only in Triton's interpreter"))])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_with_kvcache_no_new_queries_return_an_empty_output(backend, layout):
    """Tq = 0 new tokens ([B, 0, Hq, D]): an empty output [B, 0, Hq, Dv] in q's dtype at once, as torch SDPA and
    flash_attn give for empty inputs, on either layout and path. The decode kernel took its query rows as
    r // Tq, r % Tq: a division by zero (a RuntimeWarning in the interpreter, made an error here)."""
    call, _ = _kvcache_problem(layout, T=0)
    with use_backend(backend), warnings.catch_warnings():
        warnings.simplefilter("error")
        o = call(10 if layout == "contiguous" else [10, 10])
    assert o.shape == (2, 0, 4, 8) and o.dtype == torch.float32


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors take the kernel only in Triton's interpreter"))])
def test_decode_no_new_queries_return_empty_outputs(backend):
    """forgetting_attention_decode with Tq = 0: o [B, 0, Hq, Dv] in q's dtype and lse [B, Hq, 0] fp32, without a
    launch that divides by Tq; its arguments are still checked."""
    q = torch.randn(2, 0, 4, 8, dtype=torch.bfloat16)
    kc, vc = torch.randn(5, 4, 8, dtype=torch.bfloat16), torch.randn(5, 4, 6, dtype=torch.bfloat16)
    cc = torch.zeros(5, 4, 2, dtype=torch.float64)
    pt = torch.zeros(2, 2, 3, dtype=torch.int32)
    start, lengths = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32)
    with use_backend(backend), warnings.catch_warnings():
        warnings.simplefilter("error")
        o, lse = forgetting_attention_decode(q, kc, vc, cc, pt, start, lengths, return_lse=True)
        assert o.shape == (2, 0, 4, 6) and o.dtype == torch.bfloat16
        assert lse.shape == (2, 4, 0) and lse.dtype == torch.float32
        with pytest.raises(ValueError, match="num_splits: expected a positive int"):
            forgetting_attention_decode(q, kc, vc, cc, pt, start, lengths, num_splits=0)

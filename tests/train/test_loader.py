"""foxlm.train.loader: deterministic batches, split over processes and micro-batches."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from foxlm.data import TokenDataset
from foxlm.train import TokenLoader

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("packing", ["windows", "documents"])
def test_loader_deterministic_and_split_over_processes(byte_data, packing):
    ds = TokenDataset(byte_data)
    kw = dict(seq_len=48, batch_size=8, packing=packing, seed=random.randrange(1000))
    one = TokenLoader(ds, micro_batch_size=2, **kw)
    step = random.randrange(10_000)
    b1 = one.batch(step)
    assert len(b1) == 4 and one.grad_accum == 4
    again = TokenLoader(ds, micro_batch_size=4, **kw).batch(step)  # other micro split, same rows
    two = [TokenLoader(ds, micro_batch_size=2, rank=r, world_size=2, **kw).batch(step) for r in range(2)]
    flat = lambda bs: torch.cat([b.input_ids.view(-1) for b in bs])  # noqa: E731
    assert torch.equal(flat(b1), flat(again)) and torch.equal(flat(b1), flat(two[0] + two[1]))
    assert not torch.equal(flat(b1), flat(one.batch(step + 1)))
    eot = ds.meta["tokenizer"]["eot_id"]
    for b in b1:
        if packing == "windows":
            assert b.input_ids.shape == (2, 48) and b.cu_seqlens is None and b.num_targets == 2 * 47
            continue
        assert b.input_ids.shape == (1, 96) and b.cu_seqlens.dtype == torch.int32
        cu = b.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == 96 and {0, 48} <= set(cu)  # rows are segments too
        assert b.num_targets == int((b.labels[0, 1:] != -100).sum()) == 96 - 2
        # across a segment start the only target is a document's end: the next document's <|endoftext|>
        assert (b.labels[0, [48]] == -100).all() and (b.labels[0, [c for c in cu[1:-1] if c != 48]] == eot).all()
        for s, e in zip(cu[:-1], cu[1:]):  # documents open with <|endoftext|> and have none inside
            assert (b.input_ids[0, s + 1:e] != eot).all()
        starts = (b.input_ids[0] == eot).nonzero().view(-1).tolist()
        assert set(starts) <= set(cu)  # every document start opens a segment
    if packing == "documents":  # one epoch of rows is the corpus, reordered by document: nothing repeated
        steps = len(ds.tokens) // (8 * 48)
        seen = np.concatenate([b.input_ids.view(-1).numpy() for s in range(steps) for b in one.batch(s)])
        counts = np.bincount(np.asarray(ds.tokens), minlength=ds.meta["tokenizer"]["vocab_size"])
        assert (np.bincount(seen, minlength=len(counts)) <= counts).all()
        assert (seen == eot).sum() >= ds.num_docs - 1



def test_resume_refuses_other_data_of_the_same_length(tmp_path):
    """The same plays prepared in another order: as many tokens, other data. A checkpoint's loader state from one
    refuses the other (a resume would not reproduce the run); the same folder is accepted."""
    from foxlm.data import prepare
    from foxlm.data.assets import shakespeare_plays

    plays = random.Random(0).sample(shakespeare_plays(), 2)
    for name, order in (("a", plays), ("b", plays[::-1])):
        prepare(order, tmp_path / name, tokenizer="byte", val_fraction=0.0, workers=0, progress=False)
    kw = dict(seq_len=32, batch_size=4, micro_batch_size=4)
    a, b = (TokenLoader(TokenDataset(tmp_path / name), **kw) for name in "ab")
    assert len(a.ds.tokens) == len(b.ds.tokens)
    TokenLoader(TokenDataset(tmp_path / "a"), **kw).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="data: the checkpoint's loader used"):
        b.load_state_dict(a.state_dict())

"""Sequence packing's layout: every record lands whole, once, in a row within the budget, and packing then unpacking a
batch gives back its attended tokens (zeros at padding); checked against a per-record loop over the padded batch."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa.core.packing import Packing, first_fit, right_padded

LENGTHS = st.lists(st.integers(1, 12), min_size=1, max_size=20)


@settings(max_examples=60, deadline=None)
@given(LENGTHS, st.integers(1, 30))
def test_first_fit_puts_every_record_once_in_a_row_within_the_budget(lengths, budget):
    rows = first_fit(lengths, budget)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    width = max(budget, max(lengths))
    assert all(sum(lengths[i] for i in row) <= width for row in rows)


def _batch(lengths, L=None):
    L = L or max(lengths)
    mask = (torch.arange(L) < torch.tensor(lengths)[:, None]).long()
    x = torch.randn(len(lengths), L, 3) * mask[..., None]
    return mask, x


@settings(max_examples=60, deadline=None)
@given(LENGTHS, st.integers(1, 30), st.integers(0, 3))
def test_pack_then_unpack_gives_back_each_records_tokens(lengths, budget, extra):
    mask, x = _batch(lengths, max(lengths) + extra)
    packing = Packing.of(mask, budget)
    packed = packing.pack(x)
    assert packed.shape[:2] == (packing.rows, max(budget, max(lengths)))
    torch.testing.assert_close(packing.unpack(packed), x, rtol=0, atol=0)
    for i, n in enumerate(lengths):  # independent: each record found by its segment id, in order, at offsets 0..n-1
        where = packing.segment == i
        assert int(where.sum()) == n
        torch.testing.assert_close(packed[where], x[i, :n], rtol=0, atol=0)
        assert packing.offset[where].tolist() == list(range(n))
        assert len(set(where.nonzero()[:, 0].tolist())) == 1  # one row
    assert int((packing.segment >= 0).sum()) == sum(lengths)


@settings(max_examples=40, deadline=None)
@given(LENGTHS, st.integers(1, 30))
def test_the_attention_mask_joins_exactly_the_tokens_of_one_record(lengths, budget):
    mask, _ = _batch(lengths)
    packing = Packing.of(mask, budget)
    allowed = packing.attention()[:, 0]
    seg = packing.segment
    for r in range(packing.rows):
        for q in range(seg.shape[1]):
            for k in range(seg.shape[1]):
                assert bool(allowed[r, q, k]) == (int(seg[r, q]) == int(seg[r, k]))
    assert bool(allowed.any(-1).all())  # no query without a key: no empty softmax row


def test_right_padded_tells_right_from_left_padding():
    assert right_padded(torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]]))
    assert not right_padded(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert not right_padded(torch.tensor([[1, 0, 1]]))

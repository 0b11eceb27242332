"""The server's merge ledger: whatever the order in which clients sit out, the base offset a client builds from
what the ledger sends it equals the sum of every merge so far, computed here independently; its state survives a
resume point."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa.merge_ledger import MergeLedger

SHAPES = {"q": (4, 3), "v": (5, 2)}


def _merge(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(d, 2, generator=g), torch.randn(2, k, generator=g)) for n, (d, k) in SHAPES.items()}


def _receive(offset: dict, pending) -> dict:
    """A client's base offset after one message, as the client adds it up (dense increments or factors)."""
    if pending is None:
        return offset
    kind, value = pending
    if kind == "base_total":
        return {n: t.clone() for n, t in value.items()}
    for merge in value:
        for n, v in merge.items():
            inc = v if isinstance(v, torch.Tensor) else v[0] @ v[1]
            offset[n] = offset[n] + inc if n in offset else inc
    return offset


@settings(max_examples=40, deadline=None)
@given(rounds=st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=1, max_size=6),
       dense=st.booleans())  # fmt: skip
def test_every_client_holds_the_sum_of_every_merge_whenever_it_is_sent_one(rounds, dense):
    ledger, offsets, merges = MergeLedger(), {c: {} for c in (1, 2, 3)}, []
    for rnd, present in enumerate(rounds):
        for c in (1, 2, 3):
            if present[c - 1]:
                offsets[c] = _receive(offsets[c], ledger.pending(c))
                expected = {n: sum(B.double() @ A.double() for B, A in (m[n] for m in merges)) for n in SHAPES}
                for n in SHAPES if merges else ():
                    torch.testing.assert_close(offsets[c][n].double(), expected[n], rtol=1e-5, atol=1e-5)
        merges.append(_merge(rnd))
        ledger.add(merges[-1], dense=dense)


def test_a_client_that_lost_its_state_is_sent_the_whole_sum_and_a_resume_keeps_the_ledger():
    ledger = MergeLedger()
    for seed in range(3):
        ledger.add(_merge(seed), dense=False)
        ledger.pending(1)
        ledger.trained(1)
    assert ledger.pending(1) is None
    ledger.forget(1)
    kind, total = ledger.pending(1)
    assert kind == "base_total" and total is ledger.merged
    again = MergeLedger()
    again.load_state_dict(ledger.state_dict(), "cpu")
    assert again.count == 3 and again.upto == {1: 3} and again.kept == {1: 3}
    for n in SHAPES:
        torch.testing.assert_close(again.merged[n], ledger.merged[n])
        torch.testing.assert_close(again.last[n][0], ledger.last[n][0])

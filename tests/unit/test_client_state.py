"""ClientState's transitions keep its stated invariants: factors change only by keep, restart and draw; a lost state
is reported exactly once; rounds_trained counts the rounds it kept; the state survives park/unpark bit for bit."""

from __future__ import annotations

import torch

from fs_fedpa.plugin.client_state import ClientState
from fs_fedpa.state_store import StateStore


def _factors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"q": (torch.randn(6, 2, generator=g), torch.randn(2, 5, generator=g))}


def _state(tmp_path) -> ClientState:
    return ClientState(StateStore(str(tmp_path / "store"), None), keep_received=False)


def test_draw_gives_factors_once_and_never_over_kept_or_lost_ones(tmp_path):
    kept = _state(tmp_path)
    assert kept.draw(lambda: _factors(0)) and torch.equal(kept.factors["q"][0], _factors(0)["q"][0])
    assert not kept.draw(lambda: _factors(1))  # it has factors: nothing drawn over them
    assert torch.equal(kept.factors["q"][0], _factors(0)["q"][0])
    kept.forget_drawn()
    kept.lost = True
    assert not kept.draw(lambda: _factors(2)) and kept.factors is None  # a lost state restarts, it is not drawn


def test_a_lost_state_is_reported_with_exactly_one_upload(tmp_path):
    kept = _state(tmp_path)
    kept.lost = True
    kept.stand_in(_factors(0))
    kept.restart(_factors(1), _factors(2))
    assert not kept.lost and kept.lost_unreported and torch.equal(kept.received["q"][1], _factors(1)["q"][1])
    reported = []
    for rnd in range(3):
        kept.open_round(_factors(10 + rnd), None)
        reported.append(kept.lost_this_round)
    assert reported == [True, False, False]


def test_keep_preserves_the_trained_factors_and_counts_the_rounds(tmp_path):
    kept = _state(tmp_path)
    kept.draw(lambda: _factors(0))
    for rnd in (0, 3, 4):
        kept.open_round(_factors(100 + rnd), None)  # what the server sent: never the kept factors
        kept.keep(_factors(rnd + 1), {"head": torch.full((2,), float(rnd))}, rnd)
    assert (kept.rounds_trained, kept.last_trained) == (3, 4)
    assert torch.equal(kept.factors["q"][0], _factors(5)["q"][0]) and kept.local["head"][0] == 4.0
    kept.park(7)
    assert kept.factors is None and kept.received == {}
    kept.unpark(7, torch.device("cpu"))
    assert torch.equal(kept.factors["q"][1], _factors(5)["q"][1])
    assert torch.equal(kept.local["head"], torch.full((2,), 4.0))


def test_merges_add_up_and_a_total_replaces_them(tmp_path):
    kept = _state(tmp_path)
    a, b = torch.ones(3, 2), torch.full((3, 2), 2.0)
    kept.merge("q", a)
    kept.merge("q", b)
    assert torch.equal(kept.base_offset["q"], a + b)
    kept.replace_merges({"q": b})
    assert torch.equal(kept.base_offset["q"], b)


def _adamw_state(model: torch.nn.Module) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return optimizer


def test_kept_moments_survive_park_and_a_resume_file_as_tensors_by_parameter_name(tmp_path):
    """fedpa.keep_moments: AdamW's state, saved by parameter name, goes through the store and a resume file read with
    weights_only; restored into a new optimizer whose parameters come in another order, each gets its own state."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = _adamw_state(model)
    kept = _state(tmp_path)
    kept.draw(lambda: _factors(0))
    kept.keep(_factors(1), {}, 0)
    kept.moments.save(optimizer, dict(model.named_parameters()))
    assert set(kept.moments.tensors) == {f"{n}:{k}" for n, _ in model.named_parameters()
                                         for k in ("step", "exp_avg", "exp_avg_sq")}  # fmt: skip
    kept.park(3)
    assert kept.moments.tensors == {}
    kept.unpark(3, torch.device("cpu"))
    torch.save({**kept.state_dict(), "round": 0}, tmp_path / "client.pt")
    saved = torch.load(tmp_path / "client.pt", weights_only=True)
    ClientState.check_state(saved, tmp_path / "client.pt", 0, method=_Method(), initial=_factors(0), local={})
    again = _state(tmp_path)
    again.load_state_dict(saved, torch.device("cpu"))
    params = dict(model.named_parameters())
    fresh = torch.optim.AdamW(list(reversed(list(model.parameters()))), lr=0.01)
    assert again.moments.restore(fresh, params) == len(params)
    for p in model.parameters():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(fresh.state[p][key], optimizer.state[p][key]), key


def test_a_resume_file_with_non_finite_moments_is_refused_naming_the_field(tmp_path):
    import pytest

    kept = _state(tmp_path)
    kept.keep(_factors(1), {}, 0)
    saved = {**kept.state_dict(), "round": 0, "moments": {"w:exp_avg": torch.tensor([float("nan")])}}
    with pytest.raises(ValueError, match=r"field 'moments\['w:exp_avg'\]' holds a NaN"):
        ClientState.check_state(saved, "f.pt", 0, method=_Method(), initial=_factors(0), local={})


class _Method:
    """What check_state reads of a method: no pruning (end_round not overridden), its shapes and plan."""

    from fs_fedpa.methods.base import FederatedMethod

    end_round = FederatedMethod.end_round
    shapes = {"q": (6, 5)}

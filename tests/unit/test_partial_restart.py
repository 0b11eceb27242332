"""fedpa_partial_restart against the two methods it lies between (fedpa at mu -> 0, fedpa_no_preservation at mu = 1),
its start's product against the expansion of the formula, and its option's checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa.config import FedPAConfig
from fs_fedpa.core.ranks import RankPlan
from fs_fedpa.methods import METHODS, get_method

SHAPES = {"q": (7, 5), "v": (6, 4)}


def _factors(r, seed):
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    return {n: (torch.randn(d, r, generator=g, dtype=f64), torch.randn(r, k, generator=g, dtype=f64))
            for n, (d, k) in SHAPES.items()}  # fmt: skip


def _method(name, r_i, R_i, mu=None):
    get_method(name)
    plan = RankPlan.build(1, max(r_i, R_i), client_ranks=[r_i], reference_ranks=[R_i])
    cls = METHODS[name]
    cfg = FedPAConfig(methods={name: cls.options(mu=mu)}) if mu is not None else FedPAConfig()
    return cls(cfg, plan)


@pytest.mark.parametrize("r_i,R_i", [(4, 4), (4, 2), (2, 4)])
def test_mu_one_is_the_full_restart_and_mu_near_zero_is_fedpa(r_i, R_i):
    own, received = _factors(r_i, 0), _factors(R_i, 1)
    full = _method("fedpa_no_preservation", r_i, R_i).start_round(received, own, 0, 2)
    kept = _method("fedpa", r_i, R_i).start_round(received, own, 0, 2)
    one = _method("fedpa_partial_restart", r_i, R_i, mu=1.0).start_round(received, own, 0, 2)
    tiny = _method("fedpa_partial_restart", r_i, R_i, mu=1e-12).start_round(received, own, 0, 2)
    for n in own:
        for j in range(2):
            assert torch.equal(one[n][j], full[n][j]) and one[n][j].shape == own[n][j].shape
            torch.testing.assert_close(tiny[n][j], kept[n][j], rtol=0, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(mu=st.floats(1e-6, 1.0), r_i=st.integers(1, 5), R_i=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_the_start_s_product_is_the_formula_s(mu, r_i, R_i, seed):
    """(1-mu)^2 B A + mu(1-mu)(B A_r + B_r A) + mu^2 B_r A_r, with (B_r, A_r) the first r_i columns/rows of the
    received reference, zero where R_i < r_i (written here by slicing, not by the method's truncation)."""
    own, received = _factors(r_i, seed), _factors(R_i, seed + 1)
    start = _method("fedpa_partial_restart", r_i, R_i, mu=mu).start_round(received, own, 0, 1)
    for n, (B, A) in own.items():
        B_r, A_r = torch.zeros_like(B), torch.zeros_like(A)
        m = min(r_i, R_i)
        B_r[:, :m], A_r[:m] = received[n][0][:, :m], received[n][1][:m]
        want = (1 - mu) ** 2 * B @ A + mu * (1 - mu) * (B @ A_r + B_r @ A) + mu**2 * B_r @ A_r
        torch.testing.assert_close(start[n][0] @ start[n][1], want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mu", [0.0, -0.1, 1.5, float("nan"), True, "0.5"])
def test_mu_outside_zero_one_is_refused_naming_the_key(mu):
    with pytest.raises(ValueError, match=r"fedpa\.fedpa_partial_restart\.mu") as err:
        get_method("fedpa_partial_restart").options(mu=mu)
    assert "\n" not in str(err.value)


def test_own_factors_of_another_rank_are_refused():
    own, received = _factors(3, 0), _factors(4, 1)
    with pytest.raises(ValueError, match="fedpa_partial_restart: module 'q' keeps factors"):
        _method("fedpa_partial_restart", 4, 4, mu=0.5).start_round(received, own, 0, 1)


def test_it_declares_fedpa_s_release_and_hooks():
    cls = get_method("fedpa_partial_restart")
    assert cls.dp_space == "product" and cls.uses == frozenset({"alignment"}) and cls.options_section() == cls.name

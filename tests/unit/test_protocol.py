"""The statistics of the tuned comparison (fs_fedpa.protocol) against hand computations and scipy."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fs_fedpa.protocol import paired_interval, plateau_round, select, t_quantile_975, verdict


def test_paired_interval_of_a_hand_example():
    # d = (0.01, 0.03, 0.02): mean 0.02, sd 0.01, se 0.01/sqrt(3) = 0.0057735, t_{0.975,2} = 4.302653
    mean, low, high = paired_interval([0.01, 0.03, 0.02])
    assert mean == pytest.approx(0.02)
    assert (low, high) == (pytest.approx(0.02 - 0.0248414, abs=1e-7), pytest.approx(0.02 + 0.0248414, abs=1e-7))
    assert verdict(low, high) == "ties"
    assert verdict(*paired_interval([0.01, 0.012, 0.011])[1:]) == "wins"
    assert verdict(*paired_interval([-0.01, -0.012, -0.011])[1:]) == "loses"
    with pytest.raises(ValueError, match="at least 2"):
        paired_interval([0.1])


def test_t_quantiles_agree_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 9, 29, 30):
        assert t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-8)
    assert t_quantile_975(200) == pytest.approx(stats.t.ppf(0.975, 200), rel=0.01)


@given(st.lists(st.floats(-1, 1), min_size=2, max_size=12))
def test_the_interval_is_centred_on_the_mean_and_shrinks_to_it_without_spread(d):
    mean, low, high = paired_interval(d)
    assert low <= mean + 1e-12 and mean <= high + 1e-12
    assert math.isclose(mean - low, high - mean, rel_tol=1e-9, abs_tol=1e-12)
    assert paired_interval([d[0]] * len(d))[1:] == pytest.approx((d[0], d[0]))


@pytest.mark.parametrize(
    "curve, expected",
    [
        # climbs until 16, flat after: at t = 20 the best-so-far still gains 0.011 over round 15 (the best at round
        # 14), at t = 22 only 0.001 over round 16.5 (the best at round 16)
        (
            {2: 0.6, 4: 0.7, 6: 0.75, 8: 0.8, 10: 0.82, 12: 0.84, 14: 0.85, 16: 0.86, 18: 0.86, 20: 0.861, 22: 0.861},
            22,
        ),
        # still climbing 1 point per 2 rounds at the end: not converged, the last round
        ({t: 0.5 + 0.005 * t for t in range(2, 41, 2)}, 40),
        # a noisy dip does not count against the best so far: flat from round 8 on
        ({2: 0.8, 4: 0.85, 6: 0.86, 8: 0.862, 10: 0.7, 12: 0.863}, 8),
    ],
)
def test_plateau_round(curve, expected):
    assert plateau_round(curve) == expected


def test_selection_picks_the_best_validation_value_per_method():
    rows = [
        {"method": "fedpa", "lam": 0.01, "score": 0.80},
        {"method": "fedpa", "lam": 0.1, "score": 0.86},
        {"method": "fedpa", "lam": 1.0, "score": 0.79},
        {"method": "fedit", "lr": 5e-4, "score": None},  # not run yet
        {"method": "fedit", "lr": 2e-3, "score": 0.84},
        {"method": "fedit", "lr": 5e-3, "score": 0.84},  # a tie keeps the earlier row
        {"method": "ffa_lora", "lr": 2e-3, "score": float("nan")},
    ]
    best = select(rows)
    assert best["fedpa"]["lam"] == 0.1 and best["fedit"]["lr"] == 2e-3 and "ffa_lora" not in best

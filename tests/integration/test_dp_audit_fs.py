"""The canary audit of DP-SGD (fs_fedpa.tools.dp_audit): its confidence bounds against scipy's exact binomial
interval, and (opt-in, slow) its bound per treatment of the local head against the ledger's epsilon, which the
withdrawn plain head must exceed."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("k", "n"), [(0, 200), (3, 200), (50, 400), (400, 400)])
def test_the_upper_bound_is_scipys_exact_one_sided_interval(k, n):
    from scipy.stats import binomtest

    from fs_fedpa.tools.dp_audit import clopper_pearson_upper

    expected = binomtest(k, n, alternative="less").proportion_ci(confidence_level=0.975).high
    assert clopper_pearson_upper(k, n, 0.025) == pytest.approx(expected, rel=1e-9)


def test_the_bound_is_zero_when_the_test_does_no_better_than_chance():
    import torch

    from fs_fedpa.tools.dp_audit import epsilon_lower_bound

    same = torch.randn(2000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert epsilon_lower_bound(same[:1000], same[1000:], 0.0, 1e-5) == 0.0
    apart = epsilon_lower_bound(same[:1000], same[1000:] + 10.0, 5.0, 1e-5)  # no error on either side
    assert apart == pytest.approx(float(torch.tensor(0.99999 / (1 - 0.025 ** (1 / 1000))).log()), rel=1e-3)


@pytest.mark.slow
def test_the_audit_stays_below_the_ledger_for_each_option_and_catches_the_plain_head():
    from fs_fedpa.privacy.accountant import calibrate
    from fs_fedpa.tools.dp_audit import Audit

    z = calibrate(64, 64, 2, 1.0, 1e-5)
    found = {t: Audit(t, z, 2, 0.05).bound(400, 1e-5) for t in ("noised", "frozen", "plain")}
    assert found["noised"]["epsilon_lb"] < 1.0 and found["frozen"]["epsilon_lb"] < 1.0, found
    assert found["plain"]["epsilon_lb"] > 1.2, found

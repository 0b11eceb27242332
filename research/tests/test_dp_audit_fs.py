"""The canary audit of DP-SGD (research.tools.dp_audit): its confidence bounds against scipy's exact binomial
interval, and (opt-in, slow) its bound per treatment of the local head against the ledger's epsilon, which the
withdrawn plain head must exceed."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("k", "n"), [(0, 200), (3, 200), (50, 400), (400, 400)])
def test_the_upper_bound_is_scipys_exact_one_sided_interval(k, n):
    from scipy.stats import binomtest

    from research.tools.dp_audit import clopper_pearson_upper

    expected = binomtest(k, n, alternative="less").proportion_ci(confidence_level=0.975).high
    assert clopper_pearson_upper(k, n, 0.025) == pytest.approx(expected, rel=1e-9)


def test_the_bound_is_zero_when_the_test_does_no_better_than_chance():
    import torch

    from research.tools.dp_audit import epsilon_lower_bound

    same = torch.randn(2000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert epsilon_lower_bound(same[:1000], same[1000:], 0.0, 1e-5) == 0.0
    apart = epsilon_lower_bound(same[:1000], same[1000:] + 10.0, 5.0, 1e-5)  # no error on either side
    assert apart == pytest.approx(float(torch.tensor(0.99999 / (1 - 0.025 ** (1 / 1000))).log()), rel=1e-3)


@pytest.mark.slow
def test_the_audit_stays_below_the_ledger_for_each_option_and_catches_the_plain_head():
    from fs_fedpa.privacy.accountant import calibrate
    from research.tools.dp_audit import Audit

    z = calibrate(64, 64, 2, 1.0, 1e-5)
    found = {t: Audit(t, z, 2, 0.05).bound(400, 1e-5) for t in ("noised", "frozen", "plain")}
    assert found["noised"]["epsilon_lb"] < 1.0 and found["frozen"]["epsilon_lb"] < 1.0, found
    assert found["plain"]["epsilon_lb"] > 1.2, found


def _perfect_separation_ceiling(trials: int, delta: float) -> float:
    """scipy's exact one-sided 97.5 % interval at 0 errors in the second half's m trials, both rates alike."""
    import math

    from scipy.stats import binomtest

    rate = binomtest(0, trials - trials // 2, alternative="less").proportion_ci(confidence_level=0.975).high
    return math.log((1 - delta - rate) / rate)


def _printed(line: str) -> dict[str, float]:
    import re

    found = re.search(r"epsilon_lb is at most ([\d.]+).*? by ([\d.]+) noise sd or more, a true epsilon of ([\d.]+) "
                      r"\(([\d.]+) x the ledger's\)", line)  # fmt: skip
    assert found, line
    return dict(zip(("ceiling", "mu", "epsilon", "multiple"), map(float, found.groups())))


def test_the_audit_prints_the_smallest_violation_it_can_detect(capsys):
    """The audit's report states what its trial count can show: the largest epsilon_lb (no error on either side,
    against scipy's exact interval) and the smallest shift of the canary, and the true epsilon there, at which its
    bound exceeds the ledger's. Checked independently: a Gaussian pair of that shift by dp-accounting's PLD, and the
    audit's own bound on a sample at its expected quantiles, which exceeds the ledger just above that shift and not
    below it."""
    import numpy as np
    from dp_accounting.pld import privacy_loss_distribution as pld
    from scipy.stats import norm

    from research.tools.dp_audit import detection_line, epsilon_lower_bound, main

    trials, ledger, delta = 4000, 1.0, 1e-5
    shown = _printed(detection_line(trials, ledger, delta))
    assert shown["ceiling"] == pytest.approx(_perfect_separation_ceiling(trials, delta), abs=1e-3)  # 6.295
    gaussian = pld.from_gaussian_mechanism(1 / shown["mu"], sensitivity=1.0, value_discretization_interval=1e-4)
    assert shown["epsilon"] == pytest.approx(gaussian.get_epsilon_for_delta(delta), rel=2e-2)
    assert shown["multiple"] == pytest.approx(shown["epsilon"] / ledger, rel=1e-2)
    m = trials - trials // 2
    null = norm.ppf((np.arange(m) + 0.5) / m)

    def best(mu):  # the audit's bound at its best threshold on the expected sample
        return max(epsilon_lower_bound(null, null + mu, t, delta) for t in np.linspace(-3, mu + 3, 601))

    assert best(0.95 * shown["mu"]) < ledger < best(1.05 * shown["mu"])
    # at ledgers above the ceiling the audit says it can flag nothing
    assert "cannot flag any violation" in detection_line(trials, 7.0, delta)
    assert _perfect_separation_ceiling(trials, delta) < 7.0
    main(["--trials", "40", "--epsilon", "0.5", "--treatment", "frozen"])
    assert detection_line(40, 0.5, 1e-5) in capsys.readouterr().out

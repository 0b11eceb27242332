"""fedpa.dp.label_prior (issue 91, variant b): the Gaussian label count's sensitivity and noise, its composition with
DP-SGD's steps against dp-accounting's own events, the calibration that includes it, its bias and its resume state,
and the key's checks. A test with the noise removed shows the count's check can fail."""

from __future__ import annotations

import math

import pytest
import torch

dpa = pytest.importorskip("dp_accounting", reason="dp-accounting (the dp extra) is not installed")

N_I, B, STEPS, Z, DELTA, SIGMA = 1000, 64, 40, 1.0, 1e-5, 2.0


def _dp_accounting(accounting: str, sampling: str, steps: int, z: float, sigma: float) -> float:
    """epsilon of the count and the steps as dp-accounting composes them, from its own events."""
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    if sampling == "poisson":  # add/remove: the count has sensitivity 1, the step's sum C
        relation = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        count = dpa.GaussianDpEvent(sigma)
        step = dpa.PoissonSampledDpEvent(B / N_I, dpa.GaussianDpEvent(z))
    else:  # replace-one: sqrt(2) and 2C
        relation = dpa.NeighboringRelation.REPLACE_ONE
        count = dpa.GaussianDpEvent(sigma / math.sqrt(2))
        step = dpa.SampledWithoutReplacementDpEvent(N_I, B, dpa.GaussianDpEvent(z / 2))
    events = [count, dpa.SelfComposedDpEvent(step, steps)] if steps else [count]
    if accounting == "pld":
        accountant = pld_privacy_accountant.PLDAccountant(relation, value_discretization_interval=1e-3)
    else:
        accountant = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    return accountant.compose(dpa.ComposedDpEvent(events)).get_epsilon(DELTA)


CASES = [("rdp", "poisson"), ("pld", "poisson"), ("rdp", "wor")]  # dp-accounting's PLD has no wor event


@pytest.mark.parametrize("accounting,sampling", CASES)
def test_the_plans_epsilon_is_the_count_composed_with_the_steps(accounting, sampling):
    """SamplePlan.epsilon with prior_sigma is dp-accounting's ComposedDpEvent([Gaussian(sigma / s), the steps]); the
    count adds a clear amount (the check fails if the ledger leaves it out)."""
    from fs_fedpa.privacy.sample_plan import SamplePlan

    z = Z if sampling == "poisson" else 2 * Z  # the same noise per unit of sensitivity (2C under replace-one)
    plan = SamplePlan(N_I, B, 1, z, DELTA, sampling, accounting, prior_sigma=SIGMA)
    without = SamplePlan(N_I, B, 1, z, DELTA, sampling, accounting)
    expected = _dp_accounting(accounting, sampling, STEPS, z, SIGMA)
    assert plan.epsilon(STEPS) == pytest.approx(expected, rel=2e-3)
    assert plan.epsilon(STEPS) - without.epsilon(STEPS) > 10 * 2e-3 * expected
    assert plan.epsilon(0) == 0.0  # no step, no count: a client that sits out spends 0


@pytest.mark.parametrize("accounting", ["rdp", "pld"])
def test_calibration_meets_the_target_with_the_count_included(accounting):
    """calibrate's z with the count meets the target in dp-accounting's composition (and 1 % less noise does not);
    it is larger than the z calibrated without the count."""
    from fs_fedpa.privacy.accountant import calibrate

    target = 3.0
    z = calibrate(N_I, B, STEPS, target, DELTA, "poisson", accounting, prior_sigma=SIGMA)
    z_alone = calibrate(N_I, B, STEPS, target, DELTA, "poisson", accounting)
    assert z > z_alone * 1.02
    assert _dp_accounting(accounting, "poisson", STEPS, z, SIGMA) <= target * (1 + 2e-3)
    assert _dp_accounting(accounting, "poisson", STEPS, z / 1.01, SIGMA) > target
    with pytest.raises(ValueError, match=r"fedpa.dp.label_prior\(=0.5\) alone spends"):
        calibrate(N_I, B, STEPS, target, DELTA, "poisson", accounting, prior_sigma=0.5)


def _release(labels: list[int], seed_state: torch.Tensor, sigma: float = SIGMA) -> torch.Tensor:
    from fs_fedpa.privacy.label_prior import noisy_counts

    g = torch.Generator()
    g.set_state(seed_state)
    return noisy_counts(torch.tensor(labels), 3, sigma, g)


def _count_check(sigma: float, draws: int = 4000) -> tuple[float, float]:
    """(||release(D') - release(D)|| for D' = D plus one record of label 2, from the same generator state; the
    empirical standard deviation of release(D) - c over ``draws`` draws)."""
    labels = [0, 0, 1, 2, 2, 2, 1]
    state = torch.Generator().manual_seed(7).get_state()
    gap = _release(labels + [2], state, sigma) - _release(labels, state, sigma)
    torch.testing.assert_close(gap, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64), rtol=0, atol=1e-12)  # its one-hot
    g = torch.Generator().manual_seed(8)
    from fs_fedpa.privacy.label_prior import label_counts, noisy_counts

    exact = label_counts(torch.tensor(labels), 3)
    noise = torch.stack([noisy_counts(torch.tensor(labels), 3, sigma, g) - exact for _ in range(draws)])
    return float(gap.norm()), float(noise.std())


def test_the_count_has_l2_sensitivity_1_and_noise_sigma():
    gap, std = _count_check(SIGMA)
    assert gap == pytest.approx(1.0, abs=1e-12)
    assert std == pytest.approx(SIGMA, rel=0.05)


def test_the_count_check_fails_with_the_noise_removed(monkeypatch):
    """The check above can fail: with the Gaussian replaced by zeros the release is the exact count and the
    empirical std is 0, not sigma."""
    import fs_fedpa.privacy.label_prior as lp

    monkeypatch.setattr(lp, "gaussian", lambda shape, std, generator, like: torch.zeros(shape, dtype=like.dtype))
    gap, std = _count_check(SIGMA)
    assert std == 0.0  # the check's std reports no noise: the mechanism is gone
    with pytest.raises(AssertionError):
        assert std == pytest.approx(SIGMA, rel=0.05)
    released = _release([0, 1, 1], torch.Generator().manual_seed(7).get_state())
    assert torch.equal(released, torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64))  # the exact count


def test_the_bias_is_the_log_of_the_clamped_normalised_count_and_resumes():
    from fs_fedpa.privacy.label_prior import LabelPrior, prior_bias

    b = prior_bias(torch.tensor([30.0, -4.0, 10.0], dtype=torch.float64))
    torch.testing.assert_close(b, torch.log(torch.tensor([30.0, 1.0, 10.0]) / 41.0))
    prior = LabelPrior(SIGMA, 2)
    bias = prior.release(torch.tensor([0, 1, 1, 1]), torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="released once"):
        prior.release(torch.tensor([0, 1]), torch.Generator())  # a second count would not be accounted
    other = LabelPrior(SIGMA, 2)
    other.load_state_dict(prior.state_dict(), "resume file f")
    assert torch.equal(other.bias, bias)
    with pytest.raises(ValueError, match="resume file f: field 'privacy.label_prior' is missing"):
        LabelPrior(SIGMA, 2).load_state_dict({}, "resume file f")
    with pytest.raises(ValueError, match="not a log prior of 2 labels"):
        LabelPrior(SIGMA, 2).load_state_dict({"label_prior": torch.zeros(3)}, "resume file f")
    with pytest.raises(ValueError, match=r"labels in \[0, 2\)"):
        LabelPrior(SIGMA, 2).release(torch.tensor([0, 2]), torch.Generator())


@pytest.mark.parametrize(
    "dp,match",
    [({"mode": "sample", "clip": 1.0, "epsilon": 8.0, "label_prior": -1.0}, r"fedpa.dp.label_prior\(=-1.0\) must be"),
     ({"mode": "none", "label_prior": 20.0}, "fedpa.dp.label_prior=20 set while fedpa.dp.mode is 'none'"),
     ({"mode": "client", "clip": 1.0, "epsilon": 8.0, "label_prior": 20.0},
      "fedpa.dp.label_prior is a choice of DP-SGD")],
)  # fmt: skip
def test_the_key_is_refused_negative_or_without_sample_level_dp(dp, match):
    from fs_fedpa.config import FedPAConfig

    with pytest.raises(ValueError, match=match):
        FedPAConfig(dp=dp)

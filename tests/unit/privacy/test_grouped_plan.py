"""fedpa.dp.local_tensors grouped: the plan's accounting and noise. Two clipping groups, each clipped to its own C_g
and noised N(0, (z_g C_g)^2), are one Gaussian mechanism of sensitivity sqrt(2) with noise z_g once each group is
scaled by 1/C_g, so the epsilon stated must be the sampled Gaussian's at z_g / sqrt(2); checked against dp_accounting
directly, and against the noise actually drawn."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fs_fedpa.config import FedPAConfig
from fs_fedpa.privacy.mechanism import gaussian_flat, gaussian_groups
from fs_fedpa.privacy.sample_plan import sample_plan

pytest.importorskip("dp_accounting")

N_I, BATCH, ROUNDS, DELTA = 2000, 64, 40, 1e-5


def _cfg(**dp) -> SimpleNamespace:
    fedpa = FedPAConfig(dp={"mode": "sample", "clip": 0.05, "epsilon": 8.0, "sampling": "poisson",
                            "accountant": "pld", "delta": DELTA, **dp})  # fmt: skip
    return SimpleNamespace(
        fedpa=fedpa,
        federate=SimpleNamespace(total_round_num=ROUNDS),
        dataloader=SimpleNamespace(batch_size=BATCH, drop_last=False),
        train=SimpleNamespace(local_update_steps=1, batch_or_epoch="batch"),
    )


def _poisson_gaussian_epsilon(z: float, steps: int) -> float:
    """dp_accounting's own PLD epsilon of ``steps`` Poisson-sampled Gaussians (add/remove, sensitivity 1)."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(BATCH / N_I, dp_accounting.GaussianDpEvent(z)), steps
    )
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    return accountant.compose(event).get_epsilon(DELTA)


def test_the_grouped_plan_states_the_epsilon_of_the_per_group_noise_over_sqrt_2():
    plan = sample_plan(_cfg(local_tensors="grouped", local_clip=0.2), N_I)
    steps = ROUNDS * plan.steps_per_round
    assert plan.groups == 2 and plan.z_group == pytest.approx(plan.z * math.sqrt(2), rel=1e-12)
    # each group is noised at z_g = plan.z_group: the mechanism's multiplier at sensitivity 1 is z_g / sqrt(2)
    theirs = _poisson_gaussian_epsilon(plan.z_group / math.sqrt(2), steps)
    stated = plan.epsilon(steps)
    assert stated == pytest.approx(theirs, rel=1e-2, abs=1e-2), (stated, theirs)
    assert stated <= 8.0 + 1e-9  # calibrated to the target
    # accounting the per-group z at sensitivity 1 would claim far less: the check above tells the two apart
    assert _poisson_gaussian_epsilon(plan.z_group, steps) < 0.7 * stated
    # the accounted z is the one the ungrouped run calibrates: the same ledger meaning, sqrt(2) more noise a group
    assert plan.z == pytest.approx(sample_plan(_cfg(), N_I).z, rel=1e-12)
    assert sample_plan(_cfg(), N_I).groups == 1


def test_gaussian_groups_draws_each_blocks_std_from_gaussian_flats_numbers():
    """Per block, std z_g C_g empirically (200,000 entries each), from the numbers gaussian_flat draws at std 1."""
    z_g, C, C_h = 1.7, 0.05, 0.2
    sizes = [120_000, 80_000, 200_000]
    stds = [z_g * C, z_g * C, z_g * C_h]
    like = torch.zeros(1, dtype=torch.float64)
    drawn = gaussian_groups(sizes, stds, torch.Generator().manual_seed(7), like)
    plain = gaussian_flat(sizes, 1.0, torch.Generator().manual_seed(7), like)
    body, head = drawn[:200_000], drawn[200_000:]
    assert float(body.std()) == pytest.approx(z_g * C, rel=1e-2)
    assert float(head.std()) == pytest.approx(z_g * C_h, rel=1e-2)
    torch.testing.assert_close(head, plain[200_000:] * (z_g * C_h))


@pytest.mark.parametrize("dp,match", [
    ({"local_tensors": "grouped", "local_clip": -0.1}, "local_clip"),
    ({"local_clip": 0.2}, "needs fedpa.dp.local_tensors grouped"),
    ({"local_tensors": "frozen", "local_clip": 0.2}, "needs fedpa.dp.local_tensors grouped"),
])  # fmt: skip
def test_local_clip_is_refused_negative_or_without_grouped(dp, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**dp)


def test_local_clip_and_grouped_are_refused_outside_dp_sgd():
    with pytest.raises(ValueError, match="is a choice of DP-SGD"):
        FedPAConfig(dp={"mode": "client", "clip": 0.05, "epsilon": 8.0, "local_tensors": "grouped",
                        "local_clip": 0.2})  # fmt: skip
    with pytest.raises(ValueError, match="local_clip"):
        FedPAConfig(dp={"local_clip": 0.2, "local_tensors": "grouped"})

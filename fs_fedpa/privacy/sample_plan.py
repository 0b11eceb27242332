"""What a client's DP-SGD is under sample-level DP, and what account of it the server can accept: the plan of a
client of n_i records (:class:`SamplePlan`, :func:`sample_plan`) and the bounds on an account a client reports
(:func:`account_problem`). No torch and no FederatedScope import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from fs_fedpa.privacy.settings import dp_delta_for
from fs_fedpa.values import finite_number

# what a client reports it spent with each upload (SampleLevelClient.spent; SampleLevelServer.admit)
SPENT_STATS = ("dp_n", "dp_b", "dp_steps", "dp_z", "dp_clip", "dp_delta", "dp_epsilon")
MAX_RECORDS = 1e15  # more records than any client has (the intake's bound on a reported size)


@dataclass(frozen=True)
class SamplePlan:
    """Client i's DP-SGD: b of its n records a step (``sampling`` "poisson": each at rate b/n, b expected),
    ``steps_per_round`` steps a round, noise multiplier z, epsilon from ``accounting``; ``prior_sigma`` > 0: its
    label count (``fedpa.dp.label_prior``), released before its first step, composed with the steps.

    ``groups`` k: each record's gradient is clipped per group g to its own C_g and each group noised at
    N(0, (z_g C_g)^2) (``fedpa.dp.local_tensors grouped``: k = 2). Scaled by 1/C_g, that is one Gaussian mechanism of
    sensitivity sqrt(k) and noise z_g, so z_g = z sqrt(k) (:attr:`z_group`) and ``z``, the accounted multiplier at
    sensitivity 1, is what epsilon and the account read."""

    n: int
    b: int
    steps_per_round: int
    z: float
    delta: float
    sampling: str = "wor"
    accounting: str = "rdp"
    groups: int = 1
    prior_sigma: float = 0.0

    @property
    def z_group(self) -> float:
        """The noise multiplier of each clipping group: z sqrt(groups)."""
        return self.z * math.sqrt(self.groups)

    @property
    def kind(self):
        from fs_fedpa.privacy.accountant import Sampled

        return Sampled(self.n, self.b, self.z, self.sampling, self.accounting)

    def epsilon(self, steps: int) -> float:
        """epsilon after ``steps`` steps, with the label count once a step was taken (0 for none)."""
        from fs_fedpa.privacy.accountant import composed_epsilon

        return composed_epsilon(self.kind, steps, self.delta, self.prior_sigma if steps > 0 else 0.0)


def sample_plan(cfg, n: int, routines: int = 1) -> SamplePlan:
    """The plan of a client with ``n`` training records under FS config ``cfg``: b = min(batch size, n); steps a
    round as FS runs them (``local_update_steps`` batches, or that many epochs of ceil(n / b) batches, n // b with
    ``drop_last``), times the ``routines`` a round trains (2 with a personal phase); z as given, or calibrated so that
    every step it could take over the run (T rounds, or ``fedpa.dp.horizon``), with its label count
    (``fedpa.dp.label_prior``), spends at most ``fedpa.dp.epsilon`` at its delta."""
    fedpa = cfg.fedpa
    b = max(1, min(int(cfg.dataloader.batch_size), n))
    if cfg.train.batch_or_epoch == "batch":
        tau = int(cfg.train.local_update_steps)
    else:
        per_epoch = n // b if cfg.dataloader.drop_last else math.ceil(n / b)
        tau = int(cfg.train.local_update_steps) * max(per_epoch, 1)
    tau *= routines
    groups = clip_groups(fedpa.dp.local_tensors)
    if n < fedpa.dp.min_records:  # left out of DP training: no step, epsilon 0, no noise to calibrate
        delta = dp_delta_for(float(fedpa.dp.delta), n, "n_i records")
        return SamplePlan(n, b, 0, 0.0, delta, fedpa.dp.sampling, fedpa.dp.accountant, groups)
    return _plan(n, b, tau, int(fedpa.dp.horizon or cfg.federate.total_round_num), float(fedpa.dp.noise_multiplier),
                 float(fedpa.dp.epsilon), float(fedpa.dp.delta), fedpa.dp.sampling, fedpa.dp.accountant,
                 groups, float(fedpa.dp.label_prior))  # fmt: skip


def clip_groups(local_tensors: str) -> int:
    """The clipping groups of DP-SGD under ``fedpa.dp.local_tensors``: 2 when the local tensors are their own
    ('grouped'), else 1."""
    return 2 if local_tensors == "grouped" else 1


@lru_cache(maxsize=1024)
def _plan(n: int, b: int, tau: int, rounds: int, z: float, target: float, delta_setting: float, sampling: str,
          accounting: str, groups: int = 1, prior_sigma: float = 0.0) -> SamplePlan:  # fmt: skip
    from fs_fedpa.privacy.accountant import calibrate, check_pld_cost

    delta = dp_delta_for(delta_setting, n, "n_i records")
    if not z:  # the accounted z: the groups' noise is z sqrt(groups) each (SamplePlan.z_group)
        z = calibrate(n, b, rounds * tau, target, delta, sampling, accounting, prior_sigma)
    plan = SamplePlan(n, b, tau, z, delta, sampling, accounting, groups, prior_sigma)
    check_pld_cost(plan.kind, rounds * tau)  # the whole horizon's accounting, at the client's start
    return plan


def routines(method) -> int:
    """Training routines a client runs in a round: 2 for a method with a personal phase (FedDPA), else 1."""
    return 1 if method.personal_weight is None else 2


def account_problem(mine: dict, plan: Callable[[int], SamplePlan], delta_setting: float, sampling: str,
                    accounting: str) -> str | None:  # fmt: skip
    """Why a client's account ``mine`` (:data:`SPENT_STATS`) cannot be one this run's DP-SGD gives, naming the
    field, or None; checked before any plan or epsilon is computed for it, with bounds every honest client
    meets: finite numbers, whole counts, 0 <= n_i <= 1e15, 0 <= b <= n_i, steps >= 0, z >= 0, 0 <= delta < 1,
    epsilon >= 0; n_i for which the run's ``delta_setting`` (``fedpa.dp.delta``) is allowed (a client refuses to
    start at a delta above min(1e-5, 1/(10 n_i))); and steps the run's accountant can bound at the server's noise
    (``plan(n_i).z``) for n_i (the PLD accountant's memory cap, checked before anything is allocated; the RDP
    accountant bounds any count)."""
    from fs_fedpa.privacy.accountant import Sampled, check_pld_cost

    for k in SPENT_STATS:
        if not finite_number(mine[k]):
            return f"{k} {mine[k]!r} is not a finite number"
    for k in ("dp_n", "dp_b", "dp_steps"):
        if not float(mine[k]).is_integer():
            return f"{k} {mine[k]:g} is not a whole number"
    n, b, steps = int(mine["dp_n"]), int(mine["dp_b"]), int(mine["dp_steps"])
    if not 0 <= n <= MAX_RECORDS:
        return f"dp_n {n} is not a number of records in [0, {MAX_RECORDS:g}]"
    if not 0 <= b <= n:
        return f"dp_b {b} is not a batch of its dp_n {n} records"
    if steps < 0:
        return f"dp_steps {steps} is negative"
    for k, low, high in (("dp_z", 0.0, math.inf), ("dp_clip", 0.0, math.inf), ("dp_delta", 0.0, 1.0),
                         ("dp_epsilon", 0.0, math.inf)):  # fmt: skip
        if not low <= mine[k] < high:
            return f"{k} {mine[k]:g} is outside [{low:g}, {high:g})"
    try:
        dp_delta_for(float(delta_setting), max(n, 1), "n_i records")
    except ValueError as err:
        return f"dp_n {n}: {err}"
    if steps and accounting == "pld":
        z = plan(n).z or float(mine["dp_z"])
        try:
            check_pld_cost(Sampled(max(n, 1), max(b, 1), z, sampling, "pld"), steps)
        except ValueError as err:
            return f"dp_steps {steps}: {err}"
    return None


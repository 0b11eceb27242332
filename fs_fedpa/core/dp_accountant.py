"""Privacy accounting with Google's ``dp-accounting`` (the ``dp`` extra; imported only when DP is on).

Both mechanisms of :mod:`fs_fedpa.core.dp` sample a fixed-size subset without replacement (K of N clients a round,
b of n_i records a step) and are analysed under replace-one adjacency, the relation ``dp-accounting`` supports for
that sampling. Replacing one member moves the released sum by up to 2C while the noise is z C, so the event the
accountant composes is ``SampledWithoutReplacement(N, K, Gaussian(z / 2))``, ``count`` times, with the RDP
accountant. ``dp-accounting``'s Gaussian takes unit sensitivity: passing z would state an epsilon that holds only
for add/remove adjacency, which fixed-size sampling does not give.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

ACCOUNTANT = "rdp"
ADJACENCY = "replace_one"
SAMPLING = "wor"


def _dpa():
    try:
        import dp_accounting
        from dp_accounting.rdp import rdp_privacy_accountant
    except ImportError as exc:  # the dp extra is missing
        raise ImportError(
            "differential privacy (fedpa.dp_mode) needs Google's dp-accounting: pip install 'fs_fedpa[dp]' "
            "(or pip install dp-accounting)"
        ) from exc
    return dp_accounting, rdp_privacy_accountant


def version() -> str:
    from importlib.metadata import version as installed

    return f"dp-accounting {installed('dp-accounting')}"


@dataclass(frozen=True)
class Sampled:
    """One kind of event: ``sample_size`` of ``population`` without replacement, Gaussian noise multiplier ``z``
    (standard deviation z C on a sum of members clipped to C)."""

    population: int
    sample_size: int
    z: float

    @property
    def accountant_z(self) -> float:
        """The multiplier the accountant composes: z / 2 (replace-one sensitivity 2C)."""
        return self.z / 2

    def event(self, count: int):
        dpa, _ = _dpa()
        gaussian = dpa.GaussianDpEvent(self.accountant_z)
        one = gaussian if self.sample_size >= self.population else dpa.SampledWithoutReplacementDpEvent(
            self.population, self.sample_size, gaussian)  # fmt: skip
        return dpa.SelfComposedDpEvent(one, count)

    def epsilon(self, count: int, delta: float) -> float:
        """epsilon at ``delta`` after ``count`` such events (0 for none)."""
        return _epsilon(self, int(count), float(delta))

    def accountant(self, count: int):
        """The RDP accountant with ``count`` events composed (its orders and RDP values, for a check by hand)."""
        dpa, rdp = _dpa()
        accountant = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
        return accountant.compose(self.event(count)) if count else accountant


@lru_cache(maxsize=4096)
def _epsilon(kind: Sampled, count: int, delta: float) -> float:
    if count <= 0:
        return 0.0
    _, rdp = _dpa()
    orders, one = _rdp_one(kind)
    return float(rdp.compute_epsilon(orders, [count * r for r in one], delta)[0])


@lru_cache(maxsize=1024)
def _rdp_one(kind: Sampled) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The RDP curve of one event; ``count`` self-composed events have ``count`` times it (what the accountant's
    SelfComposedDpEvent computes), so the ledger needs one RDP computation per kind of event, not one per round.
    The tests compare the result with the accountant composing the whole run."""
    accountant = kind.accountant(1)  # its public orders and rdp (dp-accounting >= 0.4.4; setup.py pins the floor)
    return tuple(float(o) for o in accountant.orders), tuple(float(r) for r in accountant.rdp)


def calibrate(population: int, sample_size: int, count: int, target_epsilon: float, delta: float) -> float:
    """The smallest z (to 0.5 %) whose ``count`` events give at most ``target_epsilon`` at ``delta``."""
    if count <= 0:
        raise ValueError("calibrating a noise multiplier needs at least one event")
    lo, hi = 1e-3, 1.0
    while Sampled(population, sample_size, hi).epsilon(count, delta) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"no noise multiplier reaches epsilon {target_epsilon:g} at delta {delta:g}")
    while hi - lo > 5e-3 * hi:
        mid = (lo + hi) / 2
        if Sampled(population, sample_size, mid).epsilon(count, delta) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def poisson_add_remove_epsilon(rate: float, z: float, count: int, delta: float) -> float:
    """epsilon at ``delta`` of ``count`` steps read in the convention of Opacus, TF Privacy and the DP fine-tuning
    papers: each member included independently with probability ``rate`` (Poisson sampling), add/remove adjacency,
    so the Gaussian's multiplier is z itself (sensitivity C); dp-accounting's RDP accountant. A different guarantee
    from the plugin's (fixed-size sampling, replace-one, z/2): it serves to compare the same noise with published
    numbers, never as the run's guarantee."""
    if count <= 0:
        return 0.0
    dpa, rdp = _dpa()
    event = dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(z)) if rate < 1 else dpa.GaussianDpEvent(z)
    accountant = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    return float(accountant.compose(dpa.SelfComposedDpEvent(event, int(count))).get_epsilon(delta))

"""Privacy accounting with Google's ``dp-accounting`` (the ``dp`` extra; imported only when DP is on).

Both mechanisms of :mod:`fs_fedpa.privacy.mechanism` release a sum of members clipped to C plus N(0, (z C)^2) (divided by the
fixed or expected sample size, which changes nothing here). Two samplings, each with the adjacency it supports
(``fedpa.dp.sampling``):

- ``wor``: a fixed-size subset without replacement (K of N clients, b of n_i records), replace-one adjacency.
  Replacing one member moves the sum by up to 2C, so the Gaussian the accountant sees has sensitivity 2, i.e.
  multiplier z / 2 at unit sensitivity. Passing z would state an epsilon that holds only for add/remove adjacency.
- ``poisson``: each member included independently at rate q = K/N or b/n_i, add/remove adjacency (the convention of
  Opacus, TF Privacy and the DP fine-tuning papers): sensitivity C, multiplier z.

Two accountants (``fedpa.dp.accountant``), both valid upper bounds on the same mechanism:

- ``rdp``: dp-accounting's RDP accountant with its event for the sampling (``SampledWithoutReplacement`` under
  REPLACE_ONE, or ``PoissonSampled`` under ADD_OR_REMOVE_ONE).
- ``pld``: the privacy loss distribution (PLD) of a dominating pair, composed by FFT, pessimistic rounding at
  :data:`PLD_INTERVAL` (every rounding only raises delta, so the bound stays valid). Poisson: dp-accounting's own
  pair for the subsampled Gaussian, both the remove and the add direction. Without replacement, replace-one, it is
  built here (dp-accounting's PLD accountant has no such event; docs/privacy.md gives the proof in full):

  1. In units of C, the base Gaussian on a sum is dominated under replace-one by P = N(2, z^2), Q = N(0, z^2).
     Sampling b of n without replacement, q = b / n: for alpha >= 1 and either order of a neighbouring pair,
     H_alpha <= q H_alpha'(P || Q) = H_alpha(R), R = (q P + (1 - q) Q, Q), by the advanced joint convexity and the
     couplings of Balle, Barthe and Gaboardi (NeurIPS 2018); Zhu, Dong and Wang (AISTATS 2022) state the same pair.
  2. For alpha < 1, H_alpha(X || Y) = 1 - alpha + alpha H_{1/alpha}(Y || X), and replace-one is symmetric, so the
     bound there is that of the reversed pair R^rev = (Q, q P + (1 - q) Q). The profile "R above 1, R^rev below" is
     a symmetric pair's (Dong, Roth and Su's min{f_p, f_p^-1}** for sampling without replacement); composing R alone
     for both orders, as a Poisson remove-PLD would, is not justified.
  3. A symmetric pair's PLD is fixed by its positive losses: mass w at loss l > 0 comes with mass e^-l w at -l, and
     what is left sits at 0. The positive losses are R's, taken from dp-accounting's pessimistic PLD of the subsampled
     Gaussian (REMOVE, sensitivity 2), so the pair built here dominates the mechanism at every alpha, and
     compositions of it bound the run (dominating pairs compose, Zhu, Dong and Wang, adaptively).

  tests/unit/privacy/test_accountant.py checks it against hockey-stick divergences integrated by hand (one and two
  releases, the worst datasets of a small case) and against the RDP bound, which it never exceeds.

A client's label count (``fedpa.dp.label_prior`` sigma) is one more Gaussian, not subsampled, of L2 sensitivity 1
(add/remove) or sqrt(2) (replace-one): :func:`composed_epsilon` composes it with the steps (PLD: the two PLDs; RDP:
the curves added at each order), and :func:`calibrate` calibrates z for the composition.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("wor", "poisson")
ADJACENCY = {"wor": "replace_one", "poisson": "add_remove"}
PLD_INTERVAL = 1e-3  # the PLD's loss grid: 1e-4 moved no epsilon of the protocol's runs by 1e-4, at 10x the time
# the PLD accountant's memory is bounded before it is asked for: a grid point is 8 bytes (16 complex in the FFT);
# a Gaussian's losses are kept out to about 10 standard deviations (dp-accounting's mass truncation bound, e^-50)
PLD_MEMORY_CAP = 4 * 2**30
PLD_MAX_EVENTS = 10**6  # events the PLD accountant composes at most: a calibration at 10^6 took 32 s here, beyond grows
MAX_EPSILON = 100.0  # the largest target epsilon calibrated to (fedpa.dp.epsilon)
_PLD_TAIL_SDS = 10.0
_PLD_COPIES = 4  # live arrays of the grid's size while dp-accounting FFT-composes it
# bytes per point of one event's grid while dp-accounting builds it (its loss and CDF temporaries): tracemalloc
# measured 72-84 per point of the span below (wor and poisson, z 0.05-0.3), the process's peak RSS 91; 8 bytes times
# 4 copies, the estimate before, passed z=0.0057 at 3.9 GiB and the build peaked at 9.8 GB
_PLD_BUILD_BYTES = 128


def _dpa():
    try:
        import dp_accounting
        from dp_accounting.rdp import rdp_privacy_accountant
    except ImportError as exc:  # the dp extra is missing
        raise ImportError(
            "differential privacy (fedpa.dp.mode) needs Google's dp-accounting: pip install 'fs_fedpa[dp]' "
            "(or pip install dp-accounting)"
        ) from exc
    return dp_accounting, rdp_privacy_accountant


def version() -> str:
    from importlib.metadata import version as installed

    return f"dp-accounting {installed('dp-accounting')}"


def describe(accounting: str) -> str:
    """The ledger's name of an accountant: ``"rdp, dp-accounting 0.6.0"``."""
    return f"{accounting}, {version()}"


@dataclass(frozen=True)
class Sampled:
    """One kind of event: ``sample_size`` of ``population`` a release (fixed size without replacement, or Poisson at
    rate sample_size / population), Gaussian noise multiplier ``z`` (standard deviation z C on a sum of members
    clipped to C), accounted with ``accounting``."""

    population: int
    sample_size: int
    z: float
    sampling: str = "wor"
    accounting: str = "rdp"

    def __post_init__(self):
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"dp sampling {self.sampling!r} must be one of {SAMPLINGS}")
        if self.accounting not in ACCOUNTANTS:
            raise ValueError(f"dp accountant {self.accounting!r} must be one of {ACCOUNTANTS}")

    @property
    def rate(self) -> float:
        """q: the chance that a given member is in a release."""
        return min(1.0, self.sample_size / self.population)

    @property
    def adjacency(self) -> str:
        return ADJACENCY[self.sampling]

    @property
    def sensitivity(self) -> float:
        """How far one member moves the released sum, in units of C: 2 (replace-one), 1 (add/remove)."""
        return 2.0 if self.sampling == "wor" else 1.0

    @property
    def accountant_z(self) -> float:
        """The multiplier of the unit-sensitivity Gaussian the accountant composes: z / 2 or z."""
        return self.z / self.sensitivity

    def event(self, count: int):
        """dp-accounting's event for ``count`` releases (the RDP accountant's input)."""
        dpa, _ = _dpa()
        gaussian = dpa.GaussianDpEvent(self.accountant_z)
        if self.rate >= 1:
            one = gaussian
        elif self.sampling == "wor":
            one = dpa.SampledWithoutReplacementDpEvent(self.population, self.sample_size, gaussian)
        else:
            one = dpa.PoissonSampledDpEvent(self.rate, gaussian)
        return dpa.SelfComposedDpEvent(one, count)

    def epsilon(self, count: int, delta: float) -> float:
        """epsilon at ``delta`` after ``count`` such events (0 for none)."""
        return _epsilon(self, int(count), float(delta))

    def accountant(self, count: int):
        """The RDP accountant with ``count`` events composed (its orders and RDP values, for a check by hand)."""
        dpa, rdp = _dpa()
        relation = (dpa.NeighboringRelation.REPLACE_ONE if self.sampling == "wor"
                    else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)  # fmt: skip
        accountant = rdp.RdpAccountant(neighboring_relation=relation)
        return accountant.compose(self.event(count)) if count else accountant

    def pld(self):
        """The privacy loss distribution of one event (module docstring): dp-accounting's
        ``PrivacyLossDistribution``, pessimistic at :data:`PLD_INTERVAL`."""
        return _pld_one(self)


def pld_single_bytes(kind: Sampled) -> float:
    """About the bytes dp-accounting needs for one event's PLD grid: the Gaussian's losses, s (x - s / 2) / z^2 over
    x within :data:`_PLD_TAIL_SDS` standard deviations, span s^2 / z^2 + 2 t s / z, at :data:`PLD_INTERVAL` (an
    upper bound on the subsampled event's span, whose losses are log(1 - q + q e^l)), times the bytes a point takes
    while it is built (:data:`_PLD_BUILD_BYTES`, measured)."""
    s, z = kind.sensitivity, kind.z
    if z <= 0:
        return float("inf")
    return _PLD_BUILD_BYTES * (s * s / (z * z) + 2 * _PLD_TAIL_SDS * s / z) / PLD_INTERVAL


def check_pld_events(count: int) -> None:
    """ValueError for more than :data:`PLD_MAX_EVENTS` events composed by the PLD accountant."""
    if count > PLD_MAX_EVENTS:
        raise ValueError(
            f"the PLD accountant composes at most {PLD_MAX_EVENTS:,} events and this needs {count:,}: beyond it each "
            "epsilon takes minutes and more; use the RDP accountant (fedpa.dp.accountant rdp, dp-table --accountant "
            "rdp)"
        )


def _refuse_pld(kind: Sampled, count: int | None, need: float) -> None:
    # one event's grid does not depend on the rate (the config check has none to give)
    steps = "" if count is None else f" at rate q={kind.rate:g} over {count} events"
    raise ValueError(
        f"the PLD accountant would need about {need / 2**30:.3g} GiB for noise multiplier z={kind.z:g}{steps}, above "
        f"its cap of {PLD_MEMORY_CAP / 2**30:g} GiB: use fedpa.dp.accountant rdp, or more noise"
    )


def check_pld_cost(kind: Sampled, count: int | None) -> None:
    """ValueError, before anything is allocated, if ``count`` events of ``kind`` (None: one event's grid alone, which
    does not depend on the rate) would take the PLD accountant past :data:`PLD_MEMORY_CAP`: first from
    :func:`pld_single_bytes`, then from the length dp-accounting's own Chernoff bound gives the composition's FFT
    (``compute_self_convolve_bounds``, what ``self_compose`` allocates)."""
    if kind.accounting != "pld":
        return
    if count is None or count <= 0:
        if (need := pld_single_bytes(kind)) > PLD_MEMORY_CAP:
            _refuse_pld(kind, None, need)
        return
    check_pld_events(count)
    from dp_accounting.pld import common

    one = kind.pld()  # refuses a grid past the cap before building it (_pld_one)
    for pmf in {id(p): p for p in (one._pmf_remove, one._pmf_add)}.values():
        probs = getattr(pmf, "_probs", None)
        if probs is None:  # a sparse pmf: a few points
            continue
        low, high = common.compute_self_convolve_bounds(probs, count, 1e-15)
        if (need := 16 * _PLD_COPIES * max(high - low + 1, len(probs))) > PLD_MEMORY_CAP:
            _refuse_pld(kind, count, need)


@lru_cache(maxsize=4096)
def _epsilon(kind: Sampled, count: int, delta: float) -> float:
    if count <= 0:
        return 0.0
    if kind.accounting == "pld":
        check_pld_cost(kind, count)
        epsilon = float(kind.pld().self_compose(count).get_epsilon_for_delta(delta))
        if not epsilon < float("inf"):
            raise ValueError(
                f"the PLD accountant gives no finite epsilon at delta {delta:g} for {count} events of noise "
                f"multiplier z={kind.z:g} at rate q={kind.rate:g}: the noise is too small for any guarantee there"
            )
        return epsilon
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


@lru_cache(maxsize=256)
def _pld_one(kind: Sampled):
    _dpa()
    if (need := pld_single_bytes(kind)) > PLD_MEMORY_CAP:
        _refuse_pld(kind, None, need)
    from dp_accounting.pld import privacy_loss_distribution as pld

    if kind.sampling == "poisson":
        return pld.from_gaussian_mechanism(kind.z, sensitivity=1.0, sampling_prob=kind.rate,
                                           value_discretization_interval=PLD_INTERVAL)  # fmt: skip
    if kind.rate >= 1:  # every member in every release: the Gaussian pair (N(2, z^2), N(0, z^2)), symmetric itself
        # (step 3 below would mirror a pair whose two halves already hold all the mass, and rounding tips it over 1)
        return pld.from_gaussian_mechanism(kind.z, sensitivity=2.0, value_discretization_interval=PLD_INTERVAL)
    return pld.PrivacyLossDistribution(_symmetric_wor_pmf(kind.z, kind.rate))


def _symmetric_wor_pmf(z: float, q: float):
    """The PLD pmf of step 3 of the module docstring: R's positive losses (pessimistic), mirrored with weight e^-l,
    the rest of the mass at loss 0."""
    import numpy as np
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as pld
    from dp_accounting.pld import privacy_loss_mechanism as mechanism

    loss = mechanism.GaussianPrivacyLoss(z, sensitivity=2.0, pessimistic_estimate=True, sampling_prob=q,
                                         adjacency_type=mechanism.AdjacencyType.REMOVE)  # fmt: skip
    # dp-accounting builds a pmf from a privacy loss only through this private helper (its public from_* functions
    # take mechanisms and relations, none of them this pair); the tests pin what it gives
    remove = pld._create_pld_pmf_from_monotone_privacy_loss(loss, pessimistic_estimate=True,
                                                            value_discretization_interval=PLD_INTERVAL,
                                                            use_connect_dots=True).to_dense_pmf()  # fmt: skip
    step, low, probs = remove._discretization, remove._lower_loss, np.asarray(remove._probs, dtype=np.float64)
    index = np.arange(low, low + len(probs))
    top = int(index[-1]) if len(index) and index[-1] > 0 else 0
    positive = np.zeros(top + 1)
    keep = index > 0
    positive[index[keep]] = probs[keep]
    mirrored = positive[1:][::-1] * np.exp(-step * np.arange(top, 0, -1))  # losses -top .. -1
    rest = 1.0 - positive.sum() - mirrored.sum() - remove._infinity_mass
    if rest < -1e-9:
        raise ArithmeticError(f"the symmetric PLD at z={z:g}, q={q:g} has mass {1 - rest:.12g} > 1")
    dense = np.concatenate([mirrored, [max(rest, 0.0)], positive[1:]])
    return pld_pmf.DensePLDPmf(step, -top, dense, remove._infinity_mass, pessimistic_estimate=True)


COUNT_SENSITIVITY = {"poisson": 1.0, "wor": 2.0**0.5}  # a label count's L2 sensitivity under the sampling's adjacency


def count_event(sigma: float, sampling: str, accounting: str) -> Sampled:
    """A label count of noise sigma as one event: the Gaussian of multiplier sigma / sensitivity at unit sensitivity
    (rate 1, so no subsampling; "poisson" here only sets unit sensitivity)."""
    return Sampled(1, 1, sigma / COUNT_SENSITIVITY[sampling], "poisson", accounting)


def composed_epsilon(kind: Sampled, count: int, delta: float, prior_sigma: float = 0.0) -> float:
    """epsilon at ``delta`` of ``count`` events of ``kind`` composed with one label count of noise ``prior_sigma``
    (0: none; :func:`count_event`)."""
    if not prior_sigma:
        return kind.epsilon(count, delta)
    return _composed(kind, int(count), float(delta), float(prior_sigma))


@lru_cache(maxsize=4096)
def _composed(kind: Sampled, count: int, delta: float, prior_sigma: float) -> float:
    prior = count_event(prior_sigma, kind.sampling, kind.accounting)
    if kind.accounting == "pld":
        check_pld_cost(prior, None)
        pld = prior.pld()
        if count > 0:
            check_pld_cost(kind, count)
            pld = kind.pld().self_compose(count).compose(pld)
        epsilon = float(pld.get_epsilon_for_delta(delta))
        if not epsilon < float("inf"):
            raise ValueError(f"the PLD accountant gives no finite epsilon at delta {delta:g} for the label count and "
                             f"{count} events of z={kind.z:g}")  # fmt: skip
        return epsilon
    _, rdp = _dpa()
    orders, one = _rdp_one(kind)
    prior_orders, prior_one = _rdp_one(prior)
    if prior_orders != orders:  # both the accountant's default orders
        raise ArithmeticError("the label count's RDP orders are not the steps'")
    # no step: the count alone (0 x an order's inf, where dp-accounting gives one, would be nan)
    steps = [count * r if count else 0.0 for r in one]
    return float(rdp.compute_epsilon(orders, [r + p for r, p in zip(steps, prior_one)], delta)[0])


def calibrate(population: int, sample_size: int, count: int, target_epsilon: float, delta: float,
              sampling: str = "wor", accounting: str = "rdp", prior_sigma: float = 0.0) -> float:  # fmt: skip
    """The smallest z (to 0.5 %) whose ``count`` events, composed with a label count of noise ``prior_sigma`` (0:
    none), give at most ``target_epsilon`` at ``delta``."""
    if count <= 0:
        raise ValueError("calibrating a noise multiplier needs at least one event")
    if accounting == "pld":
        check_pld_events(count)

    if not 0 < target_epsilon <= MAX_EPSILON:
        raise ValueError(
            f"a target epsilon of {target_epsilon:g} is outside the accountants' range (0, {MAX_EPSILON:g}]: above "
            "it the PLD grid no longer resolves the losses and no guarantee is meaningful"
        )

    if prior_sigma and composed_epsilon(Sampled(population, sample_size, 1.0, sampling, accounting), 0, delta,
                                        prior_sigma) >= target_epsilon:  # fmt: skip
        raise ValueError(f"fedpa.dp.label_prior(={prior_sigma:g}) alone spends epsilon {target_epsilon:g} or more at "
                         f"delta {delta:g}: raise it")  # fmt: skip

    def spent(z: float) -> float:
        try:
            return composed_epsilon(Sampled(population, sample_size, z, sampling, accounting), count, delta,
                                    prior_sigma)  # fmt: skip
        except ValueError:  # too little noise for the accountant (no finite epsilon, or past its memory cap)
            return float("inf")

    lo, hi = 1e-3, 1.0
    while spent(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"no noise multiplier reaches epsilon {target_epsilon:g} at delta {delta:g}")
    while hi - lo > 5e-3 * hi:
        mid = (lo + hi) / 2
        if spent(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def poisson_add_remove_epsilon(rate: float, z: float, count: int, delta: float) -> float:
    """epsilon at ``delta`` of ``count`` steps read in the convention of Opacus, TF Privacy and the DP fine-tuning
    papers: each member included independently with probability ``rate`` (Poisson sampling), add/remove adjacency,
    so the Gaussian's multiplier is z itself (sensitivity C); dp-accounting's RDP accountant. For a run made with
    ``wor`` sampling this is a different guarantee from the run's own: it serves to compare the same noise with
    published numbers, never as that run's guarantee."""
    if count <= 0:
        return 0.0
    dpa, rdp = _dpa()
    event = dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(z)) if rate < 1 else dpa.GaussianDpEvent(z)
    accountant = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    return float(accountant.compose(dpa.SelfComposedDpEvent(event, int(count))).get_epsilon(delta))


@lru_cache(maxsize=256)
def poisson_replace_one_epsilon(rate: float, z: float, count: int, delta: float) -> float:
    """epsilon at ``delta`` of ``count`` steps of a Poisson run (each member in at rate q) read under replace-one
    adjacency, for comparison with published numbers only: the PLD (pessimistic, at :data:`PLD_INTERVAL`) of the pair
    in which the replaced member's clipped contribution is +C and its replacement's -C, each in at rate q, in units of
    C: P = (1 - q) N(0, z^2) + q N(1, z^2), Q = (1 - q) N(0, z^2) + q N(-1, z^2). Its loss log P(y)/Q(y) rises with y
    and the pair is symmetric (Q(y) = P(-y)), so one pmf serves both orders. Reading the same noise with fixed-size
    sampling instead (``Sampled(..., "wor", "pld")``) changes the sampling too, and states far more."""
    if count <= 0:
        return 0.0
    _dpa()
    import numpy as np
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as pld
    from scipy.stats import norm

    q, h = min(rate, 1.0), PLD_INTERVAL
    mix = np.log1p(-q) if q < 1 else -np.inf

    def loss(y):
        up = np.logaddexp(mix + norm.logpdf(y, 0, z), np.log(q) + norm.logpdf(y, 1, z))
        return up - np.logaddexp(mix + norm.logpdf(y, 0, z), np.log(q) + norm.logpdf(y, -1, z))

    def below(y):  # P(Y <= y)
        return (1 - q) * norm.cdf(y, 0, z) + q * norm.cdf(y, 1, z)

    lo, hi = -1 - _PLD_TAIL_SDS * z, 1 + _PLD_TAIL_SDS * z  # P's mass outside: about e^-50 a side
    ks = np.arange(int(np.ceil(loss(lo) / h)), int(np.ceil(loss(hi) / h)) + 1)
    a, b = np.full(len(ks), lo), np.full(len(ks), hi)
    for _ in range(100):  # y_k = the y where the loss reaches k h, by bisection (the loss rises with y)
        mid = (a + b) / 2
        up = loss(mid) >= ks * h
        a, b = np.where(up, a, mid), np.where(up, mid, b)
    # the mass of P with loss in ((k-1) h, k h] sits at k h (rounded up: pessimistic); below lo at the first point,
    # above hi at infinity
    mass = np.diff(np.concatenate([[0.0], below(b)]))
    pmf = pld_pmf.DensePLDPmf(h, int(ks[0]), mass, float(1 - below(b[-1])), pessimistic_estimate=True)
    return float(pld.PrivacyLossDistribution(pmf).self_compose(int(count)).get_epsilon_for_delta(delta))

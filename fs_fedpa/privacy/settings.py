"""The DP keys of the ``fedpa:`` section (``fedpa.dp_*``): one dataclass, :class:`DPSettings`, which
:class:`~fs_fedpa.config.FedPAConfig` extends, and its check. No torch here.

The keys stay flat (``fedpa.dp_clip``, not ``fedpa.dp.clip``): they are the names every run file, yaml and the docs
use, and FS's command line spells them so. What the check knows of a mechanism it reads from its declaration
(:mod:`fs_fedpa.privacy.registry`), so a registered mechanism is checked without an edit here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from fs_fedpa.privacy import registry
from fs_fedpa.values import integer, number, shown

DP_SAMPLINGS = ("wor", "poisson")
DP_ACCOUNTANTS = ("rdp", "pld")
DP_LOCAL_TENSORS = ("noised", "frozen")  # "plain" is refused by name: it broke DP-SGD's guarantee
DP_DELTA_MAX = 1e-5  # the largest delta a run may take, whatever the population (docs/privacy.md)
SEED_MAX = 2**32 - 1


@dataclass
class DPSettings:
    """The ``fedpa.dp_*`` keys, their defaults and help (docs/config.md), and :meth:`check_dp`."""

    dp_mode: str = field(
        default="none",
        metadata={
            "help": (
                "differential privacy (docs/privacy.md): 'client' (client-level DP with a trusted server: it samples "
                "K of N clients, clips each contribution to dp_clip, adds Gaussian noise to the mean over K), "
                "'sample' (each client trains by DP-SGD over its own records), or 'none'"
            )
        },
    )
    dp_clip: float = field(
        default=0.0,
        metadata={
            "help": (
                "C > 0: the clip norm of a client's contribution (client mode: ||s_i B_i A_i||_F for fedpa, the "
                "Frobenius norm of the round change of the uploaded factors for the others) or of a per-example "
                "gradient (sample mode)"
            )
        },
    )
    dp_noise_multiplier: float = field(
        default=0.0,
        metadata={
            "help": (
                "z > 0: Gaussian noise of standard deviation z C / K on the mean (client mode) or z C on the sum of "
                "clipped gradients (sample mode); give it or dp_epsilon, not both"
            )
        },
    )
    dp_epsilon: float = field(
        default=0.0,
        metadata={
            "help": (
                "a target epsilon > 0 for the whole run, from which z is computed (client mode: for T rounds; sample "
                "mode: per client, for every step it could take); give it or dp_noise_multiplier, not both"
            )
        },
    )
    dp_delta: float = field(
        default=0.0,
        metadata={
            "help": (
                "delta of the reported (epsilon, delta); 0: the largest allowed, min(1e-5, 1/(10 N)) in client mode "
                "(N clients) and min(1e-5, 1/(10 n_i)) in sample mode (n_i records of client i); larger is refused"
            )
        },
    )
    dp_horizon: int = field(
        default=0,
        metadata={
            "help": (
                "the rounds a dp_epsilon target covers: z is calibrated for this many rounds (0: "
                "federate.total_round_num; at least that), so a shorter run, e.g. a tuning run, trains at the noise "
                "of the full one"
            )
        },
    )
    dp_sampling: Literal["wor", "poisson"] = field(
        default="wor",
        metadata={
            "help": (
                "how DP samples (docs/privacy.md): 'wor', a fixed K of N clients a round (client mode) or b of n_i "
                "records a step (sample mode) without replacement, with replace-one adjacency; 'poisson', each client "
                "(record) in independently at rate K/N (b/n_i), the sum divided by the expected K (b), with "
                "add/remove adjacency: the convention of Opacus and the DP fine-tuning papers"
            )
        },
    )
    dp_accountant: Literal["rdp", "pld"] = field(
        default="rdp",
        metadata={
            "help": (
                "the accountant that calibrates z and states epsilon (dp-accounting): 'rdp' (Renyi DP) or 'pld' "
                "(privacy loss distribution: a tighter valid bound, 14-16 % less noise at epsilon 8 on the protocol's "
                "shards); rdp stays the default so that the runs made with it keep their noise"
            )
        },
    )
    dp_min_records: int = field(
        default=0,
        metadata={
            "help": (
                "sample mode: a client with fewer training records takes no DP-SGD step (0: none is left out); it "
                "sends the factors it started the round from with sample size 0, which weighs nothing in the "
                "aggregate, and spends epsilon 0. At b of n_i records a step, a small client needs a large z"
            )
        },
    )
    dp_chunk: int = field(
        default=0,
        metadata={
            "help": (
                "sample mode: records a batched DP-SGD forward takes on a CPU (0: 4; an accelerator takes the whole "
                "batch). Chunks are length-sorted and each record is clipped alone, so the step is the same; larger "
                "chunks of a large b cost less (benchmarks/bench_dp_sgd.py --kinds cache cache_chunks)"
            )
        },
    )
    dp_local_tensors: Literal["noised", "frozen"] = field(
        default="noised",
        metadata={
            "help": (
                "sample mode: the client's local tensors (personalization.local_param, e.g. a local head) train "
                "under DP-SGD with the rest, clipped and noised ('noised'), or stay at their initial value, which no "
                "record touches, while the rest trains ('frozen'). Either way every tensor the client trains is "
                "inside the mechanism, so the guarantee covers all it sends and its exports. 'plain' (the head on "
                "the batch's exact gradient) is refused: through the head one record moves every other record's "
                "clipped gradient, so a step's sensitivity is not 2C and the stated epsilon would be no guarantee"
            )
        },
    )
    dp_secure_rng: bool = field(
        default=True,
        metadata={
            "help": (
                "without dp_seed: draw the DP noise and sampling from the OS's cryptographic generator (a sum of two "
                "Gaussians, as Opacus's secure_mode), whose state cannot be recovered from its outputs; False: "
                "torch's MT19937 seeded from OS entropy (faster, weaker); ignored with dp_seed"
            )
        },
    )
    dp_seed: int = field(
        default=-1,
        metadata={
            "help": (
                "seed of the DP noise and sampling (0 to 2**32 - 1), for reproducible experiments: the guarantee then "
                "assumes the seed is secret; -1: seeded from OS entropy (never from the run's seed)"
            )
        },
    )

    def check_dp(self) -> None:
        """ValueError, one line naming the key, for DP settings no mechanism can honour; called by
        :class:`~fs_fedpa.config.FedPAConfig` after its own checks (some rules read its other keys)."""
        kind = registry.entry(self.dp_mode)
        for key in ("dp_clip", "dp_noise_multiplier", "dp_epsilon", "dp_delta"):
            setattr(self, key, number(getattr(self, key), key, minimum=0.0))
        self.dp_seed = integer(self.dp_seed, "dp_seed", minimum=-1)
        self.dp_horizon = integer(self.dp_horizon, "dp_horizon", minimum=0)
        self.dp_min_records = integer(self.dp_min_records, "dp_min_records", minimum=0)
        self.dp_chunk = integer(self.dp_chunk, "dp_chunk", minimum=0)
        if not isinstance(self.dp_secure_rng, bool):
            raise ValueError(f"fedpa.dp_secure_rng must be True or False, got {self.dp_secure_rng!r}")
        if self.dp_seed > SEED_MAX:
            raise ValueError(f"fedpa.dp_seed(={self.dp_seed}) must be <= 2**32 - 1")
        if self.dp_local_tensors == "plain":
            raise ValueError(
                "fedpa.dp_local_tensors 'plain' is withdrawn: a local head trained on the batch's exact gradient "
                "changes every other record's clipped gradient, so DP-SGD's sensitivity bound does not hold and "
                "epsilon is no guarantee; use 'noised' (the default) or 'frozen'"
            )
        for key, choices in (("dp_sampling", DP_SAMPLINGS), ("dp_accountant", DP_ACCOUNTANTS),
                             ("dp_local_tensors", DP_LOCAL_TENSORS)):  # fmt: skip
            if getattr(self, key) not in choices:
                raise ValueError(f"fedpa.{key}(={getattr(self, key)!r}) must be one of {choices}")
        defaults = dp_defaults()
        if not kind.noised:
            stray = [f"fedpa.{k}={shown(getattr(self, k))}" for k, off in defaults.items()
                     if getattr(self, k) != off]  # fmt: skip
            if stray:
                raise ValueError(
                    f"{', '.join(stray)} set while fedpa.dp_mode is {self.dp_mode!r}: this run would train without "
                    "differential privacy and write no ledger; set fedpa.dp_mode sample or client, or remove them"
                )
            return
        owners = {k: m for m in registry.modes() for k in registry.entry(m).own_keys}
        for key, owner in owners.items():
            if key not in kind.own_keys and getattr(self, key) != defaults[key]:
                raise ValueError(
                    f"fedpa.{key} is a choice of {registry.entry(owner).title} (fedpa.dp_mode {owner}); fedpa.dp_mode "
                    f"{self.dp_mode} does not read it ({OWN_KEY_WHY.get(key, 'it is not part of its mechanism')}): "
                    "unset it"
                )
        if self.dp_clip <= 0:
            raise ValueError(f"fedpa.dp_mode {self.dp_mode!r} needs fedpa.dp_clip, the clip norm C > 0")
        if (self.dp_noise_multiplier > 0) == (self.dp_epsilon > 0):
            raise ValueError(
                f"fedpa.dp_mode {self.dp_mode!r} needs exactly one of fedpa.dp_noise_multiplier (z > 0) and "
                f"fedpa.dp_epsilon (a target from which z is computed); got z={self.dp_noise_multiplier:g}, "
                f"epsilon={self.dp_epsilon:g}"
            )
        if self.dp_delta > DP_DELTA_MAX:
            raise ValueError(f"fedpa.dp_delta(={self.dp_delta:g}) must be <= {DP_DELTA_MAX:g} (0: the default)")
        from fs_fedpa.privacy.accountant import MAX_EPSILON  # torch-free

        if self.dp_epsilon > MAX_EPSILON:
            raise ValueError(
                f"fedpa.dp_epsilon(={self.dp_epsilon:g}) must be <= {MAX_EPSILON:g}: above it the accountants' "
                "discretisation no longer resolves the losses and no guarantee is meaningful"
            )
        if getattr(self, "adaptive_lam", "none") != "none":
            raise ValueError(
                f"fedpa.adaptive_lam {self.adaptive_lam!r} with differential privacy (fedpa.dp_mode "
                f"{self.dp_mode!r}): the adaptive lambda is computed from the task loss and its gradients, which "
                "would leave the mechanism; use a fixed fedpa.lam"
            )
        for key, why in kind.refuses.items():
            if getattr(self, key, None):
                raise ValueError(f"fedpa.{key} with differential privacy (fedpa.dp_mode {self.dp_mode!r}): {why}")

    def dp_delta_for(self, population: int) -> float:
        """delta of a population of ``population`` (N clients, or n_i records under DP-SGD) (:func:`dp_delta_for`)."""
        return dp_delta_for(self.dp_delta, population, registry.entry(self.dp_mode).population)


# why a key of DP-SGD means nothing to a mechanism without it, for the refusal of it there
OWN_KEY_WHY = {
    "dp_min_records": "without DP-SGD a client's update is clipped and noised whatever its size",
    "dp_chunk": "it sizes DP-SGD's forward",
    "dp_local_tensors": "without DP-SGD a client's local tensors train on its data and never leave it",
}


def dp_defaults() -> dict:
    """The keys that only mean something under DP (every field of :class:`DPSettings` but ``dp_mode``) and their
    values when DP is off, their defaults: one list, so a new DP key is refused without DP by being declared."""
    return {f.name: f.default for f in fields(DPSettings) if f.name != "dp_mode"}


def dp_delta_for(setting: float, population: int, who: str) -> float:
    """delta of a population of ``population`` (``who``: "N clients", "n_i records"): ``setting``
    (fedpa.dp_delta), or 0's default min(1e-5, 1/(10 population)); ValueError above that bound, which keeps the
    chance of a total release of one member far below 1/population."""
    bound = min(DP_DELTA_MAX, 1.0 / (10 * max(population, 1)))
    if setting == 0:
        return bound
    if setting > bound * (1 + 1e-9):
        raise ValueError(
            f"fedpa.dp_delta(={setting:g}) is above min(1e-5, 1/(10 x {population} {who})) = {bound:g}: "
            f"a delta near 1/{population} allows releasing one member outright; lower it or set 0"
        )
    return setting

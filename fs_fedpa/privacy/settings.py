"""The DP part of the ``fedpa:`` section (``fedpa.dp.*``): one dataclass, :class:`DPSettings`, a part of
:class:`~fs_fedpa.config.FedPAConfig`, and its check. No torch here.

Each key was flat before (``fedpa.dp_clip``, now ``fedpa.dp.clip``: its field's ``was``); the run files of the study
name them so, and they still work (:func:`fs_fedpa.plugin.config_fs.map_flat_keys`). What the check knows of a
mechanism it reads from its declaration (:mod:`fs_fedpa.privacy.registry`), so a registered mechanism is checked
without an edit here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from fs_fedpa.privacy import registry
from fs_fedpa.values import integer, number, shown

DP_SAMPLINGS = ("wor", "poisson")
DP_ACCOUNTANTS = ("rdp", "pld")
DP_LOCAL_TENSORS = ("noised", "frozen", "grouped")  # "plain" is refused by name: it broke DP-SGD's guarantee
DP_DELTA_MAX = 1e-5  # the largest delta a run may take, whatever the population (docs/privacy.md)
# bound of dp.clip and dp.noise_multiplier: the server drops any factor entry beyond 1e6 (docs/dev/faults.md), and
# noise of standard deviation z C up to 1e12 stays finite in float32 even squared and summed; 1e308 overflowed later
DP_VALUE_MAX = 1e6
SEED_MAX = 2**32 - 1


@dataclass
class DPSettings:
    """``fedpa.dp``: the keys, their defaults and help (docs/config.md), and their check."""

    mode: str = field(
        default="none",
        metadata={
            "was": "dp_mode",
            "help": (
                "differential privacy (docs/privacy.md): 'client' (client-level DP with a trusted server: it samples "
                "K of N clients, clips each contribution to dp.clip, adds Gaussian noise to the mean over K), "
                "'sample' (each client trains by DP-SGD over its own records), or 'none'"
            ),
        },
    )
    clip: float = field(
        default=0.0,
        metadata={
            "was": "dp_clip",
            "help": (
                "C in (0,1e6]: the clip norm of a client's contribution (client mode: ||s_i B_i A_i||_F for fedpa, the "
                "Frobenius norm of the round change of the uploaded factors for the others) or of a per-example "
                "gradient (sample mode)"
            ),
        },
    )
    noise_multiplier: float = field(
        default=0.0,
        metadata={
            "was": "dp_noise_multiplier",
            "help": (
                "z in (0,1e6]: Gaussian noise of standard deviation z C / K on the mean (client mode) or z C on the sum of "
                "clipped gradients (sample mode); give it or dp.epsilon, not both"
            ),
        },
    )
    epsilon: float = field(
        default=0.0,
        metadata={
            "was": "dp_epsilon",
            "help": (
                "a target epsilon > 0 for the whole run, from which z is computed (client mode: for T rounds; sample "
                "mode: per client, for every step it could take); give it or dp.noise_multiplier, not both"
            ),
        },
    )
    delta: float = field(
        default=0.0,
        metadata={
            "was": "dp_delta",
            "help": (
                "delta of the reported (epsilon, delta); 0: the largest allowed, min(1e-5, 1/(10 N)) in client mode "
                "(N clients) and min(1e-5, 1/(10 n_i)) in sample mode (n_i records of client i); larger is refused"
            ),
        },
    )
    horizon: int = field(
        default=0,
        metadata={
            "was": "dp_horizon",
            "help": (
                "the rounds a dp.epsilon target covers: z is calibrated for this many rounds (0: "
                "federate.total_round_num; at least that), so a shorter run, e.g. a tuning run, trains at the noise "
                "of the full one"
            ),
        },
    )
    sampling: Literal["wor", "poisson"] = field(
        default="wor",
        metadata={
            "was": "dp_sampling",
            "help": (
                "how DP samples (docs/privacy.md): 'wor', a fixed K of N clients a round (client mode) or b of n_i "
                "records a step (sample mode) without replacement, with replace-one adjacency; 'poisson', each client "
                "(record) in independently at rate K/N (b/n_i), the sum divided by the expected K (b), with "
                "add/remove adjacency: the convention of Opacus and the DP fine-tuning papers"
            ),
        },
    )
    accountant: Literal["rdp", "pld"] = field(
        default="rdp",
        metadata={
            "was": "dp_accountant",
            "help": (
                "the accountant that calibrates z and states epsilon (dp-accounting): 'rdp' (Renyi DP) or 'pld' "
                "(privacy loss distribution: a tighter valid bound, 14-16 % less noise at epsilon 8 on the protocol's "
                "shards); rdp stays the default so that the runs made with it keep their noise"
            ),
        },
    )
    min_records: int = field(
        default=0,
        metadata={
            "was": "dp_min_records",
            "help": (
                "sample mode: a client with fewer training records takes no DP-SGD step (0: none is left out); it "
                "sends the factors it started the round from with sample size 0, which weighs nothing in the "
                "aggregate, and spends epsilon 0. At b of n_i records a step, a small client needs a large z"
            ),
        },
    )
    chunk: int = field(
        default=0,
        metadata={
            "was": "dp_chunk",
            "help": (
                "sample mode: records a batched DP-SGD forward takes on a CPU (0: 4; an accelerator takes the whole "
                "batch). Chunks are length-sorted and each record is clipped alone, so the step is the same; larger "
                "chunks of a large b cost less (research/benchmarks/bench_dp_sgd.py --kinds cache cache_chunks)"
            ),
        },
    )
    local_tensors: Literal["noised", "frozen", "grouped"] = field(
        default="noised",
        metadata={
            "was": "dp_local_tensors",
            "help": (
                "sample mode: the client's local tensors (personalization.local_param, e.g. a head) train under "
                "DP-SGD with the rest, clipped and noised ('noised'), stay at their initial value, which no record "
                "touches ('frozen'), or train as their own clipping group ('grouped', dp.local_clip). Each way the "
                "guarantee covers all the client sends and exports; 'plain' (the head on the batch's exact gradient) "
                "is refused: it breaks DP-SGD's sensitivity bound"
            ),
        },
    )
    local_clip: float = field(
        default=0.0,
        metadata={
            "help": (
                "sample mode, local_tensors grouped: their clip C_h (0: dp.clip); each group g is noised at z "
                "sqrt(2) C_g, z the accounted multiplier"
            ),
        },
    )
    label_prior: float = field(
        default=0.0,
        metadata={
            "help": (
                "sample mode, seqcls: sigma > 0 adds log pi^ from a Gaussian label count to each client's logits "
                "(docs/privacy.md); 0: off"
            ),
        },
    )
    secure_rng: bool = field(
        default=True,
        metadata={
            "was": "dp_secure_rng",
            "help": (
                "without dp.seed: draw the DP noise and sampling from the OS's cryptographic generator (a sum of two "
                "Gaussians, as Opacus's secure_mode), whose state cannot be recovered from its outputs; False: "
                "torch's MT19937 seeded from OS entropy (faster, weaker); ignored with dp.seed"
            ),
        },
    )
    seed: int = field(
        default=-1,
        metadata={
            "was": "dp_seed",
            "help": (
                "seed of the DP noise and sampling (0 to 2**32 - 1), for reproducible experiments: the guarantee then "
                "assumes the seed is secret; -1: seeded from OS entropy (never from the run's seed)"
            ),
        },
    )

    def __post_init__(self) -> None:
        """ValueError, one line naming the key, for DP settings no mechanism can honour (the rules that read the
        section's other keys: :meth:`check_with`)."""
        kind = registry.entry(self.mode)
        for key in ("clip", "noise_multiplier", "epsilon", "delta", "local_clip", "label_prior"):
            setattr(self, key, number(getattr(self, key), f"dp.{key}", minimum=0.0))
        for key in ("clip", "noise_multiplier", "local_clip"):
            if getattr(self, key) > DP_VALUE_MAX:
                raise ValueError(
                    f"fedpa.dp.{key}(={getattr(self, key):g}) must be <= {DP_VALUE_MAX:g}: the noise z C would "
                    "overflow, and the server drops any factor entry beyond 1e6"
                )
        self.seed = integer(self.seed, "dp.seed", minimum=-1)
        self.horizon = integer(self.horizon, "dp.horizon", minimum=0)
        self.min_records = integer(self.min_records, "dp.min_records", minimum=0)
        self.chunk = integer(self.chunk, "dp.chunk", minimum=0)
        if not isinstance(self.secure_rng, bool):
            raise ValueError(f"fedpa.dp.secure_rng must be True or False, got {self.secure_rng!r}")
        if self.seed > SEED_MAX:
            raise ValueError(f"fedpa.dp.seed(={self.seed}) must be <= 2**32 - 1")
        if self.local_tensors == "plain":
            raise ValueError(
                "fedpa.dp.local_tensors 'plain' is withdrawn: a local head trained on the batch's exact gradient "
                "changes every other record's clipped gradient, so DP-SGD's sensitivity bound does not hold and "
                "epsilon is no guarantee; use 'noised' (the default) or 'frozen'"
            )
        for key, choices in (("sampling", DP_SAMPLINGS), ("accountant", DP_ACCOUNTANTS),
                             ("local_tensors", DP_LOCAL_TENSORS)):  # fmt: skip
            if getattr(self, key) not in choices:
                raise ValueError(f"fedpa.dp.{key}(={getattr(self, key)!r}) must be one of {choices}")
        if self.local_clip and self.local_tensors != "grouped":
            raise ValueError(
                f"fedpa.dp.local_clip(={self.local_clip:g}) is the clip of the local tensors' own group: it needs "
                f"fedpa.dp.local_tensors grouped, not {self.local_tensors!r}"
            )
        defaults = dp_defaults()
        if not kind.noised:
            stray = [f"fedpa.dp.{k}={shown(getattr(self, k))}" for k, off in defaults.items()
                     if getattr(self, k) != off]  # fmt: skip
            if stray:
                raise ValueError(
                    f"{', '.join(stray)} set while fedpa.dp.mode is {self.mode!r}: this run would train without "
                    "differential privacy and write no ledger; set fedpa.dp.mode sample or client, or remove them"
                )
            return
        owners = {k: m for m in registry.modes() for k in registry.entry(m).own_keys}
        for key, owner in owners.items():
            if key not in kind.own_keys and getattr(self, key) != defaults[key]:
                raise ValueError(
                    f"fedpa.dp.{key} is a choice of {registry.entry(owner).title} (fedpa.dp.mode {owner}); "
                    f"fedpa.dp.mode {self.mode} does not read it ({OWN_KEY_WHY.get(key, 'it is not part of its mechanism')}): "
                    "unset it"
                )
        if self.clip <= 0:
            raise ValueError(f"fedpa.dp.mode {self.mode!r} needs fedpa.dp.clip, the clip norm C > 0")
        if (self.noise_multiplier > 0) == (self.epsilon > 0):
            raise ValueError(
                f"fedpa.dp.mode {self.mode!r} needs exactly one of fedpa.dp.noise_multiplier (z > 0) and "
                f"fedpa.dp.epsilon (a target from which z is computed); got z={self.noise_multiplier:g}, "
                f"epsilon={self.epsilon:g}"
            )
        if self.delta > DP_DELTA_MAX:
            raise ValueError(f"fedpa.dp.delta(={self.delta:g}) must be <= {DP_DELTA_MAX:g} (0: the default)")
        from fs_fedpa.privacy.accountant import MAX_EPSILON  # torch-free

        if self.epsilon > MAX_EPSILON:
            raise ValueError(
                f"fedpa.dp.epsilon(={self.epsilon:g}) must be <= {MAX_EPSILON:g}: above it the accountants' "
                "discretisation no longer resolves the losses and no guarantee is meaningful"
            )

    def check_with(self, section) -> None:
        """The rules that read ``section``'s other keys (the :class:`~fs_fedpa.config.FedPAConfig` holding these
        settings), which its own check calls: what differential privacy refuses beside it."""
        if not registry.entry(self.mode).noised:
            return
        if section.adaptive_lam != "none":
            raise ValueError(
                f"fedpa.adaptive_lam {section.adaptive_lam!r} with differential privacy (fedpa.dp.mode "
                f"{self.mode!r}): the adaptive lambda is computed from the task loss and its gradients, which "
                "would leave the mechanism; use a fixed fedpa.lam"
            )
        for key, why in registry.entry(self.mode).refuses.items():
            if getattr(section, key, None):
                raise ValueError(f"fedpa.{key} with differential privacy (fedpa.dp.mode {self.mode!r}): {why}")

    def dp_delta_for(self, population: int) -> float:
        """delta of a population of ``population`` (N clients, or n_i records under DP-SGD) (:func:`dp_delta_for`)."""
        return dp_delta_for(self.delta, population, registry.entry(self.mode).population)


# why a key of DP-SGD means nothing to a mechanism without it, for the refusal of it there
OWN_KEY_WHY = {
    "min_records": "without DP-SGD a client's update is clipped and noised whatever its size",
    "chunk": "it sizes DP-SGD's forward",
    "local_tensors": "without DP-SGD a client's local tensors train on its data and never leave it",
    "local_clip": "without DP-SGD a client's local tensors train on its data and never leave it",
    "label_prior": "its count is composed with DP-SGD's steps",
}


def dp_defaults() -> dict:
    """The keys that only mean something under DP (every field of :class:`DPSettings` but ``mode``) and their
    values when DP is off, their defaults: one list, so a new DP key is refused without DP by being declared."""
    return {f.name: f.default for f in fields(DPSettings) if f.name != "mode"}


def dp_delta_for(setting: float, population: int, who: str) -> float:
    """delta of a population of ``population`` (``who``: "N clients", "n_i records"): ``setting``
    (fedpa.dp.delta), or 0's default min(1e-5, 1/(10 population)); ValueError above that bound, which keeps the
    chance of a total release of one member far below 1/population."""
    bound = min(DP_DELTA_MAX, 1.0 / (10 * max(population, 1)))
    if setting == 0:
        return bound
    if setting > bound * (1 + 1e-9):
        raise ValueError(
            f"fedpa.dp.delta(={setting:g}) is above min(1e-5, 1/(10 x {population} {who})) = {bound:g}: "
            f"a delta near 1/{population} allows releasing one member outright; lower it or set 0"
        )
    return setting

"""Differential privacy in the FS workers (``fedpa.dp_mode``, docs/privacy.md): what a client may send and its DP-SGD
(:class:`ClientPrivacy`), and the settings both sides share (the method check, the DP-SGD plan, the accounting
settings); the server's sampling, release and ledger are :class:`~fs_fedpa.plugin.privacy_server.ServerPrivacy`.
The mechanisms are :mod:`fs_fedpa.core.dp`, the accounting :mod:`fs_fedpa.core.dp_accountant`; the workers only
wire these in.

The ledger ``<outdir>/fedpa_privacy.jsonl`` has one line a round, whatever ``fedpa.diagnostics`` says: the
cumulative epsilon at the run's delta (sample mode: per client, and the largest), the sampling, adjacency, noise
multiplier and sensitivity the accountant was given.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from functools import lru_cache

from fs_fedpa.core.dp import dp_generator
from fs_fedpa.record import CLIENT_PRIVACY_FILE

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only

# what a client sends of its statistics under DP: client mode, only faults of its storage (not of its data);
# sample mode, everything computed from its DP factors, but not the task-gradient ratios (raw data)
CLIENT_MODE_STATS = ("state_lost",)
RAW_DATA_STATS = ("grad_ratio_",)
# sample mode: what a client reports it spent, with its upload (ClientPrivacy.spent; ServerPrivacy.check_spent)
SPENT_STATS = ("dp_n", "dp_b", "dp_steps", "dp_z", "dp_clip", "dp_delta", "dp_epsilon")


def check_method(method, cfg_fedpa) -> None:
    """ValueError, naming DP and the method, if ``method`` cannot honour ``fedpa.dp_mode client``."""
    if cfg_fedpa.dp_mode != "client":
        return
    if not method.dp_space:
        raise ValueError(
            f"differential privacy at client level (fedpa.dp_mode client) is not supported by federate.method "
            f"{method.name!r}: only fedpa, fedit, ffa_lora, fedsa_lora and fedsvd clip and noise what their server "
            "aggregates (fedpa.dp_mode sample works with every method)"
        )


@dataclass(frozen=True)
class SamplePlan:
    """Client i's DP-SGD: b of its n records a step (``sampling`` "poisson": each at rate b/n, b expected),
    ``steps_per_round`` steps a round, noise multiplier z, epsilon from ``accounting``."""

    n: int
    b: int
    steps_per_round: int
    z: float
    delta: float
    sampling: str = "wor"
    accounting: str = "rdp"

    @property
    def kind(self):
        from fs_fedpa.core.dp_accountant import Sampled

        return Sampled(self.n, self.b, self.z, self.sampling, self.accounting)

    def epsilon(self, steps: int) -> float:
        return self.kind.epsilon(steps, self.delta)


def sample_plan(cfg, n: int, routines: int = 1) -> SamplePlan:
    """The plan of a client with ``n`` training records under FS config ``cfg``: b = min(batch size, n); steps a
    round as FS runs them (``local_update_steps`` batches, or that many epochs of ceil(n / b) batches, n // b with
    ``drop_last``), times the ``routines`` a round trains (2 with a personal phase); z as given, or calibrated so that
    every step it could take over the run (T rounds, or ``fedpa.dp_horizon``) spends at most ``fedpa.dp_epsilon``
    at its delta."""
    fedpa = cfg.fedpa
    b = max(1, min(int(cfg.dataloader.batch_size), n))
    if cfg.train.batch_or_epoch == "batch":
        tau = int(cfg.train.local_update_steps)
    else:
        per_epoch = n // b if cfg.dataloader.drop_last else math.ceil(n / b)
        tau = int(cfg.train.local_update_steps) * max(per_epoch, 1)
    tau *= routines
    if n < fedpa.dp_min_records:  # left out of DP training: no step, epsilon 0, no noise to calibrate
        from fs_fedpa.config import dp_delta_for

        delta = dp_delta_for(float(fedpa.dp_delta), n, "n_i records")
        return SamplePlan(n, b, 0, 0.0, delta, fedpa.dp_sampling, fedpa.dp_accountant)
    return _plan(n, b, tau, int(fedpa.dp_horizon or cfg.federate.total_round_num), float(fedpa.dp_noise_multiplier),
                 float(fedpa.dp_epsilon), float(fedpa.dp_delta), fedpa.dp_sampling, fedpa.dp_accountant)  # fmt: skip


@lru_cache(maxsize=1024)
def _plan(n: int, b: int, tau: int, rounds: int, z: float, target: float, delta_setting: float, sampling: str,
          accounting: str) -> SamplePlan:  # fmt: skip
    from fs_fedpa.config import dp_delta_for
    from fs_fedpa.core.dp_accountant import calibrate, check_pld_cost

    delta = dp_delta_for(delta_setting, n, "n_i records")
    if not z:
        z = calibrate(n, b, rounds * tau, target, delta, sampling, accounting)
    plan = SamplePlan(n, b, tau, z, delta, sampling, accounting)
    check_pld_cost(plan.kind, rounds * tau)  # the whole horizon's accounting, at the client's start
    return plan


def noise_source(fedpa) -> str:
    """Where the DP noise and sampling come from, in words."""
    if fedpa.dp_seed >= 0:
        return "fedpa.dp_seed"
    return "the OS's cryptographic generator" if fedpa.dp_secure_rng else "MT19937 seeded from OS entropy"


def seed_warning(dp_seed: int) -> str | None:
    """The warning a run with ``fedpa.dp_seed`` gets, in both modes (None without a seed)."""
    if dp_seed < 0:
        return None
    return (
        f"[fedpa] fedpa.dp_seed(={dp_seed}) is set: the DP noise and sampling are reproducible from it, and the "
        "(epsilon, delta) guarantee holds only while the seed stays secret; for a private release leave it at -1 (OS "
        "entropy)"
    )


def accounting_settings(cfg) -> dict:
    """The settings the privacy accounting of a run's past rounds depends on, compared when it resumes: a resume
    with other values would have the accountant recompute the rounds already released at the new ones (its epsilon
    could go down), so it is refused naming the key. Without DP only ``dp_mode`` (a run may not switch DP on or off
    across a resume)."""
    fedpa = cfg.fedpa
    if fedpa.dp_mode == "none":
        return {"fedpa.dp_mode": "none"}
    # dp_seed: a seeded run continues its noise stream, an unseeded one draws fresh entropy; neither can become the
    # other across a resume
    keys = ("dp_mode", "dp_clip", "dp_noise_multiplier", "dp_epsilon", "dp_delta", "dp_sampling", "dp_accountant",
            "dp_seed")  # fmt: skip
    out = {f"fedpa.{k}": getattr(fedpa, k) for k in keys}
    if fedpa.dp_epsilon > 0:  # z calibrated over the horizon
        out["fedpa.dp_horizon (or federate.total_round_num)"] = int(fedpa.dp_horizon or cfg.federate.total_round_num)
    out["federate.client_num"] = int(cfg.federate.client_num)
    if fedpa.dp_mode == "client":
        out["federate.sample_client_num"] = int(cfg.federate.sample_client_num)
    else:
        out.update({"dataloader.batch_size": int(cfg.dataloader.batch_size), "dataloader.drop_last":
                    bool(cfg.dataloader.drop_last), "train.local_update_steps": int(cfg.train.local_update_steps),
                    "train.batch_or_epoch": str(cfg.train.batch_or_epoch),
                    # who takes steps at all, and what the clip and noise cover
                    "fedpa.dp_min_records": int(fedpa.dp_min_records),
                    "fedpa.dp_local_tensors": str(fedpa.dp_local_tensors)})  # fmt: skip
    return out


def routines(method) -> int:
    """Training routines a client runs in a round: 2 for a method with a personal phase (FedDPA), else 1."""
    return 1 if method.personal_weight is None else 2


class ClientPrivacy:
    """A client's side: what it may send, and its DP-SGD in sample mode. It takes FS's config ``cfg``, the client's
    ``method``, FS's ``trainer`` (DP-SGD replaces its step; ``num_train_data`` is the client's n_i) and the names of
    its local tensors (``fedpa.dp_local_tensors frozen`` holds them at their initial value)."""

    def __init__(self, cfg, method, trainer, local_names: list[str]):
        fedpa = method.cfg
        self.fedpa, self.trainer, self.mode = fedpa, trainer, fedpa.dp_mode
        self.path = os.path.join(cfg.outdir, CLIENT_PRIVACY_FILE) if self.mode == "sample" else None
        self.client, self.rnd = 0, 0  # whose round it is (:meth:`new_round`): the noise stream's name
        self.dp_sgd = None
        if self.mode == "sample":
            from fs_fedpa.plugin.dp_sgd import DPSGD

            def plan(n: int) -> SamplePlan:
                return sample_plan(cfg, n, routines(method))

            def make_generator(routine: int):  # a torch.Generator or a SecureGenerator (dp_generator)
                stream = f"client {self.client} round {self.rnd} routine {routine}"
                return dp_generator(fedpa.dp_seed, stream, fedpa.dp_secure_rng)

            frozen = frozen_names(fedpa.dp_local_tensors, local_names)
            self.dp_sgd = DPSGD(trainer, plan, make_generator, fedpa.dp_clip, chunk=fedpa.dp_chunk or None,
                                frozen=frozen)  # fmt: skip
            n = trainer.ctx.get("num_train_data")
            if isinstance(n, int) and n > 0:
                plan(n)  # now, not in the first batch: a delta above min(1e-5, 1/(10 n_i)) is refused at start

    def new_round(self, client: int, rnd: int) -> None:
        """Client ``client`` (FS id) starts round ``rnd``."""
        self.client, self.rnd = client, rnd
        if self.dp_sgd is not None:
            self.dp_sgd.new_round()

    @property
    def sits_out(self) -> bool:
        """Sample mode with ``fedpa.dp_min_records``: this client has fewer records and takes no DP-SGD step."""
        if self.mode != "sample" or not self.fedpa.dp_min_records:
            return False
        n = self.trainer.ctx.get("num_train_data")
        return isinstance(n, int) and n < self.fedpa.dp_min_records

    def stats(self, stats: dict, rounds_trained: int = 0) -> dict:
        """What of the round's statistics leaves the client (all of them without DP); in sample mode with what it
        spent after ``rounds_trained`` rounds (:meth:`spent`), which the server checks and its ledger records."""
        if self.mode == "none":
            return stats
        if self.mode == "client":
            return {k: v for k, v in stats.items() if k in CLIENT_MODE_STATS}
        return {**{k: v for k, v in stats.items() if not k.startswith(RAW_DATA_STATS)}, **self.spent(rounds_trained)}

    def spent(self, rounds_trained: int) -> dict:
        """Sample mode: this client's own account as upload stats (:data:`SPENT_STATS`): n_i, b, steps so far, z, C,
        delta and epsilon, from the plan its own config gave it; zeros for a client that sits out."""
        n = self.trainer.ctx.get("num_train_data")
        plan = self.dp_sgd.plan_in_use if self.dp_sgd is not None else None
        if self.sits_out or plan is None:
            return {"dp_n": int(n or 0), "dp_b": 0, "dp_steps": 0, "dp_z": 0.0, "dp_clip": float(self.fedpa.dp_clip),
                    "dp_delta": 0.0, "dp_epsilon": 0.0}  # fmt: skip
        steps = rounds_trained * plan.steps_per_round
        clip = float(self.fedpa.dp_clip)
        return {"dp_n": plan.n, "dp_b": plan.b, "dp_steps": steps, "dp_z": plan.z, "dp_clip": clip,
                "dp_delta": plan.delta, "dp_epsilon": plan.epsilon(steps)}  # fmt: skip

    def sample_size(self, sample_size: int) -> int:
        """FS's sample count of the message: 1 under client-level DP (a client's size is private there); 0 for a
        client that sits out (``fedpa.dp_min_records``: its upload weighs nothing); under Poisson DP-SGD the expected
        count of the round's steps, not how many records the draws held (which adding or removing one would
        change)."""
        if self.mode == "client":
            return 1
        if self.sits_out:
            return 0
        plan = self.dp_sgd.plan_in_use if self.dp_sgd is not None else None
        if plan is not None and plan.sampling == "poisson":
            return plan.steps_per_round * plan.b
        return sample_size

    def log_round(self, rounds_trained: int) -> None:
        """Sample mode: the client's own epsilon after ``rounds_trained`` rounds, in its own log and as a line of its
        own :data:`~fs_fedpa.record.CLIENT_PRIVACY_FILE` (:meth:`record`)."""
        if self.sits_out:
            n = self.trainer.ctx.get("num_train_data")
            logger.info(
                f"[fedpa] client #{self.client}: {n} training records, fewer than fedpa.dp_min_records"
                f"(={self.fedpa.dp_min_records}): it takes no DP-SGD step, sends the factors it started "
                "from with sample size 0 (no weight), and spends epsilon 0"
            )
            self._write({**self._account(rounds_trained), "sits_out": True, "clipped_sum": None, "noise": None})
            return
        if self.dp_sgd is None or self.dp_sgd.plan_in_use is None:
            return
        plan = self.dp_sgd.plan_in_use
        line = self.record(rounds_trained)
        self._write(line)
        logger.info(
            f"[fedpa] client #{self.client}: DP-SGD epsilon {line['epsilon']:.4g} at delta {plan.delta:.3g} after "
            f"{line['steps']} steps (n={plan.n}, b={plan.b}{' expected' if plan.sampling == 'poisson' else ''}, "
            f"z={plan.z:.4g}, C={self.fedpa.dp_clip:g}; {plan.sampling} sampling, {plan.accounting})"
            + (f"; {line['nonfinite']} records of this round had a non-finite gradient and contributed "
               "zero" if line["nonfinite"] else "")
            + (f"; {line['empty']} steps drew no record (Poisson) and were noise alone" if line["empty"] else "")
            + signal_noise_text(self.dp_sgd.signal_noise())
        )

    def _write(self, line: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def _account(self, rounds_trained: int) -> dict:
        """The round, the client and :meth:`spent` under the file's names (n, b, steps, z, clip, delta, epsilon)."""
        own = {k.removeprefix("dp_"): v for k, v in self.spent(rounds_trained).items()}
        return {"round": self.rnd, "client": self.client, **own}

    def record(self, rounds_trained: int) -> dict:
        """This client's accounting after ``rounds_trained`` rounds (what its upload reports, :meth:`spent`) and the
        round's signal against noise (per step: the clipped sum's norm and the noise's; None without a step)."""
        plan = self.dp_sgd.plan_in_use
        norms = self.dp_sgd.signal_noise()
        return {**self._account(rounds_trained), "sampling": plan.sampling, "accountant": plan.accounting,
                "nonfinite": self.dp_sgd.round_nonfinite, "empty": self.dp_sgd.round_empty,
                "clipped_sum": None if norms is None else float(norms[0]),
                "noise": None if norms is None else float(norms[1])}  # fmt: skip


def frozen_names(treatment: str, local_names: list[str]) -> frozenset[str]:
    """The tensors DP-SGD holds still: with ``fedpa.dp_local_tensors frozen`` the client's local tensors (a head),
    which keep the value they were built with, a value no record touches; DP-SGD clips and noises every tensor that
    moves, so what the client releases is post-processing of the mechanism alone."""
    if treatment != "frozen":
        return frozenset()
    if not local_names:
        raise ValueError(
            "fedpa.dp_local_tensors 'frozen' with no local tensor to freeze: personalization.local_param names none "
            "of the model's trainable non-LoRA tensors"
        )
    return frozenset(local_names)


def signal_noise_text(norms: tuple[float, float] | None) -> str:
    """The round's signal against noise in the client's own log (:meth:`DPSGD.signal_noise`; it reads the client's
    records, so it is never sent)."""
    if norms is None:
        return ""
    signal, noise = norms
    ratio = f"{noise / signal:.3g}" if signal > 0 else "inf"
    return (f"; this round, per step, clipped sum {signal:.4g} against noise {noise:.4g} (noise/signal {ratio}; "
            "from its records: this log only, never sent)")

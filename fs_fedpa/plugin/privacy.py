"""Differential privacy in the FS workers (``fedpa.dp_mode``, docs/privacy.md): the server's sampling, release and
ledger (:class:`ServerPrivacy`), what a client may send and its DP-SGD (:class:`ClientPrivacy`). The mechanisms are
:mod:`fs_fedpa.core.dp`, the accounting :mod:`fs_fedpa.core.dp_accountant`; the workers only wire these in.

The ledger ``<outdir>/fedpa_privacy.jsonl`` has one line a round, whatever ``fedpa.diagnostics`` says: the
cumulative epsilon at the run's delta (sample mode: per client, and the largest), the sampling, adjacency, noise
multiplier and sensitivity the accountant was given.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from fs_fedpa.core.dp import dp_generator, release_changes, release_products, sample_poisson
from fs_fedpa.core.dp import sample_without_replacement as _sample
from fs_fedpa.core.ranks import truncate_factors
from fs_fedpa.record import PRIVACY_FILE, PRIVATE_FAULTS_FILE

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only

# what a client sends of its statistics under DP: client mode, only faults of its storage (not of its data);
# sample mode, everything computed from its DP factors, but not the task-gradient ratios (raw data)
CLIENT_MODE_STATS = ("state_lost",)
RAW_DATA_STATS = ("grad_ratio_",)


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
    from fs_fedpa.core.dp_accountant import calibrate

    delta = dp_delta_for(delta_setting, n, "n_i records")
    if not z:
        z = calibrate(n, b, rounds * tau, target, delta, sampling, accounting)
    return SamplePlan(n, b, tau, z, delta, sampling, accounting)


def _source(fedpa) -> str:
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
    out = {f"fedpa.{k}": getattr(fedpa, k) for k in ("dp_mode", "dp_clip", "dp_noise_multiplier", "dp_epsilon",
                                                      "dp_delta", "dp_sampling", "dp_accountant")}  # fmt: skip
    if fedpa.dp_epsilon > 0:  # z calibrated over the horizon
        out["fedpa.dp_horizon (or federate.total_round_num)"] = int(fedpa.dp_horizon or cfg.federate.total_round_num)
    out["federate.client_num"] = int(cfg.federate.client_num)
    if fedpa.dp_mode == "client":
        out["federate.sample_client_num"] = int(cfg.federate.sample_client_num)
    else:
        out.update({"dataloader.batch_size": int(cfg.dataloader.batch_size), "dataloader.drop_last":
                    bool(cfg.dataloader.drop_last), "train.local_update_steps": int(cfg.train.local_update_steps),
                    "train.batch_or_epoch": str(cfg.train.batch_or_epoch)})  # fmt: skip
    return out


def routines(method) -> int:
    """Training routines a client runs in a round: 2 for a method with a personal phase (FedDPA), else 1."""
    return 1 if method.personal_weight is None else 2


class ServerPrivacy:
    """The server's side: client mode samples K of N, releases the noisy mean and accounts one event a round;
    sample mode accounts each client's DP-SGD steps. ``server.privacy`` is None when DP is off. It takes FS's
    ``cfg``, the server's federated ``method``, N ``clients``, T ``rounds``, K clients ``per_round``, the federated
    non-LoRA tensors' ``shared_names`` and the initial ``global_factors`` (for their shapes)."""

    def __init__(self, cfg, method, *, clients: int, rounds: int, per_round: int, shared_names, global_factors):
        from fs_fedpa.core.dp_accountant import ADJACENCY, describe

        self.cfg, self.method = cfg, method
        fedpa = method.cfg
        self.mode, self.C = fedpa.dp_mode, fedpa.dp_clip
        self.N, self.T = clients, rounds
        self.generator = dp_generator(fedpa.dp_seed, "server", fedpa.dp_secure_rng)
        # the method's post-processing draws (a randomized SVD's sketch) take a torch generator: the DP one when it
        # is one (seeded runs stay reproducible), else one seeded from the cryptographic generator
        self.sketch_generator = (self.generator if isinstance(self.generator, torch.Generator)
                                 else torch.Generator().manual_seed(secrets.randbits(63)))  # fmt: skip
        self.path = os.path.join(cfg.outdir, PRIVACY_FILE)
        self.sampling, self.accounting = fedpa.dp_sampling, fedpa.dp_accountant
        self.adjacency = ADJACENCY[self.sampling]
        self.accountant = describe(self.accounting)
        self.rounds = 0  # client mode: rounds released
        self.trained: dict[int, int] = {}  # sample mode: rounds each client was asked to train
        self.sizes: dict[int, int] = {}  # sample mode: n_i as the clients report it (public under replace-one)
        self.last: dict = {}
        if (warning := seed_warning(fedpa.dp_seed)) is not None:
            logger.warning(warning)
        if self.mode == "client":
            check_method(method, fedpa)
            if shared_names:
                raise ValueError(
                    f"differential privacy at client level (fedpa.dp_mode client) with federated tensors "
                    f"{sorted(shared_names)} (e.g. a head averaged by FS): they would leave unclipped and "
                    "unnoised; keep them with each client (personalization.local_param)"
                )
            plan = method.plan
            if method.dp_space == "change" and (
                set(plan.reference_ranks) != {plan.r_g} or set(plan.client_ranks) != {plan.r_g}
            ):
                raise ValueError(
                    f"fedpa.dp_mode client with federate.method {method.name}: a client's change is taken from "
                    f"the global factors it received, so every r_i and R_i must be {plan.r_g}"
                )
            self.K = per_round
            self.delta = fedpa.dp_delta_for(self.N)
            from fs_fedpa.core.dp_accountant import Sampled, calibrate

            horizon = fedpa.dp_horizon or self.T
            self.z = fedpa.dp_noise_multiplier or calibrate(self.N, self.K, horizon, fedpa.dp_epsilon, self.delta,
                                                            self.sampling, self.accounting)  # fmt: skip
            self.kind = Sampled(self.N, self.K, self.z, self.sampling, self.accounting)
            shapes = [(B.shape[0], A.shape[1]) for B, A in method.expand(global_factors).values()]
            if (
                method.dp_space == "product"
                and fedpa.svd != "randomized"
                and max(d * k for d, k in shapes) > 4e6
            ):
                logger.warning(
                    f"[fedpa] client-level DP forms each module's noisy (d, k) mean and factors it; at d x k up to "
                    f"{max(shapes, key=lambda s: s[0] * s[1])} an exact SVD takes minutes a module on a CPU "
                    "(docs/privacy.md): fedpa.svd randomized sketches it in about a second"
                )
            logger.info(
                f"[fedpa] client-level DP: K={self.K} of N={self.N} clients a round ("
                + ("without replacement" if self.sampling == "wor" else "Poisson: each at rate K/N, K expected")
                + f", from {_source(fedpa)}; {self.adjacency} adjacency, {self.accounting} accountant), clip "
                f"C={self.C:g}, "
                f"noise z={self.z:.4g} (std zC/K={self.z * self.C / self.K:.4g}), delta={self.delta:.3g}; "
                f"epsilon after {self.T} rounds: {self.kind.epsilon(self.T, self.delta):.4g}"
            )

    # ------------------------------------------------------------------------------------------ client mode
    @property
    def samples_clients(self) -> bool:
        return self.mode == "client"

    def fault(self, rnd: int, client, reason: str) -> None:
        """Client mode: a dropped upload. Whether a client's upload fails the checks, and why, can depend on its data
        (a NaN from its training), so it goes neither to the log nor to the diagnostics but to a server-private file
        beside the ledger, which docs/privacy.md lists as outside epsilon."""
        path = os.path.join(os.path.dirname(self.path), PRIVATE_FAULTS_FILE)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"round": rnd, "client": str(client), "reason": reason}) + "\n")

    @property
    def poisson_clients(self) -> bool:
        """Client mode with Poisson sampling: a round's receivers are as many as were drawn, possibly none."""
        return self.mode == "client" and self.sampling == "poisson"

    def receivers(self) -> list[int]:
        """Client ids of 1..N from the DP generator: K without replacement, or each at rate K/N (Poisson)."""
        if self.sampling == "poisson":
            return [i + 1 for i in sample_poisson(self.N, self.K / self.N, self.generator)]
        return [i + 1 for i in _sample(self.N, self.K, self.generator)]

    def release(self, uploads: list, clients: list[int], global_factors: dict, rnd: int
                ) -> tuple[dict, dict[str, Tensor], dict]:  # fmt: skip
        """New global factors, spectra and the release of round ``rnd``, from the accepted ``uploads`` (applied
        factors of ``clients``, complete) and the ``global_factors`` the round started from: a missing or dropped
        client contributes zero, and the mean divides by K."""
        method = self.method
        shapes = {n: (B.shape[0], A.shape[1]) for n, (B, A) in method.expand(global_factors).items()}
        if method.dp_space == "product":
            release, _ = release_products([method.expand(u) for u in uploads], shapes, self.K, self.C, self.z,
                                          self.generator)  # fmt: skip
        else:
            parts = method.upload_parts(rnd)
            r = method.plan.r_g
            start = {n: truncate_factors(B, A, r) for n, (B, A) in global_factors.items()}
            release, _ = release_changes(uploads, [start] * max(len(uploads), 1), parts, self.K, self.C, self.z,
                                         self.generator)  # fmt: skip
        new_global, spectra = method.dp_global(release, global_factors, self.sketch_generator)
        self.rounds += 1
        return new_global, spectra, release

    # ------------------------------------------------------------------------------------------ both
    def account(self, rnd: int, receivers: list[int], stats: dict[int, dict]) -> dict:
        """The ledger line of round ``rnd`` (written, and returned)."""
        if self.mode == "client":
            line = {
                "round": rnd,
                "dp_mode": "client",
                "dp_epsilon": self.kind.epsilon(self.rounds, self.delta),
                "dp_delta": self.delta,
                "dp_sampling": self.sampling,
                "dp_adjacency": self.adjacency,
                "dp_noise_multiplier": self.z,
                "dp_accountant_noise_multiplier": self.kind.accountant_z,
                "dp_sensitivity": self.kind.sensitivity * self.C / self.K,
                "dp_noise_std": self.z * self.C / self.K,
                "dp_clip": self.C,
                "dp_clients_per_round": self.K,
                "dp_population": self.N,
                "dp_events": self.rounds,
                "dp_accountant": self.accountant,
            }
        else:
            for c in receivers:
                self.trained[c] = self.trained.get(c, 0) + 1
            for c, st in stats.items():
                if isinstance(st.get("num_train_data"), int) and st["num_train_data"] > 0:
                    self.sizes[c] = st["num_train_data"]
            per_client = {}
            for c in sorted(self.trained):
                if c not in self.sizes:  # never reported its size: its epsilon is unknown here (its own log has it)
                    per_client[str(c)] = None
                    continue
                plan = sample_plan(self.cfg, self.sizes[c], routines(self.method))
                steps = self.trained[c] * plan.steps_per_round
                per_client[str(c)] = {"epsilon": plan.epsilon(steps), "delta": plan.delta, "noise_multiplier": plan.z,
                                      "steps": steps, "n": plan.n, "b": plan.b}  # fmt: skip
            known = [v for v in per_client.values() if v]
            line = {
                "round": rnd,
                "dp_mode": "sample",
                "dp_epsilon": max((v["epsilon"] for v in known), default=0.0),
                "dp_delta": max((v["delta"] for v in known), default=None),
                "dp_sampling": self.sampling,
                "dp_adjacency": self.adjacency,
                "dp_sensitivity": (2 if self.sampling == "wor" else 1) * self.C,
                "dp_clip": self.C,
                "dp_clients": per_client,
                "dp_accountant": self.accountant,
            }
        self.last = line
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        return line

    def summary(self) -> str:
        """The final (epsilon, delta), for the run's last log line."""
        if not self.last:
            return "[fedpa] differential privacy: no round was released, epsilon 0"
        line = self.last
        if self.mode == "client":
            return (
                f"[fedpa] differential privacy (client level): (epsilon, delta) = ({line['dp_epsilon']:.4g}, "
                f"{line['dp_delta']:.3g}) after {line['dp_events']} rounds, K={self.K} of N={self.N}, z={self.z:.4g}, "
                f"C={self.C:g} (ledger: {self.path})"
            )
        delta = line["dp_delta"]
        return (
            f"[fedpa] differential privacy (sample level, per client): largest epsilon {line['dp_epsilon']:.4g} at "
            f"delta {'?' if delta is None else format(delta, '.3g')} (per client in {self.path})"
        )

    def state(self) -> dict:
        """What a resume point carries: the accountant's counts, and the DP generator only with ``fedpa.dp_seed``
        (reproducible runs). Without a seed the generator's state would let anyone holding the file regenerate every
        noise draw and subtract it; a resumed run draws from fresh OS entropy instead."""
        out = {"rounds": self.rounds, "trained": dict(self.trained), "sizes": dict(self.sizes), "last": dict(self.last),
               "ledger": os.path.abspath(self.path)}  # fmt: skip
        if self.method.cfg.dp_seed >= 0:
            out["generator"] = self.generator.get_state()
        return out

    def restore(self, saved: dict | None) -> None:
        """Continue the accounting of a resume point. The ledger of the run it continues is the source of truth: a
        round released after the resume point was written (a crash between the release, which leaves with FS's
        evaluation broadcast, and the next round's resume point) is in the ledger but not in the point, and the
        resumed run releases that round again with fresh noise. So the counts are the larger of the two, and this
        run's ledger begins with the continued run's lines: one file states the whole run's epsilon."""
        if not saved:
            return
        self.rounds = int(saved["rounds"])
        self.trained = {int(k): int(v) for k, v in saved["trained"].items()}
        self.sizes = {int(k): int(v) for k, v in saved["sizes"].items()}
        self.last = dict(saved.get("last", {}))
        if self.method.cfg.dp_seed >= 0:  # reproducible: continue the stream; else fresh OS entropy
            self.generator.set_state(saved["generator"])
        self._continue_ledger(saved.get("ledger"))

    def _continue_ledger(self, previous: str | None) -> None:
        if not previous:
            return
        if not os.path.isfile(previous):
            logger.warning(
                f"[fedpa] the DP ledger of the run this resumes ({previous}) is not there: epsilon counts the releases "
                "up to the resume point only, not a round released after it before the run stopped"
            )
            return
        with open(previous, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
        if os.path.abspath(previous) != os.path.abspath(self.path):
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
        if not lines:
            return
        last = lines[-1]
        if self.mode == "client":
            spent = int(last.get("dp_events", 0))
            if spent > self.rounds:
                logger.warning(
                    f"[fedpa] the ledger of the resumed run counts {spent} released rounds and its resume point "
                    f"{self.rounds}: a round was released after the resume point was written; epsilon counts it"
                )
                self.rounds, self.last = spent, last
            return
        for c, entry in (last.get("dp_clients") or {}).items():
            if entry:
                spr = sample_plan(self.cfg, int(entry["n"]), routines(self.method)).steps_per_round
                rounds = -(-int(entry["steps"]) // spr)
                if rounds > self.trained.get(int(c), 0):
                    self.trained[int(c)], self.sizes[int(c)], self.last = rounds, int(entry["n"]), last


class ClientPrivacy:
    """A client's side: what it may send, and its DP-SGD in sample mode."""

    def __init__(self, client):
        fedpa = client.method.cfg
        self.client, self.mode = client, fedpa.dp_mode
        self.dp_sgd = None
        if self.mode == "sample":
            from fs_fedpa.plugin.dp_sgd import DPSGD

            def plan(n: int) -> SamplePlan:
                return sample_plan(client._cfg, n, routines(client.method))

            def make_generator(routine: int):  # a torch.Generator or a SecureGenerator (dp_generator)
                stream = f"client {client.ID} round {client.state} routine {routine}"
                return dp_generator(fedpa.dp_seed, stream, fedpa.dp_secure_rng)

            plain = frozenset(client.local_names) if fedpa.dp_local_tensors == "plain" else frozenset()
            if fedpa.dp_local_tensors == "plain" and not plain:
                raise ValueError(
                    "fedpa.dp_local_tensors 'plain' with no local tensor to train plainly: "
                    "personalization.local_param names none of the model's trainable non-LoRA tensors"
                )
            self.dp_sgd = DPSGD(client.trainer, plan, make_generator, fedpa.dp_clip, plain=plain)
            n = client.trainer.ctx.get("num_train_data")
            if isinstance(n, int) and n > 0:
                plan(n)  # now, not in the first batch: a delta above min(1e-5, 1/(10 n_i)) is refused at start

    def new_round(self) -> None:
        if self.dp_sgd is not None:
            self.dp_sgd.new_round()

    @property
    def sits_out(self) -> bool:
        """Sample mode with ``fedpa.dp_min_records``: this client has fewer records and takes no DP-SGD step."""
        if self.mode != "sample" or not self.client.method.cfg.dp_min_records:
            return False
        n = self.client.trainer.ctx.get("num_train_data")
        return isinstance(n, int) and n < self.client.method.cfg.dp_min_records

    def stats(self, stats: dict) -> dict:
        """What of the round's statistics leaves the client (all of them without DP)."""
        if self.mode == "none":
            return stats
        if self.mode == "client":
            return {k: v for k, v in stats.items() if k in CLIENT_MODE_STATS}
        return {k: v for k, v in stats.items() if not k.startswith(RAW_DATA_STATS)}

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
        """Sample mode: the client's own epsilon after ``rounds_trained`` rounds, in its own log."""
        if self.sits_out:
            n = self.client.trainer.ctx.get("num_train_data")
            logger.info(
                f"[fedpa] client #{self.client.ID}: {n} training records, fewer than fedpa.dp_min_records"
                f"(={self.client.method.cfg.dp_min_records}): it takes no DP-SGD step, sends the factors it started "
                "from with sample size 0 (no weight), and spends epsilon 0"
            )
            return
        if self.dp_sgd is None or self.dp_sgd.plan_in_use is None:
            return
        plan, client = self.dp_sgd.plan_in_use, self.client
        steps = rounds_trained * plan.steps_per_round
        logger.info(
            f"[fedpa] client #{client.ID}: DP-SGD epsilon {plan.epsilon(steps):.4g} at delta {plan.delta:.3g} after "
            f"{steps} steps (n={plan.n}, b={plan.b}{' expected' if plan.sampling == 'poisson' else ''}, "
            f"z={plan.z:.4g}, C={client.method.cfg.dp_clip:g}; {plan.sampling} sampling, {plan.accounting})"
            + (f"; {self.dp_sgd.round_nonfinite} records of this round had a non-finite gradient and contributed "
               "zero" if self.dp_sgd.round_nonfinite else "")
            + (f"; {self.dp_sgd.round_empty} steps drew no record (Poisson) and were noise alone"
               if self.dp_sgd.round_empty else "")
        )

"""Client-level DP with a trusted server (``fedpa.dp.mode client``, docs/privacy.md): the server samples K of N
clients from its DP generator, clips each contribution to C, releases the noisy mean over K and accounts one event a
round; a client sends only the faults of its storage and 1 as its sample count.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from fs_fedpa.core.norms import product_sq_norm
from fs_fedpa.core.ranks import truncate_factors
from fs_fedpa.privacy.mechanism import (
    release_changes,
    release_products,
    release_shared,
    sample_poisson,
    sample_without_replacement,
    shared_changes,
)
from fs_fedpa.privacy.policy import ClientPolicy
from fs_fedpa.privacy.private import GaussianMechanism, GaussianServer, common_settings, noise_source, split_exports

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only

# what a client sends of its statistics: only faults of its storage (not of its data)
CLIENT_MODE_STATS = ("state_lost",)


def check_method(method, name: str) -> None:
    """ValueError, naming DP and the method, if ``method`` (its class or instance) cannot honour it."""
    if not method.dp_space:
        raise ValueError(
            f"differential privacy at client level (fedpa.dp.mode client) is not supported by federate.method "
            f"{name!r}: only fedpa, fedit, ffa_lora, fedsa_lora and fedsvd clip and noise what their server "
            "aggregates (fedpa.dp.mode sample works with every method)"
        )


class ClientLevelServer(GaussianServer):
    """Samples K of N, releases the noisy mean and accounts one event a round (the module docstring)."""

    level = "client"
    FIELDS = {"rounds": int, **GaussianServer.FIELDS}

    def __init__(self, cfg, method, *, clients: int, rounds: int, per_round: int, shared_names, global_factors):
        super().__init__(cfg, method, clients=clients, rounds=rounds, per_round=per_round, shared_names=shared_names,
                         global_factors=global_factors)  # fmt: skip
        from fs_fedpa.privacy.accountant import Sampled, calibrate

        fedpa = method.cfg
        self.released = 0  # rounds released so far (the accountant's events)
        check_method(method, method.name)
        # federated non-LoRA tensors (e.g. a shared head): each client's change of them is clipped with its LoRA
        # update as one contribution, and their mean is released with the same noise (release)
        self.shared_names = sorted(shared_names)
        plan = method.plan
        if method.dp_space == "change" and (
            set(plan.reference_ranks) != {plan.r_g} or set(plan.client_ranks) != {plan.r_g}
        ):
            raise ValueError(
                f"fedpa.dp.mode client with federate.method {method.name}: a client's change is taken from "
                f"the global factors it received, so every r_i and R_i must be {plan.r_g}"
            )
        self.K = per_round
        self.delta = fedpa.dp.dp_delta_for(self.N)
        horizon = fedpa.dp.horizon or self.T
        self.z = fedpa.dp.noise_multiplier or calibrate(self.N, self.K, horizon, fedpa.dp.epsilon, self.delta,
                                                        self.sampling, self.accounting)  # fmt: skip
        self.kind = Sampled(self.N, self.K, self.z, self.sampling, self.accounting)
        shapes = [(B.shape[0], A.shape[1]) for B, A in method.expand(global_factors).values()]
        if method.dp_space == "product" and fedpa.svd != "randomized" and max(d * k for d, k in shapes) > 4e6:
            logger.warning(
                f"[fedpa] client-level DP forms each module's noisy (d, k) mean and factors it; at d x k up to "
                f"{max(shapes, key=lambda s: s[0] * s[1])} an exact SVD takes minutes a module on a CPU "
                "(docs/privacy.md): fedpa.svd randomized sketches it in about a second"
            )
        logger.info(
            f"[fedpa] client-level DP: K={self.K} of N={self.N} clients a round ("
            + ("without replacement" if self.sampling == "wor" else "Poisson: each at rate K/N, K expected")
            + f", from {noise_source(fedpa)}; {self.adjacency} adjacency, {self.accounting} accountant), clip "
            f"C={self.C:g}, "
            f"noise z={self.z:.4g} (std zC/K={self.z * self.C / self.K:.4g}), delta={self.delta:.3g}; "
            + (f"clipped and noised with the LoRA update: {', '.join(self.shared_names)}; " if self.shared_names
               else "")  # fmt: skip
            + f"epsilon after {self.T} rounds: {self.kind.epsilon(self.T, self.delta):.4g}"
        )

    @classmethod
    def checkpoint_locals(cls, initial: dict[str, Tensor]) -> dict[str, Tensor]:
        """The clients' initial local tensors (a head), which are public: the server's model may hold a client's
        trained ones (``federate.share_local_model``), trained without DP."""
        return {n: t.detach().cpu().clone() for n, t in initial.items()}

    def receivers(self, draw) -> list[int]:
        """Client ids of 1..N from the DP generator, not FS's sampler (``draw``): K without replacement, or each at
        rate K/N (Poisson)."""
        if self.sampling == "poisson":
            return [i + 1 for i in sample_poisson(self.N, self.K / self.N, self.generator)]
        return [i + 1 for i in sample_without_replacement(self.N, self.K, self.generator)]

    def most_replies(self, per_round: int) -> int:
        """A Poisson round draws any number of the N clients (K is the expected number)."""
        return self.N if self.sampling == "poisson" else per_round

    def replies(self, receivers) -> int | None:
        """A Poisson round waits for the clients it drew, possibly none (it then releases its noise alone)."""
        return len(receivers) if self.sampling == "poisson" else None

    def drop(self, rnd: int, client, reason: str) -> None:
        """Which receiver's upload was dropped, and why, can depend on its data: the private faults file only."""
        self.fault(rnd, client, reason)

    def aggregate(self, round_) -> tuple:
        """Every round releases, whatever arrived: the noisy mean of the clipped contributions over the fixed K
        (:meth:`release`), the method's server step on it, a record of the release only and one event accounted.
        The record names the K receivers, each of weight 1/K, which the DP generator drew: which of them arrived or
        were dropped (and each upload's bytes) can depend on their data, and stays in the private faults file."""
        rnd, kept, uploads = round_.rnd, list(round_.uploads), round_.uploads
        new_global, spectra, release, shared = self.release(
            [uploads[c].factors for c in kept], kept, round_.global_factors, rnd, [uploads[c].shared for c in kept],
            round_.shared)  # fmt: skip
        result = round_.released(new_global, shared)
        record = round_.record(round_.receivers, [1.0 / self.K] * len(round_.receivers))
        if self.method.cfg.records.full:
            release_diagnostics(record, self.method, new_global, spectra, release)
        self.account(rnd, round_.receivers, {})
        return result, record.to_dict()

    def release(self, uploads: list, clients: list[int], global_factors: dict, rnd: int,
                shared: list[dict[str, Tensor]] | None = None, shared_start: dict[str, Tensor] | None = None,
                ) -> tuple[dict, dict[str, Tensor], dict, dict[str, Tensor]]:  # fmt: skip
        """New global factors, spectra, the release of round ``rnd`` and the new federated non-LoRA tensors, from the
        accepted ``uploads`` (applied factors of ``clients``, complete), their ``shared`` tensors and the
        ``global_factors`` and ``shared_start`` the round started from: a missing or dropped client contributes zero,
        and the mean divides by K. A client's LoRA update and its shared tensors' change are clipped together."""
        method = self.method
        start_shared, changes, extra = {}, [], None
        if self.shared_names:
            start_shared = {n: shared_start[n] for n in self.shared_names}
            changes, extra = shared_changes([{n: s[n] for n in self.shared_names} for s in shared], start_shared)
        shapes = {n: (B.shape[0], A.shape[1]) for n, (B, A) in method.expand(global_factors).items()}
        if method.dp_space == "product":
            release, scales = release_products([method.expand(u) for u in uploads], shapes, self.K, self.C, self.z,
                                               self.generator, extra)  # fmt: skip
        else:
            parts = method.upload_parts(rnd)
            r = method.plan.r_g
            start = {n: truncate_factors(B, A, r) for n, (B, A) in global_factors.items()}
            release, scales = release_changes(uploads, [start] * max(len(uploads), 1), parts, self.K, self.C,
                                              self.z, self.generator, extra)  # fmt: skip
        new_shared = release_shared(changes, scales, self.K, self.C, self.z, self.generator, start_shared)
        new_global, spectra = method.dp_global(release, global_factors, self.sketch_generator)
        self.released += 1
        return new_global, spectra, release, new_shared

    def account(self, rnd: int, receivers: list[int], stats: dict[int, dict]) -> dict:
        return self.write({
            "round": rnd,
            "dp_mode": "client",
            "dp_epsilon": self.kind.epsilon(self.released, self.delta),
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
            "dp_events": self.released,
            "dp_accountant": self.accountant,
        })  # fmt: skip

    def summary(self) -> str:
        if not self.last:
            return "[fedpa] differential privacy: no round was released, epsilon 0"
        line = self.last
        return (
            f"[fedpa] differential privacy (client level): (epsilon, delta) = ({line['dp_epsilon']:.4g}, "
            f"{line['dp_delta']:.3g}) after {line['dp_events']} rounds, K={self.K} of N={self.N}, z={self.z:.4g}, "
            f"C={self.C:g} (ledger: {self.path})"
        )

    def counts(self) -> dict:
        return {"rounds": self.released}

    def load_counts(self, saved: dict) -> None:
        self.released = int(saved["rounds"])

    def continue_from(self, last: dict) -> None:
        spent = int(last.get("dp_events", 0))
        if spent > self.released:
            logger.warning(
                f"[fedpa] the ledger of the resumed run counts {spent} released rounds and its resume point "
                f"{self.released}: a round was released after the resume point was written; epsilon counts it"
            )
            self.released, self.last = spent, last

    def ledger_line_ok(self, entry: dict) -> bool:
        return super().ledger_line_ok(entry) and isinstance(entry.get("dp_events"), int)


def release_diagnostics(record, method, new_global, spectra, release) -> None:
    """The record's diagnostics of a release (post-processing of it only): ||B_g A_g||_F, the probe's spectrum and,
    for a method that releases products, E_agg and ||release||_F of the noisy mean; nothing is read from a client's
    upload or statistics."""
    expanded = method.expand(new_global)
    record.global_norm = product_sq_norm(expanded) ** 0.5
    if method.dp_space == "product":
        errors = {n: float(torch.linalg.matrix_norm(M.double() - B.double() @ A.double()))
                  for n, (B, A), M in ((n, expanded[n], release[n]) for n in release)}  # fmt: skip
        ideal = sum(float(M.double().pow(2).sum()) for M in release.values()) ** 0.5
        record.e_agg = sum(e**2 for e in errors.values()) ** 0.5
        record.e_agg_rel = record.e_agg / ideal if ideal > 0 else 0.0
        record.global_update_norm = ideal
        record.e_agg_probe = errors[record.probe_module]
    record.spectrum_probe = [float(s) for s in spectra.get(record.probe_module, torch.zeros(0))]


class ClientLevelClient(ClientPolicy):
    """A client sends only the faults of its storage, and 1 as its sample count (its size is private too)."""

    def stats(self, stats: dict, rounds_trained: int = 0) -> dict:
        return {k: v for k, v in stats.items() if k in CLIENT_MODE_STATS}

    def sample_size(self, sample_size: int) -> int:
        return 1


class ClientLevel(GaussianMechanism):
    """``fedpa.dp.mode client``."""

    Server, Client = ClientLevelServer, ClientLevelClient

    @classmethod
    def check_run(cls, cfg, fedpa) -> None:
        from fs_fedpa.methods.base import get_method

        super().check_run(cfg, fedpa)
        name = cfg.federate.method.lower()
        check_method(get_method(name), name)
        if cfg.federate.unseen_clients_rate > 0:
            raise ValueError(
                f"federate.unseen_clients_rate(={cfg.federate.unseen_clients_rate:g}) with differential privacy at "
                "client level (fedpa.dp.mode client): the accountant assumes K drawn from all N clients, and FS's "
                "unseen clients are never drawn; set it to 0"
            )
        if cfg.federate.client_num > 0:
            fedpa.dp.dp_delta_for(cfg.federate.client_num)  # raises above min(1e-5, 1/(10 N))

    @classmethod
    def accounting_settings(cls, cfg) -> dict:
        return {**common_settings(cfg), "federate.sample_client_num": int(cfg.federate.sample_client_num)}

    @classmethod
    def export_info(cls, fedpa, outdir: Path) -> dict:
        dp_files, not_dp_files = split_exports("client")
        return {**super().export_info(fedpa, outdir), "dp_files": dp_files, "not_dp_files": not_dp_files}

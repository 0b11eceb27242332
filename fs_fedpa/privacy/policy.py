"""The interface of a DP mechanism: what the FS workers ask of it, one policy per side, and the mechanism without
DP (:class:`NoPrivacy`), whose policies let everything through.

A :class:`Mechanism` names its :class:`ServerPolicy` and :class:`ClientPolicy` and answers the run-level questions
(what FS's config it refuses, what a resume must keep equal, what of an export it covers). The workers build the
policies through :func:`fs_fedpa.privacy.server_policy` and :func:`fs_fedpa.privacy.client_policy`, never None, and
ask them; no code outside this package reads ``fedpa.dp.mode``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from fs_fedpa.record import PRIVACY_FILE, PRIVATE_FAULTS_FILE

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only

EVERY_EXPORT = (["global", "global_r<R>"], ["client_<id>", "heads/client_<id>.safetensors"])  # every path written


class ServerPolicy:
    """The server's side. Without DP: FS's sampler draws the round's clients, the method aggregates what arrived,
    nothing is accounted. Built with FS's ``cfg``, the server's ``method``, N ``clients``, T ``rounds``, K clients
    ``per_round``, the federated non-LoRA tensors' ``shared_names`` and the initial ``global_factors``."""

    draws_receivers = False  # receivers() draws each round's clients (else FS's sampler does)
    draws_any_number = False  # a round's receivers can be any number of the N, none included (Poisson)
    releases = False  # release() makes the round's global state (else the method aggregates what admit() let in)
    private_faults = False  # a dropped upload's reason goes to the private faults file, not the log
    locals_public = False  # the server's files hold the clients' initial local tensors (a head), which are public

    def __init__(self, cfg=None, method=None, *, clients: int = 0, rounds: int = 0, per_round: int = 0,
                 shared_names=(), global_factors=None):  # fmt: skip
        self.cfg, self.method = cfg, method
        self.path = os.path.join(cfg.outdir, PRIVACY_FILE) if cfg is not None else PRIVACY_FILE

    def receivers(self) -> list[int]:
        """The round's receivers, FS ids 1..N (only where :attr:`draws_receivers`)."""
        raise NotImplementedError(f"{type(self).__name__} leaves the sampling to FS")

    def release(self, uploads: list, clients: list[int], global_factors: dict, rnd: int, shared=None,
                shared_start=None) -> tuple[dict, dict, dict, dict]:  # fmt: skip
        """New global factors, spectra, the release's record fields and the new shared tensors of round ``rnd``
        (only where :attr:`releases`)."""
        raise NotImplementedError(f"{type(self).__name__} leaves the aggregation to the method")

    @property
    def release_weight(self) -> float:
        """The weight each receiver has in a release (only where :attr:`releases`)."""
        raise NotImplementedError

    def admit(self, rnd: int, stats: dict[int, dict]) -> dict[int, str]:
        """``client -> reason`` for the uploads of round ``rnd`` (their ``stats``) that may not be aggregated."""
        return {}

    def account(self, rnd: int, receivers: list[int], stats: dict[int, dict]) -> dict | None:
        """Round ``rnd``'s line of the ledger (written, and returned); None: nothing to account."""
        return None

    def fault(self, rnd: int, client, reason: str) -> None:
        """A dropped upload whose reason may depend on the client's data: to a server-private file beside the
        ledger, which docs/privacy.md lists as outside epsilon."""
        path = os.path.join(os.path.dirname(self.path), PRIVATE_FAULTS_FILE)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"round": rnd, "client": str(client), "reason": reason}) + "\n")

    def summary(self) -> str | None:
        """The run's last log line on what it spent (None: nothing to say)."""
        return None

    def state_dict(self) -> dict:
        """What a resume point carries of the accounting."""
        return {}

    def check_state(self, saved: dict, path: str, rnd: int) -> None:
        """ValueError naming the resume point ``path`` (of round ``rnd``) and the field ``privacy.<key>`` unless its
        ``privacy`` field ``saved`` is one this policy continues from (:meth:`counts_problem`); before any part of
        the point is loaded."""
        if problem := self.counts_problem(saved, rnd):
            raise ValueError(f"federate.restore_from {path!r}: field 'privacy.{problem}")

    def load_state_dict(self, saved: dict, path: str) -> None:
        """Continue from the resume point ``path``'s ``privacy`` field ``saved`` (checked by :meth:`check_state`)."""

    def counts_problem(self, saved: dict, rnd: int) -> str | None:
        """What is wrong with the counts of a resume point's ``privacy`` field ``saved`` for a point of round ``rnd``
        (``"<field>' is ...``), or None."""
        return None


class ClientPolicy:
    """A client's side. Without DP: it trains as FS does and sends every statistic. Built with FS's ``cfg``, the
    client's ``method``, FS's ``trainer``, the names of its local tensors, and ``dp_sgd``: the plugin's DP-SGD
    hooks (:class:`fs_fedpa.plugin.dp_sgd.DPSGD`), for a mechanism that trains by it."""

    gradient_diagnostics = True  # the task gradient it trains on is the exact one, which diagnostics may read

    def __init__(self, cfg, method, trainer, local_names: list[str], dp_sgd=None):
        self.fedpa, self.trainer = method.cfg, trainer
        self.client, self.rnd = 0, 0  # whose round it is (:meth:`new_round`)

    def new_round(self, client: int, rnd: int) -> None:
        """Client ``client`` (FS id) starts round ``rnd``."""
        self.client, self.rnd = client, rnd

    @property
    def sits_out(self) -> bool:
        """This client takes no training step this run (its upload weighs nothing)."""
        return False

    def upload(self, factors: dict, rnd: int) -> dict:
        """The factors the client sends in round ``rnd`` (``name -> (B, A)``), from those it trained."""
        return factors

    def stats(self, stats: dict, rounds_trained: int = 0) -> dict:
        """What of the round's statistics leaves the client after ``rounds_trained`` rounds."""
        return stats

    def sample_size(self, sample_size: int) -> int:
        """FS's sample count of the upload message, from the count FS's trainer gave."""
        return sample_size

    def log_round(self, rounds_trained: int) -> None:
        """After the round: the client's own account, where the mechanism keeps one."""


class Mechanism:
    """A DP mechanism: its two policies and the run-level rules."""

    Server: type[ServerPolicy] = ServerPolicy
    Client: type[ClientPolicy] = ClientPolicy

    @classmethod
    def check_run(cls, cfg, fedpa) -> None:
        """ValueError for what FS's config ``cfg`` (its checked ``fedpa`` section, a
        :class:`~fs_fedpa.config.FedPAConfig`) asks that the mechanism cannot honour, before any data or model is
        built."""

    @classmethod
    def accounting_settings(cls, cfg) -> dict:
        """The settings the accounting of a run's past rounds reads, compared on resume; without DP only the mode
        (a run may not switch DP on or off across a resume)."""
        return {"fedpa.dp.mode": cfg.fedpa.dp.mode}

    @classmethod
    def export_info(cls, fedpa, outdir: Path) -> dict:
        """What of an export the guarantee covers, at which (epsilon, delta) (the manifest's ``privacy``)."""
        shared, own = EVERY_EXPORT
        return {"dp_mode": fedpa.dp.mode, "dp_files": [], "not_dp_files": [*shared, *own]}


class NoPrivacy(Mechanism):
    """``fedpa.dp.mode none``."""

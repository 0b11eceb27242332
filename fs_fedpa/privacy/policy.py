"""The interface of a DP mechanism: what the FS workers and the aggregation call on it, one policy per side, and the
mechanism without DP (:class:`NoPrivacy`), whose policies let everything through.

A :class:`Mechanism` names its :class:`ServerPolicy` and :class:`ClientPolicy` and answers the run-level questions
(what FS's config it refuses, what a resume must keep equal, what of an export it covers). The workers build the
policies through :func:`fs_fedpa.privacy.server_policy` and :func:`fs_fedpa.privacy.client_policy`, never None, and
call them, never asking what kind they are (as Flower's DP strategy wrappers delegate); no code outside this package
reads ``fedpa.dp.mode``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from fs_fedpa.record import PRIVACY_FILE, PRIVATE_FAULTS_FILE

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only

EVERY_EXPORT = (["global", "global_r<R>"], ["client_<id>", "heads/client_<id>.safetensors"])  # every path written


class ServerPolicy:
    """The server's side; the server and the aggregation call every method, whatever the mechanism. Without DP: FS's
    sampler draws the round's clients, the method aggregates what arrived, a dropped upload is logged, nothing is
    accounted. Built with FS's ``cfg``, the server's ``method``, N ``clients``, T ``rounds``, K clients ``per_round``,
    the federated non-LoRA tensors' ``shared_names`` and the initial ``global_factors``."""

    def __init__(self, cfg=None, method=None, *, clients: int = 0, rounds: int = 0, per_round: int = 0,
                 shared_names=(), global_factors=None):  # fmt: skip
        self.cfg, self.method = cfg, method
        self.path = os.path.join(cfg.outdir, PRIVACY_FILE) if cfg is not None else PRIVACY_FILE

    @classmethod
    def checkpoint_locals(cls, initial: dict) -> dict:
        """What the server's files (checkpoint, resume point) hold of the clients' local tensors (a head), from their
        ``initial`` values, in place of what the server's model holds: without DP nothing ({}: the model's own)."""
        return {}

    def receivers(self, draw: Callable[[], list[int]]) -> list[int]:
        """A training round's receivers, FS ids 1..N: without DP those FS's sampler draws (``draw()``)."""
        return draw()

    def most_replies(self, per_round: int) -> int:
        """The most replies a round can wait for, where FS's config asks ``per_round`` (FS's ``sample_client_num``,
        beyond which FS asserts no round waits)."""
        return per_round

    def replies(self, receivers) -> int | None:
        """How many replies a round sent to ``receivers`` waits for; None: FS's count (``sample_client_num``)."""
        return None

    def aggregate(self, round_) -> tuple:
        """The round's new global state and record from a :class:`fs_fedpa.aggregation.Round`: without DP the
        method's aggregation (:meth:`~fs_fedpa.aggregation.Round.aggregate`) of the uploads :meth:`admit` lets in,
        less those :meth:`set_aside`, once the round is accounted (:meth:`account`, with every upload's stats)."""
        refused = self.admit(round_.rnd, round_.stats)
        self.account(round_.rnd, round_.receivers, round_.stats)
        return round_.aggregate(refused, self.set_aside(round_.stats))

    def drop(self, rnd: int, client, reason: str) -> None:
        """Round ``rnd`` dropped ``client``'s upload for ``reason``: in the log (a mechanism whose reasons may depend
        on a client's data keeps them in its private file, :meth:`fault`)."""
        logger.warning(f"[fedpa] round {rnd}: dropped the upload of client #{client}: {reason}")

    def admit(self, rnd: int, stats: dict[int, dict]) -> dict[int, str]:
        """``client -> reason`` for the uploads of round ``rnd`` (their ``stats``) that may not be aggregated."""
        return {}

    def set_aside(self, stats: dict[int, dict]) -> dict[int, str]:
        """``client -> reason`` for the uploads (their ``stats``) that carry no training: not aggregated, and not a
        fault (a round of only such uploads has not failed)."""
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

    def epsilons(self) -> dict | None:
        """What the run has spent so far, for its summary and tracker (None without DP): ``level``, ``epsilon``
        (per client id, where each client has its own), ``epsilon_max`` (None where a client has no guarantee),
        ``delta`` and the convention (``adjacency``, ``sampling``, ``accountant``)."""
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

    @classmethod
    def task_gradient_diagnostics(cls, wanted: bool) -> bool:
        """Whether the diagnostics of the task gradient are computed where ``wanted``: without DP they are (the
        gradient a client trains on is the task's)."""
        return wanted

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

    def logit_bias(self, labels: Callable, training: bool):
        """b ``(K,)`` the client adds to its logits in a training (``training``) or evaluation routine, or None
        (without DP: none); ``labels()`` gives its training split's labels ``(n_i,)``."""
        return None

    def state_dict(self) -> dict:
        """What of the policy a client's resume file carries (tensors only)."""
        return {}

    def load_state_dict(self, saved: dict, at: str) -> None:
        """The policy's part ``saved`` of the resume file ``at``."""


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

"""Round records and diagnostics: what each client measures of its round (:class:`RoundStats`) and what
the server records of each aggregation (:class:`RoundLog`, one JSON line a round in
``<outdir>/fedpa_diagnostics.jsonl``). The study's diagnostics (E_agg, spectra, drift, change norms, staleness,
E_init) are computed only under ``fedpa.records.diagnostics full``; the default ``light`` records what a user reads."""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch

from fs_fedpa.core.diagnostics import initialization_error
from fs_fedpa.core.norms import change_sq_norm, factored_norm, product_distance
from fs_fedpa.files import read_regular
from fs_fedpa.lora import Factors
from fs_fedpa.record import DIAGNOSTICS_FILE
from fs_fedpa.state_checks import check_fields, check_int, is_int

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only
EPS = 1e-8  # E_init's eps (fs_fedpa.core.diagnostics.initialization_error's default), in the raw factors' scale


class RoundStats:
    """The statistics a client adds to its upload (a collaborator of :class:`~fs_fedpa.plugin.client.FedPAClient`),
    from its state and the round's factors, all applied (the client's one space: none is converted for them). Only
    under ``fedpa.records.diagnostics full``."""

    def __init__(self, method, alignment):
        self.method, self.alignment = method, alignment
        self.full = method.cfg.records.full  # fedpa.records.diagnostics full: else none is computed
        self._reference: tuple[Factors, Factors] | None = None  # (the round's reference, expanded)

    def expanded_reference(self, received: Factors, last: bool = False) -> Factors:
        """The round's reference ``received`` expanded (:meth:`~fs_fedpa.methods.base.FederatedMethod.expand`) once a
        round: the start's staleness and the end's statistics both read it. ``last``: the round's last reader, after
        which it is not held (it lives on the client's device)."""
        if self._reference is None or self._reference[0] is not received:
            self._reference = (received, self.method.expand(received))
        expanded = self._reference[1]
        if last:
            self._reference = None
        return expanded

    def round_stats(self, sent: Factors, received: Factors, fold: Factors | None, start: Factors | None,
                    rnd: int) -> dict[str, float]:  # fmt: skip
        """This round's mechanism, summed over LoRA modules, of its whole update (``sent`` and what it folded into its
        base weights for the round, ``fold``: Fed-PLoRA's undrawn modules): ||Delta W_i||_F, the drift
        ||Delta W_i - X_g,i||_F from the reference X_g,i it ``received`` (and relative to ||X_g,i||_F, absent while
        the reference is 0), ``change_norm`` from the round's ``start``, and ||grad of the alignment term|| / ||grad
        of the task loss|| on its factors at the round's first and last step (absent for methods without a term)."""
        if not self.full:
            return {}
        if fold is not None:
            sent = {n: (torch.cat([B, fold[n][0].to(B)], 1), torch.cat([A, fold[n][1].to(A)], 0)) for n, (B, A) in
                    sent.items()}  # fmt: skip
        whole, reference = self.method.expand(sent), self.expanded_reference(received, last=True)
        delta_sq = drift_sq = ref_sq = 0.0
        for name, (B, A) in whole.items():
            B_ref, A_ref = reference[name]
            delta_sq += float(factored_norm(B, A)) ** 2
            drift_sq += float(product_distance(B, A, B_ref, A_ref)) ** 2
            ref_sq += float(factored_norm(B_ref, A_ref)) ** 2
        stats = {"delta_norm": delta_sq**0.5, "drift": drift_sq**0.5}
        stats.update(self.change_norm(whole, start, fold, rnd))
        if ref_sq > 0:
            stats["drift_rel"] = (drift_sq / ref_sq) ** 0.5
        if self.alignment.penalty_steps:
            for when, (align, task) in self.alignment.grads.norms().items():
                stats[f"grad_ratio_{when}"] = align / task if task > 0 else float("inf")
        return stats

    def change_norm(self, sent: Factors, start: Factors | None, fold: Factors | None, rnd: int) -> dict:
        """``change_norm``: ||X_i - X_i^0||_F over the uploaded factors X of every module, from the factors the round
        started from (``start``; what client-level DP clips for factor methods). Absent for a method whose state is
        not factors, or that folds part of its model."""
        if not start or not self.method.state_is_factors or fold is not None:
            return {}
        try:
            sq = change_sq_norm(sent, start, self.method.upload_parts(rnd))
        except ValueError:  # a part whose shape changed in the round (a pruned rank): no change to measure
            return {}
        return {"change_norm": sq**0.5}

    def at_start(self, kept, received: Factors, start: Factors, space, rnd: int) -> dict[str, float]:
        """For a client that trained before (``kept``, a :class:`~fs_fedpa.plugin.client_state.ClientState`, as it
        enters round ``rnd``): the rounds since it last trained, ``||s_i B_i A_i - X_g,i||_F`` of its preserved
        factors against the reference ``received`` (partial participation: does a preserved factor that sat out drift
        from the reference?), and E_init(B), E_init(A) of the round's ``start`` for the first LoRA module (§3.3; the
        paper plots one module). E_init is that of the raw factors: on applied ones ``s_i B``, with its eps scaled by
        ``s_i`` (``space``'s) alike, the same number. None without diagnostics or before it first trained."""
        if not self.full or kept.last_trained is None or kept.factors is None:
            return {}
        own, reference = self.method.expand(kept.factors), self.expanded_reference(received)
        sq = sum(float(product_distance(B, A, *reference[n])) ** 2 for n, (B, A) in own.items() if n in reference)
        name = next(iter(start))
        (B_0, A_0), (B, A) = start[name], kept.factors[name]
        return {"staleness": rnd - kept.last_trained, "drift_start": sq**0.5,
                "e_init_B": initialization_error([B_0], [B], eps=EPS * space.s_i(name)),
                "e_init_A": initialization_error([A_0], [A])}  # fmt: skip


class RoundLog:
    """The server's round records (a collaborator of :class:`~fs_fedpa.plugin.server.FedPAServer`): unless
    ``records`` (the ``fedpa.records`` section) says ``diagnostics: off``, one JSON line a round in
    ``<outdir>/fedpa_diagnostics.jsonl``, which is the run's history (E_agg in the log line only under ``full``,
    where it is computed); in memory only what a run continues from: the bytes sent both ways so far, the clients
    aggregated so far, and the file's size and SHA-256, which resume points carry (not the records)."""

    FIELDS = ("clients", "totals", "file", "file_size", "file_sha256")  # its part of a resume point

    def __init__(self, outdir: str, records):
        self.path, self.written, self.full = os.path.join(outdir, DIAGNOSTICS_FILE), records.written, records.full
        self.clients: set[int] = set()
        self.totals = {"up": 0, "down": 0}
        self.digest, self.size = hashlib.sha256(), 0  # of every byte this run's file holds

    def add(self, record: dict) -> None:
        """One round's record: its byte totals so far added, written and logged."""
        self.totals["up"] += sum(record["bytes_up"].values())
        self.totals["down"] += sum(record["bytes_down"].values())
        record.update(bytes_up_total=self.totals["up"], bytes_down_total=self.totals["down"])
        self.clients.update(c for c in record.get("clients") or () if isinstance(c, int))
        if self.written:
            data = (json.dumps(record) + "\n").encode("utf-8")
            with open(self.path, "ab") as f:
                f.write(data)
            self.digest.update(data)
            self.size += len(data)
        e_agg = f"E_agg={_g(record['e_agg'])} (rel {_g(record['e_agg_rel'], '.3g')}), " if self.full else ""
        logger.info(
            f"[fedpa] round {record['round']}: {e_agg}alignment={_g(record['alignment_loss_mean'])}, "
            f"up {sum(record['bytes_up'].values())} B, down {sum(record['bytes_down'].values())} B"
        )

    def state_dict(self) -> dict:
        """For a resume point: the byte totals, the clients aggregated so far, and the diagnostics file (its path,
        or "" when none is written) by the size and SHA-256 of what it holds, which a resume checks it begins with."""
        return {"clients": sorted(self.clients), "totals": dict(self.totals),
                "file": os.path.abspath(self.path) if self.written else "", "file_size": self.size,
                "file_sha256": self.digest.hexdigest()}  # fmt: skip

    def check_state(self, state: dict, path: str, rnd: int) -> None:
        """ValueError naming ``path`` (or the diagnostics file) and the field ``round_log.<key>`` unless ``state``
        is :meth:`state_dict`'s dict of a resume point of round ``rnd`` and its diagnostics file, where it is there
        and this run writes one, begins with the bytes it recorded (:meth:`history`)."""
        at = f"federate.restore_from {path!r}"
        check_fields(state, at, "round_log", self.FIELDS)
        clients, totals = state["clients"], state["totals"]
        if not isinstance(clients, list) or not all(is_int(c) and c >= 1 for c in clients):
            raise ValueError(f"{at}: field 'round_log.clients' is {clients!r:.100}, not a list of client ids")
        check_fields(totals, at, "round_log.totals", ("up", "down"))
        for key in ("up", "down"):
            check_int(totals, at, key, 0, field=f"round_log.totals.{key}")
        if not isinstance(state["file"], str):
            raise ValueError(f"{at}: field 'round_log.file' is {state['file']!r:.100}, not a path")
        check_int(state, at, "file_size", 0, field="round_log.file_size")
        if not isinstance(state["file_sha256"], str) or len(state["file_sha256"]) != 64:
            raise ValueError(f"{at}: field 'round_log.file_sha256' is {state['file_sha256']!r:.100}, not a SHA-256")
        self.history(state, path)

    def history(self, state: dict, path: str) -> bytes | None:
        """The bytes of the resumed run's diagnostics file that its resume point ``path`` recorded (``state``: its
        ``round_log``), checked to be what they were (lines after them are of rounds the resumed run trains again);
        None where there is nothing to continue (no file written, or this run writes none) or the file is gone.
        ValueError naming the file for one that does not begin with them: another run's, or changed."""
        previous, size = state["file"], state["file_size"]
        if not previous or not size or not self.written or not os.path.lexists(previous):
            return None
        what = f"the diagnostics file {previous!r} of the run this resumes"
        data = read_regular(previous, size + 2**26, what)[:size]  # its later lines: a few rounds, each a few KB
        if len(data) < size or hashlib.sha256(data).hexdigest() != state["file_sha256"]:
            raise ValueError(
                f"{what} does not begin with the {size} bytes its resume point {path!r} recorded (field "
                "'round_log.file_sha256'): it is another run's, or was changed; move it aside to resume without "
                "the history"
            )
        return data

    def load_state_dict(self, state: dict, path: str) -> None:
        """Continue the run of the resume point ``path`` (``state``: :meth:`state_dict`'s dict, checked by
        :meth:`check_state`): its totals and clients, and its diagnostics file up to the point, which this run's
        file begins with (one file holds the whole run). A file that is gone is warned of: the history starts at
        the resumed round."""
        self.totals, self.clients = dict(state["totals"]), set(state["clients"])
        data = self.history(state, path)
        if data is None:
            if self.written and state["file"] and state["file_size"]:
                logger.warning(f"[fedpa] the diagnostics file of the run this resumes ({state['file']}) is not "
                               "there: this run's file holds the rounds from the resumed one on")  # fmt: skip
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "wb") as f:
            f.write(data)
        self.digest, self.size = hashlib.sha256(data), len(data)


def _g(value, spec: str = ".4g") -> str:
    """A diagnostic for the log: formatted, or ``null`` where the record holds None (it was not finite)."""
    return "null" if value is None else format(value, spec)

"""Round records and diagnostics: what each client measures of its round (:class:`RoundStats`) and what
the server records of each aggregation (:class:`RoundLog`, one JSON line a round in
``<outdir>/fedpa_diagnostics.jsonl``). The study's diagnostics (E_agg, spectra, drift, change norms, staleness,
E_init) are computed only under ``fedpa.records.diagnostics full``; the default ``light`` records what a user reads."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass

import torch

from fs_fedpa.core.diagnostics import aggregate_norm, aggregation_error, initialization_error
from fs_fedpa.core.norms import change_sq_norm, factored_norm, product_distance, product_sq_norm
from fs_fedpa.lora import Factors
from fs_fedpa.record import DIAGNOSTICS_FILE, RoundRecord
from fs_fedpa.resume import plain

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
    """The server's round records (a collaborator of :class:`~fs_fedpa.plugin.server.FedPAServer`): every round's
    record in memory, which resume points carry, the bytes sent both ways so far, and unless ``records`` (the
    ``fedpa.records`` section) says ``diagnostics: off`` one JSON line a round in ``<outdir>/fedpa_diagnostics.jsonl``
    (E_agg in the log line only under ``full``, where it is computed)."""

    def __init__(self, outdir: str, records):
        self.path, self.written, self.full = os.path.join(outdir, DIAGNOSTICS_FILE), records.written, records.full
        self.records: list[dict] = []
        self.totals = {"up": 0, "down": 0}

    def add(self, record: dict) -> None:
        """One round's record: its byte totals so far added, kept, written and logged."""
        self.totals["up"] += sum(record["bytes_up"].values())
        self.totals["down"] += sum(record["bytes_down"].values())
        record.update(bytes_up_total=self.totals["up"], bytes_down_total=self.totals["down"])
        self.records.append(record)
        self._write([record])
        e_agg = f"E_agg={_g(record['e_agg'])} (rel {_g(record['e_agg_rel'], '.3g')}), " if self.full else ""
        logger.info(
            f"[fedpa] round {record['round']}: {e_agg}alignment={_g(record['alignment_loss_mean'])}, "
            f"up {sum(record['bytes_up'].values())} B, down {sum(record['bytes_down'].values())} B"
        )

    def state_dict(self) -> dict:
        """For a resume point: the records so far (plain values) and the byte totals."""
        return {"records": plain(self.records), "totals": dict(self.totals)}

    def load_state_dict(self, state: dict, path: str) -> None:
        """A resumed run's history (:meth:`state_dict`'s dict from the file ``path``): kept, and written again to
        this run's file."""
        self.records, self.totals = list(state["records"]), dict(state["totals"])
        self._write(self.records)

    def _write(self, records: list[dict]) -> None:
        if self.written:
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(record) + "\n" for record in records)


def _g(value, spec: str = ".4g") -> str:
    """A diagnostic for the log: formatted, or ``null`` where the record holds None (it was not finite)."""
    return "null" if value is None else format(value, spec)


@dataclass(frozen=True)
class RecordHead:
    """The fields of a round's record that the round gives, not the uploads: its number, the method, the module
    whose spectrum is probed and the bytes each client was sent (by id, as a string)."""

    rnd: int
    method: object
    probe_module: str
    bytes_down: dict[str, int]


def new_record(head: RecordHead) -> RoundRecord:
    return RoundRecord(
        round=head.rnd,
        method=head.method.name,
        svd=head.method.cfg.svd,
        R_g=head.method.plan.R_g,
        probe_module=head.probe_module,
        bytes_down=dict(head.bytes_down),
    )


def round_record(head: RecordHead, uploads, weights, clients, new_global, spectra, stats) -> RoundRecord:
    """Diagnostics of one aggregation, from factors only (no d x k matrix). A diagnostic is never a reason to drop
    an upload or stop a round: one that cannot be computed (e.g. an overflow after a legal but huge upload) is None,
    with a warning, and one that is not finite is written as null (:meth:`RoundRecord.to_dict`). With
    the aggregate's diagnostics, which cost as much as a reconstruction, computed only under ``fedpa.records.diagnostics
    full``: else they are None."""
    method = head.method  # ``uploads``: as applied factors (each expanded once, when it was checked)
    record = new_record(head)
    record.clients, record.weights = list(clients), list(weights)
    blank_aggregate(record)
    if method.cfg.records.full:
        try:
            _aggregate_diagnostics(record, method.expand(new_global), uploads, weights, spectra)
        except (RuntimeError, ValueError, ArithmeticError) as err:
            logger.warning(
                f"[fedpa] round {head.rnd}: the aggregate's diagnostics cannot be computed ({type(err).__name__}: "
                f"{err}); recorded as null, and the aggregate is installed"
            )
            blank_aggregate(record)
    record.add_client_stats(list(clients), stats)
    record.upload_ranks = {str(c): sorted({B.shape[1] for B, _ in u.values()}) for c, u in zip(clients, uploads)}
    return record


def blank_aggregate(record: RoundRecord) -> None:
    record.e_agg = record.e_agg_rel = record.global_update_norm = record.global_norm = record.e_agg_probe = None


def _aggregate_diagnostics(record: RoundRecord, new_global, uploads, weights, spectra) -> None:
    """E_agg (absolute, relative, of the probe module), ||sum_i w_i Delta W_i||_F, ||B_g A_g||_F, the probe's
    spectrum: summed over modules, into ``record``."""
    errors, norms, global_sq = {}, {}, 0.0
    for name, (B_g, A_g) in new_global.items():
        Bs = [u[name][0] for u in uploads]
        As = [u[name][1] for u in uploads]
        errors[name] = float(aggregation_error(Bs, As, B_g, A_g, weights=weights))
        norms[name] = float(aggregate_norm(Bs, As, weights=weights))
        global_sq += float(factored_norm(B_g, A_g)) ** 2
    e_agg = math.sqrt(sum(e**2 for e in errors.values()))
    ideal = math.sqrt(sum(n**2 for n in norms.values()))
    record.e_agg, record.e_agg_rel = e_agg, (e_agg / ideal if ideal > 0 else 0.0)
    record.global_update_norm, record.global_norm = ideal, math.sqrt(global_sq)
    record.e_agg_probe = errors[record.probe_module]
    record.spectrum_probe = [float(s) for s in spectra.get(record.probe_module, torch.zeros(0))]


def private_record(head: RecordHead, clients: list[int], weight: float, new_global, spectra, release) -> dict:
    """The round record under client-level DP: post-processing of the release only (each of the K receivers
    ``weight`` 1/K). E_agg, the spectrum and the norms describe the noisy mean; nothing is read from a client's
    upload or statistics."""
    method = head.method
    record = new_record(head)
    record.clients = list(clients)
    record.weights = [weight] * len(clients)
    blank_aggregate(record)
    if method.cfg.records.full:
        expanded = method.expand(new_global)
        global_sq = product_sq_norm(expanded)
        record.global_norm = global_sq**0.5
        if method.dp_space == "product":
            errors = {n: float(torch.linalg.matrix_norm(M.double() - B.double() @ A.double()))
                      for n, (B, A), M in ((n, expanded[n], release[n]) for n in release)}  # fmt: skip
            ideal = sum(float(M.double().pow(2).sum()) for M in release.values()) ** 0.5
            record.e_agg = sum(e**2 for e in errors.values()) ** 0.5
            record.e_agg_rel = record.e_agg / ideal if ideal > 0 else 0.0
            record.global_update_norm = ideal
            record.e_agg_probe = errors[record.probe_module]
        record.spectrum_probe = [float(s) for s in spectra.get(record.probe_module, torch.zeros(0))]
    return record.to_dict()

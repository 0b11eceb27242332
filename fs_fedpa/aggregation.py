"""One round's aggregation without FederatedScope: ``aggregate_round(method, policy, round input, uploads) -> (result,
record)``.

The FS aggregator (:class:`fs_fedpa.plugin.aggregator.FedPAAggregator`) decodes and checks FS's messages into
:class:`Uploads`, calls :func:`aggregate_round` and installs the result. Here: every upload that could not be read is
dropped with its reason (the DP policy's :meth:`~fs_fedpa.privacy.policy.ServerPolicy.drop` says where the reason
goes); the policy makes the round's global state from a :class:`Round` (without DP: :meth:`Round.aggregate`, the
uploads it admits, less outliers, through the method, the upload that breaks the method found and dropped; a
mechanism may release instead, :meth:`Round.released`); and the round is recorded (a
:class:`~fs_fedpa.record.RoundRecord`, as a dict).
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fs_fedpa.core.diagnostics import aggregate_norm, aggregation_error
from fs_fedpa.core.norms import factored_norm, product_sq_norm
from fs_fedpa.lora import Factors
from fs_fedpa.record import RoundRecord

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


@dataclass(frozen=True)
class RoundInput:
    """The round being aggregated, as the server opened it: the round, its receivers (the only valid senders), the
    global factors it started from, the bytes each client was sent and the federated non-LoRA tensors it started
    from (:meth:`fs_fedpa.plugin.global_model.GlobalModel.round_input`)."""

    rnd: int
    expected: tuple[int, ...]
    global_factors: Factors
    down_bytes: dict[int, int]
    shared: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Uploads:
    """A round's uploads as the server read them: ``clients`` in the order they are aggregated, ``accepted`` (client
    -> an upload with ``factors``, ``shared``, ``size``, ``stats`` and ``applied``, fresh tensors:
    :class:`fs_fedpa.plugin.intake.Accepted`), ``refused`` (client -> why it cannot be read) and ``bytes_up``
    (client id as a string -> the bytes its tensors hold)."""

    clients: list
    accepted: dict
    refused: dict = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Aggregated:
    """What a round that aggregated installs: the new global factors, the averaged shared tensors, a method's merge
    into the base weights, and the clients whose stored state was lost (they are sent every merge again)."""

    global_factors: Factors
    shared: dict[str, Tensor]
    merge: dict | None
    lost: tuple[int, ...] = ()


@dataclass(frozen=True)
class Unchanged:
    """A round that installs nothing (the global adapter stays): ``failed`` when every upload was dropped (for
    ``reasons``), not when its uploads were only set aside (they carry no training)."""

    failed: bool
    reasons: dict[str, str] = field(default_factory=dict)


def aggregate_round(method, policy, round_input: RoundInput, uploads: Uploads, *, generator: torch.Generator,
                    ignore_weight: bool = False) -> tuple[Aggregated | Unchanged, dict]:  # fmt: skip
    """Round ``round_input``'s :class:`Aggregated` result (or :class:`Unchanged`) and its record, from ``uploads``:
    the refused ones dropped through ``policy`` (a :class:`~fs_fedpa.privacy.policy.ServerPolicy`), which then makes
    the round's global state (:meth:`~fs_fedpa.privacy.policy.ServerPolicy.aggregate`). ``generator``: the method's
    sketches; ``ignore_weight``: FS's ``federate.ignore_weight`` (every upload weighs the same)."""
    round_ = Round(method, policy, round_input, uploads, generator, ignore_weight)
    for client, reason in uploads.refused.items():
        round_.drop(client, reason)
    return policy.aggregate(round_)


class Round:
    """One round as its DP policy sees it: ``rnd``, its sorted ``receivers``, the ``global_factors`` and ``shared``
    tensors it started from, the accepted ``uploads`` (client -> upload) and their ``stats``. :meth:`aggregate` is
    the method's aggregation of them; :meth:`released` a mechanism's own global state, :meth:`record` the record of
    either."""

    def __init__(self, method, policy, round_input: RoundInput, uploads: Uploads, generator, ignore_weight: bool):
        self.method, self.policy, self.generator, self.ignore_weight = method, policy, generator, ignore_weight
        self.rnd, self.receivers = round_input.rnd, sorted(round_input.expected)
        self.global_factors, self.shared = round_input.global_factors, round_input.shared
        self.down_bytes, self.clients, self.bytes_up = round_input.down_bytes, uploads.clients, uploads.bytes_up
        self.uploads = dict(uploads.accepted)
        # a refused client's stats too: what it spent is the ledger's
        self.stats = {c: u.stats for c, u in self.uploads.items()}
        self.dropped: dict[str, str] = {}

    def drop(self, client, reason: str) -> None:
        """Drop ``client``'s upload for ``reason``, which the record and the policy (its log or private file) keep."""
        self.dropped[str(client)] = reason
        self.uploads.pop(client, None)
        self.policy.drop(self.rnd, client, reason)

    def aggregate(self, refused: dict, set_aside: dict) -> tuple[Aggregated | Unchanged, dict]:
        """The method's aggregation of the uploads, less the ``refused`` ones (dropped: client -> reason), those
        ``set_aside`` (client -> reason: recorded, not a fault) and those ``fedpa.norm_outlier`` drops; an upload that
        makes it fail is dropped and the others aggregated again (:meth:`_culprit`)."""
        for client, reason in refused.items():
            self.drop(client, reason)
        aside = {str(c): reason for c, reason in set_aside.items() if c in self.uploads}
        for client in set_aside:
            self.uploads.pop(client, None)
        method, cfg, accepted, rnd = self.method, self.method.cfg, self.uploads, self.rnd
        if cfg.norm_outlier and accepted:
            norms = {c: update_norm(a.applied) for c, a in accepted.items()}
            median = statistics.median(norms.values())
            for i in norm_outliers(list(norms.values()), cfg.norm_outlier):
                client = list(norms)[i]
                reason = f"||Delta W|| = {norms[client]:.3g} > fedpa.norm_outlier(={cfg.norm_outlier:g}) x the "
                self.drop(client, reason + f"round's median {median:.3g}")
        while accepted:
            kept = list(accepted)
            uploads, stats = [accepted[c].factors for c in kept], [accepted[c].stats for c in kept]
            weights, ids = self._weights([accepted[c] for c in kept]), [c - 1 for c in kept]
            try:
                new_global, spectra = method.aggregate(uploads, weights, ids, self.generator, rnd=rnd)
                merge = method.merge(uploads, weights, new_global) if method.merges else None
                averaged = weighted_mean([accepted[c].shared for c in kept], weights)
                check_finite({**new_global, **{f"{n} (merge)": f for n, f in (merge or {}).items()}}, averaged)
            except (RuntimeError, ValueError, ArithmeticError) as err:  # a contribution the checks let through
                culprit = self._culprit()
                self.drop(culprit, f"aggregation failed with its upload ({type(err).__name__}: {err})")
                continue
            record = self.record(kept, weights)
            if cfg.records.full:
                whole = with_merge(new_global, merge)
                aggregate_diagnostics(record, method, [accepted[c].applied for c in kept], weights, whole, spectra)
            record.add_client_stats(kept, stats)
            record.upload_ranks = {str(c): sorted({B.shape[1] for B, _ in accepted[c].applied.values()}) for c in kept}
            record.dropped, record.bytes_up = {**self.dropped, **aside}, self.bytes_up
            record.restarted = [c for c, st in zip(kept, stats) if st.get("restarted")]
            if bad := record.not_finite():  # a diagnostic problem: the aggregate itself is finite (checked above)
                logger.warning(f"[fedpa] round {rnd}: the diagnostics {', '.join(bad)} are not finite; recorded as "
                               "null")  # fmt: skip
            # a client whose stored state, merges included, is gone: the next message sends them all
            lost = tuple(c for c, st in zip(kept, stats) if st.get("state_lost"))
            return Aggregated(new_global, averaged, merge, lost), record.to_dict()
        record = self.new_record(self.clients)
        record.dropped, record.bytes_up = {**self.dropped, **aside}, self.bytes_up
        if aside and not self.dropped:  # nothing failed: the round's clients had no training to send
            logger.info(f"[fedpa] round {rnd}: every upload was set aside ({next(iter(aside.values()))}); the global "
                        "adapter stays as it was")  # fmt: skip
            return Unchanged(failed=False), record.to_dict()
        logger.warning(f"[fedpa] round {rnd}: every upload was dropped; the global adapter stays as it was")
        return Unchanged(failed=True, reasons=dict(self.dropped)), record.to_dict()

    def released(self, global_factors: Factors, shared: dict[str, Tensor]) -> Aggregated:
        """A mechanism's own global state of the round (a release), checked to be finite (ArithmeticError)."""
        check_finite(global_factors, shared)
        return Aggregated(global_factors, shared, None)

    def new_record(self, clients) -> RoundRecord:
        """A record with the fields the round gives, not the uploads: the bytes each of ``clients`` was sent."""
        method = self.method
        down = {str(c): self.down_bytes.get(c, 0) for c in clients}
        return RoundRecord(round=self.rnd, method=method.name, svd=method.cfg.svd, R_g=method.plan.R_g,
                           probe_module=next(iter(self.global_factors)), bytes_down=down)  # fmt: skip

    def record(self, clients: list, weights: list[float]) -> RoundRecord:
        """:meth:`new_record` of the aggregated ``clients`` and their ``weights``, the aggregate's diagnostics None
        (computed only under ``fedpa.records.diagnostics full``: :func:`aggregate_diagnostics`)."""
        record = self.new_record(clients)
        record.clients, record.weights = list(clients), list(weights)
        blank(record)
        return record

    def _culprit(self):
        """The client whose upload makes aggregation fail: the first whose removal lets the others aggregate with the
        weights the round would give them (the last one if no single removal does). Every weight is checked per
        client before aggregation (:func:`fs_fedpa.plugin.intake.check_upload`), so this search is left with what
        no check of one upload can see."""
        ids = list(self.uploads)
        for candidate in ids:
            rest = [c for c in ids if c != candidate]
            if not rest:
                break
            try:
                new_global, _ = self.method.aggregate(
                    [self.uploads[c].factors for c in rest],
                    self._weights([self.uploads[c] for c in rest]),
                    [c - 1 for c in rest],
                    torch.Generator().manual_seed(0),
                    rnd=self.rnd,
                )
                check_finite(new_global, {})
                return candidate
            except (RuntimeError, ValueError, ArithmeticError):
                continue
        return ids[-1]

    def _weights(self, uploads: list) -> list[float]:
        """The aggregation weights of accepted uploads: the method's (FS's sample sizes; FlexLoRA's
        ``num_train_data``), capped by ``fedpa.max_weight_ratio``. A client of size 0 weighs 0; a round whose weights
        are all 0 weighs its uploads equally (docs/errors.md). Sizes were checked per client, so every weight is
        finite, >= 0 and at most 1e15."""
        if self.ignore_weight:
            weights = [1.0] * len(uploads)
        else:
            sizes, data_sizes = [a.size for a in uploads], [a.stats.get("num_train_data") for a in uploads]
            weights = cap_weights(self.method.weights(sizes, data_sizes), self.method.cfg.max_weight_ratio)
        return weights if sum(weights) > 0 else [1.0] * len(uploads)


def aggregate_diagnostics(record: RoundRecord, method, uploads, weights, new_global, spectra) -> None:
    """E_agg (absolute, relative, of the probe module), ||sum_i w_i Delta W_i||_F, ||B_g A_g||_F and the probe's
    spectrum, summed over modules, into ``record``, from factors only (no d x k matrix); ``uploads``: applied factors.
    A diagnostic is never a reason to drop an upload or stop a round: one that cannot be computed (e.g. an overflow
    after a legal but huge upload) is None, with a warning."""
    try:
        _diagnostics(record, method.expand(new_global), uploads, weights, spectra)
    except (RuntimeError, ValueError, ArithmeticError) as err:
        logger.warning(
            f"[fedpa] round {record.round}: the aggregate's diagnostics cannot be computed ({type(err).__name__}: "
            f"{err}); recorded as null, and the aggregate is installed"
        )
        blank(record)


def _diagnostics(record: RoundRecord, new_global, uploads, weights, spectra) -> None:
    errors, norms, global_sq = {}, {}, 0.0
    for name, (B_g, A_g) in new_global.items():
        Bs, As = [u[name][0] for u in uploads], [u[name][1] for u in uploads]
        errors[name] = float(aggregation_error(Bs, As, B_g, A_g, weights=weights))
        norms[name] = float(aggregate_norm(Bs, As, weights=weights))
        global_sq += float(factored_norm(B_g, A_g)) ** 2
    e_agg = math.sqrt(sum(e**2 for e in errors.values()))
    ideal = math.sqrt(sum(n**2 for n in norms.values()))
    record.e_agg, record.e_agg_rel = e_agg, (e_agg / ideal if ideal > 0 else 0.0)
    record.global_update_norm, record.global_norm = ideal, math.sqrt(global_sq)
    record.e_agg_probe = errors[record.probe_module]
    record.spectrum_probe = [float(s) for s in spectra.get(record.probe_module, torch.zeros(0))]


def blank(record: RoundRecord) -> None:
    """The aggregate's diagnostics of ``record`` set to None (not computed)."""
    record.e_agg = record.e_agg_rel = record.global_update_norm = record.global_norm = record.e_agg_probe = None


def cap_weights(weights: list[float], ratio: float) -> list[float]:
    """``w_i <- min(w_i, ratio * median of the positive w)`` (``fedpa.max_weight_ratio``; 0: unchanged): no single
    client's declared sample size can outweigh the others by more than ``ratio``. A zero weight (a client that
    trained on no example) stays 0 and takes no part in the median, so zero-size clients cannot pull the ceiling
    to 0 and cap the honest weights away; with no positive weight the weights are returned unchanged."""
    positive = [w for w in weights if w > 0]
    if not ratio or not positive:
        return list(weights)
    ceiling = ratio * statistics.median(positive)
    return [min(w, ceiling) for w in weights]


def norm_outliers(norms: list[float], factor: float) -> list[int]:
    """Positions whose update norm exceeds ``factor`` times the median of the round (``fedpa.norm_outlier``; 0 or
    fewer than 3 uploads: none). A median is what a minority of poisoned uploads cannot move far."""
    if not factor or len(norms) < 3:
        return []
    ceiling = factor * statistics.median(norms)
    return [i for i, n in enumerate(norms) if n > ceiling]


def update_norm(factors: Factors) -> float:
    """``||Delta W_i||_F`` over all LoRA modules, ``sqrt(sum ||B A||_F^2)``, without forming a product."""
    return math.sqrt(product_sq_norm(factors))


def check_finite(global_factors: Factors, averaged: dict[str, Tensor]) -> None:
    """ArithmeticError if the aggregate holds a NaN or an Inf (e.g. an overflow the per-upload bounds missed)."""
    for name, (B, A) in global_factors.items():
        if not (torch.isfinite(B).all() and torch.isfinite(A).all()):
            raise ArithmeticError(f"the aggregate of {name} is not finite")
    for name, t in averaged.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ArithmeticError(f"the average of shared tensor {name} is not finite")


def with_merge(global_factors: Factors, merge: dict | None) -> Factors:
    """The factors of the round's whole global update: the adapter and, beside it, what is merged into the base."""
    if not merge:
        return global_factors
    return {n: (torch.cat([B, merge[n][0]], 1), torch.cat([A, merge[n][1]])) for n, (B, A) in global_factors.items()}


def weighted_mean(tensors: list[dict[str, Tensor]], weights: list[float]) -> dict[str, Tensor]:
    """``sum_i w_i t_i / sum_i w_i`` per name, in float64, returned in the tensors' dtype ({} without tensors)."""
    if not tensors or not tensors[0]:
        return {}
    total = sum(weights)
    return {
        k: sum(w / total * t[k].double() for w, t in zip(weights, tensors)).to(tensors[0][k].dtype) for k in tensors[0]
    }

"""The aggregation step of the FedPA server: every upload decoded (copies) and checked, outliers and uploads that
break aggregation dropped with a reason naming the client, the method's product-space aggregation and the round
recorded, the result installed and returned to FS as the model state it loads. FS has no aggregator registry: the
server installs :class:`FedPAAggregator` itself."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from federatedscope.core.aggregators import Aggregator
from torch import Tensor

from fs_fedpa.lora import Factors
from fs_fedpa.plugin.intake import Accepted, cap_weights, check_upload, message_pair, norm_outliers, update_norm
from fs_fedpa.plugin.payload import nbytes
from fs_fedpa.plugin.record_fs import RecordHead, RoundLog, new_record, private_record, round_record
from fs_fedpa.privacy.policy import ServerPolicy
from fs_fedpa.rng_states import check_generator_state
from fs_fedpa.state_checks import check_fields, check_int

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only

SAT_OUT = ("took no DP-SGD step (its account: 0 steps; fedpa.dp.min_records): its upload carries no training and is "
           "not aggregated")  # fmt: skip


@dataclass(frozen=True)
class RoundInput:
    """The round being aggregated, as the server opened it: the round, its receivers (the only valid senders), the
    global factors it started from and the bytes each client was sent."""

    rnd: int
    expected: tuple[int, ...]
    global_factors: Factors
    down_bytes: dict[int, int]
    shared: dict[str, Tensor] = field(default_factory=dict)  # the federated non-LoRA tensors it started from


@dataclass(frozen=True)
class Aggregated:
    """What a round that aggregated installs: the new global factors, the averaged shared tensors, a method's merge
    into the base weights, and the clients whose stored state was lost (they are sent every merge again)."""

    global_factors: Factors
    shared: dict[str, Tensor]
    merge: dict | None
    lost: tuple[int, ...] = ()


class FedPAAggregator(Aggregator):
    """FS's ``aggregate(agg_info)`` for the FedPA server: decode (copies), check, reconstruct, record and install.
    It is given what it needs: the method, the round log it adds to, the server's DP policy (:mod:`fs_fedpa.privacy`;
    without DP the one that lets everything through), the sketches' generator, the shapes of the LoRA modules (d, k)
    and of the shared tensors, ``round_of`` (the :class:`RoundInput` of the round FS aggregates now) and
    ``global_model`` (the server's :class:`~fs_fedpa.plugin.global_model.GlobalModel`: ``adopt`` puts an
    :class:`Aggregated` into the server's model and returns the model state it wrote, keyed as the model's
    ``state_dict``; ``save_checkpoint``/``load_checkpoint`` are FS's checkpoint, tagged with ``run``, the run's
    identity). :meth:`aggregate` returns that state, which FS merges into its model as it does a FedAvg average ({}
    when every upload was dropped), and stops the run on a count of its own, :attr:`failed_in_a_row`, which its
    :meth:`state_dict` carries with the generator's state."""

    def __init__(self, method, round_log: RoundLog, *, global_model=None, run: dict | None = None, privacy=None,
                 generator: torch.Generator | None = None, shapes=({}, {}), distributed=False, ignore_weight=False,
                 round_of: Callable[[], RoundInput] | None = None):  # fmt: skip
        super().__init__()
        self.method, self.round_log = method, round_log
        self.privacy = privacy if privacy is not None else ServerPolicy()  # without DP: everything through
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.shapes, self.distributed, self.ignore_weight = shapes, distributed, ignore_weight
        self.global_model, self.run, self.round_of = global_model, dict(run or {}), round_of
        self.round: RoundInput | None = None  # the round being aggregated (round_of's, when aggregate starts)
        self.failed_in_a_row = 0  # rounds whose every upload was dropped, since the last one that aggregated

    def state_dict(self) -> dict:
        """For a resume point: the sketches' generator and the count of rounds in a row without an aggregation."""
        return {"generator": self.generator.get_state(), "failed_in_a_row": self.failed_in_a_row}

    def check_state(self, state: dict, path: str, rnd: int) -> None:
        """ValueError naming ``path`` and the field ``aggregator.<key>`` unless ``state`` is :meth:`state_dict`'s
        dict of a resume point (of round ``rnd``): a CPU generator's state and a count of failed rounds >= 0."""
        at = f"federate.restore_from {path!r}"
        check_fields(state, at, "aggregator", ("generator", "failed_in_a_row"))
        check_int(state, at, "failed_in_a_row", 0, field="aggregator.failed_in_a_row")
        check_generator_state(state["generator"], at, "aggregator.generator")

    def load_state_dict(self, state: dict, path: str) -> None:
        """:meth:`state_dict`'s dict from the file ``path`` (checked by :meth:`check_state` before)."""
        self.generator.set_state(state["generator"])
        self.failed_in_a_row = state["failed_in_a_row"]

    def aggregate(self, agg_info) -> dict:
        """The round's uploads (FS's ``agg_info``) checked, aggregated, recorded and installed; returns the model state
        ``install`` wrote, for FS to merge into its model."""
        self.round = self.round_of()
        rnd = self.round.rnd
        clients = [client_id for client_id, _ in agg_info["staleness"]]
        feedback = list(zip(clients, agg_info["client_feedback"]))
        if self.distributed:
            # in arrival order, the float sums would depend on which client finished first; by id they do not, so a
            # run's result is the same whatever the network does (standalone keeps FS's order, as its runs were made)
            feedback.sort(key=lambda item: item[0] if isinstance(item[0], int) else float("inf"))
            clients = [client_id for client_id, _ in feedback]
        accepted, dropped, bytes_up = {}, {}, {}
        for client_id, message in feedback:
            pair = message_pair(message)
            checked = pair if isinstance(pair, str) else self._check(client_id, *pair)
            bytes_up[str(client_id)] = 0 if isinstance(pair, str) else nbytes(pair[1])  # what its tensors hold
            if isinstance(checked, str):
                self._drop(dropped, client_id, checked)
            else:  # fresh tensors: nothing below can alter what a client sent
                accepted[client_id] = checked
                if bad := sorted(k for k, v in checked.stats.items() if v is None):
                    logger.warning(
                        f"[fedpa] round {rnd}: client #{client_id} reported stats that are not finite "
                        f"({', '.join(bad)}); recorded as such, and its upload is aggregated"
                    )
        if self.privacy.releases:  # client-level DP: every round releases, whatever arrived
            return self._aggregate_private(accepted)
        stats = {c: a.stats for c, a in accepted.items()}  # a refused client's too: what it spent is the ledger's
        for client_id, reason in self.privacy.admit(rnd, stats).items():
            self._drop(dropped, client_id, reason)
            del accepted[client_id]
        self.privacy.account(rnd, sorted(self.round.expected), stats)
        # a client that took no DP-SGD step (fedpa.dp.min_records) sends no training: whatever its factors, they are
        # not aggregated (a method that weighs uploads by their norm, or a round of only such uploads, would take them)
        sat_out = {}
        for client_id in [c for c, a in accepted.items() if a.stats.get("dp_steps") == 0]:
            sat_out[str(client_id)] = SAT_OUT
            del accepted[client_id]
        method, cfg = self.method, self.method.cfg
        if cfg.norm_outlier and accepted:
            norms = {c: update_norm(a.applied) for c, a in accepted.items()}
            median = statistics.median(norms.values())
            for i in norm_outliers(list(norms.values()), cfg.norm_outlier):
                client_id = list(norms)[i]
                reason = f"||Delta W|| = {norms[client_id]:.3g} > fedpa.norm_outlier(={cfg.norm_outlier:g}) x the "
                reason += f"round's median {median:.3g}"
                self._drop(dropped, client_id, reason)
                del accepted[client_id]
        while accepted:
            kept = list(accepted)
            uploads = [accepted[c].factors for c in kept]
            stats = [accepted[c].stats for c in kept]
            weights = self._weights([accepted[c] for c in kept])
            try:
                new_global, spectra = method.aggregate(uploads, weights, [c - 1 for c in kept], self.generator, rnd=rnd)
                merge = method.merge(uploads, weights, new_global) if method.merges else None
                averaged = _weighted_mean([accepted[c].shared for c in kept], weights)
                _check_finite({**new_global, **{f"{n} (merge)": f for n, f in (merge or {}).items()}}, averaged)
            except (RuntimeError, ValueError, ArithmeticError) as err:  # a contribution the checks let through
                culprit = self._culprit(accepted)
                self._drop(dropped, culprit, f"aggregation failed with its upload ({type(err).__name__}: {err})")
                del accepted[culprit]
                continue
            whole = _with_merge(new_global, merge)
            record = round_record(self._head(kept), [accepted[c].applied for c in kept], weights, kept, whole, spectra,
                                  stats)  # fmt: skip
            record.dropped, record.bytes_up = {**dropped, **sat_out}, bytes_up
            record.restarted = [c for c, st in zip(kept, stats) if st.get("restarted")]
            if bad := record.not_finite():  # a diagnostic problem: the aggregate itself is finite (checked above)
                logger.warning(f"[fedpa] round {rnd}: the diagnostics {', '.join(bad)} are not finite; recorded as "
                               "null")  # fmt: skip
            # a client whose stored state, merges included, is gone: the next message sends them all
            lost = tuple(c for c, st in zip(kept, stats) if st.get("state_lost"))
            self.round_log.add(record.to_dict())
            self.failed_in_a_row = 0
            return self.global_model.adopt(Aggregated(new_global, averaged, merge, lost))
        record = new_record(self._head(clients))
        record.dropped, record.bytes_up = {**dropped, **sat_out}, bytes_up
        self.round_log.add(record.to_dict())
        if sat_out and not dropped:  # nothing failed: the round's clients had no step to send
            logger.info(f"[fedpa] round {rnd}: every upload came from a client that took no DP-SGD step; the global "
                        "adapter stays as it was")  # fmt: skip
            return {}
        logger.warning(f"[fedpa] round {rnd}: every upload was dropped; the global adapter stays as it was")
        limit = cfg.max_failed_rounds
        self.failed_in_a_row += 1
        if limit and self.failed_in_a_row >= limit:
            raise RuntimeError(
                f"[fedpa] {self.failed_in_a_row} rounds in a row had every upload dropped "
                f"(fedpa.max_failed_rounds={limit}); "
                f"stopping instead of training nothing. Reasons in round {rnd}: {dropped}"
            )
        return {}

    def _head(self, clients) -> RecordHead:
        """The fields of this round's record that come from the round, not from the uploads."""
        down = {str(c): self.round.down_bytes.get(c, 0) for c in clients}
        return RecordHead(self.round.rnd, self.method, next(iter(self.round.global_factors)), down)

    def _aggregate_private(self, accepted: dict) -> dict:
        """Client-level DP (:mod:`fs_fedpa.privacy.client_level`): the noisy mean of the clipped contributions over
        the fixed K, the method's server step on it, and a record of the release only."""
        rnd, kept = self.round.rnd, list(accepted)
        uploads = [accepted[c].factors for c in kept]
        new_global, spectra, release, shared = self.privacy.release(
            uploads, kept, self.round.global_factors, rnd, [accepted[c].shared for c in kept], self.round.shared)
        _check_finite(new_global, shared)
        # the K receivers, which the DP generator drew: which of them arrived or were dropped (and each upload's
        # bytes) can depend on their data, and stays in the private faults file (privacy.fault)
        receivers = sorted(self.round.expected)
        weight = self.privacy.release_weight
        record = private_record(self._head(receivers), receivers, weight, new_global, spectra, release)
        self.round_log.add(record)
        self.privacy.account(rnd, receivers, {})
        self.failed_in_a_row = 0
        return self.global_model.adopt(Aggregated(new_global, shared, None))

    def _drop(self, dropped: dict, client_id, reason: str) -> None:
        dropped[str(client_id)] = reason
        if self.privacy.private_faults:  # client-level DP: not in the log (privacy.fault)
            self.privacy.fault(self.round.rnd, client_id, reason)
            return
        logger.warning(f"[fedpa] round {self.round.rnd}: dropped the upload of client #{client_id}: {reason}")

    def _culprit(self, accepted: dict):
        """The client whose upload makes aggregation fail: the first whose removal lets the others aggregate with the
        weights the round would give them (the last one if no single removal does). Every weight is checked per
        client before aggregation (:func:`fs_fedpa.plugin.intake.check_upload`), so this search is left with what
        no check of one upload can see."""
        ids = list(accepted)
        for candidate in ids:
            rest = [c for c in ids if c != candidate]
            if not rest:
                break
            try:
                new_global, _ = self.method.aggregate(
                    [accepted[c].factors for c in rest],
                    self._weights([accepted[c] for c in rest]),
                    [c - 1 for c in rest],
                    torch.Generator().manual_seed(0),
                    rnd=self.round.rnd,
                )
                _check_finite(new_global, {})
                return candidate
            except (RuntimeError, ValueError, ArithmeticError):
                continue
        return ids[-1]

    def _weights(self, uploads: list[Accepted]) -> list[float]:
        """The aggregation weights of accepted uploads: the method's (FS's sample sizes; FlexLoRA's
        ``num_train_data``), capped by ``fedpa.max_weight_ratio``. A client of size 0 weighs 0; a round whose weights
        are all 0 weighs its uploads equally (docs/errors.md). (A client that took no DP-SGD step is not among them:
        :meth:`aggregate` sets it aside.) Sizes were checked per client, so every weight is finite, >= 0 and at most
        1e15."""
        if self.ignore_weight:
            weights = [1.0] * len(uploads)
        else:
            sizes, data_sizes = [a.size for a in uploads], [a.stats.get("num_train_data") for a in uploads]
            weights = cap_weights(self.method.weights(sizes, data_sizes), self.method.cfg.max_weight_ratio)
        return weights if sum(weights) > 0 else [1.0] * len(uploads)

    def _check(self, client_id, size, content) -> Accepted | str:
        """:func:`fs_fedpa.plugin.intake.check_upload` for this client and round, or why it cannot be checked."""
        method, rnd, global_factors = self.method, self.round.rnd, self.round.global_factors
        ranks = method.plan.client_ranks
        if isinstance(client_id, bool) or not isinstance(client_id, int) or not 1 <= client_id <= len(ranks):
            return f"client id {client_id!r} is not in the rank plan (1..{len(ranks)})"
        dtype = next(iter(global_factors.values()))[0].dtype
        shapes, shared_shapes = self.shapes
        return check_upload(
            size,
            content,
            expected_parts=set(method.upload_parts(rnd)),
            complete=lambda parts: method.complete_upload(parts, global_factors, client_id - 1, rnd),
            expand=method.expand,
            shapes=shapes,
            ranks=method.upload_ranks(client_id - 1),
            shared_shapes=shared_shapes,
            dtype=dtype,
        )

    def save_model(self, path, cur_round=-1):
        """FS's checkpoint (``federate.save_to``, ``save_freq``): the global model's, with the run's identity."""
        self.global_model.save_checkpoint(path, cur_round, self.run)

    def load_model(self, path) -> int:
        """FS's: a checkpoint :meth:`save_model` wrote, loaded into the global model; returns its round. (A run
        continues from a resume point, ``federate.restore_from``, which the server loads itself.)"""
        return self.global_model.load_checkpoint(path)


def _check_finite(global_factors, averaged) -> None:
    """ArithmeticError if the aggregate holds a NaN or an Inf (e.g. an overflow the per-upload bounds missed)."""
    for name, (B, A) in global_factors.items():
        if not (torch.isfinite(B).all() and torch.isfinite(A).all()):
            raise ArithmeticError(f"the aggregate of {name} is not finite")
    for name, t in averaged.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ArithmeticError(f"the average of shared tensor {name} is not finite")


def _with_merge(global_factors, merge):
    """The factors of the round's whole global update: the adapter and, beside it, what is merged into the base."""
    if not merge:
        return global_factors
    return {n: (torch.cat([B, merge[n][0]], 1), torch.cat([A, merge[n][1]])) for n, (B, A) in global_factors.items()}


def _weighted_mean(tensors: list[dict[str, Tensor]], weights: list[float]) -> dict[str, Tensor]:
    if not tensors or not tensors[0]:
        return {}
    total = sum(weights)
    return {
        k: sum(w / total * t[k].double() for w, t in zip(weights, tensors)).to(tensors[0][k].dtype) for k in tensors[0]
    }

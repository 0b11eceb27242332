"""The aggregation step of the FedPA server in FS: FS's ``agg_info`` decoded and every upload checked (copies;
:func:`fs_fedpa.plugin.intake.check_upload`), the round aggregated by :func:`fs_fedpa.aggregation.aggregate_round`
(no FS there), recorded, and installed in the server's global model. FS has no aggregator registry: the server
installs :class:`FedPAAggregator` itself."""

from __future__ import annotations

import logging

import torch
from federatedscope.core.aggregators import Aggregator

from fs_fedpa.aggregation import Aggregated, RoundInput, Uploads, aggregate_round
from fs_fedpa.plugin.intake import check_upload, message_pair
from fs_fedpa.plugin.payload import nbytes
from fs_fedpa.plugin.record_fs import RoundLog
from fs_fedpa.privacy.policy import ServerPolicy
from fs_fedpa.rng_states import check_generator_state
from fs_fedpa.state_checks import check_fields, check_int
from fs_fedpa.systems import Span

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


class FedPAAggregator(Aggregator):
    """FS's ``aggregate(agg_info)`` for the FedPA server: decode (copies) and check, then
    :func:`~fs_fedpa.aggregation.aggregate_round`, record and install. It is given what it needs: the method, the
    round log it adds to, the server's DP policy (:mod:`fs_fedpa.privacy`; without DP the one that lets everything
    through), the sketches' generator, the shapes of the LoRA modules (d, k) and of the shared tensors and
    ``global_model`` (the server's :class:`~fs_fedpa.plugin.global_model.GlobalModel`: ``round_input`` is the round
    FS aggregates now, as the server opened it; ``adopt`` writes an :class:`~fs_fedpa.aggregation.Aggregated` into
    the server's model; ``save_checkpoint``/``load_checkpoint`` are FS's checkpoint, tagged with ``run``, the run's
    identity), and the run's ``report`` (:class:`~fs_fedpa.run_summary.RunReport`), told of every round. Each record
    carries the aggregation's wall seconds and peak memory. :meth:`aggregate` returns {}, the state FS merges into
    its model: the model holds the round's result already. It stops the run on a count of its own,
    :attr:`failed_in_a_row`, which its :meth:`state_dict` carries with the generator's state."""

    def __init__(self, method, round_log: RoundLog, *, global_model=None, run: dict | None = None, privacy=None,
                 generator: torch.Generator | None = None, shapes=({}, {}), distributed=False,
                 ignore_weight=False, report=None):  # fmt: skip
        super().__init__()
        self.method, self.round_log, self.report = method, round_log, report
        self.privacy = privacy if privacy is not None else ServerPolicy()  # without DP: everything through
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.shapes, self.distributed, self.ignore_weight = shapes, distributed, ignore_weight
        self.global_model, self.run = global_model, dict(run or {})
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
        """The round's uploads (FS's ``agg_info``) decoded and checked (:meth:`uploads`), aggregated
        (:func:`~fs_fedpa.aggregation.aggregate_round`), recorded and written into the server's model; returns {}:
        FS merges nothing more into its model."""
        round_input = self.global_model.round_input()
        factors = round_input.global_factors
        with Span(next(iter(factors.values()))[0].device if factors else None) as span:
            result, record = aggregate_round(self.method, self.privacy, round_input,
                                             self.uploads(agg_info, round_input), generator=self.generator,
                                             ignore_weight=self.ignore_weight)  # fmt: skip
            if isinstance(result, Aggregated):
                self.global_model.adopt(result)
        record.update(aggregate_seconds=span.seconds, server_peak_memory=span.peak, memory_kind=span.kind)
        if self.report is not None:
            record["wall_seconds"] = self.report.wall_seconds()
        self.round_log.add(record)
        if self.report is not None:
            self.report.round_done(record, self.privacy.epsilons())
        if isinstance(result, Aggregated):
            self.failed_in_a_row = 0
        elif result.failed:
            limit = self.method.cfg.max_failed_rounds
            self.failed_in_a_row += 1
            if limit and self.failed_in_a_row >= limit:
                raise RuntimeError(
                    f"[fedpa] {self.failed_in_a_row} rounds in a row had every upload dropped "
                    f"(fedpa.max_failed_rounds={limit}); "
                    f"stopping instead of training nothing. Reasons in round {round_input.rnd}: {result.reasons}"
                )
        return {}

    def uploads(self, agg_info, round_input: RoundInput) -> Uploads:
        """FS's ``agg_info`` as :class:`~fs_fedpa.aggregation.Uploads`: each client's message checked
        (:func:`~fs_fedpa.plugin.intake.check_upload`; fresh tensors: nothing after can alter what a client sent),
        or the reason it cannot be read."""
        clients = [client_id for client_id, _ in agg_info["staleness"]]
        feedback = list(zip(clients, agg_info["client_feedback"]))
        if self.distributed:
            # in arrival order, the float sums would depend on which client finished first; by id they do not, so a
            # run's result is the same whatever the network does (standalone keeps FS's order, as its runs were made)
            feedback.sort(key=lambda item: item[0] if isinstance(item[0], int) else float("inf"))
            clients = [client_id for client_id, _ in feedback]
        method, rnd, global_factors = self.method, round_input.rnd, round_input.global_factors
        shapes, shared_shapes = self.shapes
        ranks, parts = method.plan.client_ranks, set(method.upload_parts(rnd))
        dtype = next(iter(global_factors.values()))[0].dtype
        accepted, refused, bytes_up = {}, {}, {}
        for client_id, message in feedback:
            pair = message_pair(message)
            bytes_up[str(client_id)] = 0 if isinstance(pair, str) else nbytes(pair[1])  # what its tensors hold
            if isinstance(pair, str):
                refused[client_id] = pair
                continue
            if isinstance(client_id, bool) or not isinstance(client_id, int) or not 1 <= client_id <= len(ranks):
                refused[client_id] = f"client id {client_id!r} is not in the rank plan (1..{len(ranks)})"
                continue
            i = client_id - 1
            checked = check_upload(*pair, expected_parts=parts, expand=method.expand,
                                   complete=lambda sent, i=i: method.complete_upload(sent, global_factors, i, rnd),
                                   shapes=shapes, ranks=method.upload_ranks(i),
                                   shared_shapes=shared_shapes, dtype=dtype)  # fmt: skip
            if isinstance(checked, str):
                refused[client_id] = checked
                continue
            accepted[client_id] = checked
            if bad := sorted(k for k, v in checked.stats.items() if v is None):
                logger.warning(
                    f"[fedpa] round {rnd}: client #{client_id} reported stats that are not finite "
                    f"({', '.join(bad)}); recorded as such, and its upload is aggregated"
                )
        return Uploads(clients, accepted, refused, bytes_up)

    def save_model(self, path, cur_round=-1):
        """FS's checkpoint (``federate.save_to``, ``save_freq``): the global model's, with the run's identity."""
        self.global_model.save_checkpoint(path, cur_round, self.run)

    def load_model(self, path) -> int:
        """FS's: a checkpoint :meth:`save_model` wrote, loaded into the global model; returns its round. (A run
        continues from a resume point, ``federate.restore_from``, which the server loads itself.)"""
        return self.global_model.load_checkpoint(path)


"""The aggregation step of the FedPA server: every upload decoded (copies) and checked, outliers and uploads that
break aggregation dropped with a reason naming the client, the method's product-space aggregation, the new
global installed and the round recorded. FS has no aggregator registry: the server installs
:class:`FedPAAggregator` itself."""

from __future__ import annotations

import logging
import statistics

import torch
from federatedscope.core.aggregators import Aggregator
from torch import Tensor

from fs_fedpa.plugin.common import (
    layer_shapes,
)
from fs_fedpa.plugin.intake import (
    Accepted,
    cap_weights,
    check_upload,
    message_pair,
    norm_outliers,
    update_norm,
)
from fs_fedpa.plugin.payload import (
    nbytes,
)
from fs_fedpa.plugin.record_fs import new_record, private_record, round_record

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


class FedPAAggregator(Aggregator):
    """``aggregate(agg_info)`` for the FedPA server: decode (copies), reconstruct, install, record."""

    def __init__(self, server):
        super().__init__()
        self.server = server
        self.failed_in_a_row = 0  # rounds whose every upload was dropped, since the last one that aggregated

    def aggregate(self, agg_info):
        server = self.server
        clients = [client_id for client_id, _ in agg_info["staleness"]]
        feedback = list(zip(clients, agg_info["client_feedback"]))
        if server._cfg.federate.mode.lower() == "distributed":
            # in arrival order, the float sums would depend on which client finished first; by id they do not, so a
            # run's result is the same whatever the network does (standalone keeps FS's order, as its runs were made)
            feedback.sort(key=lambda item: item[0] if isinstance(item[0], int) else float("inf"))
            clients = [client_id for client_id, _ in feedback]
        accepted, dropped, bytes_up = {}, {}, {}
        expected = self._expected_shapes()  # once a round: the same for every client
        for client_id, message in feedback:
            pair = message_pair(message)
            checked = pair if isinstance(pair, str) else self._check(client_id, *pair, *expected)
            bytes_up[str(client_id)] = 0 if isinstance(pair, str) else nbytes(pair[1])  # what its tensors hold
            if isinstance(checked, str):
                self._drop(dropped, client_id, checked)
            else:  # fresh tensors: nothing below can alter what a client sent
                accepted[client_id] = checked
                if bad := sorted(k for k, v in checked.stats.items() if v is None):
                    logger.warning(
                        f"[fedpa] round {server.state}: client #{client_id} reported stats that are not finite "
                        f"({', '.join(bad)}); recorded as such, and its upload is aggregated"
                    )
        if server.privacy is not None:
            if server.privacy.samples_clients:  # client-level DP: every round releases, whatever arrived
                return self._aggregate_private(accepted)
            server.privacy.account(server.state, sorted(server._expected), {c: a.stats for c, a in accepted.items()})
        cfg = server.method.cfg
        if cfg.norm_outlier and accepted:
            norms = {c: update_norm(server.method.expand(a.factors)) for c, a in accepted.items()}
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
                new_global, spectra = server.method.aggregate(
                    uploads, weights, [c - 1 for c in kept], server.generator, rnd=server.state
                )
                merge = server.method.merge(uploads, weights, new_global)
                averaged = _weighted_mean([accepted[c].shared for c in kept], weights)
                _check_finite({**new_global, **{f"{n} (merge)": f for n, f in (merge or {}).items()}}, averaged)
            except (RuntimeError, ValueError, ArithmeticError) as err:  # a contribution the checks let through
                culprit = self._culprit(accepted)
                self._drop(dropped, culprit, f"aggregation failed with its upload ({type(err).__name__}: {err})")
                del accepted[culprit]
                continue
            record = round_record(server, uploads, weights, kept, _with_merge(new_global, merge), spectra, stats)
            record.dropped, record.bytes_up = dropped, bytes_up
            record.restarted = [c for c, st in zip(kept, stats) if st.get("restarted")]
            for c, st in zip(kept, stats):
                if st.get("state_lost"):  # its stored state, merges included, is gone: the next message sends them all
                    server._merged_upto[c] = 0
            if bad := record.not_finite():  # a diagnostic problem: the aggregate itself is finite (checked above)
                logger.warning(
                    f"[fedpa] round {server.state}: the diagnostics {', '.join(bad)} are not finite; recorded as null"
                )
            server.install_global(new_global, averaged, merge)
            server.rounds.add(record.to_dict())
            self.failed_in_a_row = 0
            return {}  # the model is already updated; FS merges this empty dict into its state
        logger.warning(f"[fedpa] round {server.state}: every upload was dropped; the global adapter stays as it was")
        record = new_record(server, clients)
        record.dropped, record.bytes_up = dropped, bytes_up
        server.rounds.add(record.to_dict())
        limit = server.method.cfg.max_failed_rounds
        self.failed_in_a_row += 1
        if limit and self.failed_in_a_row >= limit:
            raise RuntimeError(
                f"[fedpa] {self.failed_in_a_row} rounds in a row had every upload dropped "
                f"(fedpa.max_failed_rounds={limit}); "
                f"stopping instead of training nothing. Reasons in round {server.state}: {dropped}"
            )
        return {}

    def _aggregate_private(self, accepted: dict) -> dict:
        """Client-level DP (:mod:`fs_fedpa.plugin.privacy_server`): the noisy mean of the clipped contributions over
        the fixed K, the method's server step on it, and a record of the release only."""
        server = self.server
        kept = list(accepted)
        uploads = [accepted[c].factors for c in kept]
        new_global, spectra, release = server.privacy.release(uploads, kept, server.global_factors, server.state)
        _check_finite(new_global, {})
        # the K receivers, which the DP generator drew: which of them arrived or were dropped (and each upload's
        # bytes) can depend on their data, and stays in the private faults file (privacy.fault)
        receivers = sorted(server._expected)
        record = private_record(server, receivers, new_global, spectra, release)
        server.install_global(new_global, {}, None)
        server.rounds.add(record)
        server.privacy.account(server.state, receivers, {})
        self.failed_in_a_row = 0
        return {}

    def _drop(self, dropped: dict, client_id, reason: str) -> None:
        dropped[str(client_id)] = reason
        privacy = self.server.privacy
        if privacy is not None and privacy.samples_clients:  # client-level DP: not in the log (privacy.fault)
            privacy.fault(self.server.state, client_id, reason)
            return
        logger.warning(f"[fedpa] round {self.server.state}: dropped the upload of client #{client_id}: {reason}")

    def _culprit(self, accepted: dict):
        """The client whose upload makes aggregation fail: the first whose removal lets the others aggregate with the
        weights the round would give them (the last one if no single removal does). Every weight is checked per
        client before aggregation (:func:`fs_fedpa.plugin.intake.check_upload`), so this search is left with what
        no check of one upload can see."""
        server, ids = self.server, list(accepted)
        for candidate in ids:
            rest = [c for c in ids if c != candidate]
            if not rest:
                break
            try:
                new_global, _ = server.method.aggregate(
                    [accepted[c].factors for c in rest],
                    self._weights([accepted[c] for c in rest]),
                    [c - 1 for c in rest],
                    torch.Generator().manual_seed(0),
                    rnd=server.state,
                )
                _check_finite(new_global, {})
                return candidate
            except (RuntimeError, ValueError, ArithmeticError):
                continue
        return ids[-1]

    def _weights(self, uploads: list[Accepted]) -> list[float]:
        """The aggregation weights of accepted uploads: the method's (FS's sample sizes; FlexLoRA's
        ``num_train_data``), capped by ``fedpa.max_weight_ratio``. A client of size 0 weighs 0; a round whose
        weights are all 0 weighs its uploads equally (docs/errors.md). Sizes were checked per client, so every
        weight is finite, >= 0 and at most 1e15."""
        server = self.server
        if server._cfg.federate.ignore_weight:
            return [1.0] * len(uploads)
        sizes, data_sizes = [a.size for a in uploads], [a.stats.get("num_train_data") for a in uploads]
        weights = cap_weights(server.method.weights(sizes, data_sizes), server.method.cfg.max_weight_ratio)
        return weights if sum(weights) > 0 else [1.0] * len(uploads)

    def _expected_shapes(self) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, ...]]]:
        """``(d, k)`` of every LoRA module and the shape of every shared tensor, for checking uploads."""
        server = self.server
        params = dict(server.model.named_parameters())
        shapes = layer_shapes(server.model)
        return shapes, {n: tuple(params[n].shape) for n in server.shared_names}

    def _check(self, client_id, size, content, shapes, shared_shapes) -> Accepted | str:
        """:func:`fs_fedpa.plugin.intake.check_upload` for this client and round, or why it cannot be checked."""
        method = self.server.method
        ranks = method.plan.client_ranks
        if isinstance(client_id, bool) or not isinstance(client_id, int) or not 1 <= client_id <= len(ranks):
            return f"client id {client_id!r} is not in the rank plan (1..{len(ranks)})"
        dtype = next(iter(self.server.global_factors.values()))[0].dtype
        return check_upload(
            size,
            content,
            expected_parts=set(method.upload_parts(self.server.state)),
            complete=lambda parts: method.complete_upload(
                parts, self.server.global_factors, client_id - 1, self.server.state
            ),
            expand=method.expand,
            shapes=shapes,
            ranks=method.upload_ranks(client_id - 1),
            shared_shapes=shared_shapes,
            dtype=dtype,
        )

    def save_model(self, path, cur_round=-1):
        self.server.save_checkpoint(path, cur_round)

    def load_model(self, path):
        """Resume from a FedPA resume point (the server does this itself for ``federate.restore_from``)."""
        return self.server.restore(path)


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

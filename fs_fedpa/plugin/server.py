"""FedPA server for FederatedScope: the global factors and one downlink message per client.

The worker holds FS's handlers, as delegations; the other concerns are in modules of their name, as mixins that hold
FS handlers (:mod:`~fs_fedpa.plugin.inbox`: what comes in, checked and authenticated; :mod:`~fs_fedpa.plugin.liveness`:
the round watchdog) or collaborators: :class:`~fs_fedpa.plugin.global_model.GlobalModel` (the global factors, shared
tensors and merges in the server's model, FS's checkpoint of them, each client's downlink message),
:class:`~fs_fedpa.plugin.aggregator.FedPAAggregator` (FS has no aggregator
registry, so the server installs it itself, in ``self.aggregator`` and ``self.aggregators[0]``; FS calls its
``aggregate``, which reads the round from ``GlobalModel.round_input``, aggregates it without FS
(:func:`fs_fedpa.aggregation.aggregate_round`), writes the result into the model through ``GlobalModel.adopt`` and
returns {}, the state FS merges; FS's ``save_model`` and ``load_model`` are the global model's checkpoint),
:class:`~fs_fedpa.plugin.record_fs.RoundLog`, :class:`~fs_fedpa.plugin.resume_fs.ServerResume` and the DP policy (:func:`fs_fedpa.privacy.server_policy`).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path

import torch
from federatedscope.core.workers import Server

from fs_fedpa import lora, privacy, resume
from fs_fedpa.plugin import auth, tls_fs
from fs_fedpa.plugin.aggregator import FedPAAggregator
from fs_fedpa.plugin.common import build_method, layer_shapes, non_lora_trainables, send
from fs_fedpa.plugin.export_fs import check_export_dir
from fs_fedpa.plugin.fs_patches import grpc_comm_manager, no_aggregator_notice
from fs_fedpa.plugin.global_model import GlobalModel
from fs_fedpa.plugin.inbox import ServerInbox
from fs_fedpa.plugin.liveness import ServerLiveness
from fs_fedpa.plugin.record_fs import RoundLog
from fs_fedpa.plugin.resume_fs import FSResults, ServerResume, check_resume_file
from fs_fedpa.plugin.run_folder_fs import identity, in_run_folder, warn_if_taken
from fs_fedpa.run_summary import RunReport, code_commit

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


class FedPAServer(ServerLiveness, ServerInbox, Server):
    def __init__(self, *args, **kwargs):
        config = kwargs.get("config", args[2] if len(args) > 2 else None)
        if config is not None and config.federate.restore_from:
            check_resume_file(config.federate.restore_from)  # before FS's own aggregator loads it with its raw errors
        explicit = config is not None and bool(config.federate.save_to)
        if config is not None:  # before FS's constructor reads federate.save_to
            config = in_run_folder(config)
            if "config" in kwargs:
                kwargs["config"] = config
            else:
                args = (*args[:2], config, *args[3:])
        make_comm = tls_fs.comm_manager(config, "server")  # its TLS files checked before FS opens its port
        # FS builds a FedAvg aggregator first, which this server replaces
        with no_aggregator_notice(), grpc_comm_manager(make_comm):
            super().__init__(*args, **kwargs)
        if self._cfg is None:
            return
        self.identity = identity(self._cfg.outdir)  # the run this server's files belong to
        self.method = build_method(self._cfg, self.model)
        if self.method.cfg.num_threads > 0:  # FS's standalone runner has just pinned torch to 1 thread
            torch.set_num_threads(self.method.cfg.num_threads)
        if self.method.merges:
            lora.keep_base(self.model)  # before a resume point's merged weights are loaded into it
        local_names, self.shared_names = non_lora_trainables(self.model, self._cfg.personalization.local_param)
        params = dict(self.model.named_parameters())
        policy = privacy.mechanism_of(self.method.cfg).Server
        public_locals = policy.checkpoint_locals({n: params[n] for n in local_names})  # what its files keep of them
        self.globals = GlobalModel(self.model, self.method, self.shared_names, public_locals)
        self.generator = torch.Generator().manual_seed(self.method.seed + 1)  # sketches
        self.privacy = policy(self._cfg, self.method, clients=self.client_num, rounds=self.total_round_num,
                              per_round=self.sample_client_num, shared_names=self.shared_names,
                              global_factors=self.globals.factors)  # fmt: skip
        self.sample_client_num = self.privacy.most_replies(self.sample_client_num)  # FS: no round waits for more
        # the records, carried by resume points
        self.round_log = RoundLog(self._cfg.outdir, self.method.cfg.records)
        self.report = open_report(self._cfg, self.method)  # summary.json and the tracker
        self._commit = code_commit(__file__)  # the code this run runs, for its summary
        shapes = (layer_shapes(self.model), {n: tuple(params[n].shape) for n in self.shared_names})
        self.aggregator = FedPAAggregator(
            self.method, self.round_log, global_model=self.globals, run=self.identity, privacy=self.privacy,
            generator=self.generator, shapes=shapes, distributed=self._cfg.federate.mode.lower() == "distributed",
            ignore_weight=self._cfg.federate.ignore_weight, report=self.report,
        )  # fmt: skip
        self.aggregators[0] = self.aggregator
        self._install_inbox()  # before any client's message reaches FS
        if self._cfg.federate.save_to:  # FS saves only after training: a missing folder would lose the run
            os.makedirs(os.path.dirname(os.path.abspath(self._cfg.federate.save_to)), exist_ok=True)
        self.resume = ServerResume(self._cfg, self.method)
        if explicit:
            warn_if_taken(self._cfg, self._cfg.federate.save_to, resume.server_path(self._cfg.federate.save_to))
        self._pending_rng: dict | None = None
        self._evaluate_first = False  # a resumed run: the evaluation that closed the round before it, asked again
        self._expected: set[int] = set()  # receivers of this round's model: the only valid senders of updates
        self._eval_round: int | None = None  # the round of the last evaluation asked for, and whom it was asked of
        self._eval_expected: set[int] = set()
        self._progress = time.monotonic()  # when the last update or evaluation arrived (the watchdog's clock)
        self._token = secrets.token_hex(16)  # marks the watchdog's own messages, which no client can send
        self._keyring: dict[int, bytes] = {}
        self._tls = isinstance(self.comm_manager, tls_fs.TLSCommManager)  # each message bound to its certificate
        if self._cfg.federate.mode.lower() == "distributed" and self.method.cfg.net.auth_keyring:
            self._keyring = auth.read_keyring(self.method.cfg.net.auth_keyring, self.client_num)
        if self._cfg.federate.mode.lower() == "standalone":
            self._watch_the_end()
        if self._cfg.federate.restore_from:
            self.restore(self._cfg.federate.restore_from)
        check_export_dir(self.method.cfg.export.dir)  # now, not after every round has trained

    def terminate(self, msg_type="finish"):
        """FS's end of the run; with ``fedpa.export.dir``, the global adapter is written first (the clients write
        their own parts when they receive the finish message); then the run's summary and tracker are closed."""
        if self.method.cfg.export.dir and msg_type == "finish":
            self.export(self.method.cfg.export.dir)
        super().terminate(msg_type=msg_type)
        path = self.write_summary()
        logger.info(f"[fedpa] the run's summary: {path}")
        if command := (self.report.tracker.open_command() if self.report.tracker is not None else None):
            logger.info(f"[fedpa] its {self.report.tracker.kind} records: {command}")
        self.report.close()
        summary = self.privacy.summary()
        if summary and self._cfg.federate.mode.lower() == "distributed":  # standalone: at the end
            logger.info(summary)
        if msg_type == "finish":
            folder = self._cfg.outdir
            export = f"; export its adapters: fs-fedpa export {folder} --out {os.path.join(folder, 'export')}"
            logger.info(f"[fedpa] the run's folder: {folder}{export if self._cfg.federate.save_to else ''}")

    def export(self, out: str) -> None:
        """The global adapter, the shared tensors and the manifest into ``out`` (:mod:`fs_fedpa.plugin.export_fs`)."""
        from fs_fedpa.plugin.export_fs import Exporter, run_info

        exporter = Exporter(self._cfg, self.model, self.method, out, force=True)
        params = dict(self.model.named_parameters())
        shared = {n: params[n] for n in self.shared_names}
        entry = exporter.write_global(self.globals.factors, self.globals.merges.merged, shared)
        exporter.finish(entry, {}, run_info(self._cfg, Path(self._cfg.outdir), self.state, []))

    # ---------------------------------------------------------------------------------- downlink
    def broadcast_model_para(self, msg_type="model_para", sample_client_num=-1, filter_unseen_clients=True):
        """As FS's broadcast (same sampling and bookkeeping), but each receiver gets its own rank-R_i reference."""
        if msg_type == "model_para":  # a round starts: the resume point, before the sampler draws
            if self._evaluate_first:  # as the interrupted run did before this round: its results were not saved
                self._evaluate_first = False
                self.eval()
            if self._pending_rng is not None:
                resume.set_rng_state(self._pending_rng)
                self._pending_rng = None
            elif self._cfg.federate.save_to and self.state > 0:
                self.write_resume_point()
        if filter_unseen_clients:
            self.sampler.change_state(self.unseen_clients_id, "unseen")

        def draw() -> list[int]:  # FS's receivers
            if sample_client_num > 0:
                return self.sampler.sample(size=sample_client_num)
            return list(self.comm_manager.neighbors.keys())

        receivers = self.privacy.receivers(draw) if msg_type == "model_para" else draw()
        if msg_type == "model_para":
            self.sampler.change_state(receivers, "working")
            self._expected = set(receivers)
            self.globals.open_round(self.state, receivers)
        rnd = self.state - 1 if msg_type == "evaluate" else self.state  # FS: evaluation closes a round
        if msg_type == "evaluate":  # the only evaluations the server accepts next (ServerInbox)
            self._eval_round, self._eval_expected = min(rnd, self.total_round_num), set(receivers)
        wire = self._cfg.federate.mode.lower() == "distributed"  # tensors as explicit encodings, never pickled
        for client_id, payload in self.globals.downlink(receivers, training=msg_type == "model_para", wire=wire):
            send(self, msg_type, client_id, payload, self.cur_timestamp, state=min(rnd, self.total_round_num))
        if filter_unseen_clients:
            self.sampler.change_state(self.unseen_clients_id, "seen")
        self._progress = time.monotonic()  # the round's wait starts now: sending to every receiver can take a while
        if msg_type == "model_para" and self.privacy.replies(receivers) == 0:
            # no message will arrive: the round aggregates (a DP release: noise alone) now
            logger.info(f"[fedpa] round {self.state}: the draw sampled no client; the round aggregates without "
                        "uploads")  # fmt: skip
            self.check_and_move_on()

    def check_and_move_on(self, check_eval_result=False, min_received_num=None):
        """FS's; a round waits for the replies the DP policy says (FS's default: ``federate.sample_client_num``), e.g.
        under Poisson client sampling for the clients it drew, possibly none."""
        if not check_eval_result and (replies := self.privacy.replies(self._expected)) is not None:
            if min_received_num is None:
                min_received_num = replies
            self.msg_buffer["train"].setdefault(self.state, {})  # FS reads it even when nothing arrived
        return super().check_and_move_on(check_eval_result=check_eval_result, min_received_num=min_received_num)

    # ---------------------------------------------------------------------------------- the run's summary
    def merge_eval_results_from_all_clients(self):
        """FS's merge of an evaluation; the run's report takes its weighted means and each client's metrics, and
        ``summary.json`` is written anew."""
        rnd = max(self.msg_buffer["eval"].keys())
        formatted = super().merge_eval_results_from_all_clients()
        weighted = formatted.get("Results_weighted_avg") or formatted.get("Results_avg") or {}
        clients = {c: m for c, m in self.msg_buffer["eval"][rnd].items() if isinstance(m, dict)}
        totals = self.round_log.totals
        self.report.evaluated(rnd, weighted, clients, totals["up"] + totals["down"])
        self.write_summary()
        return formatted

    def write_summary(self) -> str:
        """``<outdir>/summary.json`` (:mod:`fs_fedpa.run_summary`) as the run stands."""
        totals, export = self.round_log.totals, self.method.cfg.export.dir
        summary = self.report.summary(
            rounds_done=min(self.state, self.total_round_num), bytes_up=totals["up"], bytes_down=totals["down"],
            privacy=self.privacy.epsilons(), export=os.path.abspath(export) if export else None, commit=self._commit,
        )  # fmt: skip
        return self.report.write(summary)

    # ---------------------------------------------------------------------------------- resume points
    def resume_parts(self) -> dict:
        """The collaborators a resume point saves, by their names in :data:`fs_fedpa.resume.PARTS`."""
        return {"global_model": self.globals, "round_log": self.round_log, "aggregator": self.aggregator,
                "fs_results": FSResults(self), "privacy": self.privacy, "method_state": self.method,
                "run_report": self.report}  # fmt: skip

    def write_resume_point(self) -> str:
        """The resume point of round ``self.state`` (:class:`~fs_fedpa.plugin.resume_fs.ServerResume`)."""
        return self.resume.write(self.state, self.resume_parts())

    def restore(self, path: str) -> int:
        """Continue the run saved in the resume point ``path``, checked and loaded by
        :meth:`~fs_fedpa.plugin.resume_fs.ServerResume.restore`; returns the round it continues at."""
        local_names, _ = non_lora_trainables(self.model, self._cfg.personalization.local_param)
        params = dict(self.model.named_parameters())
        head = self.resume.restore(path, self.resume_parts(), global_factors=self.globals.factors,
                                   clients=self.client_num, local={n: params[n] for n in local_names},
                                   rounds=self.total_round_num)  # fmt: skip
        self._pending_rng = head["rng"]  # set when the round starts, as it was taken
        self.state = head["round"]
        # FS evaluates the round before this one after the point was written: asked again, as the clients restore
        self._evaluate_first = 0 < self.state < self.total_round_num and self.state % self._cfg.eval.freq == 0
        logger.info(f"[fedpa] resumed from {path} at round {self.state}")
        return self.state


def open_report(cfg, method) -> RunReport:
    """The run's :class:`~fs_fedpa.run_summary.RunReport`, with its tracker (``fedpa.track``) open in
    ``<outdir>/tracking``."""
    from fs_fedpa.tracking import open_tracker

    plan = method.plan
    head = {"method": method.name, "rounds": cfg.federate.total_round_num,
            "metric": cfg.eval.best_res_update_round_wise_key,
            "rank_plan": {"client_ranks": list(plan.client_ranks), "reference_ranks": list(plan.reference_ranks),
                          "R_g": plan.R_g}}  # fmt: skip
    name = os.path.basename(os.path.normpath(cfg.outdir))
    # the run's whole config, the tracker's record of its hyper-parameters
    tracker = open_tracker(method.cfg.track, os.path.join(cfg.outdir, "tracking"), name, cfg)
    return RunReport(cfg.outdir, head, tracker)

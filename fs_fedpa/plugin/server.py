"""FedPA server for FederatedScope: product-space aggregation and one downlink message per client.

FS has no aggregator registry, so the server installs :class:`FedPAAggregator` itself (in both
``self.aggregator``, used for saving, and ``self.aggregators[0]``, used for aggregation). The
server keeps the global factors (effective, rank R_g) and writes them into its own model after
every aggregation, so that FS's server-side evaluation and checkpoints see the global adapter.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import statistics
import threading
import time
from pathlib import Path

import torch
from federatedscope.core.aggregators import Aggregator
from federatedscope.core.message import Message
from federatedscope.core.workers import Server
from torch import Tensor

from fs_fedpa import lora
from fs_fedpa.core.diagnostics import aggregate_norm, aggregation_error, factored_norm
from fs_fedpa.methods.base import FederatedMethod
from fs_fedpa.plugin import auth, resume
from fs_fedpa.plugin.common import build_method, global_init, layer_shapes, non_lora_trainables
from fs_fedpa.plugin.export import check_export_dir
from fs_fedpa.plugin.intake import (
    Accepted,
    cap_weights,
    check_message_content,
    check_upload,
    message_pair,
    norm_outliers,
    update_norm,
)
from fs_fedpa.plugin.messages import ServerView, message_problem
from fs_fedpa.plugin.payload import encode_factors, encode_merge, encode_tensors, nbytes, shown
from fs_fedpa.record import DIAGNOSTICS_FILE, RoundRecord

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only
TIMEOUT = "fedpa_round_timeout"  # the watchdog's message type


class FedPAServer(Server):
    def __init__(self, *args, **kwargs):
        config = kwargs.get("config", args[2] if len(args) > 2 else None)
        if config is not None and config.federate.restore_from:
            _check_resume_file(config.federate.restore_from)  # before FS's own aggregator loads it with its raw errors
        super().__init__(*args, **kwargs)
        if self._cfg is None:
            return
        self.method = build_method(self._cfg, self.model)
        if self.method.cfg.num_threads > 0:  # FS's standalone runner has just pinned torch to 1 thread
            torch.set_num_threads(self.method.cfg.num_threads)
        self.scaling = lora.Scaling.of(self.model)
        if self.method.merges:
            lora.keep_base(self.model)  # before a resume point's merged weights are loaded into it
        _, self.shared_names = non_lora_trainables(self.model, self._cfg.personalization.local_param)
        self.global_factors = global_init(self.model, self.method)  # (B_g^(0), A_g^(0)), rank r_g
        self.generator = torch.Generator().manual_seed(self.method.seed + 1)  # sketches
        self.aggregator = FedPAAggregator(self)
        self.aggregators[0] = self.aggregator
        if self._cfg.federate.save_to:  # FS saves only after training: a missing folder would lose the run
            os.makedirs(os.path.dirname(os.path.abspath(self._cfg.federate.save_to)), exist_ok=True)
        self._down_bytes: dict[int, int] = {}
        self._late_down: dict[int, int] = {}  # merge bytes that rode on evaluation messages: next round's downlink
        self.merged: dict[str, Tensor] = {}  # sum of every merge so far, (d, k) per module (exact-aggregation methods)
        self._last_merge: dict | None = None  # the newest merge, as it travels (see install_global)
        self._merge_count = 0  # merges so far
        self._merged_upto: dict[int, int] = {}  # per client: how many merges its base offset holds
        self._merged_kept: dict[int, int] = {}  # ... by its last training message: what its resume file holds
        self._totals = {"up": 0, "down": 0}
        self._records: list[dict] = []  # diagnostics history, carried by resume points
        self._pending_rng: dict | None = None
        self._expected: set[int] = set()  # receivers of this round's model: the only valid senders of updates
        self._progress = time.monotonic()  # when the last update or evaluation arrived (the watchdog's clock)
        self._token = secrets.token_hex(16)  # marks the watchdog's own messages, which no client can send
        self._keyring: dict[int, bytes] = {}
        if self._cfg.federate.mode.lower() == "distributed" and self.method.cfg.auth_keyring:
            self._keyring = auth.read_keyring(self.method.cfg.auth_keyring, self.client_num)
        if self._cfg.federate.restore_from:
            self.restore(self._cfg.federate.restore_from)
        check_export_dir(self.method.cfg.export_dir)  # now, not after every round has trained

    def terminate(self, msg_type="finish"):
        """FS's end of the run; with ``fedpa.export_dir``, the global adapter is written first (the clients write
        their own parts when they receive the finish message)."""
        if self.method.cfg.export_dir and msg_type == "finish":
            self.export(self.method.cfg.export_dir)
        super().terminate(msg_type=msg_type)

    def export(self, out: str) -> None:
        """The global adapter, the shared tensors and the manifest into ``out`` (:mod:`fs_fedpa.plugin.export`)."""
        from fs_fedpa.plugin.export import Exporter, run_info

        exporter = Exporter(self._cfg, self.model, self.method, out, force=True)
        params = dict(self.model.named_parameters())
        entry = exporter.write_global(self.global_factors, self.merged, {n: params[n] for n in self.shared_names})
        exporter.finish(entry, {}, run_info(self._cfg, Path(self._cfg.outdir), self.state, []))

    # ---------------------------------------------------------------------------------- downlink
    def broadcast_model_para(self, msg_type="model_para", sample_client_num=-1, filter_unseen_clients=True):
        """As FS's broadcast (same sampling and bookkeeping), but each receiver gets its own rank-R_i reference."""
        if msg_type == "model_para":  # a round starts: the resume point, before the sampler draws
            if self._pending_rng is not None:
                resume.set_rng_state(self._pending_rng)
                self._pending_rng = None
            elif self._cfg.federate.save_to and self.state > 0:
                self.write_resume_point()
        if filter_unseen_clients:
            self.sampler.change_state(self.unseen_clients_id, "unseen")
        if sample_client_num > 0:
            receivers = self.sampler.sample(size=sample_client_num)
        else:
            receivers = list(self.comm_manager.neighbors.keys())
            if msg_type == "model_para":
                self.sampler.change_state(receivers, "working")
        if msg_type == "model_para":
            self._expected = set(receivers)
        params = dict(self.model.named_parameters())
        wire = self._cfg.federate.mode.lower() == "distributed"  # tensors as explicit encodings, never pickled
        shared = encode_tensors({n: params[n] for n in self.shared_names}, wire)
        rnd = self.state - 1 if msg_type == "evaluate" else self.state  # FS: evaluation closes a round
        # Standalone: the receivers of one reference rank share one read-only copy of it (the method's default
        # downlink), so a broadcast to N clients holds one copy per rank, not N (clients never change it in place).
        shared_downlink = not wire and type(self.method).downlink is FederatedMethod.downlink
        copies: dict[int, dict] = {}
        for client_id in receivers:
            R_i = self.method.plan.reference_ranks[client_id - 1]
            if not shared_downlink or R_i not in copies:
                copies[R_i] = encode_factors(self.method.downlink(self.global_factors, client_id - 1), wire=wire)
            down = copies[R_i] if shared_downlink else copies.pop(R_i)
            # FS's gRPC encoder fails on empty dicts, and rewrites dicts in place: one per receiver
            payload = {"lora": dict(down)} if down else {"zero_reference": 1}
            if shared:
                payload["shared"] = dict(shared)
            merges = self._pending_merges(client_id)
            if merges is not None:
                kind, value = merges
                payload[kind] = encode_merge(value, wire) if kind == "base" else (
                    encode_tensors(value, wire) if wire else dict(value))  # fmt: skip
            if msg_type == "model_para":
                self._down_bytes[client_id] = nbytes(payload) + self._late_down.pop(client_id, 0)
                self._merged_kept[client_id] = self._merged_upto.get(client_id, 0)
            elif merges is not None:
                late = nbytes({merges[0]: payload[merges[0]]})
                self._late_down[client_id] = self._late_down.get(client_id, 0) + late
            self.comm_manager.send(
                Message(
                    msg_type=msg_type,
                    sender=self.ID,
                    receiver=[client_id],
                    state=min(rnd, self.total_round_num),
                    timestamp=self.cur_timestamp,
                    content=payload,
                )
            )
        if filter_unseen_clients:
            self.sampler.change_state(self.unseen_clients_id, "seen")
        self._progress = time.monotonic()  # the round's wait starts now: sending to every receiver can take a while

    def _pending_merges(self, client_id: int) -> tuple[str, object] | None:
        """What ``client_id`` lacks of the merges, now counted as received: ``("base", [newest merge])`` when it
        lacks only the newest (every client, every round, with full participation), ``("base_total", merged)``, the
        sum of every merge (d, k), which replaces its base offset, when it lacks more; None when it lacks none. The
        server keeps the newest merge and the sum, whatever the number of clients and however long one sits out:
        the sum is what the client would have added up, in the same order, so its base offset is the same."""
        upto = self._merged_upto.get(client_id, 0)
        if upto >= self._merge_count:
            return None
        self._merged_upto[client_id] = self._merge_count
        if upto == self._merge_count - 1 and self._last_merge is not None:
            return "base", [self._last_merge]
        return "base_total", self.merged

    # ---------------------------------------------------------------------------------- liveness
    def run(self):
        """FS's distributed loop, with a watchdog: a round that gets no message for ``fedpa.round_timeout_s`` is
        moved on with what arrived, or the run stops with the reason (FS would wait forever for a dead client)."""
        timeout = self.method.cfg.round_timeout_s
        distributed = self._cfg.federate.mode.lower() == "distributed"
        if distributed:
            self.comm_manager.receive = self._receive_checked
        if distributed and timeout > 0:
            self.register_handlers(TIMEOUT, self._on_round_timeout, [None])
            self._progress = time.monotonic()
            threading.Thread(target=self._watchdog, args=(timeout,), daemon=True, name="fedpa-watchdog").start()
        result = super().run()
        if self.state < self.total_round_num:  # FS's loop also ends on its own failure count, with exit 0
            raise RuntimeError(
                f"[fedpa] the run ended after {self.state} of federate.total_round_num={self.total_round_num} rounds "
                "without finishing them; the reasons are in the log above"
            )
        return result

    def _receive_checked(self) -> Message:
        """The next message from the network that passes every check of :mod:`fs_fedpa.plugin.messages` (and, with
        ``fedpa.auth_keyring``, carries its sender's signature); every other one is dropped, naming its claimed
        sender and the field that failed, before FS's own code reads it."""
        while True:
            raw = self.comm_manager.server_funcs.receive()
            message, problem = _parsed(raw)
            if problem is None and message.msg_type == TIMEOUT and message.content == self._token:
                return message
            problem = problem or self._message_problem(message)
            if problem is None:
                return message
            sender = message.sender if isinstance(message.sender, int) else str(message.sender)[:40]
            logger.warning(f"[fedpa] round {self.state}: ignored a message from client {sender}: {problem}")

    def _message_problem(self, message: Message) -> str | None:
        """Why ``message`` must be dropped, or None; with a keyring, also unwraps the signed content and, for a
        join, sets the sender to the id its key is registered for."""
        joined = frozenset(self.comm_manager.neighbors)
        view = ServerView(self.state, self.total_round_num, self.client_num, joined)
        fields = (message.msg_type, message.sender, message.state, message.timestamp)
        if self._keyring:
            if message.msg_type == "join_in" and message.sender == -1:
                candidates = [c for c in self._keyring if c not in joined]
            elif isinstance(message.sender, int) and message.sender in self._keyring:
                candidates = [message.sender]
            else:
                candidates = []
            reason = "no key of this run is registered for it"
            if message.msg_type == "join_in" and message.sender == -1 and not candidates:
                reason = f"a join, but all {self.client_num} clients joined already"
            for cid in candidates:
                content, reason = auth.verify(self._keyring[cid], *fields, message.content)
                if reason is None:
                    message.content = content
                    if message.msg_type == "join_in":
                        message.sender = cid  # the id of its key, not the order of joining
                    break
            if reason is not None:
                return f"{message.msg_type!s:.40} message: {reason}"
        elif isinstance(message.content, dict) and set(message.content) == {auth.SIGNED, auth.MAC}:
            return "a signed message, but this server has no fedpa.auth_keyring to check it with"
        problem = message_problem(
            message.msg_type, message.sender, message.state, message.timestamp, message.content, view
        )
        if problem is None and message.msg_type == "model_para" and message.timestamp < self.cur_timestamp:
            message.timestamp = self.cur_timestamp  # FS asserts that timestamps never decrease; they are simulated
        return problem

    def callback_funcs_for_join_in(self, message: Message):
        """With a keyring, a client joins as the id of its key (set by :meth:`_message_problem`), and is told so;
        FS's own handler numbers clients in the order they join, which anyone can race."""
        if not self._keyring or message.msg_type != "join_in":
            return super().callback_funcs_for_join_in(message)
        sender = message.sender
        self.join_in_client_num += 1
        self.comm_manager.add_neighbors(neighbor_id=sender, address=message.content)
        self.comm_manager.send(
            Message(
                msg_type="assign_client_id",
                sender=self.ID,
                receiver=[sender],
                state=self.state,
                timestamp=self.cur_timestamp,
                content=str(sender),
            )
        )
        if len(self._cfg.federate.join_in_info) != 0:
            self.comm_manager.send(
                Message(
                    msg_type="ask_for_join_in_info",
                    sender=self.ID,
                    receiver=[sender],
                    state=self.state,
                    timestamp=self.cur_timestamp,
                    content=self._cfg.federate.join_in_info.copy(),
                )
            )
        self.trigger_for_start()

    def _watchdog(self, timeout: float) -> None:
        """Puts a timeout message into the server's own queue when nothing arrived for ``timeout`` seconds."""
        while not self.is_finish:
            time.sleep(min(1.0, timeout / 10))
            if self.join_in_client_num < self.client_num:
                self._progress = time.monotonic()  # joining has no round yet
            elif time.monotonic() - self._progress > timeout:
                self._progress = time.monotonic()
                message = Message(
                    msg_type=TIMEOUT, sender=self.ID, receiver=[self.ID], state=self.state, content=self._token
                )
                self.comm_manager.server_funcs.msg_queue.append(message.transform(to_list=True))

    def _on_round_timeout(self, message: Message):
        if self.is_finish:
            return False
        cfg = self.method.cfg
        train = self.msg_buffer["train"].get(self.state, {})
        missing = sorted(self._expected - set(train))
        if self.state < self.total_round_num and missing:
            if len(train) < cfg.min_received:
                reason = (
                    f"round {self.state}: {len(train)} of {len(self._expected)} updates within "
                    f"fedpa.round_timeout_s={cfg.round_timeout_s:g} s, fewer than "
                    f"fedpa.min_received={cfg.min_received} (no update from clients {missing})"
                )
                logger.error(f"[fedpa] {reason}; stopping the run")
                self.terminate(msg_type="finish")  # the clients that are alive exit too
                raise RuntimeError(f"[fedpa] {reason}")
            logger.warning(
                f"[fedpa] round {self.state}: no update from clients {missing} within fedpa.round_timeout_s="
                f"{cfg.round_timeout_s:g} s; aggregating the {len(train)} that arrived"
            )
            self.sampler.change_state(missing, "idle")  # FS samples idle clients only; they may come back
            return self.check_and_move_on(min_received_num=len(train))
        evaluations = self.msg_buffer["eval"]
        arrived = len(evaluations[max(evaluations)]) if evaluations else 0
        if arrived:
            logger.warning(
                f"[fedpa] round {self.state}: {arrived} evaluations within fedpa.round_timeout_s="
                f"{cfg.round_timeout_s:g} s; merging those"
            )
            return self.check_and_move_on(check_eval_result=True, min_received_num=arrived)
        return False

    def callback_funcs_for_metrics(self, message: Message):
        self._progress = time.monotonic()
        return super().callback_funcs_for_metrics(message)

    def callback_funcs_model_para(self, message: Message):
        """FS's handler, after refusing an update of this round from a sender that was not sent this round's model
        (an unknown or impersonated id) or that already sent one: FS's bookkeeping would crash on the first and
        let the second overwrite or miscount the round's updates."""
        sender, rnd = message.sender, message.state
        problem = None
        if isinstance(sender, bool) or not isinstance(sender, int) or not 1 <= sender <= self.client_num:
            problem = f"sender id {str(sender)[:40]!r} is not a client of this run (1..{self.client_num})"
        elif rnd == self.state and sender not in self._expected:
            problem = f"client #{sender} was not sent the model of round {rnd}"
        elif rnd == self.state and sender in self.msg_buffer["train"].get(rnd, {}):
            problem = f"client #{sender} already sent its update of round {rnd}"
        if problem is not None and not self.is_finish:
            logger.warning(f"[fedpa] round {self.state}: ignored a message: {problem}")
            return False
        self._progress = time.monotonic()
        return super().callback_funcs_model_para(message)

    # ---------------------------------------------------------------------------------- aggregation
    def install_global(self, global_factors, shared: dict[str, Tensor], merge=None) -> None:
        """Adopt new global factors; write them (raw, rank R_g) and the averaged shared tensors into the model; add
        a method's ``merge`` to the base weights (the server's own, and, with the next messages, the clients')."""
        self.global_factors = global_factors
        lora.set_factors(self.model, self.scaling.raw(self.method.expand(global_factors)))
        if merge:
            dense, travels = self.method.merge_encoding == "dense", {}
            for name, (B, A) in merge.items():
                dtype = torch.promote_types(B.dtype, torch.float32)
                increment = B.to(dtype) @ A.to(dtype)
                self.merged[name] = self.merged[name] + increment if name in self.merged else increment
                # per module its dense increment (formed here once, not once per receiver) or a copy of its factors
                travels[name] = increment.to(B.dtype) if dense else (B.detach().clone(), A.detach().clone())
            self._last_merge, self._merge_count = travels, self._merge_count + 1
        if self.merged:
            lora.set_base_offsets(self.model, self.merged)
        if shared:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in shared.items():
                    params[name].copy_(value)

    def record_round(self, record: dict) -> None:
        """Append one JSON line per round to ``<outdir>/fedpa_diagnostics.jsonl``."""
        self._totals["up"] += sum(record["bytes_up"].values())
        self._totals["down"] += sum(record["bytes_down"].values())
        record.update(bytes_up_total=self._totals["up"], bytes_down_total=self._totals["down"])
        self._records.append(record)
        self._write_diagnostics([record])
        e_agg = (f"E_agg={_g(record['e_agg'])} (rel {_g(record['e_agg_rel'], '.3g')}), " if self.method.cfg.diagnostics
                 else "")  # fmt: skip
        logger.info(
            f"[fedpa] round {record['round']}: {e_agg}alignment={_g(record['alignment_loss_mean'])}, "
            f"up {sum(record['bytes_up'].values())} B, down {sum(record['bytes_down'].values())} B"
        )

    def _write_diagnostics(self, records: list[dict]) -> None:
        if self.method.cfg.diagnostics:
            with open(os.path.join(self._cfg.outdir, DIAGNOSTICS_FILE), "a", encoding="utf-8") as f:
                f.writelines(json.dumps(record) + "\n" for record in records)

    # ---------------------------------------------------------------------------------- resume
    def _result_settings(self) -> dict:
        """The keys that change a run's result, compared when it resumes (and recorded in every client file)."""
        return resume.result_settings(self._cfg, self.method)

    def write_resume_point(self) -> str:
        """Everything the server needs to continue at round ``self.state`` (see :mod:`fs_fedpa.plugin.resume`)."""
        path = resume.server_path(self._cfg.federate.save_to)
        plan = self.method.plan
        resume.save(
            {
                "cur_round": self.state,
                # FS's checkpoint keys, so its own restore can read this file; without the LoRA factors, which are in
                # "global" and whose rank (R_g, Ravan's H r_h) FS's load into a fresh rank-r model would refuse
                "model": {k: v for k, v in self.model.state_dict().items() if not _LORA_KEY.search(k)},
                "fedpa_resume": {
                    "method": self.method.name,
                    "round": self.state,
                    "plan": (list(plan.client_ranks), list(plan.reference_ranks), plan.R_g),
                    "settings": self._result_settings(),
                    "global": lora.copy_factors(self.global_factors, "cpu"),
                    "generator": self.generator.get_state(),
                    "totals": dict(self._totals),
                    "down_bytes": dict(self._down_bytes),
                    "merges": {
                        "merged": {n: t.cpu() for n, t in self.merged.items()},
                        "last": _moved(self._last_merge, "cpu") if self._last_merge is not None else {},
                        "count": self._merge_count,
                        "kept": dict(self._merged_kept),  # evaluation messages are sent again after a resume
                    },
                    "records": resume.plain(self._records),
                    "history_results": resume.plain(self.history_results),
                    "best_results": resume.plain(self.best_results),
                    "rng": resume.rng_state(),
                },
            },
            path,
        )
        logger.info(f"[fedpa] resume point for round {self.state} written to {path}")
        return path

    def restore(self, path: str) -> int:
        """Continue the run saved in the resume point ``path``; returns the round it continues at."""
        if not os.path.isfile(path):
            raise ValueError(f"federate.restore_from {path!r}: no such file")
        checkpoint = resume.load(path)
        saved = checkpoint.get("fedpa_resume")
        if saved is None:
            raise ValueError(
                f"federate.restore_from {path!r} is not a FedPA resume point; runs with federate.save_to X write "
                f"them as {resume.server_path('X')} at the start of every round"
            )
        resume.check_server_fields(saved, path)
        plan = self.method.plan
        now = (list(plan.client_ranks), list(plan.reference_ranks), plan.R_g)
        if saved["method"] != self.method.name or tuple(map(tuple, saved["plan"][:2])) != tuple(map(tuple, now[:2])):
            raise ValueError(
                f"federate.restore_from {path!r} was saved by method {saved['method']!r} with ranks "
                f"{saved['plan']}; this run is {self.method.name!r} with {now}"
            )
        if saved["round"] >= self.total_round_num:
            raise ValueError(
                f"federate.restore_from {path!r} resumes at round {saved['round']}, but federate.total_round_num is "
                f"{self.total_round_num}: nothing is left to train; raise total_round_num to continue the run"
            )
        now_settings, then = self._result_settings(), saved.get("settings", {})
        if changed := sorted(k for k in then if then[k] != now_settings.get(k)):
            diffs = ", ".join(f"{k}: saved {then[k]!r}, now {now_settings.get(k)!r}" for k in changed)
            raise ValueError(f"federate.restore_from {path!r} was saved with other settings ({diffs})")
        trained = sorted({c for record in saved["records"] for c in record.get("clients", [])})
        if missing := [c for c in trained if not any(r < saved["round"] for r in resume.client_files(path, c))]:
            expected = resume.client_path(path, missing[0], saved["round"] - 1)
            raise ValueError(
                f"federate.restore_from {path!r}: the files of clients {missing} are missing (e.g. {expected}); "
                "without them those clients would restart from scratch"
            )
        resume.check_global(saved["global"], path, self.global_factors, max(plan.r_g, plan.R_g))
        self._check_client_files(path, saved["round"])
        device = next(iter(self.global_factors.values()))[0].device
        self.install_global({n: (B.to(device), A.to(device)) for n, (B, A) in saved["global"].items()}, {})
        self.model.load_state_dict(checkpoint["model"], strict=False)  # shared tensors, e.g. a shared head
        self.generator.set_state(saved["generator"])
        self._totals, self._down_bytes = dict(saved["totals"]), dict(saved["down_bytes"])
        merges = saved.get("merges", {})
        self.merged = {n: t.to(device) for n, t in merges.get("merged", {}).items()}
        if "pending" in merges:  # a resume point of an older fs_fedpa: every merge some client lacked, in order
            pending = merges["pending"]
            self._merge_count = merges.get("dropped", 0) + len(pending)
            self._last_merge = _moved(pending[-1], device) if pending else None
        else:
            self._merge_count = merges.get("count", 0)
            self._last_merge = _moved(merges["last"], device) if merges.get("last") else None
        self._merged_upto, self._merged_kept = dict(merges.get("kept", {})), dict(merges.get("kept", {}))
        if self.merged:
            lora.set_base_offsets(self.model, self.merged)
        self._records = list(saved["records"])
        self._write_diagnostics(self._records)
        self.history_results, self.best_results = saved["history_results"], saved["best_results"]
        self._pending_rng = saved["rng"]
        self.state = saved["round"]
        logger.info(f"[fedpa] resumed from {path} at round {self.state}")
        return self.state

    def _check_client_files(self, path: str, rnd: int) -> None:
        """Before any training: each client's newest file from before round ``rnd`` (the one it will restore) must
        be that client's, of this run, well formed and finite (:func:`fs_fedpa.plugin.resume.check_client_file`)."""
        local_names, _ = non_lora_trainables(self.model, self._cfg.personalization.local_param)
        params = dict(self.model.named_parameters())
        for client in range(1, self.client_num + 1):
            older = {r: p for r, p in resume.client_files(path, client).items() if r < rnd}
            if older:
                r = max(older)
                resume.check_client_file(
                    resume.load(older[r]),
                    older[r],
                    r,
                    cfg=self._cfg,
                    method=self.method,
                    client=client,
                    initial=self.method.client_init(self.global_factors, client - 1),  # the run's initial global
                    local={n: params[n] for n in local_names},
                )

    def save_checkpoint(self, path: str, cur_round: int) -> None:
        """FS's checkpoint format (``cur_round``, trainable ``model`` state with the global adapter) plus
        ``fedpa``: the effective global factors and the rank plan."""
        plan = self.method.plan
        torch.save(
            {
                "cur_round": cur_round,
                "model": self.model.state_dict(),
                "fedpa": {
                    "method": self.method.name,
                    "global": lora.copy_factors(self.global_factors, "cpu"),
                    "merged": {n: t.cpu() for n, t in self.merged.items()},  # (d, k): what merges added to W_0
                    "client_ranks": list(plan.client_ranks),
                    "reference_ranks": list(plan.reference_ranks),
                    "R_g": plan.R_g,
                },
            },
            path,
        )


class FedPAAggregator(Aggregator):
    """``aggregate(agg_info)`` for the FedPA server: decode (copies), reconstruct, install, record."""

    def __init__(self, server: FedPAServer):
        super().__init__()
        self.server = server
        _guard_fs_byte_count()  # before any client's message reaches FS's standalone runner

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
            record = _round_record(server, uploads, weights, kept, _with_merge(new_global, merge), spectra, stats)
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
            server.record_round(record.to_dict())
            return {}  # the model is already updated; FS merges this empty dict into its state
        logger.warning(f"[fedpa] round {server.state}: every upload was dropped; the global adapter stays as it was")
        record = _new_record(server, clients)
        record.dropped, record.bytes_up = dropped, bytes_up
        server.record_round(record.to_dict())
        limit = server.method.cfg.max_failed_rounds
        failed = 0
        for past in reversed(server._records):
            if past["clients"]:
                break
            failed += 1
        if limit and failed >= limit:
            raise RuntimeError(
                f"[fedpa] {failed} rounds in a row had every upload dropped (fedpa.max_failed_rounds={limit}); "
                f"stopping instead of training nothing. Reasons in round {server.state}: {dropped}"
            )
        return {}

    def _drop(self, dropped: dict, client_id, reason: str) -> None:
        dropped[str(client_id)] = reason
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


def _parsed(raw) -> tuple[Message, str | None]:
    """FS's :class:`Message` of a gRPC request, field by field: FS's parser asserts on a field of the wrong type (a
    string timestamp) or fails on a missing one, and the field that fails is the reason the message is dropped.
    The fields it could read are set, so the reason can name the claimed sender."""
    message = Message()
    for name in ("msg_type", "sender", "receiver", "state", "content", "timestamp"):
        if name not in raw.msg:
            return message, f"{name}: the message has no such field"
        try:
            value = message._parse_msg(raw.msg[name])
        except (TypeError, ValueError, AttributeError) as err:  # e.g. a field with no value set
            return message, f"{name}: FS cannot parse it ({type(err).__name__}: {err})"
        try:
            setattr(message, name, value)
        except (AssertionError, TypeError, ValueError) as err:  # FS's setters assert on the type
            return message, f"{name} {str(value)[:40]!r} is not a value FS accepts ({err})"
    return message, None


_LORA_KEY = re.compile(r"\.lora_[AB]\.")  # PEFT's names of the LoRA factors in a state dict


def _check_resume_file(path: str) -> None:
    """ValueError with the plugin's message if ``federate.restore_from`` is missing, a folder, truncated, or holds
    anything but tensors, numbers and strings."""
    if not os.path.isfile(path):
        what = "a folder" if os.path.isdir(path) else "no such file"
        raise ValueError(f"federate.restore_from {path!r}: {what}; give a resume file (fedpa_resume_<save_to name>)")
    resume.load(path)


def _g(value, spec: str = ".4g") -> str:
    """A diagnostic for the log: formatted, or ``null`` where the record holds None (it was not finite)."""
    return "null" if value is None else format(value, spec)


def _guard_fs_byte_count() -> None:
    """Make FS's byte counter safe against a client's message (once per process; FS without FedPA never gets here).

    FS's standalone runner counts every message's bytes (``Message.count_bytes``: pympler's ``asizeof`` over every
    object of the content) before it hands the message to any handler, and pympler raises on some objects (a numpy
    array broadcast to 10^12 entries): one client's message stopped the whole run before the server saw it. This is
    the plugin's earliest hook. A client's update is counted only if :func:`check_message_content` finds nothing
    but plain dicts, numbers, strings and tensors that hold their values in it; otherwise, or if the count still
    raises, FS counts 0 bytes, with a warning naming the sender, and the server's intake drops the update with its
    reason. Messages FS counts without an error are counted exactly as before."""
    original = Message.count_bytes
    if getattr(original, "fedpa_guard", False):
        return

    def count_bytes(message):
        sender = message.sender if type(message.sender) is int else "?"
        problem = check_message_content(message.content) if message.msg_type == "model_para" and sender else None
        if problem is None:
            try:
                return original(message)
            except Exception as err:  # pympler on an object it cannot size
                problem = f"{type(err).__name__}: {shown(err, 200)}"
        logger.warning(
            f"[fedpa] FS's byte counter skipped a {shown(message.msg_type)} message from {sender} (counted as 0 "
            f"bytes): {problem}"
        )
        return 0, 0

    count_bytes.fedpa_guard = True
    Message.count_bytes = count_bytes


def _check_finite(global_factors, averaged) -> None:
    """ArithmeticError if the aggregate holds a NaN or an Inf (e.g. an overflow the per-upload bounds missed)."""
    for name, (B, A) in global_factors.items():
        if not (torch.isfinite(B).all() and torch.isfinite(A).all()):
            raise ArithmeticError(f"the aggregate of {name} is not finite")
    for name, t in averaged.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ArithmeticError(f"the average of shared tensor {name} is not finite")


def _moved(merge: dict, device) -> dict:
    """A logged merge (per module its dense increment or its factors) on ``device``."""
    return {n: v.to(device) if isinstance(v, Tensor) else (v[0].to(device), v[1].to(device)) for n, v in merge.items()}


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


def _new_record(server, clients) -> RoundRecord:
    return RoundRecord(
        round=server.state,
        method=server.method.name,
        svd=server.method.cfg.svd,
        R_g=server.method.plan.R_g,
        probe_module=next(iter(server.global_factors)),
        bytes_down={str(c): server._down_bytes.get(c, 0) for c in clients},
    )


def _round_record(server, uploads, weights, clients, new_global, spectra, stats) -> RoundRecord:
    """Diagnostics of one aggregation, from factors only (no d x k matrix). A diagnostic is never a reason to drop
    an upload or stop a round: one that cannot be computed (e.g. an overflow after a legal but huge upload) is None,
    with a warning, and one that is not finite is written as null (:meth:`RoundRecord.to_dict`). With
    ``fedpa.diagnostics False`` the aggregate's diagnostics, which cost as much as a reconstruction, are not computed
    either: they are None."""
    uploads = [server.method.expand(u) for u in uploads]  # each expanded once already, when it was checked
    record = _new_record(server, clients)
    record.clients, record.weights = list(clients), list(weights)
    _blank_aggregate(record)
    if server.method.cfg.diagnostics:
        try:
            _aggregate_diagnostics(record, server.method.expand(new_global), uploads, weights, spectra)
        except (RuntimeError, ValueError, ArithmeticError) as err:
            logger.warning(
                f"[fedpa] round {server.state}: the aggregate's diagnostics cannot be computed ({type(err).__name__}: "
                f"{err}); recorded as null, and the aggregate is installed"
            )
            _blank_aggregate(record)
    record.add_client_stats(list(clients), stats)
    record.upload_ranks = {str(c): sorted({B.shape[1] for B, _ in u.values()}) for c, u in zip(clients, uploads)}
    return record


def _blank_aggregate(record: RoundRecord) -> None:
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

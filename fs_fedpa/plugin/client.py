"""FedPA client for FederatedScope: keeps its own factors and local tensors, trains toward a reference.

Per round (Alg. 1 l.7-12): the method picks the round's starting factors from what the client received and
its own factors (FedPA: its own, never the server's); they and the local tensors go into the model, whether or
not FS shares one model object between clients; training adds the method's alignment term; the client keeps the
trained factors and local tensors and uploads the factors (applied, ``s_i B_i``) and any shared non-LoRA tensors.
Local tensors never leave the client. Factors live in the client's one space (:class:`fs_fedpa.lora.ClientSpace`)
and are converted only at download, upload and when loaded into the model.

This module holds entering and leaving a round; each other concern is in a module of its name, as a collaborator
object (:class:`~fs_fedpa.plugin.client_state.ClientState`: what it keeps, parked between messages;
:class:`~fs_fedpa.plugin.alignment.Alignment`: the training term, adaptive lam;
:class:`~fs_fedpa.plugin.resume_fs.ClientResume`; :class:`~fs_fedpa.plugin.record_fs.RoundStats`: its upload's
statistics; :class:`~fs_fedpa.plugin.privacy.ClientPrivacy`) or, still, a mixin holding FS handlers:
:mod:`~fs_fedpa.plugin.liveness` (the watchdog) and :mod:`~fs_fedpa.plugin.evaluation` (both protocols; its
:class:`~fs_fedpa.plugin.evaluation.Evaluation` runs them and keeps the outcomes).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time

import torch
from federatedscope.core.auxiliaries.utils import add_prefix_to_path
from federatedscope.core.message import Message
from federatedscope.core.workers import Client
from torch import Tensor

from fs_fedpa import lora
from fs_fedpa.core.ranks import truncate_factors
from fs_fedpa.plugin import auth, fs_patches
from fs_fedpa.plugin.alignment import Alignment
from fs_fedpa.plugin.client_state import ClientState, state_store
from fs_fedpa.plugin.common import build_method, global_init, non_lora_trainables, send, share_equal
from fs_fedpa.plugin.evaluation import ClientEvaluation, Evaluation
from fs_fedpa.plugin.liveness import ClientLiveness
from fs_fedpa.plugin.messages import reply_problem
from fs_fedpa.plugin.payload import decode_factors, decode_merge, decode_tensors, encode_parts, encode_tensors
from fs_fedpa.plugin.privacy import ClientPrivacy
from fs_fedpa.plugin.record_fs import RoundStats
from fs_fedpa.plugin.resume_fs import ClientResume
from fs_fedpa.plugin.schedule import RunSchedule
from fs_fedpa.plugin.trainer import install_alignment_hook

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


class FedPAClient(ClientLiveness, ClientEvaluation, Client):
    def __init__(self, *args, **kwargs):
        if kwargs.get("config") is not None:
            kwargs["config"] = share_equal("config", kwargs["config"])
        super().__init__(*args, **kwargs)
        if self._cfg is None:  # FS builds an unconfigured client to list message handlers
            return
        ctx = self.trainer.ctx
        ctx.trainable_para_names = share_equal("names", ctx.trainable_para_names)
        self.method = build_method(self._cfg, self.model)
        # diagnostics off: none computed, not only not sent; under DP-SGD the task gradient is the noisy one
        watched = self.method.cfg.diagnostics and self.method.cfg.dp_mode != "sample"
        self.alignment = Alignment(self.method, watched)
        self._set_space()
        self.local_names, self.shared_names = non_lora_trainables(self.model, self._cfg.personalization.local_param)
        store = state_store(self._cfg, self.method.cfg.state_budget_mb)
        self.kept = ClientState(store, keep_received=bool(self.method.cfg.export_dir))
        params = dict(self.model.named_parameters())
        # Snapshot now: with share_local_model, other clients' training overwrites the model's copy.
        self.kept.local = {n: params[n].detach().clone() for n in self.local_names}
        if store.initial_local is None:  # what a client whose state is lost starts from again
            store.initial_local = {n: t.detach().cpu().clone() for n, t in self.kept.local.items()}
        if self._moves_base:
            lora.keep_base(self.model)
        self.stats = RoundStats(self.method, self.alignment)
        self._e_init: dict[str, float] = {}
        self._stale: dict[str, float] = {}
        self._restarted = False
        self._start: dict[str, tuple[Tensor, Tensor]] | None = None  # the round's starting factors (diagnostics)
        self.resume = ClientResume(self._cfg, self.method)
        self.evaluation = Evaluation(self.trainer, self.model, self._cfg, self.method)
        install_alignment_hook(self.trainer, self.alignment)
        self.privacy = ClientPrivacy(self)
        self.schedule = RunSchedule(self.trainer, self._cfg) if self.method.cfg.lr_schedule != "none" else None
        self._token = secrets.token_hex(16)  # marks the watchdog's own message
        self._heard = time.monotonic()  # the last time it heard from the server, or stopped waiting
        self._waiting = False
        self._answered = (0, 0.0)  # round and timestamp of the server's message it answers now
        # what the client sends is checked, then (distributed, with a key) signed, then goes to FS's transport
        transport = self._send = fs_patches.wrap_send(self.comm_manager, lambda _: self._send_checked)
        if self._cfg.federate.mode.lower() == "distributed" and self.method.cfg.auth_key:
            self._key = auth.read_key(self.method.cfg.auth_key)
            self._send = lambda message: transport(self._signed(message))
        if self.ID >= 1:  # from here on its state lives in the store between messages (distributed: once joined)
            self._park()

    def _set_space(self) -> None:
        """The client's factor space at its rank r_i; in distributed mode its id, and so its rank, arrives when it
        has joined (:meth:`callback_funcs_for_assign_id`)."""
        if self.method.state_is_factors and self.ID >= 1:
            scaling = share_equal("scaling", lora.Scaling.of(self.model))
            self.space = lora.ClientSpace(scaling, self.method.plan.client_ranks[self.index])
        else:
            self.space = lora.UnitSpace()
        self.alignment.penalty_weight = self.space.penalty_weight(self.method.plan.lam_rank)  # one lambda for all

    def callback_funcs_for_assign_id(self, message: Message):
        super().callback_funcs_for_assign_id(message)
        self._set_space()

    # ------------------------------------------------------------------------------ what leaves the client
    def _send_checked(self, message: Message) -> None:
        """Send ``message`` if the server would accept its fields (:func:`fs_fedpa.plugin.messages.reply_problem`,
        the checks of the server's intake); otherwise raise, naming the field: a subclass's mistake (a round of -1,
        a string state, an earlier timestamp) must not reach FS's runner, which fails on it far from the cause."""
        if message.msg_type in ("model_para", "metrics"):
            rnd, since = self._answered
            fields = (message.msg_type, message.sender, message.state, message.timestamp, message.content)
            if problem := reply_problem(*fields, self.ID, rnd, since, *self._run_size):
                raise ValueError(
                    f"[fedpa] client #{self.ID}, round {rnd}: its {message.msg_type} message is malformed and was not "
                    f"sent: {problem}"
                )
        self._send(message)

    @property
    def _run_size(self) -> tuple[int, int]:
        """(rounds, clients) of the run, as the server checks a message against them."""
        return self._cfg.federate.total_round_num, self._cfg.federate.client_num

    def _signed(self, message: Message) -> Message:
        """``message`` to the server with its content signed by this client's key (:mod:`fs_fedpa.plugin.auth`)."""
        if self.server_id in (message.receiver if isinstance(message.receiver, list) else [message.receiver]):
            fields = (message.msg_type, message.sender, message.state, message.timestamp)
            message.content = auth.sign(self._key, *fields, message.content)
        return message

    @property
    def index(self) -> int:
        """0-based position in the rank plan (FS client ids start at 1)."""
        return self.ID - 1

    # ----------------------------------------------------------------------------------- training
    def callback_funcs_for_model_para(self, message: Message):
        self._unpark()
        self.resume.restore(self.kept, self.ID, message.state, self._initial_factors, self._device)
        self.state, self._answered = message.state, (message.state, message.timestamp)
        self.privacy.new_round()
        if self.schedule is not None:
            self.schedule.new_round(self.state)
        self._enter_round(message.content)
        if self.privacy.sits_out:  # fedpa.dp_min_records: no DP-SGD step; its upload weighs 0
            sample_size, results = 0, {}
        else:
            sample_size, _, results = self.trainer.train()
        sample_size = self.privacy.sample_size(sample_size)  # client-level DP: 1, in the content and the timestamp
        self._release_optimizer()
        upload = self._leave_round()
        self.privacy.log_round(self.kept.rounds_trained)
        self._park()
        logger.info(self._monitor.format_eval_res(results, rnd=self.state, role=f"Client #{self.ID}", return_raw=True))
        timestamp = self._gen_timestamp(init_timestamp=message.timestamp, instance_number=sample_size)
        send(self, "model_para", message.sender, (sample_size, upload), timestamp)

    def _enter_round(self, payload: dict) -> None:
        if self.kept.factors is None and not self.kept.lost:
            self.kept.factors = self._initial_factors()
        received = self._own_and_received(payload)
        kept = self.kept
        kept.lost_this_round, kept.lost_unreported = kept.lost_unreported, False  # the server resends merges
        self._stale = self.stats.staleness(self.space, self.kept, received, self.state)
        self._train_personal(received, payload)
        start = self.method.start_round(received, self.kept.factors, self.index, self.state)
        self._e_init = self.stats.init_error(start, self.kept.factors, self.kept.rounds_trained)
        self._start = lora.copy_factors(start) if self.method.cfg.diagnostics else None
        self.kept.received = received
        self.kept.fold = self.method.fold(received, self.index, self.state)
        self._set_base(self.kept.fold)
        self._load(start, trainable=self.method.trainable(self.state))
        self._load_tensors(decode_tensors(payload.get("shared", {})))
        self._load_tensors(self.kept.local)
        device = self._device
        reference = {n: (B.to(device), A.to(device)) for n, (B, A) in received.items()}
        self.alignment.start_round(self.method.read(self.model), reference)

    def _train_personal(self, received: dict[str, tuple[Tensor, Tensor]], payload: dict) -> None:
        """The personal phase, if the method has one this round: the model applies ``a * personal + (1 - a) *
        reference`` with the reference frozen in the base weights (FedDPA's mixed forward), trains the personal
        factors and the local tensors, and keeps them; the personal factors never leave the client."""
        start = self.method.personal_start(received, self.kept.personal, self.index, self.state)
        if start is None or self.privacy.sits_out:
            return
        a = self.method.personal_weight
        frozen = {n: (1 - a) * (B @ A) for n, (B, A) in self.space.upload(received).items()}
        lora.set_base_offsets(self.model, frozen)
        lora.set_factors(self.model, self.space.to_model(start))
        lora.scale_adapters(self.model, a)
        self._load_tensors(decode_tensors(payload.get("shared", {})))
        self._load_tensors(self.kept.local)
        try:
            with self.alignment.paused():  # no alignment term in this phase
                self.trainer.train()
        finally:
            lora.set_base_offsets(self.model, {})  # back to W_0
        self.kept.personal = self.space.from_model(lora.copy_factors(lora.get_factors(self.model)))
        params = dict(self.model.named_parameters())
        self.kept.local = {n: params[n].detach().clone() for n in self.local_names}

    def _leave_round(self) -> dict:
        self.alignment.grads.close()
        trained = self.space.from_model(lora.copy_factors(self.method.read(self.model)))
        params = dict(self.model.named_parameters())
        local = {n: params[n].detach().clone() for n in self.local_names}
        finite = all(bool(torch.isfinite(t).all()) for B, A in trained.values() for t in (B, A))
        self._restarted = not (finite and all(bool(torch.isfinite(t).all()) for t in local.values()))
        if self._restarted:  # one bad step must not exclude this client for the rest of the run
            logger.warning(
                f"[fedpa] client #{self.ID}, round {self.state}: its own factors or local tensors became non-finite; "
                "it restarts from the global reference it received (and keeps its local tensors of the last round)"
            )
            trained, local = self._restart_factors(), self.kept.local or local
        self.kept.factors = self.method.end_round(trained, self.index, self.state)
        self.kept.local = local
        self.kept.rounds_trained += 1
        self.kept.last_trained = self.state
        if self.resume.out:  # federate.save_to
            self.resume.write(self.kept, self._snapshot(), self.ID, self.state)
        sent = self.space.upload(self.method.before_upload(self.kept.factors, self.kept.received, self.state))
        wire = self._cfg.federate.mode.lower() == "distributed"  # tensors as explicit encodings, never pickled
        upload = {
            "lora": encode_parts(self.method.upload_payload(sent, self.index, self.state), wire=wire),
            "stats": self.privacy.stats(
                {
                    "alignment_loss": self.alignment.mean(),
                    "lam": float(self.alignment.lam),
                    "num_train_data": int(getattr(self.trainer.ctx, "num_train_data", 0) or 0),
                    "restarted": int(self._restarted),
                    "state_lost": int(self.kept.lost_this_round),
                    **self._stale,
                    **self._e_init,
                    **self.stats.round_stats(sent, self.space, self.kept.received, self.kept.fold, self._start,
                                             self.state),
                }
            ),
        }
        self._start = None  # only the round's statistics read it
        if self.shared_names:  # FS's gRPC encoder fails on empty dicts
            upload["shared"] = encode_tensors({n: params[n] for n in self.shared_names}, wire)
        return upload

    def _release_optimizer(self) -> None:
        """FS builds a new optimizer and scheduler at the start of every training routine but keeps the last ones on
        the trainer's context: per client that ever trained, its AdamW moments and the round's factor parameters
        (3x its adapter), which grows with the number of clients trained. Nothing reads them after the routine."""
        ctx = self.trainer.ctx
        if not self._cfg.llm.deepspeed.use:  # deepspeed's engine owns and reuses its optimizer
            for name in ("optimizer", "scheduler"):
                if getattr(ctx, name, None) is not None:
                    setattr(ctx, name, None)

    # ------------------------------------------------------------------------------------ its state between messages
    def _park(self) -> None:
        """After each message: its state to the store; nothing of it, nor of the round's reference, stays here."""
        self.kept.park(self.ID)
        self.alignment.clear()

    def _unpark(self) -> None:
        """Before each message: its state from the store onto the device it computes on."""
        self.kept.unpark(self.ID, self._device)

    def _release(self) -> None:
        """The run is over: drop its state and the round's reference (saved where asked)."""
        self.kept.release()
        self.alignment.clear()

    def _snapshot(self) -> dict:
        """Everything this client keeps across rounds (raw factors, local tensors), on the CPU, with its round, id
        and rank r_i."""
        rank = self.method.plan.client_ranks[self.index]
        return {"round": self.state, "client": self.ID, "rank": rank, **self.kept.snapshot()}

    # ------------------------------------------------------------------------------------ the end of the run
    def callback_funcs_for_finish(self, message: Message):
        """Never load the server's model (its factors have rank R_g); save this client's own state where asked
        (``federate.save_to``, ``fedpa.export_dir``), then let it go: the run is over, and every client's state in
        memory at once would undo ``fedpa.state_budget_mb``."""
        logger.info(f"================= client {self.ID} received finish message =================")
        self._unpark()
        store = self.kept.store
        store.drop(self.ID)
        if not store.reported:
            store.reported = True
            logger.info(f"[fedpa] client state store: {store.summary()}")
        if self.kept.factors is not None:
            # what its own-factor evaluation adds to the base weights (Fed-PLoRA's undrawn modules): for the export
            state = {**self._snapshot(), "fold": lora.copy_factors(self.kept.fold or {}, "cpu"),
                     "scaling": lora.Scaling.of(self.model).record()}  # fmt: skip
            if self._cfg.federate.save_to:
                torch.save(state, add_prefix_to_path(f"fedpa_client_{self.ID}_", self._cfg.federate.save_to))
            if self.method.cfg.export_dir:
                self._export(state)
        self._release()  # saved where asked; N clients' states must not all come back into memory at the end
        self._monitor.finish_fl()

    def _export(self, state: dict) -> None:
        """This client's head (and with ``fedpa.export_clients`` its own models) into ``fedpa.export_dir``, with its
        manifest entry ``export_client_<id>.json`` (:mod:`fs_fedpa.plugin.export_fs`)."""
        from fs_fedpa.plugin.export_fs import Exporter

        out = self.method.cfg.export_dir
        exporter = Exporter(self._cfg, self.model, self.method, out, force=True)
        received = self.kept.last_received or exporter.received(self.ID, {}, self.kept.factors)
        cpu = {n: (B.cpu(), A.cpu()) for n, (B, A) in received.items()}
        entry = exporter.client_entry(self.ID, state, cpu, own_models=self.method.cfg.export_clients)
        path = os.path.join(out, f"export_client_{self.ID}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({str(self.ID): entry}, f)
        os.replace(path + ".tmp", path)

    # ------------------------------------------------------------------------------------ helpers
    def _initial_factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Alg. 1 l.4 from the global initialisation that server and clients draw from one seed (drawn on the host,
        then put on the model's device, like the factors it keeps)."""
        device = self._device
        initial = self.method.client_init(self.space.download(global_init(self.model, self.method)), self.index)
        return {n: (B.to(device), A.to(device)) for n, (B, A) in initial.items()}

    @property
    def _device(self) -> torch.device:
        """Where this client trains and evaluates: its trainer's device. Not the model's device between two routines:
        with ``federate.share_local_model False`` FS moves the model there when a routine starts and back to the
        host when it ends (``discharge_model``), so a message finds the model on the host."""
        device = getattr(getattr(self.trainer, "ctx", None), "device", None)
        if device is None:
            return next(iter(lora.get_factors(self.model).values()))[0].device
        return torch.device(device)

    def _restart_factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Rank-r_i factors whose product is the reference received this round: its R_i columns/rows, then zero
        columns of B with the rows of the client's initial A (so the extra rank can still learn)."""
        if self.method.folds or not self.method.state_is_factors:  # the round's start from what it received
            return self.method.start_round(self.kept.received, self.kept.factors, self.index, self.state)
        r_i, initial = self.method.plan.client_ranks[self.index], self._initial_factors()
        out = {}
        for name, (B, A) in self.kept.received.items():
            B_r, A_r = truncate_factors(B, A, r_i)
            R = min(B.shape[1], r_i)
            A_r[R:] = initial[name][1][R:].to(A_r)
            out[name] = (B_r, A_r)
        return out

    def _own_and_received(self, payload: dict) -> dict[str, tuple[Tensor, Tensor]]:
        """The reference of ``payload`` (:meth:`_receive`), with this client's own factors ready beside it: those it
        kept or, if its stored state could not be read back (:meth:`_unpark`), factors restarted from that reference
        (training and evaluation alike, whatever the diagnostics)."""
        lost = self.kept.lost
        if lost:
            self.kept.factors = self._initial_factors()  # the modules and ranks the reference is completed to
        received = self._receive(payload)
        if lost:
            self.kept.received = received
            self.kept.factors, self.kept.lost, self.kept.lost_unreported = self._restart_factors(), False, True
        return received

    def _receive(self, payload: dict) -> dict[str, tuple[Tensor, Tensor]]:
        """The reference of a server message in this client's space (zero at rank r_i where the method sends none),
        after adding any merge it carries to this client's base offset."""
        # on the model's device, where the client computes with it (its own factors, its round's statistics); the
        # scaling is applied first, on the host, so the values are those of a CPU run
        device = self._device
        received = {n: (B.to(device), A.to(device)) for n, (B, A) in
                    self.space.download(decode_factors(payload.get("lora", {}))).items()}  # fmt: skip
        for name, (B, A) in self.kept.factors.items():
            if name not in received:
                received[name] = (torch.zeros_like(B, device=device), torch.zeros_like(A, device=device))
        if "base_total" in payload:  # it lacked more than the newest merge: the sum of all, in place of its own
            self.kept.base_offset = {n: t.to(device, torch.promote_types(t.dtype, torch.float32)) for n, t in
                                     decode_tensors(payload["base_total"]).items()}  # fmt: skip
        for merge in decode_merge(payload.get("base", {})):  # one by one, as they were merged
            for name, increment in merge.items():
                if name not in self.kept.factors:
                    raise KeyError(f"the server merged into {name!r}, which is not a LoRA module of this model")
                dtype = torch.promote_types(increment.dtype, torch.float32)
                increment = increment.to(device, dtype)
                offsets = self.kept.base_offset
                offsets[name] = offsets[name] + increment if name in offsets else increment
        return received

    @property
    def _moves_base(self) -> bool:
        """Whether the method ever changes the model's base weights (merges, folds or a personal phase): the rule
        that also refuses a quantized base, :meth:`FederatedMethod.writes_base`."""
        return bool(self.method.writes_base())

    def _set_base(self, fold: dict[str, tuple[Tensor, Tensor]] | None = None) -> None:
        """The model's base weights: W_0 plus this client's merges (another client may have changed a shared model),
        plus the applied product of ``fold`` (client space) for this round's training."""
        if not self._moves_base:
            return
        offsets = dict(self.kept.base_offset)
        for name, (B, A) in self.space.upload(fold or {}).items():
            offsets[name] = offsets[name] + B @ A if name in offsets else B @ A
        lora.set_base_offsets(self.model, offsets)

    def _load(self, state: dict[str, tuple[Tensor, Tensor]], trainable: bool | tuple[bool, bool] = True) -> None:
        """This client's ``state`` (its space) into the model, through the method (LoRA factors for most)."""
        self.method.load(self.model, self.space.to_model(state), trainable, self.index, self.state)

    def _load_tensors(self, tensors: dict[str, Tensor]) -> None:
        if not tensors:
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value)

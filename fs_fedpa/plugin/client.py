"""FedPA client for FederatedScope: keeps its own factors and local tensors, trains toward a reference.

The worker holds FS's handlers only, as delegations to collaborators that own their state:
:class:`~fs_fedpa.plugin.client_round.ClientRound` (a round: its start, the personal phase, its upload),
:class:`~fs_fedpa.plugin.client_model.ClientModel` (what a message means in the client's space and what goes into
FS's model), :class:`~fs_fedpa.plugin.client_state.ClientState` (what it keeps, parked between messages),
:class:`~fs_fedpa.plugin.alignment.Alignment` (the training term, adaptive lam),
:class:`~fs_fedpa.plugin.resume_fs.ClientResume`, :class:`~fs_fedpa.plugin.record_fs.RoundStats` (its upload's
statistics), the DP policy (:func:`fs_fedpa.privacy.client_policy`) and
:class:`~fs_fedpa.plugin.evaluation.Evaluation`. The mixins :mod:`~fs_fedpa.plugin.liveness` (the watchdog) and
:mod:`~fs_fedpa.plugin.evaluation` hold FS handlers too. Factors live in the client's one space,
the applied one of the uploads and the server, and are converted only into and out of the model
(:class:`fs_fedpa.lora.ClientSpace`).
"""

from __future__ import annotations

import logging
import secrets
import time

import torch
from federatedscope.core.auxiliaries.utils import add_prefix_to_path
from federatedscope.core.message import Message
from federatedscope.core.workers import Client

from fs_fedpa import lora, privacy
from fs_fedpa.plugin import auth, tls_fs
from fs_fedpa.plugin.alignment import Alignment
from fs_fedpa.plugin.client_model import ClientModel
from fs_fedpa.plugin.client_round import ClientRound
from fs_fedpa.plugin.client_state import ClientState, state_store
from fs_fedpa.plugin.common import build_method, non_lora_trainables, send, share_equal
from fs_fedpa.plugin.dp_sgd import DPSGD
from fs_fedpa.plugin.evaluation import ClientEvaluation, Evaluation
from fs_fedpa.plugin.export_fs import export_client
from fs_fedpa.plugin.fs_patches import grpc_comm_manager, sized_once, warn_once
from fs_fedpa.plugin.liveness import ClientLiveness
from fs_fedpa.plugin.logit_bias import install_logit_bias
from fs_fedpa.plugin.outbox import ClientOutbox
from fs_fedpa.plugin.record_fs import RoundStats
from fs_fedpa.plugin.resume_fs import ClientResume
from fs_fedpa.plugin.run_folder_fs import identity, in_run_folder
from fs_fedpa.plugin.schedule import RunSchedule
from fs_fedpa.plugin.trainer import install_alignment_hook, install_counter_hook, install_moments_hook
from fs_fedpa.systems import Span, TrainCounter, round_stats

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


class FedPAClient(ClientLiveness, ClientEvaluation, Client):
    def __init__(self, *args, **kwargs):
        if kwargs.get("config") is not None:  # its files in the run's folder, before FS reads federate.save_to
            kwargs["config"] = share_equal("config", in_run_folder(kwargs["config"]))
        warn_once()  # FS's trainer context repeats one warning at every evaluation of every client
        make_comm = tls_fs.comm_manager(kwargs.get("config"), "client")  # checked before FS opens its port
        with sized_once(kwargs.get("model")), grpc_comm_manager(make_comm):
            super().__init__(*args, **kwargs)
        if self._cfg is None:  # FS builds an unconfigured client to list message handlers
            return
        ctx = self.trainer.ctx
        ctx.trainable_para_names = share_equal("names", ctx.trainable_para_names)
        self.method = build_method(self._cfg, self.model)
        # diagnostics off: none computed, not only not sent; under DP-SGD the task gradient is the noisy one
        policy = privacy.mechanism_of(self.method.cfg).Client
        self.alignment = Alignment(self.method, policy.task_gradient_diagnostics(self.method.cfg.records.full))
        local_names, shared_names = non_lora_trainables(self.model, self._cfg.personalization.local_param)
        store = state_store(self._cfg, self.method.cfg.store.state_budget_mb)
        self.kept = ClientState(store, keep_received=bool(self.method.cfg.export.dir))
        self.client_model = ClientModel(self.model, self.trainer, self.method, self.kept)
        self._set_space()
        # Snapshot now: with share_local_model, other clients' training overwrites the model's copy.
        self.kept.start(self.client_model.read_tensors(local_names))
        if store.initial_local is None:  # what a client whose state is lost starts from again
            store.initial_local = {n: t.detach().cpu().clone() for n, t in self.kept.local.items()}
        if self.client_model.moves_base:
            lora.keep_base(self.model)
        self.resume = ClientResume(self._cfg, self.method)
        self.resume.data = {"n": int(getattr(self.trainer.ctx, "num_train_data", 0) or 0)}  # its files record it
        if self.ID >= 1:  # a resumed run: its training set is the one its files were written with, checked now
            self.resume.check_data(self.ID, self.kept.local)
        self.evaluation = Evaluation(self.trainer, self.client_model, self.kept, self._cfg)
        install_alignment_hook(self.trainer, self.alignment)
        self.counter = TrainCounter()  # the round's batches, examples and tokens
        install_counter_hook(self.trainer, self.counter)
        if self.method.cfg.keep_moments:  # after FS builds the routine's optimizer
            install_moments_hook(self.trainer, self.kept)
        self.privacy = policy(self._cfg, self.method, self.trainer, local_names, DPSGD)
        install_logit_bias(self.trainer, self.privacy.logit_bias)  # fedpa.dp.label_prior; without it none
        wire = self._cfg.federate.mode.lower() == "distributed"  # tensors as explicit encodings, never pickled
        stats = RoundStats(self.method, self.alignment)
        self.round = ClientRound(self.client_model, self.trainer, self.alignment, stats, self.privacy, self.resume,
                                 local_names, shared_names, wire)  # fmt: skip
        self.schedule = RunSchedule(self.trainer, self._cfg) if self.method.cfg.lr_schedule != "none" else None
        self._token = secrets.token_hex(16)  # marks the watchdog's own message
        self._heard = time.monotonic()  # the last time it heard from the server, or stopped waiting
        self._waiting = False
        key = auth.read_key(self.method.cfg.net.auth_key) if wire and self.method.cfg.net.auth_key else None
        run_size = (self._cfg.federate.total_round_num, self._cfg.federate.client_num)
        self.outbox = ClientOutbox(self.comm_manager, lambda: (self.ID, self.server_id), run_size, key)
        if self.ID >= 1:  # from here on its state lives in the store between messages (distributed: once joined)
            self._park()

    def _set_space(self) -> None:
        """The client's factor space at its rank r_i; in distributed mode its id, and so its rank, arrives when it
        has joined (:meth:`callback_funcs_for_assign_id`)."""
        if self.method.state_is_factors and self.ID >= 1:
            scaling = share_equal("scaling", lora.Scaling.of(self.model))
            space = lora.ClientSpace(scaling, self.method.plan.client_ranks[self.ID - 1])
        else:
            space = lora.UnitSpace()
        self.client_model.bind(self.ID - 1, space)  # index: 0-based position in the rank plan (FS ids start at 1)
        self.alignment.penalty_weight = space.penalty_weight(self.method.plan.lam_rank)  # one lambda for all

    def callback_funcs_for_assign_id(self, message: Message):
        super().callback_funcs_for_assign_id(message)
        self._set_space()

    # ----------------------------------------------------------------------------------- training
    def callback_funcs_for_model_para(self, message: Message):
        self._open(message)
        self.privacy.new_round(self.ID, self.state)
        if self.schedule is not None:
            self.schedule.new_round(self.state)
        self.round.enter(message.content, self.state)
        systems = {}  # its training's time, memory and counts (fs_fedpa.systems)
        if self.privacy.sits_out:  # fedpa.dp.min_records: no DP-SGD step; its upload weighs 0
            sample_size, results = 0, {}
        else:
            self.counter.take()  # not the personal phase's batches (FedDPA's, in round.enter): this training's only
            with Span(self.client_model.device) as span:
                sample_size, _, results = self.trainer.train()
            systems = round_stats(span, self.counter.take())
        sample_size = self.privacy.sample_size(sample_size)  # client-level DP: 1, in the content and the timestamp
        release_optimizer(self.trainer, self._cfg)
        upload = self.round.leave(self.state, systems)
        self.privacy.log_round(self.kept.rounds_trained)
        self._park()
        logger.info(self._monitor.format_eval_res(results, rnd=self.state, role=f"Client #{self.ID}", return_raw=True))
        timestamp = self._gen_timestamp(init_timestamp=message.timestamp, instance_number=sample_size)
        send(self, "model_para", message.sender, (sample_size, upload), timestamp)

    # ------------------------------------------------------------------------------------ its state between messages
    def _park(self) -> None:
        """After each message: its state to the store; nothing of it, nor of the round's reference, stays here."""
        self.kept.park(self.ID)
        self.alignment.clear()

    def _open(self, message: Message) -> None:
        """The start of a training or evaluation message: its state from the store (continued from its resume file
        where the run resumed: the newest before the round it trains, or after the round it evaluates), and the
        round it answers. :meth:`_park` closes it."""
        device = self.client_model.device
        self.kept.unpark(self.ID, device)
        before = message.state + (message.msg_type == "evaluate")  # an evaluation closes its round
        self.resume.restore(self.kept, self.ID, before, self.client_model.initial_factors, device, self.privacy)
        self.state = message.state
        self.outbox.answering(message.state, message.timestamp)

    def _unpark(self) -> None:
        """Before each message: its state from the store onto the device it computes on."""
        self.kept.unpark(self.ID, self.client_model.device)

    # ------------------------------------------------------------------------------------ the end of the run
    def callback_funcs_for_finish(self, message: Message):
        """Never load the server's model (its factors have rank R_g); save this client's own state where asked
        (``federate.save_to``, ``fedpa.export.dir``), then let it go: the run is over, and every client's state in
        memory at once would undo ``fedpa.store.state_budget_mb``."""
        logger.info(f"================= client {self.ID} received finish message =================")
        self._unpark()
        store = self.kept.store
        store.drop(self.ID)
        if not store.reported:
            store.reported = True
            logger.info(f"[fedpa] client state store: {store.summary()}")
        if self.kept.factors is not None:
            # what its own-factor evaluation adds to the base weights (Fed-PLoRA's undrawn modules): for the export
            state = {**self.client_model.snapshot(self.state), "fold": lora.copy_factors(self.kept.fold or {}, "cpu"),
                     "scaling": lora.Scaling.of(self.model).record(), "run": identity(self._cfg.outdir)}  # fmt: skip
            if self._cfg.federate.save_to:
                torch.save(state, add_prefix_to_path(f"fedpa_client_{self.ID}_", self._cfg.federate.save_to))
            if self.method.cfg.export.dir:
                export_client(self._cfg, self.model, self.method, self.ID, state,
                              self.kept.last_received, self.kept.factors)  # fmt: skip
        # saved where asked; N clients' states must not all come back into memory at the end
        self.kept.release()
        self.alignment.clear()
        self._monitor.finish_fl()


def release_optimizer(trainer, cfg) -> None:
    """FS builds a new optimizer and scheduler at the start of every training routine but keeps the last ones on
    the trainer's context: per client that ever trained, its AdamW moments and the round's factor parameters (3x its
    adapter), which grows with the number of clients trained. Nothing reads them after the routine."""
    if not cfg.llm.deepspeed.use:  # deepspeed's engine owns and reuses its optimizer
        for name in ("optimizer", "scheduler"):
            if getattr(trainer.ctx, name, None) is not None:
                setattr(trainer.ctx, name, None)

"""FedPA client for FederatedScope: keeps its own factors and local tensors, trains toward a reference.

Per round (Alg. 1 l.7-12): the method picks the round's starting factors from what the client received and
its own factors (FedPA: its own, never the server's); they and the local tensors go into the model, whether or
not FS shares one model object between clients; training adds the method's alignment term; the client keeps the
trained factors and local tensors and uploads the factors (applied, ``s_i B_i``) and any shared non-LoRA tensors.
Local tensors never leave the client. Factors live in the client's one space (:class:`fs_fedpa.lora.ClientSpace`)
and are converted only at download, upload and when loaded into the model.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time

import torch
from federatedscope.core.auxiliaries.utils import add_prefix_to_path, merge_dict_of_results
from federatedscope.core.message import Message
from federatedscope.core.workers import Client
from torch import Tensor

from fs_fedpa import lora
from fs_fedpa.core.adaptive import lam_direction, lam_grad, lam_loss, normalized_factor_grads
from fs_fedpa.core.diagnostics import GradientSplit, factored_norm, initialization_error, product_distance
from fs_fedpa.core.instance import instance_weights, representation
from fs_fedpa.core.penalty import product_penalty
from fs_fedpa.core.ranks import truncate_factors
from fs_fedpa.plugin import auth, resume
from fs_fedpa.plugin.common import build_method, global_init, non_lora_trainables, share_equal, without_empty_splits
from fs_fedpa.plugin.payload import decode_factors, decode_merge, decode_tensors, encode_parts, encode_tensors
from fs_fedpa.plugin.trainer import install_alignment_hook
from fs_fedpa.record import OUTCOMES_FILE
from fs_fedpa.state_store import SpillError, StateStore, flatten, unflatten

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only
CLIENT_TIMEOUT = "fedpa_client_timeout"  # the client watchdog's message type
INSTANCES = 5  # FedDPA's test time: training inputs compared with each test input (the authors' instance_num)
_STORES: dict[str, StateStore] = {}  # one per run folder: the clients of a standalone run share its budget


class FedPAClient(Client):
    def __init__(self, *args, **kwargs):
        if kwargs.get("config") is not None:
            kwargs["config"] = share_equal("config", kwargs["config"])
        super().__init__(*args, **kwargs)
        if self._cfg is None:  # FS builds an unconfigured client to list message handlers
            return
        ctx = self.trainer.ctx
        ctx.trainable_para_names = share_equal("names", ctx.trainable_para_names)
        self.method = build_method(self._cfg, self.model)
        self._set_space()
        self.local_names, self.shared_names = non_lora_trainables(self.model, self._cfg.personalization.local_param)
        params = dict(self.model.named_parameters())
        # Snapshot now: with share_local_model, other clients' training overwrites the model's copy.
        self.local_tensors = {n: params[n].detach().clone() for n in self.local_names}
        self.factors: dict[str, tuple[Tensor, Tensor]] | None = None  # own (B_i, A_i), kept across rounds
        self.base_offset: dict[str, Tensor] = {}  # (d, k) per module: the merges received (exact-aggregation methods)
        self.personal: dict[str, tuple[Tensor, Tensor]] | None = None  # a personal adapter (FedDPA), never sent
        if self._moves_base:
            lora.keep_base(self.model)
        self.reference: dict[str, tuple[Tensor, Tensor]] = {}  # the received rank-R_i reference, client space
        self._grads = GradientSplit()
        self._live: dict[str, tuple[Tensor, Tensor]] = {}
        self.lam = self.method.cfg.lam
        self._lam_pending = False
        self._penalty_sum: Tensor | None = None
        self._penalty_steps = 0
        self._e_init: dict[str, float] = {}
        self._rounds_trained = 0
        self._last_trained: int | None = None  # the last round it trained (partial participation's staleness)
        self._stale: dict[str, float] = {}
        self._restarted = False
        self._received: dict[str, tuple[Tensor, Tensor]] = {}
        self._last_received: dict[str, tuple[Tensor, Tensor]] | None = None
        self._fold: dict[str, tuple[Tensor, Tensor]] | None = None  # the base part of the model it trains (last)
        save_to, restore_from = self._cfg.federate.save_to, self._cfg.federate.restore_from
        self._resume_out = resume.server_path(save_to) if save_to else None
        self._resume_in = restore_from or None  # read at the first message, which names the round
        install_alignment_hook(self.trainer, self)
        self.store = _store(self._cfg, self.method.cfg.state_budget_mb)
        if self.store.initial_local is None:  # what a client whose state is lost starts from again
            self.store.initial_local = {n: t.detach().cpu().clone() for n, t in self.local_tensors.items()}
        self._parked = False
        self._state_lost = self._lost_this_round = False
        self._token = secrets.token_hex(16)  # marks the watchdog's own message
        self._heard = time.monotonic()  # the last time it heard from the server, or stopped waiting
        self._waiting = False
        if self._cfg.federate.mode.lower() == "distributed" and self.method.cfg.auth_key:
            self._key = auth.read_key(self.method.cfg.auth_key)
            send = self.comm_manager.send
            self.comm_manager.send = lambda message: send(self._signed(message))
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
        self.penalty_weight = self.space.penalty_weight(self.method.plan.lam_rank)  # one lambda for every client

    def callback_funcs_for_assign_id(self, message: Message):
        super().callback_funcs_for_assign_id(message)
        self._set_space()

    # ------------------------------------------------------------------------------ distributed: liveness, keys
    def _signed(self, message: Message) -> Message:
        """``message`` to the server with its content signed by this client's key (:mod:`fs_fedpa.plugin.auth`)."""
        if self.server_id in (message.receiver if isinstance(message.receiver, list) else [message.receiver]):
            fields = (message.msg_type, message.sender, message.state, message.timestamp)
            message.content = auth.sign(self._key, *fields, message.content)
        return message

    def run(self):
        """FS's distributed loop, with a watchdog: a client that hears nothing from the server for
        ``fedpa.client_timeout_s`` while it waits exits non-zero with the reason instead of waiting forever."""
        timeout = self.method.cfg.client_timeout_s
        if self._cfg.federate.mode.lower() == "distributed" and timeout > 0:
            self.register_handlers(CLIENT_TIMEOUT, self._on_client_timeout, [None])
            receive = self.comm_manager.receive

            def waiting_receive():
                self._heard, self._waiting = time.monotonic(), True
                try:
                    return receive()
                finally:
                    self._heard, self._waiting = time.monotonic(), False

            self.comm_manager.receive = waiting_receive
            threading.Thread(target=self._watchdog, args=(timeout,), daemon=True, name="fedpa-client-watchdog").start()
        return super().run()

    def _watchdog(self, timeout: float) -> None:
        """Puts a timeout message into the client's own queue once it has waited ``timeout`` seconds."""
        while True:
            time.sleep(min(1.0, timeout / 10))
            if self._waiting and time.monotonic() - self._heard > timeout:
                message = Message(
                    msg_type=CLIENT_TIMEOUT, sender=self.ID, receiver=[self.ID], state=2**30, content=self._token
                )
                self.comm_manager.server_funcs.msg_queue.append(message.transform(to_list=True))
                return

    def _on_client_timeout(self, message: Message):
        if message.content != self._token:  # not its own watchdog's: a peer's forgery
            logger.warning(f"[fedpa] client #{self.ID}: ignored a {CLIENT_TIMEOUT} message it did not send itself")
            return
        raise RuntimeError(
            f"[fedpa] client #{self.ID}: no message from the server for fedpa.client_timeout_s="
            f"{self.method.cfg.client_timeout_s:g} s (round {self.state}); the server is gone or unreachable, exiting"
        )

    @property
    def index(self) -> int:
        """0-based position in the rank plan (FS client ids start at 1)."""
        return self.ID - 1

    # ----------------------------------------------------------------------------------- training
    def callback_funcs_for_model_para(self, message: Message):
        self._unpark()
        self._restore(message.state)
        self.state = message.state
        self._enter_round(message.content)
        sample_size, _, results = self.trainer.train()
        self._release_optimizer()
        upload = self._leave_round()
        self._park()
        logger.info(self._monitor.format_eval_res(results, rnd=self.state, role=f"Client #{self.ID}", return_raw=True))
        self.comm_manager.send(
            Message(
                msg_type="model_para",
                sender=self.ID,
                receiver=[message.sender],
                state=self.state,
                timestamp=self._gen_timestamp(init_timestamp=message.timestamp, instance_number=sample_size),
                content=(sample_size, upload),
            )
        )

    def _enter_round(self, payload: dict) -> None:
        if self.factors is None:
            self.factors = self._initial_factors()
        received = self._receive(payload)
        self._lost_this_round = self._state_lost
        self._stale = self._staleness(received)
        if self._state_lost:  # its stored state could not be read back: it restarts from the reference
            self._received, self.factors, self._state_lost = received, self._restart_factors(), False
        self._train_personal(received, payload)
        start = self.method.start_round(received, self.factors, self.index, self.state)
        self._e_init = self._init_error(start, self.factors)
        self._received = received
        self._fold = self.method.fold(received, self.index, self.state)
        self._set_base(self._fold)
        self._load(start, trainable=self.method.trainable(self.state))
        self._load_tensors(decode_tensors(payload.get("shared", {})))
        self._load_tensors(self.local_tensors)
        self._live = self.method.read(self.model)
        device = self._device
        self.reference = {n: (B.to(device), A.to(device)) for n, (B, A) in received.items()}
        self.lam = self.method.cfg.lam
        self._lam_pending = self.method.cfg.adaptive_lam != "none"
        self._penalty_sum, self._penalty_steps = None, 0
        if self.method.cfg.diagnostics:  # off: no diagnostic is computed, not only none written
            self._grads.watch(self._live)

    def _train_personal(self, received: dict[str, tuple[Tensor, Tensor]], payload: dict) -> None:
        """The personal phase, if the method has one this round: the model applies ``a * personal + (1 - a) *
        reference`` with the reference frozen in the base weights (FedDPA's mixed forward), trains the personal
        factors and the local tensors, and keeps them; the personal factors never leave the client."""
        start = self.method.personal_start(received, self.personal, self.index, self.state)
        if start is None:
            return
        a = self.method.personal_weight
        frozen = {n: (1 - a) * (B @ A) for n, (B, A) in self.space.upload(received).items()}
        lora.set_base_offsets(self.model, frozen)
        lora.set_factors(self.model, self.space.to_model(start))
        lora.scale_adapters(self.model, a)
        self._load_tensors(decode_tensors(payload.get("shared", {})))
        self._load_tensors(self.local_tensors)
        reference, self.reference = self.reference, {}  # no alignment term in this phase
        try:
            self.trainer.train()
        finally:
            self.reference = reference
            lora.set_base_offsets(self.model, {})  # back to W_0
        self.personal = self.space.from_model(lora.copy_factors(lora.get_factors(self.model)))
        params = dict(self.model.named_parameters())
        self.local_tensors = {n: params[n].detach().clone() for n in self.local_names}

    def _leave_round(self) -> dict:
        self._grads.close()
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
            trained, local = self._restart_factors(), self.local_tensors or local
        self.factors = self.method.end_round(trained, self.index, self.state)
        self.local_tensors = local
        self._rounds_trained += 1
        self._last_trained = self.state
        term = float(self._penalty_sum) / self._penalty_steps if self._penalty_steps else 0.0
        if self._resume_out:
            self._write_resume_file()
        sent = self.space.upload(self.method.before_upload(self.factors, self._received, self.state))
        wire = self._cfg.federate.mode.lower() == "distributed"  # tensors as explicit encodings, never pickled
        upload = {
            "lora": encode_parts(self.method.upload_payload(sent, self.index, self.state), wire=wire),
            "stats": {
                "alignment_loss": term,
                "lam": float(self.lam),
                "num_train_data": int(getattr(self.trainer.ctx, "num_train_data", 0) or 0),
                "restarted": int(self._restarted),
                "state_lost": int(self._lost_this_round),
                **self._stale,
                **self._e_init,
                **self._round_stats(sent),
            },
        }
        if self.shared_names:  # FS's gRPC encoder fails on empty dicts
            upload["shared"] = encode_tensors({n: params[n] for n in self.shared_names}, wire)
        return upload

    def _whole_update(self, sent: dict[str, tuple[Tensor, Tensor]]) -> dict[str, tuple[Tensor, Tensor]]:
        """The client's whole update as applied factors: what it sends plus what it folded into its base weights
        for the round (Fed-PLoRA's undrawn modules), so its diagnostics compare like with like."""
        if self._fold is None:
            return sent
        folded = self.space.upload(self._fold)
        return {n: (torch.cat([B, folded[n][0].to(B)], 1), torch.cat([A, folded[n][1].to(A)], 0)) for n, (B, A) in
                sent.items()}  # fmt: skip

    def _round_stats(self, sent) -> dict[str, float]:
        """This round's mechanism (issue: diagnostics that explain a result), summed over LoRA modules, of its whole
        update (``sent`` and any fold): ||Delta W_i||_F, the drift ||Delta W_i - X_g,i||_F from the received reference
        X_g,i (and relative to ||X_g,i||_F, absent while the reference is 0), and ||grad of the alignment term|| /
        ||grad of the task loss|| on the client's factors at the round's first and last step (absent for methods
        without a term). None of it with ``fedpa.diagnostics False``."""
        if not self.method.cfg.diagnostics:
            return {}
        sent = self.method.expand(self._whole_update(sent))
        reference = self.method.expand(self.space.upload(self._received))
        delta_sq = drift_sq = ref_sq = 0.0
        for name, (B, A) in sent.items():
            B_ref, A_ref = reference[name]
            delta_sq += float(factored_norm(B, A)) ** 2
            drift_sq += float(product_distance(B, A, B_ref, A_ref)) ** 2
            ref_sq += float(factored_norm(B_ref, A_ref)) ** 2
        stats = {"delta_norm": delta_sq**0.5, "drift": drift_sq**0.5}
        if ref_sq > 0:
            stats["drift_rel"] = (drift_sq / ref_sq) ** 0.5
        if self._penalty_steps:
            for when, (align, task) in self._grads.norms().items():
                stats[f"grad_ratio_{when}"] = align / task if task > 0 else float("inf")
        return stats

    def alignment_term(self, ctx) -> Tensor | None:
        """lam/2 * sum of the method's alignment term over LoRA modules, for the trainer hook (train only)."""
        self._grads.end_step()  # the previous step's backward is complete
        if not self.reference:
            return None
        if self._lam_pending and not getattr(ctx, "skip_this_batch", False):
            self.lam = self._adaptive_lam(ctx.loss_batch)
            self._lam_pending = False
            self._grads.discard()  # the probe's autograd.grad is not a training step
        live = self._grads.alias(self._live) if self.method.cfg.diagnostics else self._live
        term = self.method.alignment(live, self.reference, self.lam * self.penalty_weight)
        if term is not None:
            value = term.detach()
            self._penalty_sum = value if self._penalty_sum is None else self._penalty_sum + value
            self._penalty_steps += 1
        return term

    def _adaptive_lam(self, task_loss: Tensor) -> float:
        """lam_i^(t) from the first mini-batch of the round (Appendix F)."""
        cfg = self.method.cfg
        if cfg.adaptive_lam == "loss":
            return lam_loss(task_loss.detach(), cfg.lam, cfg.adaptive_alpha)
        Bs = [B for B, _ in self._live.values()]
        As = [A for _, A in self._live.values()]
        g_f = normalized_factor_grads(*_grads(task_loss, Bs, As), Bs, As)
        penalty = torch.stack([product_penalty(B, A, *self.reference[n]) for n, (B, A) in self._live.items()]).sum()
        if cfg.adaptive_lam == "grad":
            return lam_grad(g_f.norm(), penalty.detach().sqrt(), cfg.adaptive_alpha, cfg.lam_min, cfg.lam_max)
        g_r = normalized_factor_grads(*_grads(penalty, Bs, As), Bs, As)
        return lam_direction(g_f, g_r, cfg.lam)

    # --------------------------------------------------------------------------------- evaluation
    def callback_funcs_for_evaluate(self, message: Message):
        """Paper protocol (global rank-R_i reference + own local tensors) and, with fedpa.eval_local, the
        client's own preserved factors, reported as ``local.<split>_<metric>``."""
        self._unpark()
        self._restore(message.state)
        self.state = message.state
        payload = message.content
        # a client that never trained evaluates its initial factors, which it need not keep: any worker can draw them
        # again from the run's seed, so N never-sampled clients store nothing
        untrained = self.factors is None and not self._state_lost
        if untrained:
            self.factors = self._initial_factors()
        received = self._receive(payload)
        if self._state_lost:
            self._received, self.factors, self._state_lost = received, self._restart_factors(), False
        self._last_received = received  # what an export at the end of the run evaluates
        evaluated = self.method.evaluation_factors(received, self.factors, self.index, personal=self.personal)
        self._set_base()
        self._load(evaluated)
        self._load_tensors(decode_tensors(payload.get("shared", {})))
        self._load_tensors(self.local_tensors)
        mixed = self.method.instance_mix is not None and self.personal is not None
        undo = self._instance_mix(next(iter(received.values()))[0].shape[1]) if mixed else lambda: None
        try:
            metrics = self._evaluate_splits()
        finally:
            undo()
        outcomes = {"global": self._take_outcomes()}
        if self.method.cfg.eval_local:
            # the model it trained: Fed-PLoRA's own modules sit on the undrawn ones it folded into the base
            self._set_base(self._fold)
            self._load(self.factors)
            # FS derives the split from the text before the first "_" and the metric from the text after
            # "<split>_", so the protocol goes in front: local.test_acc, local.test_total, ...
            metrics.update({f"local.{key}": value for key, value in self._evaluate_splits().items()})
            outcomes["local"] = self._take_outcomes()
        if self.method.cfg.save_outcomes:
            self._write_outcomes(outcomes)
        metrics, empty = without_empty_splits(metrics)
        if empty:
            logger.warning(f"[fedpa] client #{self.ID}: no example in {empty}; those metrics are missing, not 0")

        formatted = self._monitor.format_eval_res(
            metrics, rnd=self.state, role=f"Client #{self.ID}", forms=["raw"], return_raw=True
        )
        logger.info(formatted)
        if any(self._cfg.eval.best_res_update_round_wise_key in key for key in metrics):  # FS raises without it
            self._monitor.update_best_result(
                self.best_results, formatted["Results_raw"], results_type=f"client #{self.ID}"
            )
        self.history_results = merge_dict_of_results(self.history_results, formatted["Results_raw"])
        if untrained:
            self.factors = None
        self._park()
        self.comm_manager.send(
            Message(
                msg_type="metrics",
                sender=self.ID,
                receiver=[message.sender],
                state=self.state,
                timestamp=message.timestamp,
                content=metrics,
            )
        )

    def _instance_mix(self, split: int):
        """FedDPA's test time on the loaded ``([B_g, B_l], [A_g; A_l])`` (``B_g`` of rank ``split``): before every
        evaluation forward, each input's weight g of the global adapter from its representation and those of
        ``INSTANCES`` of this client's training inputs drawn for it, all under the personal adapter alone
        (:func:`fs_fedpa.core.instance.instance_weights`). Returns the function that takes the hooks off."""
        gate = lora.RowGate(self.model, split)
        device = self._device
        train = self.trainer.ctx.data["train"]  # FS's DataLoader of this client's training split
        stream = torch.Generator().manual_seed(self.method.seed * 1_000_003 + self.state * 1_009 + self.ID)
        busy = False

        def weigh(module, args, kwargs):
            nonlocal busy
            if busy:  # the representation passes below
                return None
            if args or "input_ids" not in kwargs:
                raise ValueError("FedDPA's instance-wise weighting needs the model called with input_ids=...")
            inputs = {k: kwargs[k] for k in ("input_ids", "attention_mask") if kwargs.get(k) is not None}
            rows, n = inputs["input_ids"].shape[0], len(train.dataset)
            picks = torch.multinomial(torch.ones(rows, n), min(INSTANCES, n), generator=stream)
            refs = train.collate_fn([train.dataset[i] for i in picks.flatten().tolist()])
            refs = refs[0] if isinstance(refs, (tuple, list)) else refs  # seqcls: (features, labels)
            refs = {k: refs[k] for k in ("input_ids", "attention_mask") if k in refs}
            busy = True
            try:
                emb = self._representation(gate, inputs, device)
                ref = self._representation(gate, refs, device).view(rows, picks.shape[1], -1)
            finally:
                busy = False
            gate.g = instance_weights(emb, ref, self.method.instance_mix)
            self.instance_weights.append(gate.g.detach().cpu())
            return None

        self.instance_weights: list[Tensor] = []  # this evaluation's g per batch (diagnostics, tests)
        handle = self.model.register_forward_pre_hook(weigh, with_kwargs=True)

        def undo() -> None:
            handle.remove()
            gate.remove()
            if self.instance_weights:
                g = torch.cat(self.instance_weights)
                logger.info(
                    f"[fedpa] client #{self.ID}, round {self.state}: FedDPA's weight of the global adapter over "
                    f"{len(g)} inputs: mean {float(g.mean()):.3f}, min {float(g.min()):.3f}, max {float(g.max()):.3f}"
                )

        return undo

    def _representation(self, gate: lora.RowGate, inputs: dict[str, Tensor], device: torch.device) -> Tensor:
        """(batch, hidden) under the personal adapter alone (:func:`fs_fedpa.core.instance.representation`)."""
        inputs = {k: v.to(device) for k, v in inputs.items()}
        return representation(self.model, gate, inputs, classifier=self._cfg.trainer.type == "seqcls")

    def _take_outcomes(self) -> dict[str, str]:
        """The last evaluation's per-example outcomes (:class:`SeqClsTrainer`), split -> "0110..."; cleared."""
        taken = getattr(self.trainer, "outcomes", None) or {}
        self.trainer.outcomes = {}
        return {split: "".join("1" if c else "0" for c in correct.tolist()) for split, correct in taken.items()}

    def _write_outcomes(self, outcomes: dict[str, dict[str, str]]) -> None:
        """Append this evaluation's outcomes to ``<outdir>/fedpa_outcomes.jsonl`` (:data:`OUTCOMES_FILE`)."""
        lines = [
            {"round": self.state, "client": self.ID, "protocol": protocol, "split": split, "correct": bits}
            for protocol, splits in outcomes.items()
            for split, bits in splits.items()
        ]
        with open(os.path.join(self._cfg.outdir, OUTCOMES_FILE), "a", encoding="utf-8") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)

    def _evaluate_splits(self) -> dict:
        metrics = {}
        with resume.fork_rng():  # evaluations never shift the random stream of training
            for split in self._cfg.eval.split:
                metrics.update(**self.trainer.evaluate(target_data_split_name=split))
        return metrics

    # ------------------------------------------------------------------------------------- resume
    def _write_resume_file(self) -> None:
        """This client's state after round ``self.state``; the two newest files are kept."""
        owner = resume.client_owner(self._cfg, self.method, self.ID)  # whose it is: checked by every restore
        resume.save(
            {**self.local_state(), **owner, "rounds_trained": self._rounds_trained, "rng": resume.rng_state()},
            resume.client_path(self._resume_out, self.ID, self.state),
        )
        for _, path in sorted(resume.client_files(self._resume_out, self.ID).items())[:-2]:
            path.unlink(missing_ok=True)

    def _restore(self, rnd: int) -> None:
        """Once, in a resumed run: this client's newest state from before round ``rnd``, if it ever trained."""
        if self._resume_in is None:
            return
        path, self._resume_in = self._resume_in, None
        older = {r: p for r, p in resume.client_files(path, self.ID).items() if r < rnd}
        if not older:
            return  # never trained before the resume point: it starts as a new client would
        saved = resume.load(older[max(older)])
        resume.check_client_file(  # the server checked it too; this client checks what it actually reads
            saved,
            older[max(older)],
            max(older),
            cfg=self._cfg,
            method=self.method,
            client=self.ID,
            initial=self._initial_factors(),
            local=self.local_tensors,
        )
        device = self._device
        self.factors = {n: (B.to(device), A.to(device)) for n, (B, A) in saved["factors"].items()}
        self.local_tensors = {n: t.to(device) for n, t in saved["local"].items()}
        self.base_offset = {n: t.to(device) for n, t in saved.get("base_offset", {}).items()}
        self.personal = {n: (B.to(device), A.to(device)) for n, (B, A) in saved.get("personal", {}).items()} or None
        self._rounds_trained = saved["rounds_trained"]
        self._last_trained = saved["round"]  # a client writes its file in the round it trains
        if self._cfg.federate.mode == "distributed":  # its own process: its own random stream
            resume.set_rng_state(saved["rng"])
        logger.info(f"[fedpa] client {self.ID} resumed its state of round {saved['round']}")

    def callback_funcs_for_finish(self, message: Message):
        """Never load the server's model (its factors have rank R_g); save this client's own state where asked
        (``federate.save_to``, ``fedpa.export_dir``), then let it go: the run is over, and every client's state in
        memory at once would undo ``fedpa.state_budget_mb``."""
        logger.info(f"================= client {self.ID} received finish message =================")
        self._unpark()
        self.store.drop(self.ID)
        if not self.store.reported:
            self.store.reported = True
            logger.info(f"[fedpa] client state store: {self.store.summary()}")
        if self.factors is not None:
            # what its own-factor evaluation adds to the base weights (Fed-PLoRA's undrawn modules): for the export
            state = {**self.local_state(), "fold": lora.copy_factors(self._fold or {}, "cpu")}
            if self._cfg.federate.save_to:
                torch.save(state, add_prefix_to_path(f"fedpa_client_{self.ID}_", self._cfg.federate.save_to))
            if self.method.cfg.export_dir:
                self._export(state)
        self._release_state()  # saved where asked; N clients' states must not all come back into memory at the end
        self._monitor.finish_fl()

    def _release_optimizer(self) -> None:
        """FS builds a new optimizer and scheduler at the start of every training routine but keeps the last ones on
        the trainer's context: per client that ever trained, its AdamW moments and the round's factor parameters
        (3x its adapter), which grows with the number of clients trained. Nothing reads them after the routine."""
        ctx = self.trainer.ctx
        if not self._cfg.llm.deepspeed.use:  # deepspeed's engine owns and reuses its optimizer
            for name in ("optimizer", "scheduler"):
                if getattr(ctx, name, None) is not None:
                    setattr(ctx, name, None)

    # ------------------------------------------------------------------------------ state between messages
    def _park(self) -> None:
        """After each message: what this client keeps goes to the state store (host memory, or disk beyond
        ``fedpa.state_budget_mb``), and nothing of it, nor of the round's reference, stays on the model's device."""
        parts = {"factors": self.factors, "local": self.local_tensors, "base_offset": self.base_offset,
                 "personal": self.personal, "fold": self._fold}  # fmt: skip
        if self.method.cfg.export_dir:
            parts["received"] = self._last_received
        self.store.put(self.ID, flatten(parts))
        self._parked = True
        self._release_state()

    def _release_state(self) -> None:
        """Drop this client's references to its state and to the round's reference (parked, or the run is over)."""
        self.factors = self.personal = self._fold = self._last_received = None
        self.local_tensors, self.base_offset = {}, {}
        self.reference, self._received, self._live = {}, {}, {}

    def _unpark(self) -> None:
        """Before each message: this client's state from the store onto the model's device. A stored state that
        cannot be read back is this client's loss alone: it is logged, and the client restarts from the reference
        it receives, with the initial local tensors (docs/errors.md)."""
        if not self._parked:
            return
        self._parked = False
        try:
            flat = self.store.get(self.ID) or {}
        except SpillError as exc:
            logger.warning(f"[fedpa] {exc}; client #{self.ID} restarts from the global reference it receives and "
                           "its initial local tensors")  # fmt: skip
            flat, self._state_lost = flatten({"local": self.store.initial_local}), True
        parts = unflatten(flat)
        device = self._device

        def pairs(part):
            return {n: (B.to(device), A.to(device)) for n, (B, A) in parts[part].items()} if part in parts else None

        self.factors, self.personal, self._fold, self._last_received = (
            pairs(p) for p in ("factors", "personal", "fold", "received")
        )
        self.local_tensors = {n: t.to(device) for n, t in parts.get("local", {}).items()}
        self.base_offset = {n: t.to(device) for n, t in parts.get("base_offset", {}).items()}

    def _export(self, state: dict) -> None:
        """This client's head (and with ``fedpa.export_clients`` its own models) into ``fedpa.export_dir``, with its
        manifest entry ``export_client_<id>.json`` (:mod:`fs_fedpa.plugin.export`)."""
        from fs_fedpa.plugin.export import Exporter

        out = self.method.cfg.export_dir
        exporter = Exporter(self._cfg, self.model, self.method, out, force=True)
        received = self._last_received or exporter.received(self.ID, {}, self.factors)
        cpu = {n: (B.cpu(), A.cpu()) for n, (B, A) in received.items()}
        entry = exporter.client_entry(self.ID, state, cpu, own_models=self.method.cfg.export_clients)
        path = os.path.join(out, f"export_client_{self.ID}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({str(self.ID): entry}, f)
        os.replace(path + ".tmp", path)

    def local_state(self) -> dict:
        """Everything this client keeps across rounds (raw factors, local tensors), on the CPU."""
        return {
            "round": self.state,
            "client": self.ID,
            "rank": self.method.plan.client_ranks[self.index],
            "factors": lora.copy_factors(self.factors, "cpu"),
            "local": {n: t.detach().cpu().clone() for n, t in self.local_tensors.items()},
            "base_offset": {n: t.cpu() for n, t in self.base_offset.items()},
            "personal": lora.copy_factors(self.personal, "cpu") if self.personal is not None else {},
        }

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
            return self.method.start_round(self._received, self.factors, self.index, self.state)
        r_i, initial = self.method.plan.client_ranks[self.index], self._initial_factors()
        out = {}
        for name, (B, A) in self._received.items():
            B_r, A_r = truncate_factors(B, A, r_i)
            R = min(B.shape[1], r_i)
            A_r[R:] = initial[name][1][R:].to(A_r)
            out[name] = (B_r, A_r)
        return out

    def _receive(self, payload: dict) -> dict[str, tuple[Tensor, Tensor]]:
        """The reference of a server message in this client's space (zero at rank r_i where the method sends none),
        after adding any merge it carries to this client's base offset."""
        # on the model's device, where the client computes with it (its own factors, its round's statistics); the
        # scaling is applied first, on the host, so the values are those of a CPU run
        device = self._device
        received = {n: (B.to(device), A.to(device)) for n, (B, A) in
                    self.space.download(decode_factors(payload.get("lora", {}))).items()}  # fmt: skip
        for name, (B, A) in self.factors.items():
            if name not in received:
                received[name] = (torch.zeros_like(B, device=device), torch.zeros_like(A, device=device))
        if "base_total" in payload:  # it lacked more than the newest merge: the sum of all, in place of its own
            self.base_offset = {n: t.to(device, torch.promote_types(t.dtype, torch.float32)) for n, t in
                                decode_tensors(payload["base_total"]).items()}  # fmt: skip
        for merge in decode_merge(payload.get("base", {})):  # one by one, as they were merged
            for name, increment in merge.items():
                if name not in self.factors:
                    raise KeyError(f"the server merged into {name!r}, which is not a LoRA module of this model")
                dtype = torch.promote_types(increment.dtype, torch.float32)
                increment = increment.to(device, dtype)
                self.base_offset[name] = self.base_offset[name] + increment if name in self.base_offset else increment
        return received

    @property
    def _moves_base(self) -> bool:
        """Whether the method ever changes the model's base weights (merges, folds or a personal phase)."""
        return self.method.merges or self.method.folds or self.method.personal_weight is not None

    def _set_base(self, fold: dict[str, tuple[Tensor, Tensor]] | None = None) -> None:
        """The model's base weights: W_0 plus this client's merges (another client may have changed a shared model),
        plus the applied product of ``fold`` (client space) for this round's training."""
        if not self._moves_base:
            return
        offsets = dict(self.base_offset)
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

    def _staleness(self, received) -> dict[str, float]:
        """For a client that trained before: the rounds since it last trained, and ``||s_i B_i A_i - X_g,i||_F`` of
        its preserved factors against the reference ``received`` at the start of this round (partial
        participation: does a preserved factor that sat out drift from the reference?). None without diagnostics."""
        if not self.method.cfg.diagnostics or self._last_trained is None or self.factors is None:
            return {}
        own, reference = (self.method.expand(self.space.upload(f)) for f in (self.factors, received))
        sq = sum(float(product_distance(B, A, *reference[n])) ** 2 for n, (B, A) in own.items() if n in reference)
        return {"staleness": self.state - self._last_trained, "drift_start": sq**0.5}

    def _init_error(self, start, previous) -> dict[str, float]:
        """E_init(B), E_init(A) of this client for the first LoRA module (§3.3; the paper plots one module); none
        without diagnostics."""
        if not self.method.cfg.diagnostics or self._rounds_trained == 0:
            return {}
        name = next(iter(start))
        return {
            "e_init_B": initialization_error([start[name][0]], [previous[name][0]]),
            "e_init_A": initialization_error([start[name][1]], [previous[name][1]]),
        }


def _grads(loss: Tensor, Bs: list[Tensor], As: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    grads = torch.autograd.grad(loss, Bs + As, retain_graph=True, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, Bs + As)]
    return grads[: len(Bs)], grads[len(Bs) :]


def _store(cfg, budget_mb: float) -> StateStore:
    """The state store of this run's folder (shared by the clients of a standalone run)."""
    folder = os.path.join(os.path.abspath(cfg.outdir), "fedpa_state")
    if folder not in _STORES:
        _STORES[folder] = StateStore(folder, int(budget_mb * 2**20) if budget_mb > 0 else None)
    return _STORES[folder]

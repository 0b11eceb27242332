"""A client's training round (Alg. 1 l.7-12; :class:`ClientRound`, a collaborator of
:class:`~fs_fedpa.plugin.client.FedPAClient`, whose FS handler runs FS's training between :meth:`ClientRound.enter`
and :meth:`ClientRound.leave`).

Entering, the method picks the round's starting factors from what the client received and its own factors (FedPA:
its own, never the server's); they and the local tensors go into the model, whether or not FS shares one model
object between clients, and the alignment term starts toward the reference. A method with a personal phase
(FedDPA) trains it first. Leaving, the client keeps the trained factors and local tensors and builds its upload: the
factors, any shared non-LoRA tensors, and the round's statistics that may leave it. Local tensors never leave the
client. Every factor here is applied (``s_i B_i``, the uploads' and the server's space): a training phase converts
once into the model and once out of it (:class:`fs_fedpa.lora.ClientSpace`)."""

from __future__ import annotations

import logging

import torch

from fs_fedpa import lora
from fs_fedpa.lora import Factors
from fs_fedpa.plugin.alignment import Alignment
from fs_fedpa.plugin.client_model import ClientModel
from fs_fedpa.plugin.payload import encode_parts, encode_tensors
from fs_fedpa.plugin.record_fs import RoundStats
from fs_fedpa.plugin.resume_fs import ClientResume
from fs_fedpa.privacy.policy import ClientPolicy

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


class ClientRound:
    """One client's rounds on ``client_model`` (:class:`ClientModel`) and FS's ``trainer``; ``local_names`` and
    ``shared_names`` are its trainable non-LoRA tensors that stay and that are sent; ``wire``: tensors are sent as
    explicit encodings (distributed mode), never pickled."""

    def __init__(self, client_model: ClientModel, trainer, alignment: Alignment, stats: RoundStats,
                 privacy: ClientPolicy, resume: ClientResume, local_names: list[str], shared_names: list[str],
                 wire: bool):  # fmt: skip
        self.client_model, self.trainer, self.alignment, self.stats = client_model, trainer, alignment, stats
        self.privacy, self.resume = privacy, resume
        self.method, self.kept = client_model.method, client_model.kept
        self.local_names, self.shared_names, self.wire = local_names, shared_names, wire
        self.restarted = False  # its factors or local tensors became non-finite this round
        self.at_start: dict[str, float] = {}  # the statistics of the round's start
        self.start: Factors | None = None  # the round's starting factors (diagnostics only)

    def enter(self, payload: dict, rnd: int) -> None:
        """Round ``rnd`` from the server's ``payload``: the model holds the round's start, the term its reference."""
        client_model, kept, method = self.client_model, self.kept, self.method
        kept.draw(client_model.initial_factors)
        received = client_model.own_and_received(payload, rnd)
        self.train_personal(received, payload, rnd)
        start = method.start_round(received, kept.factors, client_model.index, rnd)
        self.at_start = self.stats.at_start(kept, received, start, client_model.space, rnd)
        self.start = lora.copy_factors(start) if self.stats.full else None
        fold = method.fold(received, client_model.index, rnd) if "fold" in method.uses else None
        kept.open_round(received, fold)  # a lost state is reported now
        client_model.set_base(kept.fold)
        trainable = method.trainable(rnd) if "trainable" in method.uses else (True, True)
        reference = client_model.load(start, rnd, trainable, reference=received)
        client_model.load_round_tensors(payload)
        self.alignment.start_round(method.read(client_model.model), reference)

    def train_personal(self, received: Factors, payload: dict, rnd: int) -> None:
        """The personal phase, if the method has one this round: the model applies ``a * personal + (1 - a) *
        reference`` with the reference frozen in the base weights (FedDPA's mixed forward), trains the personal
        factors and the local tensors, and keeps them; the personal factors never leave the client."""
        client_model, kept = self.client_model, self.kept
        if "personal_start" not in self.method.uses:
            return
        start = self.method.personal_start(received, kept.personal, client_model.index, rnd)
        if start is None or self.privacy.sits_out:
            return
        a, model = self.method.personal_weight, client_model.model
        lora.set_base_offsets(model, {n: (1 - a) * (B @ A) for n, (B, A) in received.items()})
        lora.set_factors(model, client_model.space.into_model(start)[0])
        lora.scale_adapters(model, a)
        client_model.load_round_tensors(payload)
        try:
            with self.alignment.paused():  # no alignment term in this phase
                self.trainer.train()
        finally:
            lora.set_base_offsets(model, {})  # back to W_0
        kept.keep_personal(client_model.space.from_model(lora.copy_factors(lora.get_factors(model))),
                           client_model.read_tensors(self.local_names))  # fmt: skip

    def leave(self, rnd: int, systems: dict | None = None) -> dict:
        """The end of round ``rnd``: the trained state kept (a client whose state became non-finite restarts from
        the reference), its resume file written where asked, and its upload (``lora``, ``stats``, ``shared``; the
        statistics with the round's ``systems`` ones, :data:`fs_fedpa.systems.SYSTEMS_STATS`, where the DP policy
        lets them leave)."""
        client_model, kept, method = self.client_model, self.kept, self.method
        if self.alignment.watched:
            self.alignment.grads.close()
        trained = client_model.trained()
        local = client_model.read_tensors(self.local_names)
        finite = all(bool(torch.isfinite(t).all()) for B, A in trained.values() for t in (B, A))
        self.restarted = not (finite and all(bool(torch.isfinite(t).all()) for t in local.values()))
        if self.restarted:  # one bad step must not exclude this client for the rest of the run
            logger.warning(
                f"[fedpa] client #{client_model.client_id}, round {rnd}: its own factors or local tensors became "
                "non-finite; it restarts from the global reference it received (and keeps its local tensors of the "
                "last round)"
            )
            trained, local = client_model.restart_factors(rnd, kept.received), kept.local or local
            kept.moments.clear()  # the optimizer's state of a diverged round goes too
        if "end_round" in method.uses:
            trained = method.end_round(trained, client_model.index, rnd)
        kept.keep(trained, local, rnd)
        if self.resume.out:  # federate.save_to
            snapshot = client_model.snapshot(rnd)
            if privacy := self.privacy.state_dict():  # e.g. the label prior's b, which a resume must not draw again
                snapshot["privacy"] = privacy
            self.resume.write(snapshot, snapshot["client"], rnd)
        sent = kept.factors
        if "before_upload" in method.uses:
            sent = method.before_upload(sent, kept.received, rnd)
        sent = self.privacy.upload(sent, rnd)  # what leaves, as the DP policy has it (without DP: as trained)
        upload = {
            "lora": encode_parts(method.upload_payload(sent, client_model.index, rnd), wire=self.wire),
            "stats": self.privacy.stats(
                {
                    "alignment_loss": self.alignment.value(),
                    "lam": float(self.alignment.lam),
                    "num_train_data": int(getattr(self.trainer.ctx, "num_train_data", 0) or 0),
                    "restarted": int(self.restarted),
                    "state_lost": int(kept.lost_this_round),
                    **self.at_start,
                    **self.stats.round_stats(sent, kept.received, kept.fold, self.start, rnd),
                    **(systems or {}),
                },
                kept.rounds_trained,
            ),
        }
        self.start = None  # only the round's statistics read it
        if self.shared_names:  # FS's gRPC encoder fails on empty dicts
            params = dict(client_model.model.named_parameters())
            upload["shared"] = encode_tensors({n: params[n] for n in self.shared_names}, self.wire)
        return upload

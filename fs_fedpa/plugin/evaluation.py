"""A client's evaluation under both protocols (the global reference with its own local tensors; with
``fedpa.eval.local`` its own factors), FedDPA's instance-wise mixing, and the per-example outcomes.
:class:`ClientEvaluation` holds FS's ``evaluate`` handler of :class:`~fs_fedpa.plugin.client.FedPAClient`;
:class:`Evaluation`, its collaborator, runs the evaluations and owns what they leave (outcomes, FedDPA's weights)."""

from __future__ import annotations

import logging
import time

import torch
from federatedscope.core.auxiliaries.utils import merge_dict_of_results
from federatedscope.core.message import Message
from torch import Tensor

from fs_fedpa import lora, resume
from fs_fedpa.core import head_refit
from fs_fedpa.core.instance import instance_weights, representation
from fs_fedpa.outcomes import append_outcomes
from fs_fedpa.plugin.common import send, without_empty_splits
from fs_fedpa.record import EVAL_SECONDS

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only
INSTANCES = 5  # FedDPA's test time: training inputs compared with each test input (the authors' instance_num)


class ClientEvaluation:
    """FS's ``evaluate`` handler (a mixin of the client; the evaluations themselves are :class:`Evaluation`'s)."""

    def callback_funcs_for_evaluate(self, message: Message):
        """Paper protocol (global rank-R_i reference + own local tensors) and, with fedpa.eval.local, the
        client's own preserved factors, reported as ``local.<split>_<metric>``."""
        self._open(message)
        # after the client's last upload only (the evaluation closing the last round, numbered from 0): the refitted
        # head sees its training records exactly
        last = message.state >= self._cfg.federate.total_round_num - 1
        start = time.perf_counter()
        metrics = self.evaluation.evaluate(message.content, self.state, self.ID, last=last)
        seconds = time.perf_counter() - start
        formatted = self._monitor.format_eval_res(
            metrics, rnd=self.state, role=f"Client #{self.ID}", forms=["raw"], return_raw=True
        )
        logger.info(formatted)
        if any(self._cfg.eval.best_res_update_round_wise_key in key for key in metrics):  # FS raises without it
            self._monitor.update_best_result(
                self.best_results, formatted["Results_raw"], results_type=f"client #{self.ID}"
            )
        self.history_results = merge_dict_of_results(self.history_results, formatted["Results_raw"])
        self._park()
        send(self, "metrics", message.sender, {**metrics, EVAL_SECONDS: seconds}, message.timestamp)


class Evaluation:
    """A client's evaluations (a collaborator of :class:`~fs_fedpa.plugin.client.FedPAClient`): FS's trainer on
    every split of ``eval.split`` with the training's random stream untouched, the per-example outcomes the trainer
    leaves, and FedDPA's instance-wise weighting around them (:attr:`instance_weights`: the last evaluation's g per
    batch, for diagnostics and tests)."""

    def __init__(self, trainer, client_model, kept, cfg):
        self.trainer, self.client_model, self.kept, self.cfg = trainer, client_model, kept, cfg
        self.model, self.method = client_model.model, client_model.method
        self.instance_weights: list[Tensor] = []

    def evaluate(self, payload: dict, rnd: int, client: int, last: bool) -> dict:
        """The metrics of one evaluation message ``payload`` of round ``rnd``: the paper protocol (what the method
        evaluates, :meth:`~fs_fedpa.methods.base.FederatedMethod.evaluation_factors`, with FedDPA's instance-wise
        mixing), with ``fedpa.eval.local`` the client's own factors (``local.*``), and with ``fedpa.eval.refit_head``
        and ``last`` (after its last upload) both again with the head refitted (``refit.*``); splits without an
        example are left out. The outcomes are written where ``fedpa.records.save_outcomes`` asks."""
        client_model, kept, method = self.client_model, self.kept, self.method
        # a client that never trained evaluates its initial factors, which it need not keep: any worker can draw them
        # again from the run's seed, so N never-sampled clients store nothing
        untrained = kept.draw(client_model.initial_factors)
        received = client_model.own_and_received(payload, rnd)
        kept.evaluated(received)
        evaluated = method.evaluation_factors(received, kept.factors, client_model.index, personal=kept.personal)
        client_model.set_base()
        client_model.load(evaluated, rnd)
        client_model.load_round_tensors(payload)
        undo = lambda: None  # noqa: E731
        if method.instance_mix is not None and kept.personal is not None:
            # the global adapter's rank: the columns of B_g in the loaded ([B_g, B_l], [A_g; A_l])
            rank = next(iter(received.values()))[0].shape[1]
            undo = self.instance_mix(rank, client_model.device, rnd, client)
        refit = method.cfg.eval.refit_head and last
        try:
            metrics = self.splits()
        finally:
            undo()
        outcomes = {"global": self.take_outcomes()}
        if refit:
            metrics.update({f"refit.{key}": value for key, value in self.refit_splits().items()})
            outcomes["refit"] = self.take_outcomes()
        if method.cfg.eval.local:
            # the model it trained: Fed-PLoRA's own modules sit on the undrawn ones it folded into the base
            client_model.set_base(kept.fold)
            client_model.load(kept.factors, rnd)
            # FS derives the split from the text before the first "_" and the metric from the text after
            # "<split>_", so the protocol goes in front: local.test_acc, local.test_total, ...
            metrics.update({f"local.{key}": value for key, value in self.splits().items()})
            outcomes["local"] = self.take_outcomes()
            if refit:
                metrics.update({f"local.refit.{key}": value for key, value in self.refit_splits().items()})
                outcomes["local.refit"] = self.take_outcomes()
        if method.cfg.records.save_outcomes:
            append_outcomes(self.cfg.outdir, outcomes, rnd, client)
        metrics, empty = without_empty_splits(metrics)
        if empty:
            logger.warning(f"[fedpa] client #{client}: no example in {empty}; those metrics are missing, not 0")
        if untrained:
            kept.forget_drawn()
        return metrics

    def instance_mix(self, split: int, device: torch.device, rnd: int, client: int):
        """FedDPA's test time on the loaded ``([B_g, B_l], [A_g; A_l])`` (``B_g`` of rank ``split``): before every
        evaluation forward, each input's weight g of the global adapter from its representation and those of
        ``INSTANCES`` of this client's training inputs drawn for it, all under the personal adapter alone
        (:func:`fs_fedpa.core.instance.instance_weights`), drawn from a stream of the run's seed, round ``rnd``
        and ``client``. Returns the function that takes the hooks off."""
        gate = lora.RowGate(self.model, split)
        train = self.trainer.ctx.data["train"]  # FS's DataLoader of this client's training split
        stream = torch.Generator().manual_seed(self.method.seed * 1_000_003 + rnd * 1_009 + client)
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

        self.instance_weights = []
        handle = self.model.register_forward_pre_hook(weigh, with_kwargs=True)

        def undo() -> None:
            handle.remove()
            gate.remove()
            if self.instance_weights:
                g = torch.cat(self.instance_weights)
                logger.info(
                    f"[fedpa] client #{client}, round {rnd}: FedDPA's weight of the global adapter over "
                    f"{len(g)} inputs: mean {float(g.mean()):.3f}, min {float(g.min()):.3f}, max {float(g.max()):.3f}"
                )

        return undo

    def _representation(self, gate: lora.RowGate, inputs: dict[str, Tensor], device: torch.device) -> Tensor:
        """(batch, hidden) under the personal adapter alone (:func:`fs_fedpa.core.instance.representation`)."""
        inputs = {k: v.to(device) for k, v in inputs.items()}
        return representation(self.model, gate, inputs, classifier=self.cfg.trainer.type == "seqcls")

    def take_outcomes(self) -> dict[str, str]:
        """The last evaluation's per-example outcomes (:class:`SeqClsTrainer`), split -> "0110..."; cleared."""
        taken = getattr(self.trainer, "outcomes", None) or {}
        self.trainer.outcomes = {}
        return {split: "".join("1" if c else "0" for c in correct.tolist()) for split, correct in taken.items()}

    def refit_splits(self) -> dict:
        """:meth:`splits` with the classifier head refitted on this client's whole training split under the loaded
        adapter (:func:`fs_fedpa.core.head_refit.fit_softmax_head`, no DP) and put back after."""
        ctx = self.trainer.ctx
        head = head_refit.head_of(self.model, self.cfg.personalization.local_param)
        train = ctx.data["train"]  # FS's DataLoader; its records in order, whatever its sampler
        size, n = max(1, self.cfg.dataloader.batch_size), len(train.dataset)
        if n == 0:
            logger.warning("[fedpa] a client without training records: no head to refit, no refit.* scores")
            return {}
        batches = (train.collate_fn([train.dataset[i] for i in range(j, min(j + size, n))]) for j in range(0, n, size))
        forward = lambda features, labels: self.trainer._forward_loss(ctx, features, labels)  # noqa: E731
        was_training = self.model.training
        self.model.eval()
        try:
            with resume.fork_rng():
                X, y = head_refit.head_inputs(head, batches, forward)
        finally:
            self.model.train(was_training)
        W, b = head_refit.fit_softmax_head(X, y, head.out_features)
        with head_refit.swapped(head, W, b):
            return self.splits()

    def splits(self) -> dict:
        """FS's evaluation of the loaded model on every split of ``eval.split``, merged."""
        metrics = {}
        with resume.fork_rng():  # evaluations never shift the random stream of training
            for split in self.cfg.eval.split:
                metrics.update(**self.trainer.evaluate(target_data_split_name=split))
        return metrics

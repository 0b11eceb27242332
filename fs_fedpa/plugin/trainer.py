"""The alignment term and the training counts as FS train hooks: they work with FS-LLM's stock ``llmtrainer`` and
any trainer built on ``GeneralTorchTrainer`` (the plugin's classification trainer included).

The alignment hook runs last in ``on_batch_forward``, after FS has set ``ctx.loss_task`` (task loss plus any
FS regularizer), and adds the client's lam/2 * penalty to it. It is registered for training only:
evaluation forwards never pay for, nor report, the penalty.
"""

from __future__ import annotations

from federatedscope.core.trainers.context import CtxVar
from federatedscope.core.trainers.enums import LIFECYCLE


def install_alignment_hook(trainer, alignment) -> None:
    """Register ``alignment.term(ctx)`` (:class:`~fs_fedpa.plugin.alignment.Alignment`) as an additive loss term in
    ``trainer``'s training hooks."""

    def _hook_on_batch_forward_fedpa_alignment(ctx):
        term = alignment.term(ctx)
        if term is not None:
            ctx.loss_task = CtxVar(ctx.loss_task + term, LIFECYCLE.BATCH)

    trainer.register_hook_in_train(new_hook=_hook_on_batch_forward_fedpa_alignment, trigger="on_batch_forward")


def install_counter_hook(trainer, counter) -> None:
    """Count each training batch in ``counter`` (:class:`~fs_fedpa.systems.TrainCounter`) at the batch's end."""

    def _hook_on_batch_end_fedpa_count(ctx):
        counter.count(ctx.get("data_batch"), ctx.get("batch_size"))

    trainer.register_hook_in_train(new_hook=_hook_on_batch_end_fedpa_count, trigger="on_batch_end", insert_pos=0)


def install_moments_hook(trainer, kept) -> None:
    """``fedpa.keep_moments``: after FS builds the routine's optimizer (``on_fit_start``), put the client's kept
    optimizer state into it (``kept.moments``, :class:`~fs_fedpa.core.moments.KeptMoments`, by parameter name); at
    the routine's end take it back. ``kept``: the client's :class:`~fs_fedpa.plugin.client_state.ClientState`."""

    def _hook_on_fit_start_fedpa_moments(ctx):
        kept.moments.restore(ctx.optimizer, dict(ctx.model.named_parameters()))

    def _hook_on_fit_end_fedpa_moments(ctx):
        kept.moments.save(ctx.optimizer, dict(ctx.model.named_parameters()))

    trainer.register_hook_in_train(new_hook=_hook_on_fit_start_fedpa_moments, trigger="on_fit_start")
    trainer.register_hook_in_train(new_hook=_hook_on_fit_end_fedpa_moments, trigger="on_fit_end", insert_pos=0)

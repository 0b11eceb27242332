"""The client's alignment term during training: lam/2 * ||Delta W_i - B_g,i A_g,i||_F^2 (the method's form of
it) toward the round's reference, with the adaptive lam of Appendix F. :class:`Alignment` is a collaborator of
:class:`~fs_fedpa.plugin.client.FedPAClient` that owns the round's reference, lam and the term's running sum; the
trainer calls :meth:`Alignment.term` at every step (:func:`fs_fedpa.plugin.trainer.install_alignment_hook`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from fs_fedpa.core.adaptive import lam_direction, lam_grad, lam_loss, normalized_factor_grads
from fs_fedpa.core.diagnostics import GradientSplit
from fs_fedpa.core.penalty import product_penalty

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only

Pairs = dict[str, tuple[Tensor, Tensor]]


class Alignment:
    """One client's alignment term. ``method`` gives the term's form and ``fedpa`` config; :attr:`grads` splits the
    factors' gradient between the term and the task loss for the diagnostics (``watched`` says whether it does).
    ``penalty_weight`` is the client's lam/s_bar^2 factor (:meth:`fs_fedpa.lora.ClientSpace.penalty_weight`), set
    when its space is known."""

    def __init__(self, method, watched: bool):
        self.method, self.watched = method, watched
        self.grads = GradientSplit()
        self.penalty_weight = 1.0
        self.reference: Pairs = {}  # X_g,i: the received rank-R_i reference, client space, on the model's device
        self.live: Pairs = {}  # the model's trainable factors the term is computed on
        self.lam = method.cfg.lam
        self.lam_pending = False  # adaptive lam: set from the round's first mini-batch
        self.penalty_sum: Tensor | None = None
        self.penalty_steps = 0

    def start_round(self, live: Pairs, reference: Pairs) -> None:
        """A new round toward ``reference`` on the factors ``live``: lam back to ``fedpa.lam`` (the adaptive rule
        resets it at the first batch), the running sum to zero."""
        self.live, self.reference = live, reference
        self.lam = self.method.cfg.lam
        self.lam_pending = self.method.cfg.adaptive_lam != "none"
        self.penalty_sum, self.penalty_steps = None, 0
        if self.watched:
            self.grads.watch(live)

    def clear(self) -> None:
        """Drop the round's tensors (the client's state is parked, or the run is over)."""
        self.reference, self.live = {}, {}

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No term inside the block (FedDPA's personal phase trains without it)."""
        reference, self.reference = self.reference, {}
        try:
            yield
        finally:
            self.reference = reference

    def mean(self) -> float:
        """The round's mean of the term over the steps that computed it (0 without one)."""
        return float(self.penalty_sum) / self.penalty_steps if self.penalty_steps else 0.0

    def term(self, ctx) -> Tensor | None:
        """lam/2 * sum of the method's alignment term over LoRA modules, for the trainer hook (train only)."""
        self.grads.end_step()  # the previous step's backward is complete
        if not self.reference:
            return None
        if self.lam_pending and not getattr(ctx, "skip_this_batch", False):
            self.lam = self._adaptive_lam(ctx.loss_batch)
            self.lam_pending = False
            self.grads.discard()  # the probe's autograd.grad is not a training step
        live = self.grads.alias(self.live) if self.method.cfg.records.full else self.live
        if "alignment" not in self.method.uses:
            return None
        term = self.method.alignment(live, self.reference, self.lam * self.penalty_weight)
        if term is not None:
            value = term.detach()
            self.penalty_sum = value if self.penalty_sum is None else self.penalty_sum + value
            self.penalty_steps += 1
        return term

    def _adaptive_lam(self, task_loss: Tensor) -> float:
        """lam_i^(t) from the first mini-batch of the round (Appendix F)."""
        cfg = self.method.cfg
        if cfg.adaptive_lam == "loss":
            return lam_loss(task_loss.detach(), cfg.lam, cfg.adaptive_alpha)
        Bs = [B for B, _ in self.live.values()]
        As = [A for _, A in self.live.values()]
        g_f = normalized_factor_grads(*_grads(task_loss, Bs, As), Bs, As)
        penalty = torch.stack([product_penalty(B, A, *self.reference[n]) for n, (B, A) in self.live.items()]).sum()
        if cfg.adaptive_lam == "grad":
            return lam_grad(g_f.norm(), penalty.detach().sqrt(), cfg.adaptive_alpha, cfg.lam_min, cfg.lam_max)
        g_r = normalized_factor_grads(*_grads(penalty, Bs, As), Bs, As)
        return lam_direction(g_f, g_r, cfg.lam)


def _grads(loss: Tensor, Bs: list[Tensor], As: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    grads = torch.autograd.grad(loss, Bs + As, retain_graph=True, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, Bs + As)]
    return grads[: len(Bs)], grads[len(Bs) :]

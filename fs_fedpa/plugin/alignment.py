"""The client's alignment term during training: lam/2 * ||Delta W_i - B_g,i A_g,i||_F^2 (the method's form of
it) toward the round's reference, with the adaptive lam of Appendix F. :class:`Alignment` is a collaborator of
:class:`~fs_fedpa.plugin.client.FedPAClient` that owns the round's reference and lam; the trainer calls
:meth:`Alignment.term` at every step (:func:`fs_fedpa.plugin.trainer.install_alignment_hook`). FedPA-LoRA's product
penalty trains batched by shape with its gradient in closed form (:class:`~fs_fedpa.core.batched_penalty.ProductTerm`);
other forms through the method's :meth:`~fs_fedpa.methods.base.FederatedMethod.alignment` and autograd."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from fs_fedpa.core.adaptive import lam_direction, lam_grad, lam_loss, normalized_factor_grads
from fs_fedpa.core.batched_penalty import ProductTerm
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
        self.reference: Pairs = {}  # X_g,i / s_i: the rank-R_i reference in the model's frame, on its device
        self.live: Pairs = {}  # the model's trainable factors the term is computed on
        self.batched: ProductTerm | None = None  # the product penalty of the round, batched by shape
        self.lam = method.cfg.lam
        self.lam_pending = False  # adaptive lam: set from the round's first mini-batch
        self.penalty_steps = 0  # the round's steps that trained with the term
        # FedPA-LoRA's product penalty, batched: a property of the method's config, asked once
        self.product = "alignment" in method.uses and method.product_alignment()

    def start_round(self, live: Pairs, reference: Pairs) -> None:
        """A new round toward ``reference`` on the factors ``live``: lam back to ``fedpa.lam`` (the adaptive rule
        resets it at the first batch), no step taken yet."""
        self.release()
        self.live, self.reference = live, reference
        self.lam = self.method.cfg.lam
        self.lam_pending = self.method.cfg.adaptive_lam != "none"
        self.penalty_steps = 0
        if self.watched:
            self.grads.watch(live)
        if reference and self.product:
            self.batched = ProductTerm(live, reference, self.grads.add_alignment if self.watched else None)

    def release(self) -> None:
        """The batched term's hold on the factors' storage let go."""
        if self.batched is not None:
            self.batched.release()
            self.batched = None

    def clear(self) -> None:
        """Drop the round's tensors (the client's state is parked, or the run is over)."""
        self.release()
        self.reference, self.live = {}, {}

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No term inside the block (FedDPA's personal phase trains without it)."""
        reference, self.reference = self.reference, {}
        try:
            yield
        finally:
            self.reference = reference

    def value(self) -> float:
        """lam/2 * the method's alignment term now, on the factors as trained (the round's end); 0 where no step
        trained with it. FedPA-LoRA's product penalty from QR factors in float64 (accurate near convergence)."""
        if not self.penalty_steps:
            return 0.0
        weight = self.lam * self.penalty_weight
        if self.batched is not None:
            return self.batched.value(0.5 * weight)
        with torch.no_grad():
            term = self.method.alignment(self.live, self.reference, weight)
        return 0.0 if term is None else float(term)

    def term(self, ctx) -> Tensor | None:
        """lam/2 * sum of the method's alignment term over LoRA modules, for the trainer hook (train only)."""
        if self.watched:
            self.grads.end_step()  # the previous step's backward is complete
        if not self.reference:
            return None
        if self.lam_pending and not getattr(ctx, "skip_this_batch", False):
            self.lam = self._adaptive_lam(ctx.loss_batch)
            self.lam_pending = False
            if self.watched:
                self.grads.discard()  # the probe's autograd.grad is not a training step
        if "alignment" not in self.method.uses:
            return None
        if self.batched is not None:
            coef = 0.5 * self.lam * self.penalty_weight
            term = self.batched(coef) if coef != 0 else None
        else:
            live = self.grads.alias(self.live) if self.watched else self.live
            term = self.method.alignment(live, self.reference, self.lam * self.penalty_weight)
        if term is not None:
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

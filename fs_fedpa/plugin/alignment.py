"""The client's alignment term during training: lam/2 * ||Delta W_i - B_g,i A_g,i||_F^2 (the method's form of
it) toward the round's reference, with the adaptive lam of Appendix F. :class:`ClientAlignment` is a mixin of
:class:`~fs_fedpa.plugin.client.FedPAClient`; the trainer calls :meth:`ClientAlignment.alignment_term` at every
step (:func:`fs_fedpa.plugin.trainer.install_alignment_hook`)."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from fs_fedpa.core.adaptive import lam_direction, lam_grad, lam_loss, normalized_factor_grads
from fs_fedpa.core.penalty import product_penalty

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


class ClientAlignment:
    """Needs ``reference``, ``_live``, ``lam``, ``_lam_pending``, ``_penalty_sum``, ``_penalty_steps`` and
    ``_grads``, set by the client when it enters a round."""

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


def _grads(loss: Tensor, Bs: list[Tensor], As: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    grads = torch.autograd.grad(loss, Bs + As, retain_graph=True, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, Bs + As)]
    return grads[: len(Bs)], grads[len(Bs) :]

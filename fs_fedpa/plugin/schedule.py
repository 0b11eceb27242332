"""``fedpa.lr_schedule``: one learning-rate schedule over the federated run (:mod:`fs_fedpa.core.schedule`) as an FS
train hook, for any trainer built on ``GeneralTorchTrainer``, with or without DP-SGD."""

from __future__ import annotations

import logging
import math

from fs_fedpa.core.schedule import lr_factor

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only
_ANNOUNCED: set[tuple] = set()


class RunSchedule:
    """Sets every parameter group's learning rate before each training step to ``train.optimizer.lr`` times
    :func:`~fs_fedpa.core.schedule.lr_factor` of the global step ``t * tau + k``: round t (the server's, so every
    client follows one schedule), the routine's k-th step, tau the steps a routine takes (``local_update_steps``
    batches, or that many epochs of batches). The run spans ``fedpa.dp.horizon`` rounds when set, so that a shorter
    tuning run follows the full run's schedule, else ``federate.total_round_num``."""

    def __init__(self, trainer, cfg):
        fedpa = cfg.fedpa
        self.kind, self.warmup = fedpa.lr_schedule, int(fedpa.lr_warmup_steps)
        self.base = float(cfg.train.optimizer.lr)
        self.horizon = int(fedpa.dp.horizon or cfg.federate.total_round_num)
        self.cfg, self.round, self.k = cfg, 0, 0
        if (key := (self.kind, self.warmup, self.horizon, self.base)) not in _ANNOUNCED:
            _ANNOUNCED.add(key)
            logger.info(
                f"[fedpa] learning rate: {self.kind} schedule over {self.horizon} rounds of tau steps (global step "
                f"t * tau + k), {self.warmup} steps of warm-up, peak {self.base:g}"
            )
        trainer.register_hook_in_train(new_hook=self._hook_on_fit_start_schedule, trigger="on_fit_start")
        trainer.register_hook_in_train(new_hook=self._hook_on_batch_start_schedule, trigger="on_batch_start",
                                       insert_pos=0)  # fmt: skip

    def new_round(self, rnd: int) -> None:
        """Called when the client enters round ``rnd``."""
        self.round = int(rnd)

    def tau(self, n: int) -> int:
        """Steps a routine takes on ``n`` training records."""
        cfg = self.cfg
        if cfg.train.batch_or_epoch == "batch":
            return int(cfg.train.local_update_steps)
        b = max(1, min(int(cfg.dataloader.batch_size), n))
        per_epoch = n // b if cfg.dataloader.drop_last else math.ceil(n / b)
        return int(cfg.train.local_update_steps) * max(per_epoch, 1)

    def lr(self, step: int, n: int) -> float:
        return self.base * lr_factor(step, self.horizon * self.tau(n), self.warmup, self.kind)

    def _hook_on_fit_start_schedule(self, ctx):
        self.k = 0

    def _hook_on_batch_start_schedule(self, ctx):
        n = int(ctx.get("num_train_data") or 1)
        lr = self.lr(self.round * self.tau(n) + self.k, n)
        for group in ctx.optimizer.param_groups:
            group["lr"] = lr
        self.k += 1

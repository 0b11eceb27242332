"""A learning-rate schedule over the whole federated run, in plain torch-free Python.

FS builds a new optimizer and scheduler at every training routine, so its schedulers restart each round. Private
training wants one schedule over the run (a warm-up while the fresh head is far off, then constant or a cosine
decay), indexed by the global step ``t * tau + k`` of round t's k-th local step, the same for every client whatever
rounds it trained in.
"""

from __future__ import annotations

import math

SCHEDULES = ("none", "constant", "cosine")


def lr_factor(step: int, total: int, warmup: int, kind: str) -> float:
    """The multiplier of the base learning rate at 0-based global ``step`` of ``total``: ``(step + 1) / warmup`` for
    the first ``warmup`` steps, then 1 (``"constant"``) or ``(1 + cos(pi * (step - warmup) / (total - warmup))) / 2``
    (``"cosine"``, reaching 0 at ``total``); 1 throughout for ``"none"``. Steps past ``total`` keep the last value."""
    if kind not in SCHEDULES:
        raise ValueError(f"learning-rate schedule {kind!r} must be one of {SCHEDULES}")
    if kind == "none":
        return 1.0
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    done = min(step - warmup, total - warmup) / (total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * done))

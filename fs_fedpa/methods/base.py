"""The small interface every federated LoRA method implements, and the registry of methods.

All factors here are *effective*: ``(s B, A)`` with PEFT's scaling folded into B, so that the
product is the update the model applies (see ``fs_fedpa.lora``). A method decides:

- ``init_global``: the server's factors before round 1 (Alg. 1 l.2);
- ``client_init``: what a client starts from when it has no factors yet (Alg. 1 l.4);
- ``keeps`` / ``start_round``: which factors a client keeps from its last round, and what it takes
  from what it received; ``trainable``: which factors it trains this round;
- ``before_upload``: what it makes of its factors before sending them (e.g. a rotation);
- ``aggregate``: what the server makes of the uploads;
- ``downlink``: what the server sends to one client;
- ``alignment``: the extra loss term of local training, if any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from fs_fedpa.config import FedPAConfig
from fs_fedpa.core.ranks import RankPlan, init_global_factors, truncate_factors

Factors = dict[str, tuple[Tensor, Tensor]]

METHODS: dict[str, type[FederatedMethod]] = {}


class FederatedMethod:
    """Defaults shared by the methods; a method overrides what differs."""

    name: ClassVar[str] = ""
    keeps: ClassVar[tuple[bool, bool]] = (False, False)  # (B, A) kept from the client's previous round

    def __init__(self, cfg: FedPAConfig, plan: RankPlan):
        self.cfg = cfg
        self.plan = plan
        self.check_plan()

    def check_plan(self) -> None:
        """Raise ValueError if the rank plan does not suit the method (default: any plan)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            if cls.name in METHODS:
                raise ValueError(f"federated method {cls.name!r} is registered twice")
            METHODS[cls.name] = cls

    # ------------------------------------------------------------------ server
    def init_global(self, shapes: dict[str, tuple[int, int]], generator: torch.Generator) -> Factors:
        """Rank-r_g global factors: B = 0, A Kaiming-uniform as PEFT (Alg. 1 l.2). ``shapes[name] = (d, k)``."""
        return {name: init_global_factors(d, k, self.plan.r_g, generator=generator) for name, (d, k) in shapes.items()}

    def aggregate(
        self, uploads: Sequence[Factors], weights: Sequence[float], clients: Sequence[int], generator: torch.Generator
    ) -> tuple[Factors, dict[str, Tensor]]:
        """New global factors and, per module, the aggregate's singular values (may be empty)."""
        raise NotImplementedError

    def downlink(self, global_: Factors, client: int) -> Factors:
        """What the server sends client ``client`` (0-based index)."""
        return {n: truncate_factors(B, A, self.plan.reference_ranks[client]) for n, (B, A) in global_.items()}

    # ------------------------------------------------------------------ client
    def client_init(self, global_init: Factors, client: int) -> Factors:
        """A new client's factors: the first r_i columns of B_g and rows of A_g (Alg. 1 l.4)."""
        return {n: truncate_factors(B, A, self.plan.client_ranks[client]) for n, (B, A) in global_init.items()}

    def start_round(self, received: Factors, client: int) -> Factors:
        """Factors a client that does not keep its own trains from: the received ones at its rank r_i."""
        return {n: truncate_factors(B, A, self.plan.client_ranks[client]) for n, (B, A) in received.items()}

    def trainable(self, rnd: int) -> tuple[bool, bool]:
        """Whether (B, A) are trained in round ``rnd``."""
        return True, True

    def before_upload(self, local: Factors, received: Factors, rnd: int) -> Factors:
        """The factors a client uploads, from its trained ones and what it received this round."""
        return local

    def alignment(self, local: Factors, reference: Factors, lam: float) -> Tensor | None:
        """Extra local loss for factors ``local`` (live parameters) and a fixed ``reference``; None for none."""
        return None


def get_method(name: str) -> type[FederatedMethod]:
    import importlib
    import pkgutil

    import fs_fedpa.methods as package

    for module in pkgutil.iter_modules(package.__path__):  # each method module registers itself
        importlib.import_module(f"fs_fedpa.methods.{module.name}")

    if name not in METHODS:
        raise ValueError(f"unknown federated method {name!r}; known: {sorted(METHODS)}")
    return METHODS[name]

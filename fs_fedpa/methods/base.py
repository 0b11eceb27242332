"""The small interface every federated LoRA method implements, and the registry of methods.

All factors here are *effective*: ``(s B, A)`` with PEFT's scaling folded into B, so that the
product is the update the model applies (see ``fs_fedpa.lora``). A method decides:

- ``init_global``: the server's factors before round 1 (Alg. 1 l.2);
- ``client_init``: what a client starts from when it has no factors yet (Alg. 1 l.4);
- ``keeps_factors`` / ``start_round``: whether a client trains on from its own factors, or from
  what (given what) it received;
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
    keeps_factors: ClassVar[bool] = False

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

    def alignment(self, local: Factors, reference: Factors, lam: float) -> Tensor | None:
        """Extra local loss for factors ``local`` (live parameters) and a fixed ``reference``; None for none."""
        return None


def get_method(name: str) -> type[FederatedMethod]:
    import fs_fedpa.methods.fedit  # noqa: F401  (each module registers its method)
    import fs_fedpa.methods.fedpa  # noqa: F401
    import fs_fedpa.methods.flexlora  # noqa: F401

    if name not in METHODS:
        raise ValueError(f"unknown federated method {name!r}; known: {sorted(METHODS)}")
    return METHODS[name]

"""FedPA-LoRA: local factor preservation, product-guided alignment, product-space aggregation.

Clients keep their own (B_i, A_i) across rounds (§4.1) and add lam/2 ||B_i A_i - B_g,i A_g,i||_F^2
toward a rank-R_i reference (§4.2); the server reconstructs the optimal rank-R_g factors of
sum_i w_i B_i A_i without forming it (§4.3, Algorithm 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Generator, Tensor

from fs_fedpa.core.penalty import regularizer
from fs_fedpa.core.reconstruct import reconstruct_adapter
from fs_fedpa.methods.base import Factors, FederatedMethod, Uploads


class FedPA(FederatedMethod):
    name = "fedpa"
    uses = frozenset({"alignment"})
    dp_space = "product"

    def start_round(self, received: Factors, own: Factors, client: int, rnd: int) -> Factors:
        return own  # §4.1: local factor preservation; the received factors are only the reference

    def aggregate(
        self, uploads: Uploads, weights: Sequence[float], clients: Sequence[int], generator: Generator, rnd: int = 0
    ) -> tuple[Factors, dict[str, Tensor]]:
        return reconstruct_adapter(
            uploads,
            self.plan.R_g,
            weights=weights,
            mode=self.cfg.svd,
            oversample=self.cfg.oversample,
            generator=generator,
            return_spectrum=True,
        )

    def product_alignment(self) -> bool:
        return self.cfg.reg == "product"

    def alignment(self, local: Factors, reference: Factors, lam: float) -> Tensor | None:
        if self.cfg.reg == "none" or lam == 0:
            return None
        terms = [regularizer(self.cfg.reg, B, A, *reference[name]) for name, (B, A) in local.items()]
        return 0.5 * lam * torch.stack(terms).sum()

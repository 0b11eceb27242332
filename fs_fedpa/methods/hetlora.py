"""HetLoRA [Cho et al., 2024]: heterogeneous ranks by zero-padding every upload to the largest rank, factor-wise
averaging, and truncation back to each client's rank. Paper: arxiv.org/abs/2401.06432 (its rank
self-pruning and sparsity-weighted aggregation are not implemented here)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fs_fedpa.core.factorwise import average_factors
from fs_fedpa.core.ranks import truncate_factors
from fs_fedpa.methods.base import Factors, FederatedMethod


class HetLoRA(FederatedMethod):
    name = "hetlora"

    def aggregate(
        self, uploads: Sequence[Factors], weights: Sequence[float], clients: Sequence[int], generator: torch.Generator
    ) -> tuple[Factors, dict[str, Tensor]]:
        r_max = self.plan.r_g
        padded = [{n: truncate_factors(B, A, r_max) for n, (B, A) in u.items()} for u in uploads]
        return average_factors(padded, weights), {}

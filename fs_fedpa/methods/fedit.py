"""FedIT [Zhang et al., 2024]: clients start from the global factors; the server averages B and A separately.
Paper: arxiv.org/abs/2305.05644 (FS-LLM's FedAvg with LoRA is the same rule)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Generator, Tensor

from fs_fedpa.core.factorwise import average_factors
from fs_fedpa.methods.base import Factors, FederatedMethod, Uploads


class FedIT(FederatedMethod):
    name = "fedit"
    dp_space = "change"

    def check_plan(self) -> None:
        if len(set(self.plan.client_ranks)) > 1:
            raise ValueError(
                f"federate.method {self.name} averages factors, so every client needs the same rank; got client_ranks "
                f"{list(self.plan.client_ranks)} (use fedpa or flexlora for heterogeneous ranks)"
            )

    def aggregate(
        self, uploads: Uploads, weights: Sequence[float], clients: Sequence[int], generator: Generator, rnd: int = 0
    ) -> tuple[Factors, dict[str, Tensor]]:
        return average_factors(uploads, weights), {}

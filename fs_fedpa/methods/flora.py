"""FLoRA [Wang et al., NeurIPS 2024]: the server stacks the clients' factors, ``[w_1 B_1, ..., w_N B_N]`` and
``[A_1; ...; A_N]``, whose product is ``sum_i w_i Delta W_i`` exactly at global rank ``sum_i r_i``; every worker
merges the stack into its frozen base weights, and every client starts each round from a fresh LoRA (B = 0, A drawn
as PEFT does). Paper: arxiv.org/abs/2409.05976; authors' code: ziyaow1010/FederatedLLM.

The downlink is the stacked adapter; no global adapter remains after the merge, so none is sent (the reference is 0).
Ranks may differ per client; weights are the clients' local data sizes, as in the authors' code.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Generator, Tensor

from fs_fedpa.core.factorwise import stack_factors
from fs_fedpa.core.ranks import fresh_factors
from fs_fedpa.methods.base import Factors, FederatedMethod, Uploads
from fs_fedpa.methods.flexlora import FlexLoRA


class FLoRA(FederatedMethod):
    name = "flora"
    uses = frozenset({"merge"})
    weights = FlexLoRA.weights

    def aggregate(
        self, uploads: Uploads, weights: Sequence[float], clients: Sequence[int], generator: Generator, rnd: int = 0
    ) -> tuple[Factors, dict[str, Tensor]]:
        """Zero global factors of rank r_g: the round's update lives in the merge."""
        r_g = self.plan.r_g
        return {
            n: (B.new_zeros(B.shape[0], r_g), A.new_zeros(r_g, A.shape[1])) for n, (B, A) in uploads[0].items()
        }, {}

    def merge(self, uploads: Sequence[Factors], weights: Sequence[float], global_: Factors) -> Factors:
        return {name: stack_factors([u[name] for u in uploads], weights) for name in uploads[0]}

    def downlink(self, global_: Factors, client: int) -> Factors:
        return {}

    def start_round(self, received: Factors, own: Factors, client: int, rnd: int) -> Factors:
        """A fresh LoRA at rank r_i: B = 0, A Kaiming-uniform from the worker's random stream, as PEFT draws it."""
        return fresh_factors(own, self.plan.client_ranks[client])

"""FedSA-LoRA [Guo et al., 2025]: A is shared and averaged, B stays with each client (it carries the
client-specific knowledge). Paper: arxiv.org/abs/2410.01463

Each round a client trains its own B with the freshly averaged A and uploads A only (the authors' code lists
``lora_B`` in ``personalization.local_param``), so the server's B stays at its initialisation and the E_agg of
this method describes nothing. Evaluation pairs the client's own B with the global A, the model the client holds.
"""

from __future__ import annotations

from fs_fedpa.core.ranks import truncate_factors
from fs_fedpa.methods.base import Factors
from fs_fedpa.methods.fedit import FedIT


class FedSALoRA(FedIT):
    name = "fedsa_lora"
    dp_space = "change"

    def upload_parts(self, rnd: int) -> tuple[str, ...]:
        return ("A",)

    def start_round(self, received: Factors, own: Factors, client: int, rnd: int) -> Factors:
        return _own_B_global_A(received, own, self.plan.client_ranks[client])

    def evaluation_factors(self, received: Factors, own: Factors, client: int, personal=None) -> Factors:
        return _own_B_global_A(received, own, self.plan.client_ranks[client])


def _own_B_global_A(received: Factors, own: Factors, r_i: int) -> Factors:
    return {n: (own[n][0], truncate_factors(B, A, r_i)[1]) for n, (B, A) in received.items()}

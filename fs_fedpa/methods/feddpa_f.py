"""FedDPA-F [Yang et al., NeurIPS 2024]: FedDPA-T (``fs_fedpa.methods.feddpa_t``) except that the personal adapter
restarts every round from the freshly received global adapter (at the client's rank r_i) instead of continuing its
own trajectory, as the FedPA-LoRA paper describes the two variants. The authors' code has no switch for this
variant; this is the paper's reading.
"""

from __future__ import annotations

from fs_fedpa.core.ranks import truncate_factors
from fs_fedpa.methods.base import Factors
from fs_fedpa.methods.feddpa_t import FedDPAT


class FedDPAF(FedDPAT):
    name = "feddpa_f"

    def personal_start(self, received: Factors, personal: Factors | None, client: int, rnd: int) -> Factors | None:
        if rnd == 0:
            return None
        r_i = self.plan.client_ranks[client]
        return {n: truncate_factors(B, A, r_i) for n, (B, A) in received.items()}

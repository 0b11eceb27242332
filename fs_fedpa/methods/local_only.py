"""Local training only, the reference line below every federated method: each client trains its own (B_i, A_i) and
head from the shared initialisation and never uses what the server sends; the paper protocol evaluates its own
factors. The workers still exchange the usual messages (the server's factor average is computed and ignored), so
the bytes reported for this method are not a cost of it."""

from __future__ import annotations

from fs_fedpa.methods.base import Factors
from fs_fedpa.methods.fedit import FedIT


class LocalOnly(FedIT):
    name = "local_only"

    def start_round(self, received: Factors, own: Factors, client: int, rnd: int) -> Factors:
        return own

    def evaluation_factors(self, received: Factors, own: Factors, client: int, personal=None) -> Factors:
        return own

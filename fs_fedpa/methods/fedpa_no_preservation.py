"""Ablation of FedPA-LoRA (Table 5, "w/o local preservation"): the same alignment and server, but clients
restart every round from the rank-r_i truncation of the global reference instead of their own factors."""

from __future__ import annotations

from fs_fedpa.methods.base import Factors, FederatedMethod
from fs_fedpa.methods.fedpa import FedPA


class FedPANoPreservation(FedPA):
    name = "fedpa_no_preservation"

    def start_round(self, received: Factors, own: Factors, client: int, rnd: int) -> Factors:
        return FederatedMethod.start_round(self, received, own, client, rnd)

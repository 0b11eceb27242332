"""Ablation of FedPA-LoRA (Table 5, "w/o local preservation"): the same alignment and server, but clients
restart every round from the rank-r_i truncation of the global reference instead of their own factors."""

from __future__ import annotations

from fs_fedpa.methods.fedpa import FedPA


class FedPANoPreservation(FedPA):
    name = "fedpa_no_preservation"
    keeps = (False, False)

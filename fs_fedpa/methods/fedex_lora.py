"""FedEx-LoRA [Singhal et al., 2025]: FedIT's factor-wise averages, plus the residual
``sum_i w_i Delta W_i - B_bar A_bar`` folded into every worker's frozen base weights each round, so the global model
carries the average of the clients' updates exactly. Paper: arxiv.org/abs/2410.09432; authors' code:
RaghavSinghal10/fedex-lora.

The residual travels as the dense d x k matrix, as in the paper: its downlink costs what full fine-tuning's does,
and the bytes recorded per round say so. Clients restart from (B_bar, A_bar) every round, as in FedIT; every client
needs the same rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fs_fedpa.core.factorwise import stack_factors
from fs_fedpa.methods.base import Factors
from fs_fedpa.methods.fedit import FedIT


class FedExLoRA(FedIT):
    name = "fedex_lora"
    uses = frozenset({"merge"})
    merge_encoding = "dense"

    def merge(self, uploads: Sequence[Factors], weights: Sequence[float], global_: Factors) -> Factors:
        """Per module ``([w_1 B_1, ..., w_N B_N, -B_bar], [A_1; ...; A_N; A_bar])``: the residual as factors of rank
        ``N r + r`` (sent dense)."""
        out = {}
        for name, (B_bar, A_bar) in global_.items():
            B, A = stack_factors([u[name] for u in uploads], weights)
            out[name] = (torch.cat([B, -B_bar], dim=1), torch.cat([A, A_bar], dim=0))
        return out

"""FFA-LoRA [Sun et al., 2024]: A stays frozen at its shared random initialisation; only B is trained and
averaged, which makes factor-wise averaging exact. Paper: arxiv.org/abs/2403.12313"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fs_fedpa.core.factorwise import average_factors
from fs_fedpa.methods.base import Factors
from fs_fedpa.methods.fedit import FedIT


class FFALoRA(FedIT):
    name = "ffa_lora"

    def trainable(self, rnd: int) -> tuple[bool, bool]:
        return True, False

    def aggregate(
        self, uploads: Sequence[Factors], weights: Sequence[float], clients: Sequence[int], generator: torch.Generator
    ) -> tuple[Factors, dict[str, Tensor]]:
        averaged = average_factors(uploads, weights)
        out = {}
        for name, (B, _) in averaged.items():
            A = uploads[0][name][1]  # the frozen initialisation, bit for bit (an average would round it)
            if any(not torch.equal(u[name][1], A) for u in uploads):
                raise ValueError(f"module {name!r}: FFA-LoRA clients uploaded different A; A must stay frozen")
            out[name] = (B, A)
        return out, {}

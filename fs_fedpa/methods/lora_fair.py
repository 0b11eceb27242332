"""LoRA-FAIR [Bian et al., ICCV 2025]: FedIT's factor averages, with the server correcting the averaged B toward
the averaged product: ``B_bar' = B_bar + Delta B*``, Delta B* minimising ``1 - cos(sum_i w_i B_i A_i,
(B_bar + Delta B) A_bar) + lam ||Delta B||_F^2`` (Eq. 8; :func:`fs_fedpa.core.fair.fair_correction`). Clients
load ``(B_bar', A_bar)`` every round ("Avg-Initial"), as in FedIT; bytes are FedIT's. Paper:
arxiv.org/abs/2411.14961; no public code of the authors could be read here.

Choices where the paper is silent (docs/dev/baselines.md lists them): Delta B starts at 0 (FedIT's average), plain
gradient descent with step 0.01 for 1000 steps and lam = 0.01 (the values of the re-implementations; the paper
states lam = 0.01), the cosine of the flattened matrices, the squared norm, the best iterate kept. The problem is
solved on the applied factors ``(s B, A)``; the cosine does not depend on s, the regulariser does (by s^2).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Generator, Tensor

from fs_fedpa.core.factorwise import average_factors
from fs_fedpa.core.fair import fair_correction
from fs_fedpa.methods.base import Factors, Uploads
from fs_fedpa.methods.fedit import FedIT

LAM, STEPS, LR = 0.01, 1000, 0.01


class LoRAFAIR(FedIT):
    name = "lora_fair"

    def aggregate(
        self, uploads: Uploads, weights: Sequence[float], clients: Sequence[int], generator: Generator, rnd: int = 0
    ) -> tuple[Factors, dict[str, Tensor]]:
        averaged = average_factors(uploads, weights)
        groups: dict[tuple, list[str]] = {}  # modules of one shape are solved as one batch
        for name, (B_bar, A_bar) in averaged.items():
            groups.setdefault((B_bar.shape, A_bar.shape, B_bar.device, B_bar.dtype), []).append(name)
        out = {}
        for names in groups.values():
            stacked = [(torch.stack([u[n][0] for n in names]), torch.stack([u[n][1] for n in names])) for u in uploads]
            B_bar = torch.stack([averaged[n][0] for n in names])
            A_bar = torch.stack([averaged[n][1] for n in names])
            B = fair_correction(stacked, weights, B_bar, A_bar, lam=LAM, steps=STEPS, lr=LR)
            out.update({n: (B[j], averaged[n][1]) for j, n in enumerate(names)})
        return {n: out[n] for n in averaged}, {}

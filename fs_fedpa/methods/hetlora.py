"""HetLoRA [Cho et al., EMNLP 2024]: heterogeneous ranks with rank self-pruning and sparsity-weighted aggregation.
Paper: arxiv.org/abs/2401.06432

- Distribution: client k receives the first r_k columns of B_g and rows of A_g (its current rank).
- Local training adds ``lam ||B_k[:, g:]||_F ||A_k[g:, :]||_F`` with ``g = floor(gamma r_k)`` (``fedpa.hetlora.lam``,
  ``fedpa.hetlora.gamma``); after the round a module whose tail shrank below its value at the round's start is
  pruned to rank ``max(1, g)``, for good (self-pruning).
- Aggregation: uploads are zero-padded to r_max and averaged factor-wise with the sparsity weights
  ``p_k = ||B_k A_k||_F / sum_j ||B_j A_j||_F`` (per module, on the applied updates) instead of data sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Generator, Tensor

from fs_fedpa.config_sections import key
from fs_fedpa.core.factorwise import average_factors
from fs_fedpa.core.norms import factored_norm
from fs_fedpa.core.ranks import truncate_factors
from fs_fedpa.methods.base import Factors, FederatedMethod, Uploads
from fs_fedpa.values import number


def tail_norm(B: Tensor, A: Tensor, gamma: float) -> Tensor:
    """``||B[:, g:]||_F ||A[g:, :]||_F`` with ``g = floor(gamma r)``: HetLoRA's self-pruning quantity (0 if empty)."""
    g = math.floor(gamma * B.shape[-1])
    return torch.linalg.vector_norm(B[..., g:]) * torch.linalg.vector_norm(A[..., g:, :])


@dataclass
class HetLoRAOptions:
    """``fedpa.hetlora``."""

    gamma: float = key(
        0.99,
        "HetLoRA's rank decay gamma in (0, 1): the penalised tail is every rank index >= floor(gamma r), and "
        "self-pruning cuts a module's rank to max(1, floor(gamma r))",
        was="hetlora_gamma",
    )
    lam: float = key(
        0.01,
        "HetLoRA's self-pruning weight: lam * ||B[:, floor(gamma r):]||_F ||A[floor(gamma r):, :]||_F is added to "
        "the local loss (>= 0; 0 turns self-pruning off)",
        was="hetlora_lam",
    )

    def __post_init__(self) -> None:
        self.gamma = number(self.gamma, "hetlora.gamma", minimum=0.0)
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"fedpa.hetlora.gamma(={self.gamma}) must be in (0, 1)")
        self.lam = number(self.lam, "hetlora.lam", minimum=0.0)


class HetLoRA(FederatedMethod):
    name = "hetlora"
    options = HetLoRAOptions
    uses = frozenset({"alignment", "end_round"})

    def __init__(self, cfg, plan, seed=None):
        super().__init__(cfg, plan, seed)
        self.current = list(plan.client_ranks)  # server: each client's rank as of its last upload
        self._start_tails: dict[str, float] = {}  # client: the tails at the start of its round

    # ------------------------------------------------------------------ server
    def state_dict(self) -> dict:
        return {"current": list(self.current)}  # the pruned ranks, which size each client's downlink

    def check_state(self, state: dict, path: str, rnd: int) -> None:
        ranks = state.get("current")
        top = self.plan.client_ranks
        if (set(state) != {"current"} or not isinstance(ranks, list) or len(ranks) != len(top)
                or not all(type(r) is int and 1 <= r <= t for r, t in zip(ranks, top))):  # fmt: skip
            raise ValueError(f"federate.restore_from {path!r}: field 'method_state.current' must be each client's "
                             f"rank under HetLoRA, from 1 to its r_i {list(top)}; got {ranks!r:.200}")  # fmt: skip

    def load_state_dict(self, state: dict, path: str) -> None:
        self.current = list(state["current"])

    def upload_ranks(self, client: int) -> tuple[int, ...]:
        return tuple(range(1, self.plan.client_ranks[client] + 1))  # pruning only ever lowers a rank

    def aggregate(
        self, uploads: Uploads, weights: Sequence[float], clients: Sequence[int], generator: Generator, rnd: int = 0
    ) -> tuple[Factors, dict[str, Tensor]]:
        r_max = self.plan.r_g
        for c, upload in zip(clients, uploads):
            self.current[c] = max(B.shape[1] for B, _ in upload.values())
        out: Factors = {}
        for name in uploads[0]:
            norms = [float(factored_norm(*u[name])) for u in uploads]
            p = norms if sum(norms) > 0 else list(weights)  # all-zero updates (round 0 of B = 0): fall back
            padded = [{name: truncate_factors(*u[name], r_max)} for u in uploads]
            out.update(average_factors(padded, p))
        return out, {}

    def downlink(self, global_: Factors, client: int) -> Factors:
        rank = min(self.plan.reference_ranks[client], self.current[client])
        return {n: truncate_factors(B, A, rank) for n, (B, A) in global_.items()}

    # ------------------------------------------------------------------ client
    def start_round(self, received: Factors, own: Factors, client: int, rnd: int) -> Factors:
        start = {n: truncate_factors(B, A, own[n][0].shape[1]) for n, (B, A) in received.items()}
        gamma = self.opts.gamma
        self._start_tails = {n: float(tail_norm(B, A, gamma)) for n, (B, A) in start.items()}
        return start

    def alignment(self, local: Factors, reference: Factors, lam: float) -> Tensor | None:
        if self.opts.lam == 0:
            return None
        gamma = self.opts.gamma
        return self.opts.lam * torch.stack([tail_norm(B, A, gamma) for B, A in local.values()]).sum()

    def end_round(self, local: Factors, client: int, rnd: int) -> Factors:
        if self.opts.lam == 0:
            return local
        gamma, out = self.opts.gamma, {}
        for n, (B, A) in local.items():
            keep = max(1, math.floor(gamma * B.shape[1]))
            shrank = float(tail_norm(B, A, gamma)) < self._start_tails.get(n, 0.0)
            out[n] = truncate_factors(B, A, keep) if keep < B.shape[1] and shrank else (B, A)
        return out

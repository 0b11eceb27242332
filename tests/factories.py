"""Seeded builders of client factors for the core tests (plain torch, no fixtures magic)."""

from __future__ import annotations

import torch
from torch import Tensor

KINDS = ("generic", "duplicate", "zero_client", "low_rank", "opposite")


def client_factors(
    seed: int, d: int, k: int, ranks: list[int], kind: str = "generic", dtype: torch.dtype = torch.float64
) -> tuple[list[Tensor], list[Tensor]]:
    """Random ``Bs[i]: (d, r_i)``, ``As[i]: (r_i, k)``; ``kind`` adds the degenerate cases hypothesis should hit.

    duplicate: client 1 repeats client 0 (rank-deficient B_cat); zero_client: client 0 uploads zeros;
    low_rank: every B_i lies in one 1-D column space; opposite: client 1 cancels client 0's product.
    """
    g = torch.Generator().manual_seed(seed)
    Bs = [torch.randn(d, r, generator=g, dtype=torch.float64) for r in ranks]
    As = [torch.randn(r, k, generator=g, dtype=torch.float64) for r in ranks]
    if kind == "duplicate" and len(ranks) > 1 and ranks[1] == ranks[0]:
        Bs[1], As[1] = Bs[0].clone(), As[0].clone()
    elif kind == "zero_client":
        Bs[0].zero_()
        As[0].zero_()
    elif kind == "low_rank":
        u = torch.randn(d, 1, generator=g, dtype=torch.float64)
        Bs = [u @ torch.randn(1, r, generator=g, dtype=torch.float64) for r in ranks]
    elif kind == "opposite" and len(ranks) > 1 and ranks[1] == ranks[0]:
        Bs[1], As[1] = -Bs[0].clone(), As[0].clone()
    return [B.to(dtype) for B in Bs], [A.to(dtype) for A in As]


def dense_aggregate(Bs: list[Tensor], As: list[Tensor], weights: list[float] | None = None) -> Tensor:
    """Independent reference: ``sum_i w_i B_i A_i`` in float64 with w normalised (uniform if None)."""
    n = len(Bs)
    w = [1.0 / n] * n if weights is None else [float(x) / sum(weights) for x in weights]
    return sum(wi * (B.double() @ A.double()) for wi, B, A in zip(w, Bs, As))


def optimal_error(X: Tensor, rank: int) -> float:
    """Eckart-Young: ``min_{rank(Y) <= rank} ||X - Y||_F`` from the dense float64 SVD."""
    S = torch.linalg.svdvals(X.double())
    return float(S[rank:].pow(2).sum().sqrt())

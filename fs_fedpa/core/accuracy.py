"""How close a reconstruction is to the optimum, and the cases that test it (issue: float-floor reconstruction).

The metric is the *excess over the optimal tail*, ``||M - B_g A_g||_F / ||M - M_R||_F - 1`` for the aggregate
``M = sum_i w_i B_i A_i`` and its best rank-R approximation ``M_R``, both from a float64 dense SVD: 0 is the optimum,
and a method is compared with the *float32 floor*, the excess of the exact float64 factors rounded to float32.
Dividing by the tail (not by ``||M||`` or ``sum_i w_i ||B_i|| ||A_i||``) is what exposes the cases below: where the
tail is small against ``M`` itself, a method can look accurate relative to ``M`` and still be far from optimal.

Dense ``(d, k)`` work throughout: this is a reference for tests and benchmarks, not for the server.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FAMILIES = ("random", "shared_A_1e-3", "shared_A_1e-6", "shared_AB_1e-3", "shared_AB_1e-6", "duplicated", "norms",
            "cancelling")  # fmt: skip


def case(family: str, seed: int = 0, n: int = 10, d: int = 256, k: int = 256, r: int = 4):
    """Float64 client factors ``(Bs, As)`` of one case family (``n`` clients of rank ``r``, ``(d, k)`` layers):

    - ``random``: independent Gaussians (flat spectrum);
    - ``shared_A_<eps>``: every ``A_i = A_0 + eps E_i`` near one ``A_0`` (FedPA's clients after a few rounds),
      small independent ``B_i``; ``shared_AB_<eps>``: both factors near shared ones;
    - ``duplicated``: three distinct clients, each repeated (rank-deficient stacks);
    - ``norms``: client update norms spread over 1e-6 .. 1e3;
    - ``cancelling``: two clients whose products cancel to 1e-6 beside small others.
    """
    if family not in FAMILIES:
        raise ValueError(f"family(={family!r}) must be one of {FAMILIES}")
    g = torch.Generator().manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    if family == "random":
        return [rn(d, r) for _ in range(n)], [rn(r, k) for _ in range(n)]
    if family.startswith("shared"):
        eps = float(family.rsplit("_", 1)[1])
        A0, B0 = rn(r, k) / math.sqrt(k), rn(d, r) * 1e-3
        As = [A0 + eps * rn(r, k) / math.sqrt(k) for _ in range(n)]
        both = family.startswith("shared_AB")
        Bs = [B0 + eps * 1e-3 * rn(d, r) if both else rn(d, r) * 1e-3 for _ in range(n)]
        return Bs, As
    if family == "duplicated":
        Bs, As = [rn(d, r) for _ in range(3)], [rn(r, k) for _ in range(3)]
        return [Bs[i % 3] for i in range(n)], [As[i % 3] for i in range(n)]
    if family == "norms":
        scales = torch.logspace(-6, 3, n, dtype=torch.float64)
        return [rn(d, r) * s for s in scales], [rn(r, k) for _ in range(n)]
    B, A = rn(d, r), rn(r, k)  # cancelling
    Bs = [B, -B * (1 + 1e-6)] + [rn(d, r) * 1e-3 for _ in range(n - 2)]
    return Bs, [A, A.clone()] + [rn(r, k) for _ in range(n - 2)]


def _aggregate(Bs, As, weights) -> Tensor:
    total = sum(weights)
    return sum(w / total * (B.double() @ A.double()) for w, B, A in zip(weights, Bs, As))


def tail_excess(Bs, As, B_g: Tensor, A_g: Tensor, rank: int, weights=None) -> float:
    """``||M - B_g A_g||_F / ||M - M_R||_F - 1`` in float64 (``inf`` where the optimal tail is 0 and the
    reconstruction is not exact, 0 where both are 0)."""
    weights = [1.0] * len(Bs) if weights is None else list(weights)
    M = _aggregate(Bs, As, weights)
    tail = float(torch.linalg.svdvals(M)[rank:].square().sum().sqrt())
    err = float(torch.linalg.matrix_norm(M - B_g.double() @ A_g.double()))
    if tail == 0:
        return 0.0 if err == 0 else math.inf
    return err / tail - 1


def float32_floor(Bs, As, rank: int, weights=None) -> float:
    """The excess of the exact rank-``rank`` factors (float64 SVD) rounded to float32: what no float32 output beats."""
    weights = [1.0] * len(Bs) if weights is None else list(weights)
    U, S, Vh = torch.linalg.svd(_aggregate(Bs, As, weights), full_matrices=False)
    return tail_excess(Bs, As, (U[:, :rank] * S[:rank]).float(), Vh[:rank].float(), rank, weights)

"""FedSVD [Lee et al., 2025]: FFA-LoRA's B-only rounds, with A re-chosen by the server every round from an SVD of
the aggregate. Paper: arxiv.org/abs/2505.12805

Clients train and upload B only, with A fixed at the orthonormal-row factor the server last sent; the server
completes each upload with that A, so the weighted mean B̄ times A is the mean of the clients' products exactly. It
then re-factors B̄ A by a small SVD (:func:`refactor`) and sends A = its top right singular vectors (orthonormal
rows) and B = U S, so A adapts to the updates while staying orthonormal. The first A is PEFT's draw, orthonormalised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Generator, Tensor

from fs_fedpa.core._checks import check_finite
from fs_fedpa.core.factorwise import average_factors
from fs_fedpa.core.ranks import init_global_factors
from fs_fedpa.methods.base import Factors, Uploads
from fs_fedpa.methods.ffa_lora import FFALoRA


def refactor(B: Tensor, A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(B', A', S)`` with ``B' A' = B A``, ``A'`` orthonormal rows and ``B'`` orthogonal columns of norms ``S``.

    With ``B = U S Wᵀ`` the thin SVD of B, ``B' = U S`` and ``A' = Wᵀ A``: W is orthogonal, so the product is
    unchanged and A' has orthonormal rows whenever A has; then ``U S (Wᵀ A)`` is the SVD of ``B A`` and S its
    singular values. The ``(d, k)`` product is never formed: the cost is the SVD of B, ``O(d r²)``, and ``O(r² k)``.

    Args:
        B: ``(d, r)``, e.g. the weighted mean of the clients' B (or, with privacy, a noisy one).
        A: ``(r, k)`` with orthonormal rows (``A Aᵀ = I``, so r <= k), the A every client used.

    Returns:
        ``B': (d, r)``, ``A': (r, k)`` and ``S: (min(d, r),)``, descending, in B's dtype (computed in float64). Where
        d < r, the last r - d columns of B' are zero. An all-zero B (nothing learned) gives zeros, a copy of A and
        S = 0.

    Where B has rank q < r, the last r - q rows of A' still complete an orthonormal basis (B' is zero there), so
    the clients' next B receives gradient in all r directions (zero rows of A would freeze those columns of B).
    """
    if B.ndim != 2 or A.ndim != 2 or B.shape[1] != A.shape[0]:
        raise ValueError(f"refactor needs B (d, r) and A (r, k); got B {tuple(B.shape)} and A {tuple(A.shape)}")
    check_finite(B, "B")
    check_finite(A, "A")
    d, r = B.shape
    if not bool(B.any()):  # the SVD of 0 has arbitrary singular vectors: keep the A every client holds
        return torch.zeros_like(B), A.clone(), B.new_zeros(min(d, r))
    # full_matrices only where d < r: W must be r x r for A' to keep all r orthonormal rows
    U, S, Wt = torch.linalg.svd(B.double(), full_matrices=d < r)
    B_new = U[:, : S.numel()] * S
    if d < r:
        B_new = torch.cat([B_new, B_new.new_zeros(d, r - d)], dim=1)
    A_new = Wt @ A.double()
    return B_new.to(B.dtype), A_new.to(A.dtype), S.to(B.dtype)


class FedSVD(FFALoRA):
    name = "fedsvd"
    dp_space = "change"  # client-level DP noises the mean change of B only; the re-factoring is post-processing

    def init_global(self, shapes: dict[str, tuple[int, int]], generator: torch.Generator) -> Factors:
        """B = 0 and A = PEFT's Kaiming-uniform draw with its rows orthonormalised (QR of Aᵀ, signs fixed)."""
        out = {}
        for name, (d, k) in shapes.items():
            B, A = init_global_factors(d, k, self.plan.r_g, generator=generator)
            Q, R = torch.linalg.qr(A.double().T)  # A = Rᵀ Qᵀ; the signs make Q unique, as R's diagonal > 0 does
            out[name] = (B, (Q * torch.where(R.diagonal() < 0, -1.0, 1.0)).T.to(A.dtype))
        return out

    def aggregate(
        self, uploads: Uploads, weights: Sequence[float], clients: Sequence[int], generator: Generator, rnd: int = 0
    ) -> tuple[Factors, dict[str, Tensor]]:
        """:func:`refactor` of (weighted mean of B, the common A) per module; the spectrum is each module's S."""
        global_, spectra = {}, {}
        for name, (B, A) in average_factors(uploads, weights).items():
            B_new, A_new, spectra[name] = refactor(B, A)
            global_[name] = (B_new, A_new)
        return global_, spectra

    def dp_global(self, release: dict, global_: Factors, generator: Generator) -> tuple[Factors, dict[str, Tensor]]:
        """Client-level DP: the global B plus the noisy mean change of B, re-factored with the common A."""
        noisy, _ = super().dp_global(release, global_, generator)
        out, spectra = {}, {}
        for name, (B, A) in noisy.items():
            B_new, A_new, spectra[name] = refactor(B, A)
            out[name] = (B_new, A_new)
        return out, spectra

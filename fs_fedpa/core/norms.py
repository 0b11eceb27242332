"""Norms of factored updates without forming the ``(d, k)`` product (§3.3): ``||B A||_F = ||R_B A||_F`` with
``B = Q_B R_B`` a reduced QR, ``O(d r^2 + r^2 k)``, which unlike the Gram expansion ``tr(B^T B A A^T)`` does not lose
half the digits to cancellation when the product is small next to its factors. The round's diagnostics
(:mod:`fs_fedpa.core.diagnostics`), the DP clip (:mod:`fs_fedpa.privacy.mechanism`: one function for the clip and the
diagnostic a user sets it from) and the server's intake read them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fs_fedpa.core._checks import compute_dtype


def factored_norm(B: Tensor, A: Tensor) -> Tensor:
    """``||B A||_F`` for ``B: (*, d, r)``, ``A: (*, r, k)`` without forming ``B A``; returns ``(*)``."""
    if B.shape[-1] != A.shape[-2]:
        raise ValueError(f"B has {B.shape[-1]} columns but A has {A.shape[-2]} rows")
    cdtype = compute_dtype(B.dtype)
    R_B = torch.linalg.qr(B.to(cdtype), mode="r").R  # (*, min(d, r), r)
    return torch.linalg.matrix_norm(R_B @ A.to(cdtype))


PART = {"B": 0, "A": 1}  # an uploaded factor part's index in a (B, A) pair


def product_sq_norm(factors: Mapping[str, tuple[Tensor, Tensor]]) -> float:
    """``sum_m ||B_m A_m||_F^2`` over the modules of ``{name: (B, A)}`` (the squared Frobenius norm of a whole
    update), from the factors (:func:`factored_norm`, in the factors' compute precision: pass float64 factors for a
    float64 norm, as the DP clip does), summed as a Python float."""
    return sum(float(factored_norm(B, A)) ** 2 for B, A in factors.values())


def change_sq_norm(factors: Mapping[str, tuple[Tensor, Tensor]], start: Mapping[str, tuple[Tensor, Tensor]],
                   parts: Sequence[str]) -> float:  # fmt: skip
    """``sum_m sum_{X in parts} ||X_m - X_m^0||_F^2`` in float64: the change of the uploaded factor ``parts``
    (``"B"``, ``"A"``) from ``start``, what client-level DP clips for factor-averaging methods and what the
    diagnostics report as ``change_norm`` (one function, so the clip a user sets from the diagnostic is the one
    applied). ValueError where a part's shape differs from its start's."""
    sq = 0.0
    for name, pair in factors.items():
        for part in parts:
            x, x0 = pair[PART[part]], start[name][PART[part]]
            if x.shape != x0.shape:
                raise ValueError(f"{name} {part}: shape {tuple(x.shape)}, started from {tuple(x0.shape)}")
            sq += float((x.double() - x0.double()).pow(2).sum())
    return sq


def product_distance(B: Tensor, A: Tensor, B_ref: Tensor, A_ref: Tensor) -> Tensor:
    """``||B A - B_ref A_ref||_F`` from the factors (a client's drift from its reference, §4.2), any two ranks.

    The difference is the product ``[B, -B_ref] [A; A_ref]``, so this is a :func:`factored_norm` of rank
    ``r + R``: ``O((d + k)(r + R)^2)``, no ``(d, k)`` tensor. Shapes: ``B (d, r)``, ``A (r, k)``, ``B_ref (d, R)``,
    ``A_ref (R, k)``.
    """
    if B.shape[-2] != B_ref.shape[-2] or A.shape[-1] != A_ref.shape[-1]:
        raise ValueError(
            f"products differ in shape: {B.shape[-2]}x{A.shape[-1]} vs {B_ref.shape[-2]}x{A_ref.shape[-1]}"
        )
    cdtype = compute_dtype(B.dtype)
    return factored_norm(
        torch.cat([B.to(cdtype), -B_ref.to(cdtype)], dim=-1), torch.cat([A.to(cdtype), A_ref.to(cdtype)], dim=-2)
    )

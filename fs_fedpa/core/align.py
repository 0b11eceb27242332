"""Factor alignment for FedRot-LoRA: the rotation that best aligns a client's factors with the global ones."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor


def procrustes_rotation(M: Tensor) -> Tensor:
    """The rotation ``R`` (``R^T R = I``, ``det R = +1``) maximising ``tr(R^T M)`` for ``M: (*, r, r)``.

    With ``M = U S V^T``: ``R = U diag(1, ..., 1, det(U V^T)) V^T`` (orthogonal Procrustes with a proper
    rotation, Kabsch/Umeyama).
    """
    U, _, Vh = torch.linalg.svd(M)
    d = torch.linalg.det(U @ Vh)
    D = torch.ones_like(M[..., 0])
    D[..., -1] = torch.sign(d) + (d == 0)  # +1 or -1; a degenerate 0 counts as +1
    return (U * D[..., None, :]) @ Vh


def rotate_to(
    B: Tensor, A: Tensor, B_ref: Tensor, A_ref: Tensor, which: Literal["A", "B"], strength: float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """``(B R, R^T A, R)`` with the rotation aligning ``A`` to ``A_ref`` (``min ||R^T A - A_ref||``) or ``B`` to
    ``B_ref`` (``min ||B R - B_ref||``). The product ``B A`` is unchanged. Shapes: ``B (d, r)``, ``A (r, k)``.

    ``strength`` λ in [0, 1] softens the rotation as FedRot-LoRA does: ``R_λ`` is the rotation nearest to
    ``(1 - λ) I + λ R`` (identity at 0, the full Procrustes rotation at 1).
    """
    if B.shape != B_ref.shape or A.shape != A_ref.shape:
        raise ValueError(f"alignment needs factors of the reference's shape: {tuple(B.shape)} vs {tuple(B_ref.shape)}")
    if which not in ("A", "B"):
        raise ValueError(f"which(={which!r}) must be 'A' or 'B'")
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"rotation strength(={strength}) must be in [0, 1]")
    M = A @ A_ref.mT if which == "A" else B.mT @ B_ref
    R = procrustes_rotation(M.double())
    if strength < 1.0:
        eye = torch.eye(R.shape[-1], dtype=R.dtype, device=R.device)
        R = procrustes_rotation((1.0 - strength) * eye + strength * R)
    R = R.to(B.dtype)
    return B @ R, R.mT @ A, R

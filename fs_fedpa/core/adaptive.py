"""Adaptive regularisation strength lam_i^(t) (Appendix F), as pure functions.

Each rule is evaluated once per client and round from the first mini-batch ``xi_i^(t,0)``.
The paper's preliminary constants are lam_0 = 1, alpha = 1, lam_min = 0, lam_max = 10.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def lam_loss(loss: float | Tensor, lam0: float = 1.0, alpha: float = 1.0) -> float:
    """Task-loss rule (F.1): ``lam = lam0 / (1 + alpha * f_i(W^(t,0); xi^(t,0)))``, in ``(0, lam0]``."""
    value = float(loss)
    if not value >= 0:  # also rejects NaN
        raise ValueError(f"loss(={value}) must be a non-negative task loss")
    _check_nonneg(lam0, "lam0")
    _check_nonneg(alpha, "alpha")
    return lam0 / (1.0 + alpha * value)


def normalized_factor_grads(
    grads_B: Sequence[Tensor], grads_A: Sequence[Tensor], Bs: Sequence[Tensor], As: Sequence[Tensor], eps: float = 1e-8
) -> Tensor:
    """Factor gradients normalised by the complementary factor norm, concatenated over LoRA layers.

    ``[grad_B_l / (||A_l||_F + eps), grad_A_l / (||B_l||_F + eps)]_l`` flattened to one vector
    (F.2, F.3): ``grad_B = grad_W A^T`` and ``grad_A = B^T grad_W`` are scaled by the other factor,
    and dividing by its norm removes that scale. Its norm is the surrogate ``g_hat`` of Eq. (F.2).
    """
    n = len(grads_B)
    if not (n == len(grads_A) == len(Bs) == len(As)) or n == 0:
        raise ValueError(
            f"need the same non-zero number of grads_B, grads_A, Bs, As; got {n}, {len(grads_A)}, {len(Bs)}, {len(As)}"
        )
    parts = []
    for gB, gA, B, A in zip(grads_B, grads_A, Bs, As):
        if gB.shape != B.shape or gA.shape != A.shape:
            raise ValueError(
                f"gradient shapes {tuple(gB.shape)}, {tuple(gA.shape)} differ from factors {tuple(B.shape)}, "
                f"{tuple(A.shape)}"
            )
        parts.append((gB.float() / (torch.linalg.vector_norm(A.float()) + eps)).flatten())
        parts.append((gA.float() / (torch.linalg.vector_norm(B.float()) + eps)).flatten())
    return torch.cat(parts)


def lam_grad(
    g_hat: float | Tensor,
    mismatch: float | Tensor,
    alpha: float = 1.0,
    lam_min: float = 0.0,
    lam_max: float = 10.0,
    eps: float = 1e-8,
) -> float:
    """Gradient-aware rule (F.2): ``clip(alpha * g_hat / (||X_i - X_g,i||_F + eps), lam_min, lam_max)``.

    ``g_hat`` is the norm of :func:`normalized_factor_grads`; ``mismatch`` is ``||B_i A_i - B_g,i A_g,i||_F``
    at the start of the round (``product_penalty(...).sqrt()``).
    """
    if not lam_max > lam_min >= 0:
        raise ValueError(f"need lam_max(={lam_max}) > lam_min(={lam_min}) >= 0")
    _check_nonneg(alpha, "alpha")
    g, m = float(g_hat), float(mismatch)
    if not (g >= 0 and m >= 0):
        raise ValueError(f"g_hat(={g}) and mismatch(={m}) must be non-negative")
    return max(lam_min, min(alpha * g / (m + eps), lam_max))


def lam_direction(g_f: Tensor, g_r: Tensor, lam0: float = 1.0, eps: float = 1e-8) -> float:
    """Gradient-direction rule (F.3): ``lam0 * (1 - <g_f, g_r> / (||g_f|| ||g_r|| + eps))``, in ``[0, 2 lam0]``.

    ``g_f`` and ``g_r`` are the task and product-regulariser gradients, each the output of
    :func:`normalized_factor_grads`.
    """
    if g_f.shape != g_r.shape:
        raise ValueError(f"g_f {tuple(g_f.shape)} and g_r {tuple(g_r.shape)} differ in shape")
    _check_nonneg(lam0, "lam0")
    g_f, g_r = g_f.double().flatten(), g_r.double().flatten()
    cos = float(g_f @ g_r / (torch.linalg.vector_norm(g_f) * torch.linalg.vector_norm(g_r) + eps))
    return lam0 * (1.0 - cos)


def _check_nonneg(value: float, name: str) -> None:
    if not float(value) >= 0:
        raise ValueError(f"{name}(={value}) must be >= 0")

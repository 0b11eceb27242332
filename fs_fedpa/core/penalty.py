"""Client-side alignment terms: the product penalty of §4.2 and the factor-wise ablations of Appendix C.2.

The client minimises ``f_i(W_0 + B_i A_i) + lam/2 * penalty``. The product penalty is expanded in
Gram matrices so that no ``(d, k)`` tensor is formed:

    ||B A - B_r A_r||_F^2 = <B^T B, A A^T> - 2 <B^T B_r, A A_r^T> + <B_r^T B_r, A_r A_r^T>

with ``<X, Y> = sum(X * Y)``; the Grams are ``(r, r)``, ``(r, R)`` and ``(R, R)``, so a call costs
``O((d + k) r (r + R))`` instead of the ``O(d k r)`` of the dense product, and r != R is allowed.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from fs_fedpa.core._checks import compute_dtype

Reg = Literal["product", "b", "a", "both", "none"]
REGS: tuple[str, ...] = ("product", "b", "a", "both", "none")


def product_penalty(B: Tensor, A: Tensor, B_ref: Tensor, A_ref: Tensor) -> Tensor:
    """``||B A - B_ref A_ref||_F^2`` through Gram products (§4.2, Eq. product-guided objective, without lam/2).

    Args:
        B: local factor ``(*, d, r)``; gradients flow into it.
        A: local factor ``(*, r, k)``; gradients flow into it.
        B_ref: reference ``(*, d, R)``, a constant (detached).
        A_ref: reference ``(*, R, k)``, a constant (detached).

    Returns:
        A differentiable tensor of shape ``(*)`` (a scalar for 2-D factors) in at least float32.
        Rounding can make the expansion slightly negative when the products agree; it is
        clamped at zero.
    """
    _check_pair(B, A, "B", "A")
    _check_pair(B_ref, A_ref, "B_ref", "A_ref")
    if B.shape[-2] != B_ref.shape[-2] or A.shape[-1] != A_ref.shape[-1]:
        raise ValueError(
            f"products differ in shape: B A is {B.shape[-2]}x{A.shape[-1]} but B_ref A_ref is "
            f"{B_ref.shape[-2]}x{A_ref.shape[-1]}"
        )
    cdtype = compute_dtype(B.dtype)
    B, A = B.to(cdtype), A.to(cdtype)
    B_ref, A_ref = B_ref.detach().to(cdtype), A_ref.detach().to(cdtype)
    own = ((B.mT @ B) * (A @ A.mT)).sum((-2, -1))
    cross = ((B.mT @ B_ref) * (A @ A_ref.mT)).sum((-2, -1))
    ref = ((B_ref.mT @ B_ref) * (A_ref @ A_ref.mT)).sum((-2, -1))
    return (own - 2 * cross + ref).clamp_min(0)


def factor_penalty(B: Tensor, A: Tensor, B_ref: Tensor, A_ref: Tensor, which: Literal["b", "a", "both"]) -> Tensor:
    """Factor-wise ablation terms of Appendix C.2 (without lam/2).

    ``which="b"``: ``||B - B_ref||_F^2``; ``"a"``: ``||A - A_ref||_F^2``; ``"both"``: their sum.
    They compare factors, so the reference must have the local rank (R_i == r_i).

    Args: as :func:`product_penalty`, with ``B_ref`` shaped like ``B`` and ``A_ref`` like ``A``.
    """
    if which not in ("b", "a", "both"):
        raise ValueError(f"which(={which!r}) must be 'b', 'a' or 'both'")
    if B.shape != B_ref.shape or A.shape != A_ref.shape:
        raise ValueError(
            f"factor-wise regularizer {which!r} needs a reference of the local rank: B {tuple(B.shape)} vs "
            f"B_ref {tuple(B_ref.shape)}, A {tuple(A.shape)} vs A_ref {tuple(A_ref.shape)}; "
            "use reg='product' when R_i != r_i"
        )
    cdtype = compute_dtype(B.dtype)
    dims = tuple(range(-2, 0))
    term_b = (B.to(cdtype) - B_ref.detach().to(cdtype)).pow(2).sum(dims)
    term_a = (A.to(cdtype) - A_ref.detach().to(cdtype)).pow(2).sum(dims)
    return {"b": term_b, "a": term_a, "both": term_b + term_a}[which]


def regularizer(reg: Reg, B: Tensor, A: Tensor, B_ref: Tensor, A_ref: Tensor) -> Tensor | None:
    """The alignment term selected by ``fedpa.reg``: ``product`` (FedPA), ``b``/``a``/``both`` (ablations)
    or ``none`` (returns ``None``: no term at all, not a zero that still costs a backward)."""
    if reg == "product":
        return product_penalty(B, A, B_ref, A_ref)
    if reg in ("b", "a", "both"):
        return factor_penalty(B, A, B_ref, A_ref, reg)  # type: ignore[arg-type]
    if reg == "none":
        return None
    raise ValueError(f"reg(={reg!r}) must be one of {REGS}")


def _check_pair(B: Tensor, A: Tensor, b: str, a: str) -> None:
    if B.ndim < 2 or A.ndim < 2:
        raise ValueError(f"{b} and {a} must have at least 2 dims, got {tuple(B.shape)}, {tuple(A.shape)}")
    if B.shape[-1] != A.shape[-2]:
        raise ValueError(f"{b} has {B.shape[-1]} columns but {a} has {A.shape[-2]} rows")

"""The truncated SVD of an aggregate ``B_cat @ A_cat`` from its factors alone: the routes behind
:func:`fs_fedpa.core.reconstruct.reconstruct` (its docstring says which route runs when).

- :func:`reduced_qr`: reduced QR of both stacks, the SVD of the small core ``R_B R_A^T`` (Householder, Q applied,
  never formed);
- :func:`gram_route`: the same optimum for float32/half uploads through float64 Gram matrices of the stacks;
- :func:`reduced64`: the float64 route, choosing between the two by the stacks' shapes;
- :func:`reconstruct_cat`: one stack pair in any mode (``reduced``, ``randomized`` sketch, ``dense`` baseline).

Shapes: ``B_cat (d, r_tot)``, ``A_cat (r_tot, k)``; every result is ``(B_g (d, R_g), A_g (R_g, k), S (R_g,))``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def column_weights(w: Sequence[float], ranks: Sequence[int], dtype: torch.dtype, device) -> Tensor:
    """``(sum_i r_i,)``: sqrt(w_i) for each of client i's ``ranks[i]`` columns (the square root taken in float64)."""
    sw = torch.tensor(list(w), dtype=torch.float64).sqrt().to(dtype)
    return sw.repeat_interleave(torch.tensor(list(ranks))).to(device)


def reduced64(Bt: Tensor, A: Tensor, ranks: Sequence[int], rank: int, w) -> tuple[Tensor, Tensor, Tensor]:
    """``reduced`` on the unweighted float64 stacks ``Bt: (*, m, d)``, ``A: (*, m, k)`` of float32 / half uploads:
    the Gram route while ``m = sum_i r_i <= min(d, k)``; beyond, the QR route in float64 (:func:`reduced_qr`), whose
    core is ``min(d, m) x min(k, m)`` where the Gram route's eigenproblems would be ``m x m``, with the core's leading
    pairs from its smaller Gram (:func:`gram_pairs`). K = 10 clients of r = 64 on a 256-wide adapter: about 3x
    faster than Householder QR on both sides and the core's SVD, the same optimum at the float32 floor."""
    m, d, k = A.shape[-2], Bt.shape[-1], A.shape[-1]
    if m <= min(d, k):
        return gram_route(Bt, A, ranks, rank, w)
    sw = column_weights(w, ranks, Bt.dtype, Bt.device)[:, None]
    B_g, A_g, S = reduced_qr((Bt * sw).mT, A * sw, rank, gram_pairs)
    return pad_rank(B_g, A_g, rank) + (S,)


def gram_route(Bt: Tensor, A: Tensor, ranks: Sequence[int], rank: int, w) -> tuple[Tensor, Tensor, Tensor]:
    """``reduced`` for float32 / bfloat16 / float16 factors, from their float64 stacks ``Bt = [B_1^T; ...; B_N^T]:
    (*, m, d)`` and ``A: (*, m, k)`` (client i's ``ranks[i]`` rows after client i-1's): float64 Gram matrices, two
    small symmetric eigenproblems, a float64 map back. It reaches the float32 floor (the exact SVD rounded to float32),
    where Householder QR in float32 loses up to 2-3 digits when the clients' factors are nearly parallel.

    With the unweighted stacks ``B = [B_1, ..., B_N]: (*, d, m)``, ``A = [A_1; ...; A_N]: (*, m, k)`` and per column j
    (of client i, norms b_j, a_j) the weights ``beta_j = sqrt(w_i) c_j``, ``alpha_j = sqrt(w_i) / c_j`` with the
    balancing ``c_j = sqrt(a_j / b_j)`` (so factor norms spanning decades do not spoil the Grams):

        G_A = diag(alpha) A A^T diag(alpha) = P P^T,   T with T diag(alpha) A = Q^T orthonormal  (:func:`_row_space`)
        K   = P^T diag(beta) B^T B diag(beta) P = Z diag(sigma^2) Z^T
        B_g = B diag(beta) P Z_R          (singular values folded in)
        A_g = Z_R^T T diag(alpha) A       (orthonormal rows)

    since ``sum_i w_i B_i A_i = (B diag(beta) P) Q^T``. ``P`` is a Cholesky factor, or ``E diag(sqrt(mu))`` from an
    eigendecomposition where the stack is rank-deficient.
    Only the two Grams and the two map-backs touch d or k: ``O((d + k) m^2 + m^3)``, no QR of a tall matrix.
    Singular values below ``sqrt(eps_64) sigma_1`` (about 1e-8 sigma_1) come out of ``K`` with absolute error
    about 1e-8 sigma_1: below the float32 floor, so the float32 result is as good as the exact one rounded.
    """
    f64 = torch.float64  # Bt: (*, m, d) is the fast layout for B^T B
    sw = column_weights(w, ranks, f64, Bt.device)
    G_B, G_A = Bt @ Bt.mT, A @ A.mT
    nb, na = G_B.diagonal(dim1=-2, dim2=-1).sqrt(), G_A.diagonal(dim1=-2, dim2=-1).sqrt()
    require_finite(nb, na)  # the squared column norms hold any NaN/Inf
    both = (nb > 0) & (na > 0)
    c = torch.where(both, (na / torch.where(both, nb, 1)).sqrt(), torch.ones_like(nb))
    beta, alpha = sw * c, sw / c
    P, to_Q = _row_space(alpha[..., :, None] * G_A * alpha[..., None, :])
    BP = beta[..., :, None] * P  # diag(beta) P: (*, m, m)
    K = BP.mT @ G_B @ BP
    lam, Z = small_eigh((K + K.mT) / 2)
    require_finite(lam)  # an entry near the float64 limit overflowed in a Gram
    lam, Z = lam.flip(-1), Z.flip(-1)  # descending
    m = A.shape[-2]
    q = min(Bt.shape[-1], A.shape[-1], m)
    n = min(rank, q)
    Z_R = Z[..., :n]
    B_g = ((BP @ Z_R).mT @ Bt).mT  # B diag(beta) P Z_R, computed against the row-major B^T
    A_g = (Z_R.mT @ (to_Q * alpha[..., None, :])) @ A
    S = lam[..., :q].clamp_min(0).sqrt()
    return pad_rank(B_g, A_g, rank) + (S,)


BATCHED_EIGH_MAX = 32  # torch's CUDA eigh batches cuSOLVER's Jacobi solver up to 32 x 32, then loops over the batch


def on_host(shape: torch.Size, device: torch.device) -> bool:
    """Whether :func:`small_eigh` solves a stack of ``shape`` on the host: a batch of CUDA matrices larger than
    :data:`BATCHED_EIGH_MAX`, which torch would solve one dense solver call (about a millisecond) at a time."""
    return device.type == "cuda" and shape[-1] > BATCHED_EIGH_MAX and math.prod(shape[:-2]) > 1


def small_eigh(M: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of a stack of small symmetric matrices ``(*, m, m)`` (the modules of a shape group),
    batched where the device batches it, else on the host (:func:`on_host`: one copy each way and a LAPACK loop
    of microseconds a matrix, in place of a device solver call a matrix); the result on ``M``'s device."""
    if not on_host(M.shape, M.device):
        return torch.linalg.eigh(M)
    lam, E = torch.linalg.eigh(M.cpu())
    return lam.to(M.device), E.to(M.device)


class NonFinite(ValueError):
    """NaN/Inf reached the reconstruction; the public entry points name the client it came from."""


def require_finite(*tensors: Tensor) -> None:
    """Raise :class:`NonFinite` if any of ``tensors`` holds NaN or Inf."""
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise NonFinite("NaN or Inf in the factors")


def _row_space(G: Tensor) -> tuple[Tensor, Tensor]:
    """For a Gram matrix ``G = X X^T: (*, m, m)`` (PSD, float64): ``P`` with ``G = P P^T`` and ``T`` with ``T X``
    orthonormal rows on the range of ``X`` (zero rows elsewhere). Cholesky of the unit-diagonal ``D G D`` where it
    succeeds with a pivot above ``sqrt(m eps)`` (``P = D^-1 L``, ``T = L^-1 D``), else the eigendecomposition
    ``G = E diag(mu) E^T`` with ``mu <= m eps mu_max`` set to 0 (``P = E diag(sqrt(mu))``, ``T = diag(mu^-1/2) E^T``):
    rank-deficient stacks (duplicated or nearly parallel clients) take the second branch."""
    m = G.shape[-1]
    eps = torch.finfo(G.dtype).eps
    diag = G.diagonal(dim1=-2, dim2=-1)
    inv_d = torch.where(diag > 0, diag.clamp_min(torch.finfo(G.dtype).tiny).rsqrt(), 0)
    L, info = torch.linalg.cholesky_ex(inv_d[..., :, None] * G * inv_d[..., None, :])
    pivots = L.diagonal(dim1=-2, dim2=-1)
    good = (info == 0) & (pivots > (m * eps) ** 0.5).all(-1) & (diag > 0).all(-1)
    eye = torch.eye(m, dtype=G.dtype, device=G.device)
    if bool(good.all()):
        P = L / inv_d[..., :, None]  # D^-1 L
        T = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False) * inv_d[..., None, :]  # L^-1 D
        return P, T
    mu, E = small_eigh(G)
    keep = mu > mu[..., -1:].clamp_min(0) * (m * eps)
    root = torch.where(keep, mu, 1).sqrt()
    P = E * torch.where(keep, root, 0)[..., None, :]
    T = (E * torch.where(keep, 1 / root, 0)[..., None, :]).mT
    return P, T


def reduced_qr(B_cat: Tensor, A_cat: Tensor, rank: int, top_pairs) -> tuple[Tensor, Tensor, Tensor]:
    """``reduced`` through Householder QR on pre-weighted ``B_cat: (*, d, m)``, ``A_cat: (*, m, k)``:
    ``B_cat = Q_B R_B``, ``A_cat^T = Q_A R_A`` (compact form: each Q is applied, never formed), the core
    ``H = R_B R_A^T: (*, p, q)`` with ``p = min(d, m)``, ``q = min(k, m)``, its leading pairs ``H ~ B_c A_c`` from
    ``top_pairs(H, rank)``, and ``B_g = Q_B B_c``, ``A_g = A_c Q_A^T``. Returns ``B_g: (*, d, n)``,
    ``A_g: (*, n, k)`` and ``S``, ``n = min(rank, p, q)``.

    A side no longer than the stack (``d <= m``) skips its QR: the identity is then an orthonormal basis of a space
    that holds ``B_cat``'s columns, so ``Q_B = I`` and ``R_B = B_cat``, at the core size the QR would give. Where
    ``m >= max(d, k)`` the core is thus the aggregate ``B_cat A_cat`` itself: there every exact method decomposes a
    ``d x k`` core, and the two QRs only rotated it.
    """
    d, m, k = B_cat.shape[-2], B_cat.shape[-1], A_cat.shape[-1]
    if d > m:
        hB, tauB = torch.geqrf(B_cat)  # R_B in the upper triangle of the first m rows
        B_cat = hB[..., :m, :].triu()  # (*, m, m)
    if k > m:
        hA, tauA = torch.geqrf(A_cat.mT)
        A_cat = hA[..., :m, :].triu().mT  # R_A^T: (*, m, m)
    B_c, A_c, S = top_pairs(B_cat @ A_cat, rank)
    B_g = torch.ormqr(hB, tauB, _pad_rows(B_c, d)) if d > m else B_c  # Q_B B_c: (*, d, n)
    A_g = torch.ormqr(hA, tauA, _pad_rows(A_c.mT, k)).mT if k > m else A_c  # (Q_A A_c^T)^T: (*, n, k)
    return B_g, A_g, S


def svd_pairs(H: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """``H: (*, p, q)`` -> ``(U_n S_n, V_n^T, S)`` from its SVD, ``n = min(rank, p, q)``: exact to ``H``'s dtype."""
    U, S, Vh = _svd(H)
    n = min(rank, S.shape[-1])
    return U[..., :n] * S[..., None, :n], Vh[..., :n, :], S


def gram_pairs(H: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`svd_pairs` for a float64 core of float32 / half uploads, from the eigendecomposition of its smaller
    Gram matrix (about half the SVD's time). With ``q <= p``: ``H^T H = V diag(sigma^2) V^T``, ``B_c = H V_n``,
    ``A_c = V_n^T``; with ``q > p``: ``H H^T = U diag(sigma^2) U^T`` and the QR ``H^T U_n = Q R`` (``R`` is ``S_n`` up
    to signs), ``B_c = U_n R^T``, ``A_c = Q^T``. Either way ``B_c A_c`` is ``H`` projected onto the computed
    subspace, without dividing by a singular value, and ``A_c`` has orthonormal rows. The eigenvalues carry an
    absolute error of about ``eps_64 sigma_1^2``, so each sigma one of at most ``sqrt(eps_64) sigma_1`` (1.5e-8
    sigma_1): below the float32 floor, as in :func:`gram_route`."""
    require_finite(H)
    p, q = H.shape[-2], H.shape[-1]
    n = min(rank, p, q)
    lam, E = small_eigh(H.mT @ H if q <= p else H @ H.mT)  # ascending
    require_finite(lam)  # an entry near the float64 limit overflowed in the Gram
    S = lam.flip(-1).clamp_min(0).sqrt()
    E_n = E[..., -n:].flip(-1)  # the leading n eigenvectors, descending
    if q <= p:
        return H @ E_n, E_n.mT, S
    Q, R = torch.linalg.qr(H.mT @ E_n)  # (*, q, n), (*, n, n)
    return E_n @ R.mT, Q.mT, S


def reconstruct_cat(
    B_cat: Tensor, A_cat: Tensor, rank: int, mode: str, oversample: int, generator: torch.Generator | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Core on pre-weighted factors ``B_cat: (*, d, m)``, ``A_cat: (*, m, k)``; returns ``(B_g, A_g, S)``.

    NaN or Inf anywhere in the factors propagates into the small matrix that is decomposed (the QR
    core, the sketch's projection or the dense aggregate), so checking that matrix alone catches
    them without another pass over the uploads.
    """
    if mode == "reduced":
        B_g, A_g, S = reduced_qr(B_cat, A_cat, rank, svd_pairs)
    elif mode == "randomized":
        ell = min(rank + oversample, B_cat.shape[-1])
        gen_device = generator.device if generator is not None else B_cat.device
        shape = (*A_cat.shape[:-2], A_cat.shape[-1], ell)
        Omega = torch.randn(shape, generator=generator, device=gen_device, dtype=A_cat.dtype).to(A_cat.device)
        Q, _ = torch.linalg.qr(B_cat @ (A_cat @ Omega))  # range finder: (*, d, l)
        B_c, A_g, S = svd_pairs((Q.mT @ B_cat) @ A_cat, rank)  # (*, l, k)
        B_g = Q @ B_c
    else:  # dense: the (d, k) aggregate, for comparison only
        B_g, A_g, S = svd_pairs(B_cat @ A_cat, rank)
    return pad_rank(B_g, A_g, rank) + (S,)


def _svd(M: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    require_finite(M)
    return torch.linalg.svd(M, full_matrices=False)


def pad_rank(B_g: Tensor, A_g: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """``B_g: (*, d, n)``, ``A_g: (*, n, k)`` with zero columns / rows appended up to ``rank`` (the aggregate has only
    ``n < rank`` singular values)."""
    n = B_g.shape[-1]
    if n == rank:
        return B_g, A_g
    B_g = torch.cat([B_g, B_g.new_zeros((*B_g.shape[:-1], rank - n))], dim=-1)
    A_g = torch.cat([A_g, A_g.new_zeros((*A_g.shape[:-2], rank - n, A_g.shape[-1]))], dim=-2)
    return B_g, A_g


def _pad_rows(X: Tensor, rows: int) -> Tensor:
    """``[X; 0]`` with ``rows`` rows in all: the input of a full Householder Q that stands for the reduced one."""
    if X.shape[-2] == rows:
        return X
    return torch.cat([X, X.new_zeros((*X.shape[:-2], rows - X.shape[-2], X.shape[-1]))], dim=-2)

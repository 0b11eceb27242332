"""Product-space aggregation: the optimal rank-R_g factors of ``sum_i w_i B_i A_i`` (§4.3, Alg. 1 l.13-16).

In ``reduced`` and ``randomized`` mode the server never decomposes or forms a matrix larger than
``min(d, r_tot) x min(k, r_tot)``: the dense ``(d, k)`` aggregate appears only where ``r_tot >= max(d, k)``,
where it is that bound. With ``s_i = sqrt(w_i)`` the weighted client factors stack into

    B_cat = [s_1 B_1, ..., s_N B_N]      (d, r_tot)       r_tot = sum_i r_i
    A_cat = [s_1 A_1; ...; s_N A_N]      (r_tot, k)       so B_cat @ A_cat = sum_i w_i B_i A_i

(the paper's ``1/sqrt(N)`` is the uniform case). ``reduced`` takes reduced QR factorisations
``B_cat = Q_B R_B`` and ``A_cat^T = Q_A R_A`` (Householder; each Q stays in compact form and is
applied, never formed), the SVD of the small core ``H = R_B R_A^T = U S V^T``, and returns
``B_g = Q_B U_R S_R``, ``A_g = (Q_A V_R)^T``: by Eckart-Young this is exactly the best rank-R_g
approximation of the aggregate, at ``O(d r_tot^2 + r_tot^3)`` instead of ``O(d^2 k)``. A side no longer than
``r_tot`` needs no QR (its Q is the identity). That is the route for float64 uploads; float32 and half-precision
uploads reach the same optimum through float64 Gram matrices of the stacks (:func:`_gram_route`), which stays at
the float32 floor where float32 Householder QR loses digits, while ``r_tot <= min(d, k)``; past that the Grams'
``r_tot x r_tot`` eigenproblems outgrow the QR core ``min(d, r_tot) x min(k, r_tot)``, and they take the QR route
in float64 with the core's leading pairs from its smaller Gram (:func:`_reduced64`, :func:`_gram_pairs`).
``randomized`` replaces the two QRs by a Gaussian sketch of width ``l = min(R_g + p, r_tot)``
applied through the factored form (Appendix G.1.2, Halko et al. 2011, Alg. 4.1 + 5.1), at
``O(N d r l)``. ``dense`` forms the aggregate and takes its SVD; it exists only as the
comparison baseline (what FlexLoRA does).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from fs_fedpa.core._checks import (
    check_factor_lists,
    check_positive_int,
    compute_dtype,
    first_nonfinite_client,
    normalized_weights,
)

Mode = Literal["reduced", "randomized", "dense"]
MODES: tuple[str, ...] = ("reduced", "randomized", "dense")


def reconstruct(
    Bs: Sequence[Tensor],
    As: Sequence[Tensor],
    rank: int,
    weights: Sequence[float] | Tensor | None = None,
    mode: Mode = "reduced",
    oversample: int = 8,
    generator: torch.Generator | None = None,
    return_spectrum: bool = False,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Best rank-``rank`` factors ``(B_g, A_g)`` of ``sum_i w_i B_i A_i`` (§4.3, Eq. efficient reconstruction).

    Args:
        Bs: client factors ``Bs[i]: (*, d, r_i)``; the ranks ``r_i`` may differ per client.
            Leading batch dims ``*`` (equal for all clients) reconstruct many layers at once.
        As: client factors ``As[i]: (*, r_i, k)``.
        rank: R_g, the rank of the returned factors.
        weights: ``w_i >= 0`` (not all zero), normalised to sum to 1; ``None`` is uniform.
        mode: ``"reduced"`` (exact, QR + core SVD), ``"randomized"`` (sketch of width
            ``min(rank + oversample, r_tot)``) or ``"dense"`` (forms the ``(d, k)`` aggregate).
        oversample: p, the sketch oversampling of ``randomized`` (Halko's bound needs p >= 2).
        generator: seeds the Gaussian test matrix of ``randomized``; drawn on its own device.
        return_spectrum: also return the singular values of the aggregate.

    Returns:
        ``B_g: (*, d, rank)`` with the singular values folded in, ``A_g: (*, rank, k)`` with
        orthonormal rows, in the input dtype; where the aggregate has fewer than ``rank``
        singular values the extra columns of ``B_g`` and rows of ``A_g`` are zero. With
        ``return_spectrum`` also ``S: (*, q)``, descending: all ``q = min(d, k, r_tot)`` singular
        values in exact modes, the ``l`` sketched ones in ``randomized``.

    ``reduced`` computes in float64 (float32 / half inputs through float64 Gram matrices, float64 inputs through
    Householder QR), the other modes in float32 (float64 for float64 inputs); only ``dense`` materialises a
    ``(d, k)`` tensor. ValueError if the result does not fit the inputs' dtype (e.g. float16).
    """
    check_factor_lists(Bs, As)
    check_positive_int(rank, "rank")
    _check_mode(mode, oversample)
    w = normalized_weights(weights, len(Bs))
    B_g, A_g, S = _reconstruct_clients(Bs, As, rank, w, mode, oversample, generator)
    return (B_g, A_g, S) if return_spectrum else (B_g, A_g)


def reconstruct_adapter(
    uploads: Sequence[Mapping[str, tuple[Tensor, Tensor]]],
    rank: int,
    weights: Sequence[float] | Tensor | None = None,
    mode: Mode = "reduced",
    oversample: int = 8,
    generator: torch.Generator | None = None,
    return_spectrum: bool = False,
) -> dict[str, tuple[Tensor, Tensor]] | tuple[dict[str, tuple[Tensor, Tensor]], dict[str, Tensor]]:
    """:func:`reconstruct` for every LoRA module of an adapter, batched over modules of equal shapes.

    Args:
        uploads: one mapping per client, ``module name -> (B_i: (d, r_i), A_i: (r_i, k))``; every
            client names the same modules. A client's rank may differ between modules.
        rank, weights, mode, oversample, generator: as in :func:`reconstruct`; ``rank`` is R_g
            for every module.
        return_spectrum: also return ``module name -> S``.

    Returns:
        ``module name -> (B_g: (d, rank), A_g: (rank, k))`` in the order of ``uploads[0]``
        (and the spectra). Modules whose ``(d, k, r_1..r_N, dtype, device)`` agree are stacked
        and reconstructed in one batched call: a RoBERTa-large adapter with LoRA on query and
        value is one call of batch 48 instead of 48 calls.
    """
    if isinstance(uploads, Mapping) or len(uploads) == 0:
        raise ValueError("uploads must be a non-empty sequence with one {module: (B, A)} mapping per client")
    names = list(uploads[0])
    if not names:
        raise ValueError("uploads[0] names no LoRA module")
    for i, upload in enumerate(uploads):
        if set(upload) != set(names):
            missing = sorted(set(names) - set(upload))
            extra = sorted(set(upload) - set(names))
            raise ValueError(f"client {i} uploads different modules than client 0: missing {missing}, extra {extra}")
    check_positive_int(rank, "rank")
    _check_mode(mode, oversample)
    w = normalized_weights(weights, len(uploads))

    groups: dict[tuple, list[str]] = {}
    checked: dict[tuple, tuple] = {}  # the modules of an adapter share a few layouts: check each layout once
    for name in names:
        Bs = [upload[name][0] for upload in uploads]
        As = [upload[name][1] for upload in uploads]
        layout = _layout(Bs, As)
        key = checked.get(layout) if layout is not None else None
        if key is None:
            if any(isinstance(B, Tensor) and B.ndim != 2 for B in Bs):
                raise ValueError(
                    f"module {name!r}: factors must be 2-D per module, got B of shape {tuple(Bs[0].shape)}"
                )
            try:
                ranks, dtype, device = check_factor_lists(Bs, As)
            except ValueError as exc:
                raise ValueError(f"module {name!r}: {exc}") from None
            key = checked[layout] = (Bs[0].shape[0], As[0].shape[1], tuple(ranks), dtype, device)
        groups.setdefault(key, []).append(name)

    result: dict[str, tuple[Tensor, Tensor]] = {}
    spectra: dict[str, Tensor] = {}
    for (_, _, ranks, dtype, _), group in groups.items():
        try:
            if mode == "reduced" and dtype != torch.float64:  # straight from the uploads into the float64 stacks
                B_g, A_g, S = _in_dtype(*_reduced64(*_stack_modules(uploads, group, ranks), ranks, rank, w), dtype)
            else:  # one batch per group: client i's factors of every module in the group, on a leading dim
                Bs = [torch.stack([u[n][0].mT for n in group]).mT for u in uploads]
                As = [torch.stack([u[n][1] for n in group]) for u in uploads]
                B_g, A_g, S = _reconstruct_clients(Bs, As, rank, w, mode, oversample, generator)
        except ValueError as exc:  # name the module, not the batch position
            for n in group:
                where = first_nonfinite_client([u[n][0] for u in uploads], [u[n][1] for u in uploads])
                if where != "the weighted factors":
                    raise ValueError(f"module {n!r}: {where} contains NaN or Inf") from None
            raise ValueError(f"modules {group}: {exc}") from None
        for j, n in enumerate(group):
            result[n] = (B_g[j], A_g[j])
            spectra[n] = S[j]
    ordered = {n: result[n] for n in names}
    if return_spectrum:
        return ordered, {n: spectra[n] for n in names}
    return ordered


def _layout(Bs: Sequence[object], As: Sequence[object]) -> tuple | None:
    """What :func:`check_factor_lists` checks of one module's uploads, as a hashable key; None if any is not a
    tensor."""
    if not all(isinstance(t, Tensor) for t in (*Bs, *As)):
        return None
    return tuple((B.shape, A.shape, B.dtype, A.dtype, B.device, A.device) for B, A in zip(Bs, As))


def weighted_stack(Bs: Sequence[Tensor], As: Sequence[Tensor], w: Sequence[float], dtype: torch.dtype):
    """``B_cat = [sqrt(w_1) B_1, ..., sqrt(w_N) B_N]: (*, d, r_tot)`` and ``A_cat = [sqrt(w_i) A_i]_i: (*, r_tot, k)``
    in ``dtype``, so that ``B_cat @ A_cat = sum_i w_i B_i A_i`` (``w`` already normalised).

    ``B_cat`` is built transposed and returned as a view, so that it is column-major for LAPACK's QR.
    """
    scale = _column_weights(w, [B.shape[-1] for B in Bs], dtype, Bs[0].device)[:, None]
    Bt = torch.cat([B.mT for B in Bs], dim=-2).to(dtype) * scale
    A_cat = torch.cat(list(As), dim=-2).to(dtype) * scale
    return Bt.mT, A_cat


def _reconstruct_clients(Bs, As, rank, w, mode, oversample, generator) -> tuple[Tensor, Tensor, Tensor]:
    """Checked client lists (``(*, d, r_i)``, ``(*, r_i, k)``) -> ``(B_g, A_g, S)`` in the inputs' dtype."""
    dtype = Bs[0].dtype
    try:
        if mode == "reduced" and dtype != torch.float64:
            ranks = [B.shape[-1] for B in Bs]
            B_g, A_g, S = _reduced64(_stack64([B.mT for B in Bs], "B"), _stack64(As, "A"), ranks, rank, w)
        else:
            B_cat, A_cat = weighted_stack(Bs, As, w, compute_dtype(dtype))
            B_g, A_g, S = _reconstruct_cat(B_cat, A_cat, rank, mode, oversample, generator)
    except _NonFinite:
        raise ValueError(f"{first_nonfinite_client(Bs, As)} contains NaN or Inf") from None
    return _in_dtype(B_g, A_g, S, dtype)


def _in_dtype(B_g: Tensor, A_g: Tensor, S: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The factors cast to the uploads' ``dtype``; ValueError where they do not fit it."""
    out_B, out_A = B_g.to(dtype), A_g.to(dtype)
    # |B_g| entries <= sigma_1 (its columns have norms sigma_j) and A_g has orthonormal rows: below finfo.max the
    # outputs fit and the scan of both is skipped.
    fits = S.numel() == 0 or float(S.max()) * (1 + 1e-3) < torch.finfo(dtype).max
    if not (fits or bool(torch.isfinite(out_B).all() and torch.isfinite(out_A).all())):  # fits in float64 only
        raise ValueError(
            f"the global factors do not fit in {dtype} (largest |B_g| entry {float(B_g.abs().max()):.3g}, "
            f"largest representable {torch.finfo(dtype).max:.3g}); aggregate float32 uploads instead"
        )
    return out_B, out_A, S


def _column_weights(w: Sequence[float], ranks: Sequence[int], dtype: torch.dtype, device) -> Tensor:
    """``(sum_i r_i,)``: sqrt(w_i) for each of client i's ``ranks[i]`` columns (the square root taken in float64)."""
    sw = torch.tensor(list(w), dtype=torch.float64).sqrt().to(dtype)
    return sw.repeat_interleave(torch.tensor(list(ranks))).to(device)


def _reduced64(Bt: Tensor, A: Tensor, ranks: Sequence[int], rank: int, w) -> tuple[Tensor, Tensor, Tensor]:
    """``reduced`` on the unweighted float64 stacks ``Bt: (*, m, d)``, ``A: (*, m, k)`` of float32 / half uploads:
    the Gram route while ``m = sum_i r_i <= min(d, k)``; beyond, the QR route in float64 (:func:`_reduced_qr`), whose
    core is ``min(d, m) x min(k, m)`` where the Gram route's eigenproblems would be ``m x m``, with the core's leading
    pairs from its smaller Gram (:func:`_gram_pairs`). K = 10 clients of r = 64 on a 256-wide adapter: about 3x
    faster than Householder QR on both sides and the core's SVD, the same optimum at the float32 floor."""
    m, d, k = A.shape[-2], Bt.shape[-1], A.shape[-1]
    if m <= min(d, k):
        return _gram_route(Bt, A, ranks, rank, w)
    sw = _column_weights(w, ranks, Bt.dtype, Bt.device)[:, None]
    B_g, A_g, S = _reduced_qr((Bt * sw).mT, A * sw, rank, _gram_pairs)
    return _pad_rank(B_g, A_g, rank) + (S,)


def _gram_route(Bt: Tensor, A: Tensor, ranks: Sequence[int], rank: int, w) -> tuple[Tensor, Tensor, Tensor]:
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
    sw = _column_weights(w, ranks, f64, Bt.device)
    G_B, G_A = Bt @ Bt.mT, A @ A.mT
    nb, na = G_B.diagonal(dim1=-2, dim2=-1).sqrt(), G_A.diagonal(dim1=-2, dim2=-1).sqrt()
    _require_finite(nb, na)  # the squared column norms hold any NaN/Inf
    both = (nb > 0) & (na > 0)
    c = torch.where(both, (na / torch.where(both, nb, 1)).sqrt(), torch.ones_like(nb))
    beta, alpha = sw * c, sw / c
    P, to_Q = _row_space(alpha[..., :, None] * G_A * alpha[..., None, :])
    BP = beta[..., :, None] * P  # diag(beta) P: (*, m, m)
    K = BP.mT @ G_B @ BP
    lam, Z = torch.linalg.eigh((K + K.mT) / 2)
    _require_finite(lam)  # an entry near the float64 limit overflowed in a Gram
    lam, Z = lam.flip(-1), Z.flip(-1)  # descending
    m = A.shape[-2]
    q = min(Bt.shape[-1], A.shape[-1], m)
    n = min(rank, q)
    Z_R = Z[..., :n]
    B_g = ((BP @ Z_R).mT @ Bt).mT  # B diag(beta) P Z_R, computed against the row-major B^T
    A_g = (Z_R.mT @ (to_Q * alpha[..., None, :])) @ A
    S = lam[..., :q].clamp_min(0).sqrt()
    return _pad_rank(B_g, A_g, rank) + (S,)


def _check_mode(mode: str, oversample: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode(={mode!r}) must be one of {MODES}")
    if isinstance(oversample, bool) or not isinstance(oversample, int) or oversample < 0:
        raise ValueError(f"oversample(={oversample!r}) must be an int >= 0")


class _NonFinite(ValueError):
    """NaN/Inf reached the reconstruction; the public entry points name the client it came from."""


def _require_finite(*tensors: Tensor) -> None:
    """Raise :class:`_NonFinite` if any of ``tensors`` holds NaN or Inf."""
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise _NonFinite("NaN or Inf in the factors")


_WORKSPACES = threading.local()  # per thread: the float64 stacks of the last few shapes, reused round after round


def _workspace(slot: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float64) -> Tensor:
    """A ``dtype`` tensor of ``shape`` for ``slot``, reused by the next call with the same slot, shape and dtype, so a
    server reconstructing the same adapter every round allocates (and first-touches) its stacks once; what it holds
    is only valid until then."""
    cache = getattr(_WORKSPACES, "cache", None)
    if cache is None:
        cache = _WORKSPACES.cache = {}
    key = (slot, shape, device, dtype)
    out = cache.pop(key, None)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    cache[key] = out  # most recent last
    while len(cache) > 8:
        del cache[next(iter(cache))]
    return out


def _stack_modules(uploads, group: Sequence[str], ranks: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The float64 stacks of :func:`_gram_route` for every module of ``group`` at once, ``Bt: (G, m, d)`` and
    ``A: (G, m, k)``, written straight from the clients' uploads (each casts as it is copied) into the workspaces."""
    B0, A0 = uploads[0][group[0]]
    G, m, d, k = len(group), sum(ranks), B0.shape[0], A0.shape[1]
    Bt, A = _workspace("B", (G, m, d), B0.device), _workspace("A", (G, m, k), A0.device)
    if len(set(ranks)) == 1:  # a stack in the uploads' dtype, then one copy that casts (and transposes B): faster
        n, r = len(uploads), ranks[0]  # than a casting cat, and than transposing piece by piece. The stacks in
        # the uploads' dtype are workspaces too: a fresh allocation of that size is first-touched page by page, which
        # cost more than the stacking itself (2.5 against 0.2 ms per factor for a RoBERTa-large adapter)
        stacked = _workspace("B_in", (G * n, d, r), B0.device, B0.dtype)
        torch.stack([u[name][0] for name in group for u in uploads], out=stacked)
        Bt.view(G, n, r, d).copy_(stacked.view(G, n, d, r).mT)
        stacked = _workspace("A_in", (G * n, r, k), A0.device, A0.dtype)
        torch.stack([u[name][1] for name in group for u in uploads], out=stacked)
        A.view(G * n, r, k).copy_(stacked)
    else:
        torch.cat([u[name][0].mT for name in group for u in uploads], out=Bt.view(G * m, d))
        torch.cat([u[name][1] for name in group for u in uploads], out=A.view(G * m, k))
    return Bt, A


def _stack64(parts: Sequence[Tensor], slot: str) -> Tensor:
    """``parts`` concatenated along dim -2 into the float64 workspace of ``slot`` (one pass that casts as it
    copies); valid until the next call with that slot and shape."""
    shape = (*parts[0].shape[:-2], sum(t.shape[-2] for t in parts), parts[0].shape[-1])
    out = _workspace(slot, shape, parts[0].device)
    start = 0
    for t in parts:
        out[..., start : start + t.shape[-2], :].copy_(t)
        start += t.shape[-2]
    return out


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
    mu, E = torch.linalg.eigh(G)
    keep = mu > mu[..., -1:].clamp_min(0) * (m * eps)
    root = torch.where(keep, mu, 1).sqrt()
    P = E * torch.where(keep, root, 0)[..., None, :]
    T = (E * torch.where(keep, 1 / root, 0)[..., None, :]).mT
    return P, T


def _reduced_qr(B_cat: Tensor, A_cat: Tensor, rank: int, top_pairs) -> tuple[Tensor, Tensor, Tensor]:
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


def _svd_pairs(H: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """``H: (*, p, q)`` -> ``(U_n S_n, V_n^T, S)`` from its SVD, ``n = min(rank, p, q)``: exact to ``H``'s dtype."""
    U, S, Vh = _svd(H)
    n = min(rank, S.shape[-1])
    return U[..., :n] * S[..., None, :n], Vh[..., :n, :], S


def _gram_pairs(H: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_svd_pairs` for a float64 core of float32 / half uploads, from the eigendecomposition of its smaller
    Gram matrix (about half the SVD's time). With ``q <= p``: ``H^T H = V diag(sigma^2) V^T``, ``B_c = H V_n``,
    ``A_c = V_n^T``; with ``q > p``: ``H H^T = U diag(sigma^2) U^T`` and the QR ``H^T U_n = Q R`` (``R`` is ``S_n`` up
    to signs), ``B_c = U_n R^T``, ``A_c = Q^T``. Either way ``B_c A_c`` is ``H`` projected onto the computed
    subspace, without dividing by a singular value, and ``A_c`` has orthonormal rows. The eigenvalues carry an
    absolute error of about ``eps_64 sigma_1^2``, so each sigma one of at most ``sqrt(eps_64) sigma_1`` (1.5e-8
    sigma_1): below the float32 floor, as in :func:`_gram_route`."""
    _require_finite(H)
    p, q = H.shape[-2], H.shape[-1]
    n = min(rank, p, q)
    lam, E = torch.linalg.eigh(H.mT @ H if q <= p else H @ H.mT)  # ascending
    _require_finite(lam)  # an entry near the float64 limit overflowed in the Gram
    S = lam.flip(-1).clamp_min(0).sqrt()
    E_n = E[..., -n:].flip(-1)  # the leading n eigenvectors, descending
    if q <= p:
        return H @ E_n, E_n.mT, S
    Q, R = torch.linalg.qr(H.mT @ E_n)  # (*, q, n), (*, n, n)
    return E_n @ R.mT, Q.mT, S


def _reconstruct_cat(
    B_cat: Tensor, A_cat: Tensor, rank: int, mode: str, oversample: int, generator: torch.Generator | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Core on pre-weighted factors ``B_cat: (*, d, m)``, ``A_cat: (*, m, k)``; returns ``(B_g, A_g, S)``.

    NaN or Inf anywhere in the factors propagates into the small matrix that is decomposed (the QR
    core, the sketch's projection or the dense aggregate), so checking that matrix alone catches
    them without another pass over the uploads.
    """
    if mode == "reduced":
        B_g, A_g, S = _reduced_qr(B_cat, A_cat, rank, _svd_pairs)
    elif mode == "randomized":
        ell = min(rank + oversample, B_cat.shape[-1])
        gen_device = generator.device if generator is not None else B_cat.device
        shape = (*A_cat.shape[:-2], A_cat.shape[-1], ell)
        Omega = torch.randn(shape, generator=generator, device=gen_device, dtype=A_cat.dtype).to(A_cat.device)
        Q, _ = torch.linalg.qr(B_cat @ (A_cat @ Omega))  # range finder: (*, d, l)
        B_c, A_g, S = _svd_pairs((Q.mT @ B_cat) @ A_cat, rank)  # (*, l, k)
        B_g = Q @ B_c
    else:  # dense: the (d, k) aggregate, for comparison only
        B_g, A_g, S = _svd_pairs(B_cat @ A_cat, rank)
    return _pad_rank(B_g, A_g, rank) + (S,)


def _svd(M: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    _require_finite(M)
    return torch.linalg.svd(M, full_matrices=False)


def _pad_rank(B_g: Tensor, A_g: Tensor, rank: int) -> tuple[Tensor, Tensor]:
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

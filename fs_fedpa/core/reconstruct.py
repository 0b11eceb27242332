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
uploads reach the same optimum through float64 Gram matrices of the stacks, which stays at the float32 floor where
float32 Householder QR loses digits, while ``r_tot <= min(d, k)``; past that the Grams' ``r_tot x r_tot``
eigenproblems outgrow the QR core ``min(d, r_tot) x min(k, r_tot)``, and they take the QR route in float64 with the
core's leading pairs from its smaller Gram. The routes are in :mod:`fs_fedpa.core.factored_svd`.
``randomized`` replaces the two QRs by a Gaussian sketch of width ``l = min(R_g + p, r_tot)``
applied through the factored form (Appendix G.1.2, Halko et al. 2011, Alg. 4.1 + 5.1), at
``O(N d r l)``. ``dense`` forms the aggregate and takes its SVD; it exists only as the
comparison baseline (what FlexLoRA does).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Literal, TypedDict, Unpack

import torch
from torch import Tensor

from fs_fedpa.core._checks import (
    check_factor_lists,
    check_positive_int,
    compute_dtype,
    first_nonfinite_client,
    normalized_weights,
)
from fs_fedpa.core.factored_svd import NonFinite, column_weights, reconstruct_cat, reduced64

Mode = Literal["reduced", "randomized", "dense"]
MODES: tuple[str, ...] = ("reduced", "randomized", "dense")


class SVDOptions(TypedDict, total=False):
    """How the truncated SVD of the aggregate is taken, for :func:`reconstruct` and :func:`reconstruct_adapter`.

    mode: ``"reduced"`` (the default; exact, QR + core SVD), ``"randomized"`` (a sketch of width
        ``min(rank + oversample, r_tot)``) or ``"dense"`` (forms the ``(d, k)`` aggregate).
    oversample: p, the sketch oversampling of ``randomized`` (default 8; Halko's bound needs p >= 2).
    generator: seeds the Gaussian test matrix of ``randomized``; drawn on its own device (default: torch's).
    """

    mode: Mode
    oversample: int
    generator: torch.Generator | None


def svd_options(options: Mapping) -> tuple[str, int, torch.Generator | None]:
    """``(mode, oversample, generator)`` from :class:`SVDOptions` keywords, with their defaults; TypeError for a
    keyword it does not know, ValueError for a mode or oversampling it does not take."""
    if unknown := sorted(set(options) - set(SVDOptions.__annotations__)):
        raise TypeError(f"unknown option(s) {unknown}; the options are {sorted(SVDOptions.__annotations__)}")
    mode, oversample = options.get("mode", "reduced"), options.get("oversample", 8)
    _check_mode(mode, oversample)
    return mode, oversample, options.get("generator")


def reconstruct(
    Bs: Sequence[Tensor],
    As: Sequence[Tensor],
    rank: int,
    weights: Sequence[float] | Tensor | None = None,
    return_spectrum: bool = False,
    **options: Unpack[SVDOptions],
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Best rank-``rank`` factors ``(B_g, A_g)`` of ``sum_i w_i B_i A_i`` (§4.3, Eq. efficient reconstruction).

    Args:
        Bs: client factors ``Bs[i]: (*, d, r_i)``; the ranks ``r_i`` may differ per client.
            Leading batch dims ``*`` (equal for all clients) reconstruct many layers at once.
        As: client factors ``As[i]: (*, r_i, k)``.
        rank: R_g, the rank of the returned factors.
        weights: ``w_i >= 0`` (not all zero), normalised to sum to 1; ``None`` is uniform.
        return_spectrum: also return the singular values of the aggregate.
        options: ``mode``, ``oversample``, ``generator`` (:class:`SVDOptions`).

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
    mode, oversample, generator = svd_options(options)
    w = normalized_weights(weights, len(Bs))
    B_g, A_g, S = _reconstruct_clients(Bs, As, rank, w, mode, oversample, generator)
    return (B_g, A_g, S) if return_spectrum else (B_g, A_g)


def reconstruct_adapter(
    uploads: Sequence[Mapping[str, tuple[Tensor, Tensor]]],
    rank: int,
    weights: Sequence[float] | Tensor | None = None,
    return_spectrum: bool = False,
    **options: Unpack[SVDOptions],
) -> dict[str, tuple[Tensor, Tensor]] | tuple[dict[str, tuple[Tensor, Tensor]], dict[str, Tensor]]:
    """:func:`reconstruct` for every LoRA module of an adapter, batched over modules of equal shapes.

    Args:
        uploads: one mapping per client, ``module name -> (B_i: (d, r_i), A_i: (r_i, k))``; every
            client names the same modules. A client's rank may differ between modules.
        rank, weights, options: as in :func:`reconstruct`; ``rank`` is R_g for every module.
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
    mode, oversample, generator = svd_options(options)
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
                B_g, A_g, S = _in_dtype(*reduced64(*_stack_modules(uploads, group, ranks), ranks, rank, w), dtype)
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
    scale = column_weights(w, [B.shape[-1] for B in Bs], dtype, Bs[0].device)[:, None]
    Bt = torch.cat([B.mT for B in Bs], dim=-2).to(dtype) * scale
    A_cat = torch.cat(list(As), dim=-2).to(dtype) * scale
    return Bt.mT, A_cat


def _reconstruct_clients(Bs, As, rank, w, mode, oversample, generator) -> tuple[Tensor, Tensor, Tensor]:
    """Checked client lists (``(*, d, r_i)``, ``(*, r_i, k)``) -> ``(B_g, A_g, S)`` in the inputs' dtype."""
    dtype = Bs[0].dtype
    try:
        if mode == "reduced" and dtype != torch.float64:
            ranks = [B.shape[-1] for B in Bs]
            B_g, A_g, S = reduced64(_stack64([B.mT for B in Bs], "B"), _stack64(As, "A"), ranks, rank, w)
        else:
            B_cat, A_cat = weighted_stack(Bs, As, w, compute_dtype(dtype))
            B_g, A_g, S = reconstruct_cat(B_cat, A_cat, rank, mode, oversample, generator)
    except NonFinite:
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


def _check_mode(mode: str, oversample: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode(={mode!r}) must be one of {MODES}")
    if isinstance(oversample, bool) or not isinstance(oversample, int) or oversample < 0:
        raise ValueError(f"oversample(={oversample!r}) must be an int >= 0")


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
    """The float64 stacks of :func:`~fs_fedpa.core.factored_svd.gram_route` for every module of ``group`` at once,
    ``Bt: (G, m, d)`` and ``A: (G, m, k)``, written straight from the clients' uploads (each casts as it is copied)
    into the workspaces."""
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



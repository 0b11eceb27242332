"""Client-level DP's post-processing (docs/privacy.md): the new global factors from a round's noisy release. Pure
post-processing of what :mod:`fs_fedpa.privacy.client_level` released, so it costs no privacy; no FS import.

The release of a ``"product"`` method is a dense (d, k) noisy mean of the clients' clipped products, so its
rank-R_g factors come from that matrix itself (an exact SVD, or with ``fedpa.svd: randomized`` a sketch of it):
:func:`fs_fedpa.reconstruct` works on stacked factors, which the noise does not have."""

from __future__ import annotations

import torch
from torch import Generator, Tensor

from fs_fedpa.core.factored_svd import pad_rank, svd_pairs
from fs_fedpa.core.norms import PART

Factors = dict[str, tuple[Tensor, Tensor]]


def global_from_release(dp_space: str, release: dict, global_: Factors, R_g: int, cfg, generator: Generator,
                        ) -> tuple[Factors, dict[str, Tensor]]:  # fmt: skip
    """The new global factors and spectra. ``"product"``: ``release[name]`` is the (d, k) noisy mean product, and the
    global is its rank-R_g truncated SVD (B = U S, A = V^T; ``cfg.svd == "randomized"`` sketches it with width
    R_g + p). ``"change"``: ``release[name][part]`` is the noisy mean change of that factor, added to ``global_``."""
    if dp_space == "product":
        out, spectra = {}, {}
        for name, M in release.items():
            out[name], spectra[name] = top_factors(M, R_g, cfg, generator)
        return out, spectra
    out = {}
    for name, (B, A) in global_.items():
        pair = [B, A]
        for part, change in release[name].items():
            pair[PART[part]] = pair[PART[part]] + change.to(pair[PART[part]])
        out[name] = (pair[0], pair[1])
    return out, {}


def top_factors(M: Tensor, rank: int, cfg, generator: Generator) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """Rank-``rank`` factors ``(U S, V^T)`` of the (d, k) matrix ``M`` (exact SVD in float64, or with
    ``fedpa.svd: randomized`` a sketch of width rank + p, two power iterations), zero-padded to ``rank`` where ``M``
    has fewer singular values, and its leading singular values."""
    if cfg.svd == "randomized":
        q = min(rank + cfg.oversample, *M.shape)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        with torch.random.fork_rng(devices=[M.device] if M.device.type == "cuda" else []):
            torch.manual_seed(seed)  # svd_lowrank draws from torch's global stream
            U, S, V = torch.svd_lowrank(M.float(), q=q, niter=2)
        n = min(rank, S.shape[0])
        B, A = U[:, :n] * S[:n], V.mT[:n]
    else:
        B, A, S = svd_pairs(M.double(), rank)
    B, A = pad_rank(B.to(M.dtype), A.to(M.dtype), rank)
    return (B, A), S[: min(rank, S.shape[0])].to(M.dtype)

"""Factor-wise aggregation (FedIT and the other factor-averaging baselines), in plain torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fs_fedpa.core._checks import normalized_weights


def average_factors(
    uploads: Sequence[Mapping[str, tuple[Tensor, Tensor]]], weights: Sequence[float] | Tensor | None = None
) -> dict[str, tuple[Tensor, Tensor]]:
    """``(sum_i w_i B_i, sum_i w_i A_i)`` per module (FedIT): the product generally differs from
    ``sum_i w_i B_i A_i`` by the cross terms ``B_i A_j`` (the aggregation mismatch of §3.1).

    Args:
        uploads: one ``{module: (B_i: (d, r), A_i: (r, k))}`` per client; every client must use the same
            rank per module (factors of different ranks cannot be averaged).
        weights: ``w_i >= 0``, normalised; ``None`` is uniform.
    """
    if not uploads:
        raise ValueError("uploads is empty")
    w = normalized_weights(weights, len(uploads))
    out = {}
    for name in uploads[0]:
        shapes = {(tuple(u[name][0].shape), tuple(u[name][1].shape)) for u in uploads}
        if len(shapes) > 1:
            raise ValueError(
                f"module {name!r}: factor-wise averaging needs equal shapes, got {sorted(shapes)}; "
                "clients of different ranks need a product-space method (fedpa, flexlora)"
            )
        out[name] = (_average([u[name][0] for u in uploads], w), _average([u[name][1] for u in uploads], w))
    return out


def _average(factors: list[Tensor], w: list[float]) -> Tensor:
    """``sum_i w_i Y_i``; a factor every client holds unchanged (FFA-LoRA's frozen A, RoLoRA's untrained factor)
    is returned as it is, since the weighted sum of equal tensors can differ from them in the last bit."""
    first = factors[0]
    if all(Y is first or torch.equal(Y, first) for Y in factors[1:]):
        return first.clone()
    return sum(wi * Y for wi, Y in zip(w, factors))


def stack_factors(
    factors: Sequence[tuple[Tensor, Tensor]], weights: Sequence[float] | Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``([w_1 B_1, ..., w_N B_N], [A_1; ...; A_N])``: factors of rank ``sum_i r_i`` whose product is exactly
    ``sum_i w_i B_i A_i`` (FLoRA's stacking); ranks may differ. ``factors``: ``(B_i: (d, r_i), A_i: (r_i, k))``;
    ``weights``: ``w_i >= 0``, normalised; ``None`` is uniform."""
    if not factors:
        raise ValueError("factors is empty")
    w = normalized_weights(weights, len(factors))
    return torch.cat([wi * B for wi, (B, _) in zip(w, factors)], dim=1), torch.cat([A for _, A in factors], dim=0)

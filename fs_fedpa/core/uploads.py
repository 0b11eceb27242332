"""Checks of a client's upload before the server aggregates it: the right modules, shapes and finite values."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


def upload_problem(
    factors: Mapping[str, tuple[Tensor, Tensor]],
    shapes: Mapping[str, tuple[int, int]],
    rank: int | tuple[int, ...],
    shared: Mapping[str, Tensor] | None = None,
    shared_shapes: Mapping[str, tuple[int, ...]] | None = None,
    max_abs: float | None = None,
) -> str | None:
    """Why this upload cannot be aggregated, or None if it can.

    ``factors[name] = (B: (d, r), A: (r, k))`` must name exactly the modules of ``shapes[name] = (d, k)``, at
    the client's rank ``r = rank`` (or a rank in the tuple ``rank``), with finite values (and, given ``max_abs``, none
    beyond it in absolute value); ``shared`` tensors, if the run has any, must match ``shared_shapes`` and obey the
    same value bounds.
    """
    if missing := sorted(shapes.keys() - factors.keys()):
        return f"LoRA modules missing from the upload: {missing[:3]}{' ...' if len(missing) > 3 else ''}"
    if unknown := sorted(factors.keys() - shapes.keys()):
        return f"unknown LoRA modules in the upload: {unknown[:3]}{' ...' if len(unknown) > 3 else ''}"
    allowed = (rank,) if isinstance(rank, int) else tuple(rank)
    for name, (B, A) in factors.items():
        d, k = shapes[name]
        r = B.shape[1] if B.ndim == 2 and B.shape[1] in allowed else allowed[-1]
        if tuple(B.shape) != (d, r) or tuple(A.shape) != (r, k):
            return (
                f"{name}: B {tuple(B.shape)} and A {tuple(A.shape)}, expected ({d}, {r}) and ({r}, {k}) "
                f"for the client's rank {r if len(allowed) == 1 else f'(at most {allowed[-1]})'}"
            )
        if not (torch.isfinite(B).all() and torch.isfinite(A).all()):
            return f"{name}: NaN or Inf in {'B' if not torch.isfinite(B).all() else 'A'}"
        for part, t in (("B", B), ("A", A)):
            if max_abs is not None and t.numel() and (peak := float(t.abs().max())) > max_abs:
                return f"{name}: |{part}| reaches {peak:.3g} > {max_abs:g}"
    shared, shared_shapes = shared or {}, shared_shapes or {}
    if shared.keys() != shared_shapes.keys():
        return f"shared tensors {sorted(shared)[:3]} differ from the expected {sorted(shared_shapes)[:3]}"
    for name, t in shared.items():
        if tuple(t.shape) != tuple(shared_shapes[name]):
            return f"shared tensor {name}: shape {tuple(t.shape)}, expected {tuple(shared_shapes[name])}"
        if t.is_floating_point() and not torch.isfinite(t).all():
            return f"shared tensor {name}: NaN or Inf"
        if max_abs is not None and t.numel() and (peak := float(t.abs().max())) > max_abs:
            return f"shared tensor {name}: |value| reaches {peak:.3g} > {max_abs:g}"
    return None

"""Argument checks shared by the public entry points of :mod:`fs_fedpa.core`.

Every check raises ``ValueError`` naming the argument and the offending value, so that a bad
upload or config is reported where it enters, not deep inside a LAPACK call.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype (fp16, bf16, fp32) computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_positive_int(value: object, name: str) -> int:
    """``value`` as an int if it is an integer (numpy ints included, bools excluded) >= 1."""
    try:
        as_int = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        as_int = None
    if isinstance(value, bool) or as_int is None or as_int <= 0:
        raise ValueError(f"{name}(={value!r}) must be a positive int")
    return as_int


def check_factor_lists(Bs: Sequence[Tensor], As: Sequence[Tensor]) -> tuple[list[int], torch.dtype, torch.device]:
    """Check client factors ``Bs[i]: (*, d, r_i)``, ``As[i]: (*, r_i, k)``; return ``(r_i list, dtype, device)``."""
    if isinstance(Bs, Tensor) or isinstance(As, Tensor):
        raise ValueError("Bs and As must be sequences of tensors, one per client, not a single tensor")
    if len(Bs) == 0:
        raise ValueError("Bs is empty: need the factors of at least one client")
    if len(Bs) != len(As):
        raise ValueError(f"len(Bs)(={len(Bs)}) != len(As)(={len(As)}): one (B_i, A_i) pair per client")
    B0, A0 = Bs[0], As[0]
    for i, (B, A) in enumerate(zip(Bs, As)):
        if not isinstance(B, Tensor) or not isinstance(A, Tensor):
            raise ValueError(f"client {i}: B and A must be torch tensors, got {type(B).__name__}, {type(A).__name__}")
        if B.ndim < 2 or A.ndim < 2:
            raise ValueError(
                f"client {i}: B and A must have at least 2 dims, got shapes {tuple(B.shape)}, {tuple(A.shape)}"
            )
        if not B.is_floating_point() or not A.is_floating_point():
            raise ValueError(f"client {i}: factors must be real floating point, got {B.dtype}, {A.dtype}")
        if B.shape[-1] != A.shape[-2]:
            raise ValueError(
                f"client {i}: B has r={B.shape[-1]} columns but A has {A.shape[-2]} rows (shapes "
                f"{tuple(B.shape)}, {tuple(A.shape)})"
            )
        if B.shape[-1] == 0:
            raise ValueError(f"client {i}: rank r_i must be >= 1, got factors of rank 0")
        if B.shape[:-1] != B0.shape[:-1]:
            raise ValueError(
                f"client {i}: B has shape {tuple(B.shape)} but client 0 has {tuple(B0.shape)}; "
                "all B_i must share (*, d)"
            )
        if A.shape[:-2] + A.shape[-1:] != A0.shape[:-2] + A0.shape[-1:]:
            raise ValueError(
                f"client {i}: A has shape {tuple(A.shape)} but client 0 has {tuple(A0.shape)}; "
                "all A_i must share (*, k)"
            )
        if B.shape[:-2] != A.shape[:-2]:
            raise ValueError(f"client {i}: batch dims of B {tuple(B.shape[:-2])} and A {tuple(A.shape[:-2])} differ")
        if B.dtype != B0.dtype or A.dtype != B0.dtype:
            raise ValueError(f"client {i}: dtypes {B.dtype}, {A.dtype} differ from client 0's {B0.dtype}")
        if B.device != B0.device or A.device != B0.device:
            raise ValueError(f"client {i}: devices {B.device}, {A.device} differ from client 0's {B0.device}")
    return [int(B.shape[-1]) for B in Bs], B0.dtype, B0.device


def normalized_weights(weights: Sequence[float] | Tensor | None, n: int) -> list[float]:
    """Return ``w_i / sum(w)`` as floats; ``None`` means uniform ``1/n`` (the paper's 1/N)."""
    if weights is None:
        return [1.0 / n] * n
    if isinstance(weights, Tensor):
        if weights.ndim != 1:
            raise ValueError(f"weights must be 1-D, got shape {tuple(weights.shape)}")
        values = [float(w) for w in weights.detach().cpu().tolist()]
    else:
        try:
            values = [float(w) for w in weights]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"weights must be a sequence of numbers, got {weights!r}") from exc
    if len(values) != n:
        raise ValueError(f"len(weights)(={len(values)}) != number of clients(={n})")
    for i, w in enumerate(values):
        if not math.isfinite(w):
            raise ValueError(f"weights[{i}](={w}) is not finite")
        if w < 0:
            raise ValueError(f"weights[{i}](={w}) is negative; aggregation weights must be >= 0")
    total = sum(values)
    if total <= 0:
        raise ValueError("weights are all zero; at least one client needs a positive weight")
    return [w / total for w in values]


def check_finite(t: Tensor, what: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what} contains NaN or Inf")


def first_nonfinite_client(Bs: Sequence[Tensor], As: Sequence[Tensor]) -> str:
    """Name the first client whose factors are not finite (slow path, only after a failed check)."""
    for i, (B, A) in enumerate(zip(Bs, As)):
        if not bool(torch.isfinite(B).all()):
            return f"B of client {i}"
        if not bool(torch.isfinite(A).all()):
            return f"A of client {i}"
    return "the weighted factors"

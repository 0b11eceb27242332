"""Checks of saved state that several owners share: each owner of a resume file's part (the global model, the round
log, the aggregator, a client's state, ...) validates its own fields with these, naming the file and the field in a
one-line ``ValueError`` (``<at>: field '<part>.<key>' ...``) before anything is installed. Tensors are checked for
what they claim to be (dense, floating point, storage for every element) before any value is read. No FederatedScope
import.
"""

from __future__ import annotations

import torch
from torch import Tensor


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_fields(saved, at: str, part: str, keys) -> None:
    """``saved`` is a mapping holding every key of ``keys``; else ValueError naming ``part`` (or ``part.key``)."""
    check_mapping(saved, at, part)
    if missing := [k for k in keys if k not in saved]:
        raise ValueError(f"{at} has no field '{part}.{missing[0]}'; it is not a whole FedPA resume point")


def check_mapping(value, at: str, field: str) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{at}: field {field!r} is a {type(value).__name__}, not a mapping")


def check_int(saved: dict, at: str, key: str, minimum: int, maximum: int | None = None, field: str | None = None):
    """ValueError unless ``saved[key]`` is an int from ``minimum`` to ``maximum`` (``field``: its name in the file)."""
    field = key if field is None else field
    if key not in saved:
        raise ValueError(f"{at} has no field {field!r}")
    value = saved[key]
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(f"{at}: field {field!r} is {value!r:.100}; it must be an int {bound}")


def owns_storage(t: Tensor) -> bool:
    """Whether every element of the dense tensor ``t`` has storage of its own (not a planted stride-0 view of 10^12
    elements over a few bytes): from its strides and storage size, no value read."""
    return all(stride > 0 for size, stride in zip(t.shape, t.stride()) if size > 1) and (
        t.untyped_storage().nbytes() >= t.numel() * t.element_size()
    )


def check_tensor(t, where: str) -> None:
    """A dense floating-point tensor whose every element has storage of its own; its values are not read (a planted
    view can stand for far more elements than its file holds, so :func:`check_finite` runs after the shape's
    check)."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{where} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided or not t.is_floating_point():
        raise ValueError(f"{where} is a {t.dtype} tensor of layout {t.layout}, not a dense floating-point one")
    if not owns_storage(t):
        shape = tuple(t.shape)
        raise ValueError(f"{where} is a view of shape {shape} and strides {t.stride()} over a smaller storage")


def check_finite(t: Tensor, where: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where} holds a NaN or an Inf")


def check_pairs(pairs, at: str, field: str, shapes: dict, max_rank: int | None, lower_rank: bool) -> None:
    """``pairs`` maps exactly the modules of ``shapes`` to finite floating-point ``(B, A)`` of those shapes; with
    ``lower_rank``, 2-D factors may have any rank from 1 to ``max_rank`` (default the expected rank)."""
    if not isinstance(pairs, dict):
        raise ValueError(f"{at}: field {field!r} is a {type(pairs).__name__}, not a mapping of modules to (B, A)")
    if set(pairs) != set(shapes):
        odd = sorted(set(pairs) ^ set(shapes))[:3]
        raise ValueError(f"{at}: field {field!r} does not have the modules of this run's adapter (e.g. {odd})")
    for name, pair in pairs.items():
        where = f"{at}: field '{field}[{name!r}]'"
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{where} is not a pair (B, A)")
        for part, t in zip("BA", pair):
            check_tensor(t, f"{where} {part}")
        (B, A), (want_B, want_A) = [tuple(t.shape) for t in pair], shapes[name]
        if not _fits(B, A, want_B, want_A, max_rank if lower_rank else None, lower_rank):
            raise ValueError(f"{where} has shapes B {B}, A {A}; this run's adapter has B {want_B}, A {want_A}")
        for part, t in zip("BA", pair):
            check_finite(t, f"{where} {part}")


def _fits(B: tuple, A: tuple, want_B: tuple, want_A: tuple, max_rank: int | None, lower_rank: bool) -> bool:
    """Whether factors of shapes ``B, A`` fit ``want_B, want_A``; with ``lower_rank``, 2-D factors may have any rank
    from 1 to ``max_rank`` (default the expected one)."""
    if not (lower_rank and len(B) == len(A) == len(want_B) == len(want_A) == 2):
        return B == want_B and A == want_A
    top = want_B[1] if max_rank is None else max_rank
    return B[0] == want_B[0] and A[1] == want_A[1] and 1 <= B[1] == A[0] <= top


def check_global(saved, path, initial: dict, max_rank: int, *, at: str | None = None,
                 field: str = "global_model.factors") -> None:  # fmt: skip
    """ValueError naming ``path`` (or ``at``) and ``field`` unless the saved global factors have the modules of
    ``initial`` (the run's initial global factors, whose shapes the base model gives), their shapes up to a rank from
    1 to ``max_rank``, storage for every element (checked before a value is read) and finite floating-point values.
    """
    shapes = {n: (tuple(B.shape), tuple(A.shape)) for n, (B, A) in initial.items()}
    at = f"federate.restore_from {path!r}" if at is None else at
    check_pairs(saved, at, field, shapes, max_rank=max_rank, lower_rank=True)


def check_tensors(tensors, at: str, field: str, shapes: dict, exact: bool = True) -> None:
    """``tensors`` maps the names of ``shapes`` (``exact``; else some of them) to dense, finite floating-point
    tensors of those shapes (storage checked before a value is read); ValueError naming ``at`` and ``field``."""
    at = str(at)
    if not isinstance(tensors, dict):
        raise ValueError(f"{at}: field {field!r} is a {type(tensors).__name__}, not a mapping of names to tensors")
    if (set(tensors) != set(shapes)) if exact else not set(tensors) <= set(shapes):
        odd = sorted(set(tensors) ^ set(shapes) if exact else set(tensors) - set(shapes))[:3]
        raise ValueError(f"{at}: field {field!r} does not have this run's tensors (e.g. {odd})")
    for name, t in tensors.items():
        where = f"{at}: field '{field}[{name!r}]'"
        check_tensor(t, where)
        if tuple(t.shape) != tuple(shapes[name]):
            raise ValueError(f"{where} has shape {tuple(t.shape)}; this run's is {tuple(shapes[name])}")
        check_finite(t, where)

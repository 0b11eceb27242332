"""What the server accepts from one client in one round, checked before anything else touches it (torch only).

:func:`check_upload` turns FS's ``(sample_size, content)`` of a client into an :class:`Accepted` upload, or into the
reason it is dropped (a string): sample size, payload structure, stats, decoding (tensors only, no pickle), dtype,
layout, device, shapes, finiteness and magnitude, in that order. One client's fault is that client's problem: the
server logs the reason with the client's id and aggregates the others (docs/errors.md).
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fs_fedpa.core.diagnostics import factored_norm
from fs_fedpa.core.uploads import upload_problem
from fs_fedpa.lora import Factors
from fs_fedpa.plugin.payload import decode_parts, decode_tensors

MAX_ABS = 1e6  # far above any trained LoRA factor or head, far below what overflows the float32 Gram of a stack
MAX_SAMPLES = 1e15  # more examples than any client has; beyond it a weight is an attack or a bug
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class Accepted:
    """An upload that can be aggregated: full factors at the client's rank, shared tensors, its FS sample size
    and its numeric stats, all fresh tensors in the server's dtype."""

    factors: Factors
    shared: dict[str, Tensor]
    size: float
    stats: dict[str, float] = field(default_factory=dict)


def _real(value: object, what: str) -> float | str:
    """``value`` as a float if it is a real number (not a bool), else why not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"{what} = {str(value)[:40]!r} ({type(value).__name__}) is not a number"
    try:
        return float(value)
    except OverflowError:
        return f"{what} = {str(value)[:40]}... overflows a float"


def sample_size(value: object) -> float | str:
    """FS's sample size as a float (Python, numpy or 0-d torch numbers), or why it is not one."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    size = _real(value, "sample size")
    if isinstance(size, float) and not (math.isfinite(size) and 0 <= size <= MAX_SAMPLES):
        return f"sample size {size!r} is not a finite number in [0, {MAX_SAMPLES:g}]"
    return size


def check_stats(stats: object) -> dict[str, float] | str:
    """The client's stats as ``name -> float`` (ints kept as ints), or why they are not."""
    if not isinstance(stats, Mapping):
        return f"stats of type {type(stats).__name__} are not a mapping of names to numbers"
    out = {}
    for key, value in stats.items():
        if not isinstance(key, str):
            return f"stats key {str(key)[:40]!r} is not a string"
        number = _real(value, f"stat {key[:40]!r}")
        if isinstance(number, str):
            return number
        if not math.isfinite(number):
            return f"stat {key[:40]!r} = {number} is not finite"
        out[key] = int(value) if isinstance(value, numbers.Integral) else number
    return out


def as_float(name: str, t: Tensor, dtype: torch.dtype) -> Tensor | str:
    """``t`` as a dense CPU tensor of the server's ``dtype``: other float dtypes are cast (a value that does not fit
    becomes Inf and is refused by the finiteness check); integer, complex, sparse or meta tensors are refused."""
    if t.layout != torch.strided:
        return f"{name}: layout {t.layout} (only dense tensors are accepted)"
    if t.device.type == "meta":
        return f"{name}: a meta tensor holds no values"
    if t.dtype not in FLOAT_DTYPES:
        return f"{name}: dtype {t.dtype} (factors are floating point: {', '.join(map(str, FLOAT_DTYPES))})"
    return t.detach().to(device="cpu", dtype=dtype)


def check_upload(
    size: object,
    content: object,
    *,
    expected_parts: set[str],
    complete,
    shapes: Mapping[str, tuple[int, int]],
    ranks: tuple[int, ...],
    shared_shapes: Mapping[str, tuple[int, ...]],
    dtype: torch.dtype = torch.float32,
    expand=None,
) -> Accepted | str:
    """The upload ``(size, content)`` of one client as :class:`Accepted`, or why it is dropped.

    ``expected_parts``: the factors the method wants this round; ``complete(parts)`` builds full ``(B, A)`` from
    them (:meth:`FederatedMethod.complete_upload` for this client); ``shapes[name] = (d, k)``; ``ranks``: the ranks
    the client may upload; ``shared_shapes``: the shared tensors of the run; ``expand``: the factors of a completed
    upload (:meth:`FederatedMethod.expand`; default: it is factors), which the shape and value checks read."""
    n = sample_size(size)
    if isinstance(n, str):
        return n
    if not isinstance(content, Mapping) or not isinstance(content.get("lora"), Mapping):
        kind = type(content).__name__ if not isinstance(content, Mapping) else "a mapping without a 'lora' mapping"
        return f"payload of type {kind} has no 'lora' factors"
    stats = check_stats(content.get("stats", {}))
    if isinstance(stats, str):
        return stats
    try:
        parts = decode_parts(content["lora"])
        shared = decode_tensors(content.get("shared", {}))
    except ValueError as err:
        return f"undecodable payload ({err})"
    for name, sent in parts.items():
        for part, t in sent.items():
            cast = as_float(f"{name} {part}", t, dtype)
            if isinstance(cast, str):
                return cast
            sent[part] = cast
    for name, t in shared.items():
        cast = as_float(f"shared tensor {name}", t, dtype)
        if isinstance(cast, str):
            return cast
        shared[name] = cast
    if wrong := sorted(n for n, sent in parts.items() if set(sent) != expected_parts):
        return f"module {wrong[0]!r}: uploaded factors {sorted(parts[wrong[0]])}, expected {sorted(expected_parts)}"
    if unknown := sorted(parts.keys() - shapes.keys()):  # before completing: only known modules have a global
        return f"unknown LoRA modules in the upload: {unknown[:3]}{' ...' if len(unknown) > 3 else ''}"
    try:
        factors = complete(parts)
    except ValueError as err:
        return str(err)
    try:
        expanded = factors if expand is None else expand(factors)
    except (ValueError, RuntimeError) as err:
        return f"the completed upload does not expand to factors ({err})"
    problem = upload_problem(expanded, shapes, ranks, shared, shared_shapes, max_abs=MAX_ABS)
    return problem if problem is not None else Accepted(factors, shared, n, stats)


def cap_weights(weights: list[float], ratio: float) -> list[float]:
    """``w_i <- min(w_i, ratio * median(w))`` (``fedpa.max_weight_ratio``; 0: unchanged): no single client's
    declared sample size can outweigh the others by more than ``ratio``."""
    if not ratio or not weights:
        return list(weights)
    ceiling = ratio * statistics.median(weights)
    return [min(w, ceiling) for w in weights]


def norm_outliers(norms: list[float], factor: float) -> list[int]:
    """Positions whose update norm exceeds ``factor`` times the median of the round (``fedpa.norm_outlier``; 0 or
    fewer than 3 uploads: none). A median is what a minority of poisoned uploads cannot move far."""
    if not factor or len(norms) < 3:
        return []
    ceiling = factor * statistics.median(norms)
    return [i for i, n in enumerate(norms) if n > ceiling]


def update_norm(factors: Factors) -> float:
    """``||Delta W_i||_F`` over all LoRA modules, ``sqrt(sum ||B A||_F^2)``, without forming a product."""
    return math.sqrt(sum(float(factored_norm(B, A)) ** 2 for B, A in factors.values()))

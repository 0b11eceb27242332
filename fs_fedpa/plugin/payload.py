"""Message payloads between the FedPA server and clients: flat string-keyed dicts of tensors.

FS's gRPC transport serialises nested dicts of tensors (not tuples), so factors travel as
``{"<module>|B": B, "<module>|A": A}``. A payload is ``{"lora": ..., "shared": ..., "stats": ...}``:
LoRA factors, non-LoRA tensors that are averaged (e.g. a non-local head), and floats.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from fs_fedpa.core.diagnostics import payload_bytes
from fs_fedpa.lora import Factors

SEP = "|"


def encode_factors(factors: Mapping[str, tuple[Tensor, Tensor]], parts: tuple[str, ...] = ("B", "A")) -> dict:
    """``{"<module>|B": B, "<module>|A": A}`` with only the factors named in ``parts`` (a method may send one)."""
    out = {}
    for name, (B, A) in factors.items():
        for part, value in zip(("B", "A"), (B, A)):
            if part in parts:
                out[f"{name}{SEP}{part}"] = value.detach().cpu().clone()
    return out


def decode_parts(flat: Mapping[str, object]) -> dict[str, dict[str, Tensor]]:
    """``module -> {"B": B, "A": A}`` with whichever factors were sent; accepts what a transport made of the
    tensors (lists, arrays)."""
    from federatedscope.core.auxiliaries.utils import param2tensor

    names: dict[str, dict[str, Tensor]] = {}
    for key, value in flat.items():
        name, _, part = key.rpartition(SEP)
        if part not in ("A", "B") or not name:
            raise ValueError(f"malformed factor key {key!r}: expected '<module>{SEP}A' or '<module>{SEP}B'")
        names.setdefault(name, {})[part] = _tensor(param2tensor(value))
    return names


def decode_factors(flat: Mapping[str, object]) -> Factors:
    """Inverse of :func:`encode_factors` with both factors of every module."""
    names = decode_parts(flat)
    missing = [n for n, parts in names.items() if set(parts) != {"A", "B"}]
    if missing:
        raise ValueError(f"modules {missing[:3]} lack their A or B factor")
    return {n: (parts["B"], parts["A"]) for n, parts in names.items()}


def decode_tensors(flat: Mapping[str, object]) -> dict[str, Tensor]:
    from federatedscope.core.auxiliaries.utils import param2tensor

    return {k: _tensor(param2tensor(v)) for k, v in flat.items()}


def nbytes(payload: Mapping[str, object]) -> int:
    """Bytes of every tensor in a payload (factors and shared tensors; stats are negligible)."""
    tensors = [v for part in ("lora", "shared") for v in payload.get(part, {}).values()]
    return payload_bytes([t for t in tensors if isinstance(t, Tensor)])


def _tensor(value: object) -> Tensor:
    """A fresh tensor: standalone FS hands over the sender's objects, and nobody may alter what a client sent."""
    return value.detach().clone() if isinstance(value, Tensor) else torch.as_tensor(value)

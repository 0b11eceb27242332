"""Message payloads between the FedPA server and clients: flat string-keyed dicts of tensors.

Factors travel as ``{"<module>|B": B, "<module>|A": A}``. A payload is ``{"lora": ..., "shared": ..., "stats": ...}``:
LoRA factors, non-LoRA tensors that are averaged (e.g. a non-local head), and floats.

Nothing a peer sends is ever unpickled. In standalone mode the tensors are handed over as objects. Over a network
(``wire=True``) each tensor is sent as :func:`to_wire`'s explicit encoding ``{"dtype", "shape", "data"}`` (base64
of its raw bytes), which FS's gRPC transport carries as plain strings and ints. FS's own tensor decoder would
turn any string it is given into an arbitrary object, so it is never called: the decoder here accepts a tensor
object or that encoding, and refuses everything else with a reason.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping

import torch
from torch import Tensor

from fs_fedpa.core.diagnostics import payload_bytes
from fs_fedpa.lora import Factors

SEP = "|"


WIRE_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
WIRE_KEYS = frozenset({"dtype", "shape", "data"})
MAX_DIMS = 8


def to_wire(tensor: Tensor) -> dict:
    """``{"dtype": "float32", "shape": [d, k], "data": base64 of the raw bytes}``: a tensor as strings and ints."""
    tensor = tensor.detach().cpu().contiguous()
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in WIRE_DTYPES:
        raise ValueError(f"dtype {tensor.dtype} cannot be sent; use one of {sorted(WIRE_DTYPES)}")
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": name, "shape": list(tensor.shape), "data": base64.b64encode(raw).decode("ascii")}


def from_wire(value: object) -> Tensor:
    """The tensor of a :func:`to_wire` encoding; ``ValueError`` naming what is wrong with anything else. Reads
    nothing but the dtype name, the integers of the shape and the bytes: no object is ever reconstructed."""
    if not isinstance(value, Mapping) or set(value) != WIRE_KEYS:
        raise ValueError(f"expected a tensor or its encoding {{dtype, shape, data}}, got {_what(value)}")
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise ValueError(f"encoded dtype {str(dtype)[:40]!r} is not one of {sorted(WIRE_DTYPES)}")
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > MAX_DIMS
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    ):
        raise ValueError(f"encoded shape {str(shape)[:60]} is not a list of at most {MAX_DIMS} ints >= 0")
    if not isinstance(data, (str, bytes)):
        raise ValueError(f"encoded data is {type(data).__name__}, not base64 text")
    dtype = WIRE_DTYPES[dtype]
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(data) != 4 * math.ceil(expected / 3):  # checked before decoding: a huge claim costs nothing
        raise ValueError(f"encoded data of {len(data)} characters does not hold shape {list(shape)} of {dtype}")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as err:
        raise ValueError(f"encoded data is not base64 ({err})") from None
    if len(raw) != expected:
        raise ValueError(f"encoded data has {len(raw)} bytes, shape {list(shape)} of {dtype} needs {expected}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()


def _what(value: object) -> str:
    if isinstance(value, Mapping):
        return f"a mapping with keys {sorted(map(str, value))[:5]}"
    return f"{type(value).__name__}"


def encode_factors(
    factors: Mapping[str, tuple[Tensor, Tensor]], parts: tuple[str, ...] = ("B", "A"), wire: bool = False
) -> dict:
    """``{"<module>|B": B, "<module>|A": A}`` with only the factors named in ``parts`` (a method may send one);
    ``wire``: each as :func:`to_wire`'s encoding (distributed mode)."""
    return encode_parts(
        {n: {p: t for p, t in zip(("B", "A"), pair) if p in parts} for n, pair in factors.items()}, wire
    )


def encode_parts(parts: Mapping[str, Mapping[str, Tensor]], wire: bool = False) -> dict:
    """``{"<module>|<part>": tensor}`` from ``module -> {"B"|"A": tensor}`` (the inverse of :func:`decode_parts`)."""
    return {
        f"{name}{SEP}{part}": to_wire(t) if wire else t.detach().cpu().clone()
        for name, sent in parts.items()
        for part, t in sent.items()
    }


def encode_tensors(tensors: Mapping[str, Tensor], wire: bool = False) -> dict:
    """Shared (non-LoRA) tensors by name, as objects or (``wire``) encoded."""
    return {k: to_wire(v) if wire else v.detach().cpu().clone() for k, v in tensors.items()}


def decode_parts(flat: Mapping[str, object]) -> dict[str, dict[str, Tensor]]:
    """``module -> {"B": B, "A": A}`` with whichever factors were sent (tensor objects or their encodings)."""
    if not isinstance(flat, Mapping):
        raise ValueError(f"factors must be a mapping of '<module>{SEP}B|A' to tensors, got {_what(flat)}")
    names: dict[str, dict[str, Tensor]] = {}
    for key, value in flat.items():
        name, _, part = key.rpartition(SEP) if isinstance(key, str) else ("", "", "")
        if part not in ("A", "B") or not name:
            raise ValueError(f"malformed factor key {str(key)[:80]!r}: expected '<module>{SEP}A' or '<module>{SEP}B'")
        try:
            names.setdefault(name, {})[part] = _tensor(value)
        except ValueError as err:
            raise ValueError(f"{key}: {err}") from None
    return names


def decode_factors(flat: Mapping[str, object]) -> Factors:
    """Inverse of :func:`encode_factors` with both factors of every module."""
    names = decode_parts(flat)
    missing = [n for n, parts in names.items() if set(parts) != {"A", "B"}]
    if missing:
        raise ValueError(f"modules {missing[:3]} lack their A or B factor")
    return {n: (parts["B"], parts["A"]) for n, parts in names.items()}


def decode_tensors(flat: Mapping[str, object]) -> dict[str, Tensor]:
    """Shared tensors by name from tensor objects or their encodings."""
    if not isinstance(flat, Mapping):
        raise ValueError(f"shared tensors must be a mapping of names to tensors, got {_what(flat)}")
    out = {}
    for key, value in flat.items():
        try:
            out[str(key)] = _tensor(value)
        except ValueError as err:
            raise ValueError(f"{str(key)[:80]}: {err}") from None
    return out


def encode_merge(merges: list[Mapping[str, Tensor | tuple[Tensor, Tensor]]], wire: bool = False) -> dict:
    """What a worker adds to its base weights, in order: per merge ``i`` and module either its factors ``(B, A)``,
    as ``"<i>|<module>|B"`` and ``"<i>|<module>|A"``, or its dense ``(d, k)`` increment, as ``"<i>|<module>"``. Kept
    apart (not summed) so that a worker adds them one by one, as it would have on time."""
    out = {}
    for i, merge in enumerate(merges):
        dense = {n: v for n, v in merge.items() if isinstance(v, Tensor)}
        factors = {n: v for n, v in merge.items() if not isinstance(v, Tensor)}
        flat = {**encode_tensors(dense, wire), **encode_factors(factors, wire=wire)}
        out.update({f"{i}{SEP}{key}": value for key, value in flat.items()})
    return out


def decode_merge(flat: Mapping[str, object]) -> list[dict[str, Tensor]]:
    """The ``(d, k)`` increment per module of every merge of an :func:`encode_merge` payload, in order."""
    if not isinstance(flat, Mapping):
        raise ValueError(f"a merge must be a mapping of '<i>{SEP}<module>...' to tensors, got {_what(flat)}")
    groups: dict[int, dict[str, object]] = {}
    for key, value in flat.items():
        index, _, rest = key.partition(SEP) if isinstance(key, str) else ("", "", "")
        if not index.isdigit() or not rest:
            raise ValueError(f"malformed merge key {str(key)[:80]!r}: expected '<i>{SEP}<module>...'")
        groups.setdefault(int(index), {})[rest] = value
    out = []
    for _, group in sorted(groups.items()):
        factors = decode_factors({k: v for k, v in group.items() if SEP in k})
        dense = decode_tensors({k: v for k, v in group.items() if SEP not in k})
        out.append({**dense, **{n: B @ A for n, (B, A) in factors.items()}})
    return out


def nbytes(payload: object) -> int:
    """Bytes of every tensor in a payload (factors and shared tensors, as objects or encoded; stats are
    negligible); 0 for what is not a payload, which the server's checks then refuse."""
    if not isinstance(payload, Mapping):
        return 0
    parts = [payload.get(part) for part in ("lora", "shared", "base")]
    values = [v for part in parts if isinstance(part, Mapping) for v in part.values()]
    encoded = [v["data"] for v in values if isinstance(v, Mapping) and isinstance(v.get("data"), str)]
    return payload_bytes([t for t in values if isinstance(t, Tensor)]) + sum(
        len(d) * 3 // 4 - d[-2:].count("=") for d in encoded
    )


def _tensor(value: object) -> Tensor:
    """A fresh tensor from a tensor object (standalone FS hands over the sender's objects, and nobody may alter what
    a client sent) or from :func:`to_wire`'s encoding; anything else is refused."""
    return value.detach().clone() if isinstance(value, Tensor) else from_wire(value)

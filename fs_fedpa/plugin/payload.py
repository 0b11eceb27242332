"""Message payloads between the FedPA server and clients: flat string-keyed dicts of tensors.

Factors travel as ``{"<module>|B": B, "<module>|A": A}``. A payload is ``{"lora": ..., "shared": ..., "stats": ...}``:
LoRA factors, non-LoRA tensors that are averaged (e.g. a non-local head), and floats.

Nothing a peer sends is ever unpickled. In standalone mode the tensors are handed over as objects. Over a network
(``wire=True``) each tensor is sent as :func:`to_wire`'s text: base64 of the safetensors bytes of ``{"t": tensor}``,
which FS's gRPC transport carries as a plain string. FS's own tensor decoder would turn any string it is given into
an arbitrary object, so it is never called: the decoder here accepts a tensor object or that text, bounds its length
and its safetensors header before safetensors reads it, and refuses everything else with a reason.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from torch import Tensor

from fs_fedpa.lora import Factors

SEP = "|"


WIRE_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
WIRE_KEY = "t"  # the one tensor's name inside its safetensors bytes
MAX_DIMS = 8
MAX_ELEMENT_SIZE = max(torch.empty((), dtype=t).element_size() for t in WIRE_DTYPES.values())  # float64's 8
# safetensors' 8-byte header length, then its JSON: {"t":{"dtype":..,"shape":[<= 8 ints],"data_offsets":[0,n]}}
# is under 300 bytes for any shape of at most MAX_DIMS dims; a longer header is refused before it is parsed
MAX_HEADER = 320


def to_wire(tensor: Tensor) -> str:
    """Base64 text of the safetensors bytes of ``{"t": tensor}``: a tensor as one string FS's gRPC carries."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype not in WIRE_DTYPES.values():
        raise ValueError(f"dtype {tensor.dtype} cannot be sent; use one of {sorted(WIRE_DTYPES)}")
    return base64.b64encode(safetensors_save({WIRE_KEY: tensor})).decode("ascii")


def from_wire(value: object, max_numel: int | None = None, what: str = "", max_chars: int | None = None) -> Tensor:
    """The tensor of a :func:`to_wire` text; ``ValueError`` naming what is wrong with anything else. Only a plain
    ``str`` is read (no method of a sender's object is called), and only safetensors parses it: no object is ever
    reconstructed. ``max_chars``: the longest the text may be; ``max_numel``: the most values the tensor may have,
    which bounds the text's length too. Both are checked before anything is decoded (refusing a long text costs its
    length, never its decoding), then the header's length before safetensors reads it, then the tensor's dtype,
    dimensions and values."""
    if type(value) is not str:
        raise ValueError(f"expected a tensor or its encoding (base64 safetensors text), got {_what(value)}")
    if max_numel is not None:
        max_chars = min(encoded_length(MAX_ELEMENT_SIZE * max_numel), max_chars or math.inf)
    if max_chars is not None and len(value) > max_chars:
        raise ValueError(f"encoded tensor of {len(value)} characters, more than {what or 'it'} can need ({max_chars})")
    try:
        raw = base64.b64decode(value, validate=True)
    except (ValueError, binascii.Error) as err:
        raise ValueError(f"encoded tensor is not base64 ({err})") from None
    header = int.from_bytes(raw[:8], "little")
    if len(raw) < 8 or header > MAX_HEADER:  # a hostile header is refused before safetensors parses it
        raise ValueError(
            f"encoded tensor's safetensors header ({len(raw)} bytes, header {header}) is longer than "
            f"{MAX_HEADER} bytes or cut short"
        )
    try:
        loaded = safetensors_load(raw)
    except SafetensorError as err:
        raise ValueError(f"encoded tensor is not safetensors ({err})") from None
    if list(loaded) != [WIRE_KEY]:
        raise ValueError(f"encoded tensors {sorted(loaded)[:3]}, expected one named {WIRE_KEY!r}")
    tensor = loaded[WIRE_KEY]
    if tensor.dtype not in WIRE_DTYPES.values():
        name = str(tensor.dtype).removeprefix("torch.")
        raise ValueError(f"encoded dtype {name!r} is not one of {sorted(WIRE_DTYPES)}")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"encoded shape {list(tensor.shape)[:10]} has more than {MAX_DIMS} dims")
    if max_numel is not None and tensor.numel() > max_numel:
        raise ValueError(_too_large(list(tensor.shape), tensor.numel(), max_numel, what))
    return tensor.clone()  # safetensors' tensor reads a buffer of bytes the decoder does not own


def encoded_length(nbytes: int) -> int:
    """The most characters of :func:`to_wire`'s text of a tensor of ``nbytes`` bytes (its header at the longest)."""
    return 4 * math.ceil((8 + MAX_HEADER + nbytes) / 3)


def _what(value: object) -> str:
    """What ``value`` is, for a message; calls no method of it (a dict's keys are read through dict's own)."""
    if isinstance(value, dict):
        return f"a mapping with keys {sorted(shown(k) for k in list(dict.keys(value))[:5])}"
    return f"{type(value).__name__}"


def shown(value: object, width: int = 40) -> str:
    """``str(value)`` cut to ``width`` characters, or its type's name if its ``__str__`` raises (a hostile object)."""
    try:
        return str(value)[:width]
    except Exception:
        return f"<{type(value).__name__}>"


def _too_large(shape: list, numel: int, max_numel: int, what: str = "") -> str:
    return f"a tensor of shape {tuple(shape)} ({numel} values), more than {what or 'it'} can hold ({max_numel})"


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


def decode_parts(
    flat: Mapping[str, object],
    max_numel: Mapping[str, int] | None = None,
    max_sent: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, dict[str, Tensor]]:
    """``module -> {"B": B, "A": A}`` with whichever factors were sent (tensor objects or their encodings).

    ``flat`` must be a dict (read through dict's own methods: no method a sender's subclass defines is called).
    ``max_numel[module]``: the most values one factor of that module may have (a module it does not name: the
    largest it names), checked before a tensor is copied or decoded (a tensor expanded to 10^12 entries is refused,
    not cloned). ``max_sent[module][part]``: the most values that factor's encoding may hold (else the largest of
    ``max_numel``), which bounds its base64 text at float64's size, checked first, before its shape is read or
    anything decoded."""
    if not isinstance(flat, dict):
        raise ValueError(f"factors must be a mapping (a dict) of '<module>{SEP}B|A' to tensors, got {_what(flat)}")
    largest = max(max_numel.values(), default=0) if max_numel is not None else None
    names: dict[str, dict[str, Tensor]] = {}
    for key, value in list(dict.items(flat)):
        name, _, part = str.rpartition(key, SEP) if isinstance(key, str) else ("", "", "")
        if part not in ("A", "B") or not name:
            raise ValueError(f"malformed factor key {shown(key, 80)!r}: expected '<module>{SEP}A' or '<module>{SEP}B'")
        limit = None if max_numel is None else max_numel.get(name, largest)
        chars = None
        if max_sent is not None:
            chars = encoded_length(MAX_ELEMENT_SIZE * max_sent.get(name, {}).get(part, largest or 0))
        try:
            names.setdefault(name, {})[part] = _tensor(value, limit, "a factor of its module", chars)
        except ValueError as err:
            raise ValueError(f"{name}{SEP}{part}: {err}") from None
    return names


def decode_factors(flat: Mapping[str, object]) -> Factors:
    """Inverse of :func:`encode_factors` with both factors of every module."""
    names = decode_parts(flat)
    missing = [n for n, parts in names.items() if set(parts) != {"A", "B"}]
    if missing:
        raise ValueError(f"modules {missing[:3]} lack their A or B factor")
    return {n: (parts["B"], parts["A"]) for n, parts in names.items()}


def decode_tensors(flat: Mapping[str, object], max_numel: Mapping[str, int] | None = None) -> dict[str, Tensor]:
    """Shared tensors by name from tensor objects or their encodings; ``flat`` and ``max_numel`` as in
    :func:`decode_parts` (``max_numel[name]``: the values of the shared tensor ``name``)."""
    if not isinstance(flat, dict):
        raise ValueError(f"shared tensors must be a mapping (a dict) of names to tensors, got {_what(flat)}")
    largest = max(max_numel.values(), default=0) if max_numel is not None else None
    out = {}
    for key, value in list(dict.items(flat)):
        name = str.__str__(key) if isinstance(key, str) else shown(key, 80)
        limit = None if max_numel is None else max_numel.get(name, largest)
        try:
            out[name] = _tensor(value, limit, "the shared tensor")
        except ValueError as err:
            raise ValueError(f"{name[:80]}: {err}") from None
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
    negligible); 0 for what is not a payload, which the server's checks then refuse. Reads only dicts, through
    dict's own methods, and counts a tensor object by the bytes it holds, never by the shape it claims (an expanded
    view of one value counts that value's bytes; a sparse or meta tensor holds no dense values and counts 0)."""
    if not isinstance(payload, dict):
        return 0
    total = 0
    for part in ("lora", "shared", "base"):
        values = dict.get(payload, part)
        for value in list(dict.values(values)) if isinstance(values, dict) else []:
            if type(value) is Tensor:
                total += _held_bytes(value)
            elif type(value) is str:
                total += _encoded_bytes(value)
    return total


def _encoded_bytes(text: str) -> int:
    """The tensor bytes of a :func:`to_wire` text: its bytes less safetensors' header (0 for a malformed one)."""
    try:
        header = int.from_bytes(base64.b64decode(text[:12], validate=True)[:8], "little")
    except (ValueError, binascii.Error):
        return 0
    return max(0, len(text) * 3 // 4 - text[-2:].count("=") - 8 - header)


def _held_bytes(t: Tensor) -> int:
    """``numel x element size`` of a dense tensor, at most the bytes of its storage."""
    if t.layout != torch.strided or t.device.type == "meta":
        return 0
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _tensor(value: object, max_numel: int | None = None, what: str = "", max_chars: int | None = None) -> Tensor:
    """A fresh tensor from a tensor object (standalone FS hands over the sender's objects, and nobody may alter what
    a client sent) or from :func:`to_wire`'s encoding; anything else is refused. A tensor object must be a plain
    ``torch.Tensor`` (a subclass could run its own code on every operation) with at most ``max_numel`` values that
    its storage holds (no view that repeats one value 10^12 times): both checked before it is copied."""
    if type(value) is not Tensor:
        return from_wire(value, max_numel, what, max_chars)
    if max_numel is not None and value.numel() > max_numel:
        raise ValueError(_too_large(list(value.shape), value.numel(), max_numel, what))
    if (
        value.layout == torch.strided
        and value.device.type != "meta"
        and _held_bytes(value) < value.numel() * value.element_size()
    ):
        raise ValueError(
            f"a tensor of shape {tuple(value.shape)} repeats the {value.untyped_storage().nbytes()} bytes it holds "
            "(an expanded view); send the values themselves"
        )
    return value.detach().clone()

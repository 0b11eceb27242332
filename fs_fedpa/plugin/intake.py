"""What the server accepts from one client in one round, checked before anything else touches it (torch only).

:func:`check_upload` turns FS's ``(sample_size, content)`` of a client into an :class:`Accepted` upload, or into the
reason it is dropped (a string): sample size, payload structure, stats, decoding (tensors only, no pickle), dtype,
layout, device, shapes, finiteness and magnitude, in that order. One client's fault is that client's problem: the
server logs the reason with the client's id and aggregates the others (docs/errors.md).

In standalone mode a client hands over Python objects, which may be hostile: a dict subclass whose ``get`` raises, a
float whose ``__float__`` raises, a tensor expanded to 10^12 entries. So nothing here calls a method a sender's type
defines: containers must be dicts, read through dict's own methods; a number is converted once, in a ``try``; a
tensor must be a plain ``torch.Tensor`` whose size is checked against its module before it is copied; and anything
that still raises becomes the reason the upload is dropped. :func:`check_message_content` does the same for FS's own
code that reads a message before the server does (its byte counter).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fs_fedpa.core.uploads import upload_problem
from fs_fedpa.lora import Factors
from fs_fedpa.plugin.payload import decode_parts, decode_tensors, shown

MAX_ABS = 1e6  # far above any trained LoRA factor or head, far below what overflows the float32 Gram of a stack
MAX_SAMPLES = 1e15  # more examples than any client has; beyond it a weight is an attack or a bug
WEIGHT_STATS = ("num_train_data",)  # stats that weigh an upload (FlexLoRA's); every other stat is a diagnostic
MAX_OBJECTS = 100_000  # objects in one message: far more than the tensors and stats of any model's upload
MAX_DEPTH = 8  # nesting of one message: (size, {"lora": {key: "<safetensors text>"}, "stats": ...}) is 3 deep
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class Accepted:
    """An upload that can be aggregated: full factors at the client's rank, shared tensors, its FS sample size
    and its numeric stats (None for a diagnostic that is not finite), all fresh tensors in the server's dtype;
    ``applied``: its factors as the method expands them (:meth:`FederatedMethod.expand`, the factors themselves for
    most methods), expanded once, when it was checked."""

    factors: Factors
    shared: dict[str, Tensor]
    size: float
    stats: dict[str, float | int | None] = field(default_factory=dict)
    applied: Factors = field(default_factory=dict)


def _real(value: object, what: str, *, overflow: bool = False) -> float | str:
    """``value`` as a float if it is a real number (not a bool), else why not; converted once, and a conversion that
    raises (a hostile ``__float__``) is a reason too. ``overflow``: an int beyond a float is ``inf``, not a reason."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"{what} = {shown(value)!r} ({type(value).__name__}) is not a number"
    try:
        return float(value)
    except OverflowError:
        return math.inf if overflow else f"{what} = {shown(value)}... overflows a float"
    except Exception as err:
        return f"{what} cannot be read as a number ({type(err).__name__}: {shown(err, 80)})"


def sample_size(value: object) -> float | str:
    """FS's sample size as a float (Python, numpy or 0-d torch numbers), or why it is not one."""
    if type(value) is Tensor and value.numel() == 1 and not value.is_complex():
        value = value.item()
    size = _real(value, "sample size")
    if isinstance(size, float) and not (math.isfinite(size) and 0 <= size <= MAX_SAMPLES):
        return f"sample size {size!r} is not a finite number in [0, {MAX_SAMPLES:g}]"
    return size


def train_size(value: object) -> int | str:
    """``stats["num_train_data"]``, the size of a client's training set (FlexLoRA's aggregation weight), as an int in
    [0, MAX_SAMPLES] like the sample size, or why it is not one."""
    number = _real(value, "stats num_train_data")
    if isinstance(number, str):
        return number
    if not (math.isfinite(number) and 0 <= number <= MAX_SAMPLES and number.is_integer()):
        return f"stats num_train_data(={number:g}) must be an integer in [0, {MAX_SAMPLES:g}]"
    return int(number)


def check_stats(stats: object) -> dict[str, float | int | None] | str:
    """The client's stats as ``name -> number``, or why the upload is dropped.

    The stats are diagnostics, except :data:`WEIGHT_STATS` (:func:`train_size`). A diagnostic that is a number but
    not finite (NaN, Inf, an int beyond a float) is kept as None, which the server logs and records as null: an
    honest client whose gradients overflow against a huge reference must not be dropped for what it reports. A
    stat that is not a number, or a key that is not a string, drops the upload (a malformed message)."""
    if not isinstance(stats, dict):
        return f"stats of type {type(stats).__name__} are not a mapping of names to numbers (a dict)"
    out: dict[str, float | int | None] = {}
    for key, value in list(dict.items(stats)):
        if not isinstance(key, str):
            return f"stats key {shown(key)!r} is not a string"
        key = str.__str__(key)  # a plain str: a subclass's __hash__ or __eq__ never runs
        if key in WEIGHT_STATS:
            size = train_size(value)
            if isinstance(size, str):
                return size
            out[key] = size
            continue
        number = _real(value, f"stat {key[:40]!r}", overflow=True)
        if isinstance(number, str):
            return number
        if not math.isfinite(number):
            out[key] = None
        else:
            out[key] = int(number) if isinstance(value, numbers.Integral) else number
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
    upload (:meth:`FederatedMethod.expand`; default: it is factors), which the shape and value checks read.

    Never raises for what a client sent: an exception that a hostile object still manages to raise is the reason."""
    try:
        return _check_upload(size, content, expected_parts, complete, shapes, ranks, shared_shapes, dtype, expand)
    except Exception as err:
        return f"the upload cannot be read ({type(err).__name__}: {shown(err, 120)})"


def _not_a_dict(what: str, value: object) -> str:
    return (
        f"{what} of type {type(value).__name__} is not a dict (a message is built of dicts; no method of another "
        "mapping is called)"
    )


def _check_upload(size, content, expected_parts, complete, shapes, ranks, shared_shapes, dtype, expand):
    n = sample_size(size)
    if isinstance(n, str):
        return n
    if not isinstance(content, dict):
        if isinstance(content, Mapping):
            return _not_a_dict("payload", content)
        return f"payload of type {type(content).__name__} has no 'lora' factors"
    lora = dict.get(content, "lora")  # dict's own get: a subclass's never runs
    if isinstance(lora, Mapping) and not isinstance(lora, dict):
        return _not_a_dict("'lora'", lora)
    if not isinstance(lora, dict):
        return "payload of type a mapping without a 'lora' mapping has no 'lora' factors"
    stats = check_stats(dict.get(content, "stats", {}))
    if isinstance(stats, str):
        return stats
    # the most values a tensor may hold, checked before it is copied: a factor of a (d, k) module at any rank
    # <= min(d, k) has at most d * k (a name the run does not have: the largest, so that its own check names it)
    limits = {name: d * k for name, (d, k) in shapes.items()}
    limits.update({name: math.prod(shape) for name, shape in shared_shapes.items()})
    # and the longest text an encoded factor may be: B of a (d, k) module at the ranks the client uploads holds
    # d x r values, A r x k (a method's own parts hold fewer: Ravan's (heads, r_h, r_h) cores), float64 at most,
    # with safetensors' header; a B of (d, k) is refused by its length (where d (k - r) values outweigh the header),
    # before it is decoded and its rank checked
    r = max(ranks, default=0)
    sent = {name: {"B": d * r, "A": r * k} for name, (d, k) in shapes.items()}
    try:
        parts = decode_parts(lora, limits, sent)
        shared = decode_tensors(dict.get(content, "shared", {}), limits)
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
    return problem if problem is not None else Accepted(factors, shared, n, stats, expanded)


def message_pair(content: object) -> tuple[object, object] | str:
    """FS's ``(sample_size, payload)``, the content of a client's update, or why it is not one. Only a plain tuple or
    list is taken apart (a subclass's ``__iter__`` or ``__len__`` never runs)."""
    if type(content) not in (tuple, list) or len(content) != 2:
        return f"message content of type {type(content).__name__} is not a (sample size, payload) pair"
    return content[0], content[1]


def check_message_content(content: object) -> str | None:
    """Why no code may walk the content of a client's update message, or None: a ``(sample size, payload)`` pair
    built only of dicts, lists, tuples, numbers (numpy scalars included), strings, bytes, None and plain tensors whose
    storage holds their values, at most :data:`MAX_DEPTH` deep and :data:`MAX_OBJECTS` objects.

    For code that reads every object of a message before the server's checks do: FS's standalone runner counts a
    message's bytes (pympler's ``asizeof``) before any handler runs, and raises on, e.g., a numpy array broadcast to
    10^12 entries; and it would count a tensor expanded to 10^12 entries as 4 TB. Reads without calling a method
    of the content's objects; what it refuses, the server's intake (:func:`check_upload`) drops with its reason."""
    pair = message_pair(content)
    if isinstance(pair, str):
        return pair
    stack, seen = [("content", content, 0)], 0
    while stack:
        where, value, depth = stack.pop()
        seen += 1
        if seen > MAX_OBJECTS or depth > MAX_DEPTH:
            return f"the message holds more than {MAX_OBJECTS} objects or is nested deeper than {MAX_DEPTH}"
        kind = type(value)
        if kind in (dict, list, tuple):
            items = list(dict.items(value)) if kind is dict else list(enumerate(value))
            for key, item in items:
                if type(key) not in (str, int):
                    return f"{where} has a key of type {type(key).__name__}"
                stack.append((f"{where}[{key!r}]"[:200], item, depth + 1))
        elif kind is Tensor:
            if value.layout == torch.strided and value.device.type != "meta":
                held, claimed = value.untyped_storage().nbytes(), value.numel() * value.element_size()
                if held < claimed:
                    return f"{where} is a tensor of shape {tuple(value.shape)} over {held} bytes (an expanded view)"
        elif kind not in (type(None), bool, int, float, complex, str, bytes) and not _numpy_scalar(value):
            return f"{where} is a {kind.__name__} (a message holds dicts, lists, numbers, strings and tensors)"
    return None


def _numpy_scalar(value: object) -> bool:
    """A numpy number (``np.float64(2.0)``; not an array), by its type alone."""
    kind = type(value)
    return kind.__module__ == "numpy" and issubclass(kind, numbers.Number)

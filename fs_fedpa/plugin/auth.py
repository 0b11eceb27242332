"""Message authentication for distributed mode: each client signs what it sends the server with a key of its own.

HMAC-SHA256 (standard library) over ``(message type, sender id, round, timestamp, digest of the content)``, where
the content is digested in a canonical form that survives FS's gRPC transport: FS carries numbers as 32-bit floats
and int32, lists for tuples, and strings (the plugin's tensor encodings are already strings). The sender signs the
canonical form of what it sends; the server recomputes it from what it received. Nothing here imports FS or torch.

Threat covered: a client, or any network peer, sending messages under another client's id, altering a client's
message on the way, or replaying it into another round. Not covered: a malicious server, and messages from the
server to the clients (docs/distributed.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path

KEY_BYTES = 32  # a key is 32 random bytes, written as 64 hex digits
SIGNED, MAC = "fedpa_signed", "fedpa_mac"  # the signed content and its tag, the only keys of a signed content


def read_key(path: str) -> bytes:
    """A client's key: the file's one line of at least 64 hex digits. ValueError naming the file otherwise."""
    try:
        text = Path(path).read_text().strip()
    except OSError as err:
        raise ValueError(f"fedpa.net.auth_key {path!r}: cannot read the key file ({err.strerror})") from err
    return _key(text, f"fedpa.net.auth_key {path!r}")


def read_keyring(path: str, clients: int) -> dict[int, bytes]:
    """The server's keys: one line ``<client id> <hex key>`` per client 1..``clients`` (``#`` starts a comment).
    ValueError naming the file and the line for anything else: a missing or repeated id, or a key used twice."""
    where = f"fedpa.net.auth_keyring {path!r}"
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ValueError(f"{where}: cannot read the keyring ({err.strerror})") from err
    keys: dict[int, bytes] = {}
    for number, line in enumerate(lines, start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit():
            raise ValueError(f"{where}, line {number}: expected '<client id> <hex key>'")
        cid = int(parts[0])
        if not 1 <= cid <= clients or cid in keys:
            raise ValueError(f"{where}, line {number}: client id {cid} is repeated or not in 1..{clients}")
        keys[cid] = _key(parts[1], f"{where}, line {number}")
    if missing := sorted(set(range(1, clients + 1)) - set(keys)):
        raise ValueError(f"{where}: no key for clients {missing} (federate.client_num is {clients})")
    if len(set(keys.values())) != len(keys):
        raise ValueError(f"{where}: two clients share a key; each client needs its own")
    return keys


def _key(text: str, where: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < KEY_BYTES:
        raise ValueError(f"{where}: a key is at least {2 * KEY_BYTES} hex digits ({KEY_BYTES} random bytes)")
    return key


def _float32(x: float) -> str:
    """``x`` as FS's gRPC transport delivers it (a 32-bit float), written exactly."""
    if math.isnan(x):
        return "nan"
    try:
        return repr(struct.unpack("f", struct.pack("f", x))[0])
    except OverflowError:
        return "inf" if x > 0 else "-inf"


def canonical(value: object) -> object:
    """A JSON-able form of ``value`` that is the same before and after FS's gRPC transport: tuples become lists,
    floats 32-bit floats, bytes strings, dict keys sorted; objects with ``tolist`` (numpy, torch) are converted as FS
    converts them. TypeError for anything FS cannot carry."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, bool):
        raise TypeError("FS's gRPC transport cannot carry a bool")
    if isinstance(value, int):
        return ["i", value]
    if isinstance(value, float):
        return ["f", _float32(value)]
    if isinstance(value, bytes):
        return ["s", value.decode("utf-8")]
    if isinstance(value, str):
        return ["s", value]
    if isinstance(value, (list, tuple)):
        return ["l", [canonical(v) for v in value]]
    if isinstance(value, Mapping):
        items = [[canonical(k), canonical(v)] for k, v in value.items()]
        return ["d", sorted(items, key=lambda kv: json.dumps(kv[0]))]
    raise TypeError(f"FS's gRPC transport cannot carry a {type(value).__name__}")


def tag(key: bytes, msg_type: str, sender: int, state: int, timestamp: float, content: object) -> str:
    """The HMAC-SHA256 tag (hex) of one message."""
    digest = hashlib.sha256(json.dumps(canonical(content), separators=(",", ":")).encode()).hexdigest()
    fields = json.dumps(["fedpa-auth-v1", msg_type, sender, state, canonical(timestamp), digest])
    return hmac.new(key, fields.encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, msg_type: str, sender: int, state: int, timestamp: float, content: object) -> dict:
    """``content`` wrapped with its tag: what a client sends in place of ``content``."""
    return {SIGNED: content, MAC: tag(key, msg_type, sender, state, timestamp, content)}


def verify(
    key: bytes, msg_type: str, sender: int, state: int, timestamp: float, content: object
) -> tuple[object, str | None]:
    """``(signed content, None)`` if the tag of a received ``content`` is right for these fields under ``key``, else
    ``(None, why not)``: "unsigned ..." or "wrong signature ..."."""
    if not isinstance(content, Mapping) or set(content) != {SIGNED, MAC} or not isinstance(content[MAC], str):
        return None, "unsigned: the content is not a signed message, and the server requires signatures"
    try:
        expected = tag(key, msg_type, sender, state, timestamp, content[SIGNED])
    except TypeError as err:
        return None, f"wrong signature: the signed content cannot be canonicalised ({err})"
    if not hmac.compare_digest(expected, content[MAC]):
        return None, "wrong signature"
    return content[SIGNED], None

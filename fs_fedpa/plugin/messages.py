"""What the server accepts from the network in distributed mode, field by field, before FS's own code reads it.

FS's server trusts every field of a received message: it compares ``state`` with ints, asserts that timestamps never
decrease, unpacks ``content`` as ``(sample_size, upload)`` and merges metric values as numbers. One malformed message
from one client therefore stopped the whole federation. :func:`message_problem` names the field that is wrong, and
the server drops that message with the sender's id and the reason (docs/errors.md). No FS import here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

from fs_fedpa.record import EVAL_SECONDS

CLIENT_TYPES = ("join_in", "join_in_info", "model_para", "metrics")  # what a client sends a FedPA server
MAX_TIMESTAMP = 1e15  # simulated seconds; far beyond any run, far below what breaks FS's float arithmetic


@dataclass(frozen=True)
class ServerView:
    """What the checks need to know of the server: its round, the run's size and the clients that joined."""

    state: int
    total_rounds: int
    client_num: int
    joined: frozenset
    metrics: frozenset = frozenset()  # the metric names FS's monitor can look up (its calculator's); empty: any


def _integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def message_problem(msg_type: object, sender: object, state: object, timestamp: object, content: object,
                    server: ServerView) -> str | None:  # fmt: skip
    """Why a message from the network must be dropped (the field and what is wrong with it), or None."""
    if not isinstance(msg_type, str) or msg_type not in CLIENT_TYPES:
        return (
            f"msg_type {str(msg_type)[:40]!r} is not a message a client sends the server ({', '.join(CLIENT_TYPES)})"
        )
    if not _integer(sender):
        return f"sender {str(sender)[:40]!r} is not an integer client id"
    joining = msg_type == "join_in"
    if joining and sender != -1 and not 1 <= sender <= server.client_num:
        return f"sender {sender} is not -1 (a new client) or a client id of this run (1..{server.client_num})"
    if joining and (len(server.joined) >= server.client_num or sender in server.joined):
        who = "that client" if sender in server.joined else f"all {server.client_num} clients"
        return f"a join from sender {sender}, but {who} joined already"
    if not joining and sender not in server.joined:
        return f"sender {sender} is not a client that joined this run (joined: {sorted(server.joined)})"
    if not _integer(state):
        return f"state {str(state)[:40]!r} is not an integer round"
    if not _real(timestamp) or not math.isfinite(timestamp) or not 0 <= timestamp <= MAX_TIMESTAMP:
        return f"timestamp {str(timestamp)[:40]!r} is not a finite number of seconds in [0, {MAX_TIMESTAMP:g}]"
    if problem := content_problem(msg_type, content, server.metrics):
        return problem
    # every field is well-formed; now whether it fits the server's round
    if msg_type == "model_para" and state != server.state:
        return f"state {state}: an update for round {state}, but the server is at round {server.state}"
    if msg_type == "metrics" and not 0 <= state <= min(server.state, server.total_rounds):
        return f"state {state}: evaluation results for round {state}, but the server is at round {server.state}"
    return None


def content_problem(msg_type: str, content: object, metrics: frozenset = frozenset()) -> str | None:
    """Why the ``content`` of a client's message of ``msg_type`` cannot be what FS's handler reads, or None.
    ``metrics``: the names FS's monitor looks a metric's ``<split>_<name>`` up by (unknown names raise there)."""
    if msg_type == "model_para":
        if not isinstance(content, (list, tuple)) or len(content) != 2:
            kind = f"a {len(content)}-item {type(content).__name__}" if isinstance(content, (list, tuple)) else None
            return f"content is {kind or type(content).__name__}, not a (sample_size, upload) pair"
        if not _real(content[0]):
            return f"content[0], the sample size, is a {type(content[0]).__name__}, not a number"
        if not isinstance(content[1], Mapping):
            return f"content[1], the upload, is a {type(content[1]).__name__}, not a mapping"
        return None
    if not isinstance(content, Mapping):
        return f"content is a {type(content).__name__}, not a mapping"
    if msg_type == "metrics":
        for key, value in content.items():
            if not isinstance(key, str):
                return f"content: metric name {str(key)[:40]!r} is not a string"
            if not _real(value) or not math.isfinite(value):
                return f"content: metric {key[:40]!r} = {str(value)[:40]!r} is not a finite number"
            if metrics and key != EVAL_SECONDS and not _known(key, metrics):
                return f"content: metric {key[:40]!r} is not one this run computes ({', '.join(sorted(metrics))})"
    if msg_type == "join_in":
        host, port = content.get("host"), content.get("port")
        if not isinstance(host, str) or not (_integer(port) or (isinstance(port, str) and port.isdigit())):
            return "content: a join needs the client's address {'host': str, 'port': int}"
    return None


def _known(key: str, metrics: frozenset) -> bool:
    """FS's monitor reads a metric named like ``val_acc`` as split ``val`` and metric ``acc`` (for every split whose
    name occurs in it) and looks the metric up: a KeyError, and the server stops, for a name it does not compute."""
    for split in ("train", "val", "test"):
        if split in key and (f"{split}_" not in key or key.split(f"{split}_")[1] not in metrics):
            return False
    return True


def reply_problem(msg_type: str, sender: object, state: object, timestamp: object, content: object, client: int,
                  rnd: int, since: float, total_rounds: int, client_num: int) -> str | None:  # fmt: skip
    """Why the server would drop client ``client``'s reply of ``msg_type`` to its message of round ``rnd`` sent at
    ``since`` (:func:`message_problem`, as the server at round ``rnd`` sees it), or why FS's runner would fail on it
    (a timestamp before ``since``); None if neither. Another sender than ``client`` is "not a client that joined"."""
    view = ServerView(rnd, total_rounds, client_num, frozenset({client}))
    if problem := message_problem(msg_type, sender, state, timestamp, content, view):
        return problem
    if timestamp < since:
        return f"timestamp {timestamp!r} is earlier than {since!r}, that of the server's message it answers"
    return None

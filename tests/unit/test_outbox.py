"""What leaves a client (fs_fedpa.plugin.outbox.ClientOutbox): installed on FS's comm manager, it refuses a reply
the server's intake would drop, signs what goes to the server (and only that), and hands the rest to FS's transport
unchanged. The signature is checked by auth.verify, the server's own check, not by the outbox."""

from __future__ import annotations

import secrets
from types import SimpleNamespace

import pytest

pytest.importorskip("federatedscope", reason="ClientOutbox wraps FS's comm manager and Message (FS not installed)")

from federatedscope.core.message import Message  # noqa: E402

from fs_fedpa.plugin import auth  # noqa: E402
from fs_fedpa.plugin.outbox import ClientOutbox  # noqa: E402

KEY = secrets.token_bytes(32)
UPLOAD = (12, {"lora": {}})


def _outbox(key=None):
    wire = []
    manager = SimpleNamespace(send=wire.append)
    outbox = ClientOutbox(manager, lambda: (2, 0), (10, 3), key)
    outbox.answering(3, 5.0)
    return manager, outbox, wire


def test_a_reply_the_server_accepts_goes_through_fs_comm_manager_unchanged():
    manager, _, wire = _outbox()
    message = Message("model_para", 2, [0], state=3, timestamp=6.0, content=UPLOAD)
    manager.send(message)
    assert wire == [message] and message.content == UPLOAD


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(sender=1), "sender 1"),  # another client's id
        (dict(state=4), "state"),  # not the round it answers
        (dict(timestamp=4.0), "earlier than 5.0"),  # before the server's message it answers
        (dict(content=[12]), "content"),
    ],
)
def test_a_malformed_reply_is_refused_naming_the_field_and_nothing_is_sent(fields, named):
    manager, _, wire = _outbox()
    message = Message(**{**dict(msg_type="model_para", sender=2, receiver=[0], state=3, timestamp=6.0,
                                content=UPLOAD), **fields})  # fmt: skip
    with pytest.raises(ValueError, match=f"client #2, round 3: its model_para message is malformed.*{named}"):
        manager.send(message)
    assert wire == []


def test_with_a_key_what_goes_to_the_server_is_signed_and_verifies_and_nothing_else_is():
    manager, _, wire = _outbox(KEY)
    manager.send(Message("model_para", 2, [0], state=3, timestamp=6.0, content=UPLOAD))
    manager.send(Message("join_in", 2, [1], state=0, timestamp=0.0, content="peer"))  # to another worker
    to_server, to_peer = wire
    content, problem = auth.verify(KEY, "model_para", 2, 3, 6.0, to_server.content)
    assert problem is None and list(content) == list(UPLOAD)
    assert auth.verify(secrets.token_bytes(32), "model_para", 2, 3, 6.0, to_server.content)[1] is not None
    assert to_peer.content == "peer"

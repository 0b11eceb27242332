"""The server's checks of every field of a message from the network (fs_fedpa.plugin.messages) and the message
signatures of distributed mode (fs_fedpa.plugin.auth), through FS's own gRPC encoding where FS is installed."""

from __future__ import annotations

import math
import secrets

import pytest

from fs_fedpa.plugin import auth
from fs_fedpa.plugin.messages import ServerView, message_problem, reply_problem

SERVER = ServerView(state=3, total_rounds=10, client_num=3, joined=frozenset({1, 2, 3}))
JOINING = ServerView(state=0, total_rounds=10, client_num=3, joined=frozenset({1}))
LOSS_ONLY = ServerView(3, 10, 3, frozenset({1, 2, 3}), frozenset({"loss", "avg_loss", "total"}))  # a causal LM's
UPLOAD = [12, {"lora": {}}]


@pytest.mark.parametrize(
    "fields, view, field",
    [
        (("evaluate", 1, 3, 1.0, UPLOAD), SERVER, "msg_type"),
        (("fedpa_round_timeout", 0, 3, 1.0, ""), SERVER, "msg_type"),
        ((None, 1, 3, 1.0, UPLOAD), SERVER, "msg_type"),
        (("model_para", "1", 3, 1.0, UPLOAD), SERVER, "sender"),
        (("model_para", True, 3, 1.0, UPLOAD), SERVER, "sender"),
        (("model_para", 4, 3, 1.0, UPLOAD), SERVER, "sender 4 is not a client that joined"),
        (("model_para", 1, "3", 1.0, UPLOAD), SERVER, "state"),
        (("model_para", 1, None, 1.0, UPLOAD), SERVER, "state"),
        (("model_para", 1, 4, 1.0, UPLOAD), SERVER, "state 4: an update for round 4"),
        (("model_para", 1, -1, 1.0, UPLOAD), SERVER, "state -1"),
        (("model_para", 1, 3, -1.0, UPLOAD), SERVER, "timestamp"),
        (("model_para", 1, 3, math.nan, UPLOAD), SERVER, "timestamp"),
        (("model_para", 1, 3, "soon", UPLOAD), SERVER, "timestamp"),
        (("model_para", 1, 3, 1e300, UPLOAD), SERVER, "timestamp"),
        (("model_para", 1, 3, 1.0, "x"), SERVER, "content is str"),
        (("model_para", 1, 3, 1.0, [1, {}, 2]), SERVER, "content is a 3-item list"),
        (("model_para", 1, 3, 1.0, None), SERVER, "content is NoneType"),
        (("model_para", 1, 3, 1.0, ["12", {}]), SERVER, "content[0], the sample size"),
        (("model_para", 1, 3, 1.0, [12, "lora"]), SERVER, "content[1], the upload"),
        (("metrics", 1, 2, 1.0, {"val_acc": "high"}), SERVER, "metric 'val_acc'"),
        (("metrics", 1, 2, 1.0, {"val_acc": math.inf}), SERVER, "metric 'val_acc'"),
        (("metrics", 1, 2, 1.0, {3: 0.5}), SERVER, "metric name '3'"),
        (("metrics", 1, 7, 1.0, {"val_acc": 0.5}), SERVER, "state 7: evaluation results"),
        # FS's monitor looks 'val_acc' up as 'acc': a KeyError that stopped the server (a flaky hostile-peer test)
        (("metrics", 1, 2, 1.0, {"val_loss": 1.0, "val_acc": 0.5}), LOSS_ONLY, "metric 'val_acc' is not one"),
        (("metrics", 1, 2, 1.0, {"interval": 0.5}), LOSS_ONLY, "metric 'interval' is not one"),  # 'val', no 'val_'
        (("metrics", 1, 2, 1.0, {"val_test_loss": 0.5}), LOSS_ONLY, "metric 'val_test_loss'"),  # val: 'test_loss'
        (("join_in", 5, 0, 0.0, {"host": "h", "port": 1}), JOINING, "sender 5 is not -1"),
        (("join_in", 1, 0, 0.0, {"host": "h", "port": 1}), JOINING, "that client joined already"),
        (("join_in", -1, 0, 0.0, {"host": "h"}), JOINING, "address"),
        (("join_in", -1, 0, 0.0, {"host": "h", "port": 1}), SERVER, "all 3 clients joined already"),
    ],
)
def test_every_field_is_checked_and_named(fields, view, field):
    problem = message_problem(*fields, view)
    assert problem is not None and field in problem


@pytest.mark.parametrize(
    "fields, view",
    [
        (("model_para", 2, 3, 17.5, UPLOAD), SERVER),
        (("model_para", 2, 3, 0, (12.0, {"lora": {}})), SERVER),
        (("metrics", 3, 2, 1.0, {"val_acc": 0.5, "val_total": 87}), SERVER),
        (("metrics", 3, 2, 1.0, {"val_loss": 0.5, "local.val_avg_loss": 0.1, "test_total": 87}), LOSS_ONLY),
        (("join_in", -1, -1, 0, {"host": "127.0.0.1", "port": "50052"}), JOINING),
        (("join_in_info", 1, 0, 0.0, {"num_sample": 3}), SERVER),
    ],
)
def test_honest_messages_pass(fields, view):
    assert message_problem(*fields, view) is None


KEY = bytes.fromhex(secrets.token_hex(32))


def test_a_signature_fails_for_any_changed_field_and_any_other_key():
    content = [12, {"lora": {"q": {"B": {"dtype": "float32", "shape": [4, 2], "data": "AAAA"}}}, "stats": {"x": 0.1}}]
    signed = auth.sign(KEY, "model_para", 2, 3, 17.25, content)
    assert auth.verify(KEY, "model_para", 2, 3, 17.25, signed) == (content, None)
    for changed in (("model_para", 1, 3, 17.25), ("model_para", 2, 4, 17.25), ("metrics", 2, 3, 17.25)):
        assert auth.verify(KEY, *changed, signed)[1] == "wrong signature"
    tampered = {**signed, auth.SIGNED: [13, content[1]]}
    assert auth.verify(KEY, "model_para", 2, 3, 17.25, tampered)[1] == "wrong signature"
    other = bytes.fromhex(secrets.token_hex(32))
    assert auth.verify(other, "model_para", 2, 3, 17.25, signed)[1] == "wrong signature"
    assert auth.verify(KEY, "model_para", 2, 3, 17.25, content)[1].startswith("unsigned")


def test_the_canonical_form_is_that_of_fs_grpc_transport():
    # float32 rounding, tuples as lists, bytes as strings: what FS's gRPC messages deliver
    assert auth.canonical((0.1, b"x")) == auth.canonical([float.fromhex("0x1.99999ap-4"), "x"])
    assert auth.canonical(0.1) != auth.canonical(0.2)
    with pytest.raises(TypeError, match="bool"):
        auth.canonical({"flag": True})


def test_a_signed_message_survives_fs_grpc_encoding():
    """Signed before FS's gRPC encoding (ints as int32, floats as float32), verified after FS's parser."""
    pytest.importorskip("federatedscope")
    from federatedscope.core.message import Message

    content = [12, {"lora": {"q": {"dtype": "float32", "shape": [4, 2], "data": "AAAA"}}, "stats": {"x": 0.1}}]
    sent = Message(msg_type="model_para", sender=2, receiver=[0], state=3, timestamp=17.123456789,
                   content=auth.sign(KEY, "model_para", 2, 3, 17.123456789, content))  # fmt: skip
    received = Message()
    received.parse(sent.transform(to_list=True).msg)
    assert received.timestamp != 17.123456789  # float32 on the wire
    got, problem = auth.verify(
        KEY, "model_para", received.sender, received.state, received.timestamp, received.content
    )
    assert problem is None and got[0] == 12 and got[1]["stats"]["x"] == pytest.approx(0.1, rel=1e-7)


def test_keys_and_keyrings_are_checked_with_the_file_named(tmp_path):
    good = [secrets.token_hex(32) for _ in range(3)]
    ring = tmp_path / "keyring"
    ring.write_text("# id key\n" + "".join(f"{i} {k}\n" for i, k in enumerate(good, start=1)))
    assert auth.read_keyring(str(ring), 3) == {i: bytes.fromhex(k) for i, k in enumerate(good, start=1)}
    for text, match in (
        (f"1 {good[0]}\n2 {good[1]}\n", r"no key for clients \[3\]"),
        (f"1 {good[0]}\n2 {good[1]}\n3 {good[0]}\n", "share a key"),
        (f"1 {good[0]}\n1 {good[1]}\n3 {good[2]}\n", "line 2: client id 1 is repeated"),
        (f"1 {good[0]}\n2 abc\n3 {good[2]}\n", "line 2: a key is at least 64 hex digits"),
        (f"1 {good[0]} extra\n", "line 1: expected"),
    ):
        ring.write_text(text)
        with pytest.raises(ValueError, match=match):
            auth.read_keyring(str(ring), 3)
    key = tmp_path / "client.key"
    key.write_text(good[0] + "\n")
    assert auth.read_key(str(key)) == bytes.fromhex(good[0])
    with pytest.raises(ValueError, match="cannot read the key file"):
        auth.read_key(str(tmp_path / "missing.key"))


@pytest.mark.parametrize(
    "fields, field",
    [
        (("model_para", 2, 3, 7.5, UPLOAD), None),  # the honest reply: its round, a later timestamp
        (("metrics", 2, 3, 5.0, {"val_acc": 0.5}), None),  # an evaluation keeps the server's timestamp
        (("model_para", 2, -1, 7.5, UPLOAD), "state -1: an update for round -1, but the server is at round 3"),
        (("model_para", 2, "3", 7.5, UPLOAD), "state '3' is not an integer round"),
        (("model_para", 2, 3, 4.0, UPLOAD), "timestamp 4.0 is earlier than 5.0"),
        (("model_para", 1, 3, 7.5, UPLOAD), "sender 1 is not a client that joined"),
        (("model_para", 2, 3, 7.5, (12,)), "content is a 1-item tuple"),
        (("metrics", 2, 4, 5.0, {"val_acc": 0.5}), "state 4: evaluation results for round 4"),
    ],
)
def test_a_clients_reply_is_checked_as_the_server_would_check_it_plus_its_timestamp(fields, field):
    """Client 2 answers the server's message of round 3 sent at t = 5.0 (a run of 10 rounds and 3 clients)."""
    problem = reply_problem(*fields, client=2, rnd=3, since=5.0, total_rounds=10, client_num=3)
    if field is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(field), problem

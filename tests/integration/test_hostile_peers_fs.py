"""Issue 32 over gRPC: a server and three honest clients on loopback (scripts/run_distributed.sh, each client with its
own key), and a hostile peer that sends the server every malformed, forged, replayed and mislabelled message that
used to stop the federation or be aggregated. The server must drop each one naming the sender and the field, every
honest party must exit 0, and the final global adapter must be the run's without the hostile messages. A client
whose server dies must exit non-zero with the reason instead of waiting forever."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.integration.conftest import fedpa_cfg
from tests.integration.test_distributed_fs import distributed_cfgs
from tests.integration.tiny_assets import dump_yaml, fs_env

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("distributed")]  # one worker: 4 processes each


def _send_all(port: int, requests: list) -> None:
    """Each request to the server's gRPC port, over one channel, as fast as they go."""
    import grpc
    from federatedscope.core.proto import gRPC_comm_manager_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = gRPC_comm_manager_pb2_grpc.gRPCComServeFuncStub(channel)
        for request in requests:
            stub.sendMessage(request, timeout=10)


def _request(msg_type, sender, state, timestamp, content, key: bytes | None = None):
    """FS's own gRPC request for these fields; signed with ``key`` as a client with that key would sign it."""
    from federatedscope.core.message import Message

    from fs_fedpa.plugin import auth

    if key is not None:
        content = auth.sign(key, msg_type, sender, state, timestamp, content)
    return Message(msg_type, sender, [0], state=state, timestamp=timestamp, content=content).transform(to_list=True)


def _own_key(keys: Path) -> bytes:
    return bytes.fromhex((keys / "client_1.key").read_text().strip())


def _hostile_messages(keys: Path) -> list[tuple[str, object]]:
    """``(the reason the server must log, request)`` for each hostile message; client 1's key is the compromised
    client's own, the others are forgeries."""
    from federatedscope.core.message import Message

    own = _own_key(keys)
    stranger = bytes.fromhex(secrets.token_hex(32))
    upload = [8, {"lora": {"q": "x"}}]  # FS cannot encode an empty dict
    missing_state = Message("model_para", 1, [0], state=0, timestamp=1.0, content=upload).transform(to_list=True)
    del missing_state.msg["state"]
    no_content = Message("model_para", 1, [0], state=0, timestamp=1.0, content=upload).transform(to_list=True)
    no_content.msg["content"].Clear()  # what a None would be, which FS's encoder refuses to send
    return [
        # client 1, signing malformed messages with its own key
        ("timestamp '-1.0' is not", _request("model_para", 1, 0, -1.0, upload, own)),
        ("timestamp 'nan' is not", _request("model_para", 1, 0, float("nan"), upload, own)),
        ("timestamp 'soon' is not a value FS accepts", _request("model_para", 1, 0, "soon", upload, own)),
        ("state 'zero' is not an integer round", _request("model_para", 1, "zero", 1.0, upload, own)),
        ("content is str, not a (sample_size, upload) pair", _request("model_para", 1, 0, 1.0, "x", own)),
        ("content is a 3-item list", _request("model_para", 1, 0, 1.0, [8, {"lora": {"q": "x"}}, 1], own)),
        (
            "metric 'val_loss' = 'high' is not a finite number",
            _request("metrics", 1, 0, 1.0, {"val_loss": "high"}, own),
        ),
        # a metric this run does not compute (a causal LM's are loss, avg_loss, total): FS's monitor raised a
        # KeyError on it, and the server stopped, if it came while round 0 was being evaluated
        ("metric 'val_acc' is not one this run computes", _request("metrics", 1, 0, 1.0, {"val_acc": 0.5}, own)),
        ("state -1: an update for round -1", _request("model_para", 1, -1, 1.0, upload, own)),
        # forgeries under other ids: unsigned, signed with a key of no client, for the next round
        ("model_para message: unsigned", _request("model_para", 2, 0, 1.0, upload)),
        ("model_para message: wrong signature", _request("model_para", 2, 0, 1.0, upload, stranger)),
        ("model_para message: wrong signature", _request("model_para", 3, 1, 1.0, upload, stranger)),
        ("model_para message: wrong signature", _request("model_para", 3, 0, 1.0, upload, own)),  # 1's key as 3
        ("clients joined already", _request("join_in", -1, 0, 0.0, {"host": "127.0.0.1", "port": 1})),
        ("no key of this run is registered", _request("fedpa_round_timeout", 0, 0, 0.0, "")),
        ("state: the message has no such field", missing_state),
        ("content: FS cannot parse it", no_content),
    ]


def _launch(cfgs: list[dict], tmp_path: Path, **env) -> subprocess.Popen:
    paths = [dump_yaml(cfg, tmp_path / f"party{i}.yaml") for i, cfg in enumerate(cfgs)]
    extra = {"LOGDIR": str(tmp_path), "JOIN_WAIT": "5", "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", **env}
    return subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "run_distributed.sh"), *paths], cwd=tmp_path, env=fs_env(extra),
        start_new_session=True,
    )  # fmt: skip


def _wait_for(path: Path, text: str, proc: subprocess.Popen, limit: float = 180) -> None:
    deadline = time.time() + limit
    while not (path.is_file() and text in path.read_text()):
        assert time.time() < deadline and proc.poll() is None, path.read_text()[-3000:] if path.is_file() else ""
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    """The launcher's exit status; afterwards no party of it is left running (the next test counts processes)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        raise
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _final_global(folder: Path) -> dict:
    return torch.load(folder / "final_ckpt.pt", weights_only=False)["fedpa"]["global"]


def test_no_hostile_message_stops_or_changes_the_federation(tiny_llm, tmp_path):
    # Prepare: the setting of the distributed-vs-standalone test, long enough that every hostile message arrives
    # while the run is under way; its run without the hostile peer is the reference
    changes = {"dataloader.shuffle": False, "fedpa.reference_ranks": [2, 3, 4], "federate.save_to": ""}
    changes["federate.total_round_num"] = 12
    base = fedpa_cfg(tiny_llm, tmp_path, **changes)
    clean, attacked = tmp_path / "clean", tmp_path / "attacked"
    clean.mkdir()
    attacked.mkdir()
    assert _finish(_launch(distributed_cfgs(base, clean / "dist"), clean)) == 0
    cfgs = distributed_cfgs(base, attacked / "dist")
    port = cfgs[0]["distribute"]["server_port"]
    # Execute: the hostile messages arrive as round 0 starts, before or among the honest updates
    proc = _launch(cfgs, attacked)
    try:
        _wait_for(attacked / "party0.log", "Starting training (Round #0)", proc)
        hostile = _hostile_messages(attacked / "keys")
        _send_all(port, [request for _, request in hostile])
        sent = [reason for reason, _ in hostile]
        # a correctly signed evaluation no one asked for, a replay of round 0's once that evaluation is over (sent
        # with the others it could arrive while round 0 is evaluated and count as client 1's): it must not count,
        # nor keep the round alive
        _wait_for(attacked / "party0.log", "Starting a new training round (Round #4)", proc)
        _send_all(port, [_request("metrics", 1, 0, 1.0, {"val_loss": 0.5}, _own_key(attacked / "keys"))])
        sent.append("client 1, which was not asked to evaluate round 0")
        status = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # Assert: every party exited 0, each hostile message was dropped with its reason, the result is the clean run's
    logs = [(attacked / f"party{i}.log").read_text() for i in range(4)]
    assert status == 0, "\n\n".join(log[-3000:] for log in logs)
    dropped = [line for line in logs[0].splitlines() if "[fedpa]" in line and "ignored a message" in line]
    for reason in sent:
        assert any(reason in line for line in dropped), (reason, dropped)
    assert len(dropped) == len(sent), dropped
    final, reference = _final_global(attacked / "dist"), _final_global(clean / "dist")
    for name, (B, A) in reference.items():
        got, want = final[name][0] @ final[name][1], B @ A
        assert float((got - want).norm() / want.norm()) < 1e-6, name


def test_a_client_whose_server_dies_exits_with_the_reason(tiny_llm, tmp_path):
    # the clients' timeout covers their wait for the others to join, which is slow on a loaded machine
    changes = {"federate.save_to": "", "federate.total_round_num": 200, "fedpa.net.round_timeout_s": 20.0}
    changes["fedpa.net.client_timeout_s"] = 40.0
    changes["fedpa.net.join_timeout_s"] = 35.0  # at most the clients' timeout (a longer join bound is refused)
    cfgs = distributed_cfgs(fedpa_cfg(tiny_llm, tmp_path, **changes), tmp_path / "dist")
    proc = _launch(cfgs, tmp_path)
    try:
        _wait_for(tmp_path / "party0.log", "Starting a new training round (Round #1)", proc)
        # the server itself, not the launch script, nor a party of another test that has not exited yet
        pattern = f"federatedscope.main --cfg {tmp_path}/party0.yaml"
        server = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        assert len(server) == 1, server
        os.kill(int(server[0]), signal.SIGKILL)
        started = time.time()
        status = _finish(proc, timeout=150)
        waited = time.time() - started
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
    logs = [(tmp_path / f"party{i}.log").read_text() for i in range(1, 4)]
    assert status != 0 and waited < 100
    for log in logs:
        assert "no message from the server for fedpa.net.client_timeout_s=40 s" in log, log[-2000:]


def test_only_the_clients_own_watchdog_can_stop_it():
    """A client-watchdog message with another token (a peer's forgery) is ignored; its own stops the client."""
    from types import SimpleNamespace

    from federatedscope.core.message import Message

    from fs_fedpa.plugin.client import FedPAClient
    from fs_fedpa.plugin.liveness import CLIENT_TIMEOUT

    client = FedPAClient.__new__(FedPAClient)  # the handler needs only these fields
    client._token, client.ID, client.state = "right", 1, 3
    client.method = SimpleNamespace(cfg=SimpleNamespace(net=SimpleNamespace(client_timeout_s=5.0)))
    assert client._on_client_timeout(Message(CLIENT_TIMEOUT, 0, [1], state=0, content="wrong")) is None
    with pytest.raises(RuntimeError, match="no message from the server for fedpa.net.client_timeout_s=5 s"):
        client._on_client_timeout(Message(CLIENT_TIMEOUT, 1, [1], state=0, content="right"))


def test_a_join_the_server_refuses_does_not_keep_it_waiting(tiny_llm, tmp_path):
    """Client 3 holds a key that is not its own: the server refuses its join with the reason, waits at most
    fedpa.net.join_timeout_s for another join, then stops non-zero naming client 3 and lets the two that
    joined finish."""
    # a loaded machine takes tens of seconds to start a client: the bound is between two joins, so it must exceed that
    changes = {"federate.save_to": "", "fedpa.net.join_timeout_s": 60.0, "fedpa.net.round_timeout_s": 20.0}
    changes["fedpa.net.client_timeout_s"] = 150.0  # the honest clients wait from their join to the server's stop
    cfgs = distributed_cfgs(fedpa_cfg(tiny_llm, tmp_path, **changes), tmp_path / "dist")
    proc = _launch(cfgs, tmp_path)
    try:
        keys = tmp_path / "keys"
        deadline = time.time() + 60
        while not (keys / "keyring").is_file() or len((keys / "keyring").read_text().splitlines()) < 3:
            assert time.time() < deadline, "run_distributed.sh wrote no keyring"
            time.sleep(0.05)
        (keys / "client_3.key").write_text(secrets.token_hex(32) + "\n")  # before client 3 starts and reads it
        stopped = "RuntimeError: [fedpa] 2 of 3 clients joined"  # the server's exception: it exits non-zero
        _wait_for(tmp_path / "party0.log", stopped, proc, limit=300)
        for i in (1, 2):  # told to finish; client 3, never assigned, would wait out its own client_timeout_s
            _wait_for(tmp_path / f"party{i}.log", "received finish message", proc, limit=60)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    server = (tmp_path / "party0.log").read_text()
    assert "join_in message: wrong signature" in server, server[-3000:]
    assert "2 of 3 clients joined, then none for fedpa.net.join_timeout_s=60 s; clients [3] never joined" in server

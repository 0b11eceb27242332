"""Mutual TLS in distributed mode (fedpa.net.tls_cert, tls_key, tls_ca), on 127.0.0.1: what crosses the network is
encrypted, only holders of a certificate of the run's CA can deliver a message, a message goes only to the
certificate of its receiver, the server binds each message to its sender's certificate, and a federation over TLS
trains what the standalone run trains while a client with a certificate of another CA is shut out."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.integration.conftest import fedpa_cfg, probe
from tests.integration.test_distributed_fs import _free_ports, distributed_cfgs
from tests.integration.test_hostile_peers_fs import _finish, _launch, _wait_for
from tests.integration.tiny_assets import dump_yaml, fs_env
from tests.unit.test_tls import needs_openssl

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("distributed"), needs_openssl]

GRPC = SimpleNamespace(grpc_max_send_message_length=2**27, grpc_max_receive_message_length=2**27,
                       grpc_enable_http_proxy=False, grpc_compression="no")  # FS's cfg.distribute, its defaults


def _manager(certs: Path, name: str, role: str = "client"):
    """A TLS comm manager of party ``name`` (``server``, ``client_1``) listening on a free port of 127.0.0.1."""
    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.plugin import tls
    from fs_fedpa.plugin.tls_fs import TLSCommManager

    net = {"tls_cert": str(certs / f"{name}.pem"), "tls_key": str(certs / f"{name}.key")}
    files = tls.read_files(FedPAConfig(net=net | {"tls_ca": str(certs / "ca.pem")}).net, role=role, clients=2)
    return TLSCommManager(files, host="127.0.0.1", port=_free_ports(1)[0], client_num=2, cfg=GRPC)


def _plain_manager():
    from federatedscope.core.communication import gRPCCommManager

    return gRPCCommManager(host="127.0.0.1", port=_free_ports(1)[0], client_num=2, cfg=GRPC)


def _message(sender: int, receiver: int, content: str):
    from federatedscope.core.message import Message

    return Message("model_para", sender, [receiver], state=0, timestamp=1.0, content=content)


def _arrived(manager, wait: float = 2.0) -> list:
    """The requests in ``manager``'s queue once nothing more arrives for ``wait`` seconds."""
    time.sleep(wait)
    return list(manager.server_funcs.msg_queue)


class _Relay:
    """A TCP relay from a port of 127.0.0.1 to ``target``, recording every byte that crosses it: what anyone on
    the path sees."""

    def __init__(self, target: int):
        self.seen = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = target
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src, dst):
        try:
            while data := src.recv(65536):
                self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_a_message_crosses_the_network_encrypted_and_arrives_with_the_name_of_its_senders_certificate(certs):
    # Prepare: a server and client 1 over TLS, a pair of FS's own plaintext managers, each behind a relay
    from federatedscope.core.message import Message

    from fs_fedpa.plugin.tls_fs import peer_of

    canary = f"canary-{secrets.token_hex(8)}"
    server, client = _manager(certs, "server", "server"), _manager(certs, "client_1")
    plain_server, plain_client = _plain_manager(), _plain_manager()
    relay, plain_relay = _Relay(int(server.port)), _Relay(int(plain_server.port))
    client.add_neighbors(0, f"127.0.0.1:{relay.port}")
    plain_client.add_neighbors(0, f"127.0.0.1:{plain_relay.port}")
    # Execute
    client.send(_message(1, 0, canary))
    plain_client.send(_message(1, 0, canary))
    # Assert: both arrive; the relay of the plaintext pair read the canary, the TLS relay did not
    request = server.server_funcs.receive()
    assert peer_of(request) == "fedpa-client-1"
    got = Message()
    got.parse(request.msg)
    assert (got.sender, got.content) == (1, canary)
    assert plain_server.server_funcs.receive() is not None
    assert canary.encode() in plain_relay.seen
    assert len(relay.seen) > 200 and canary.encode() not in relay.seen
    for m in (server, client, plain_server, plain_client):
        m.grpc_server.stop(None)


def test_a_peer_without_a_certificate_of_the_run_cannot_deliver_a_message(certs, other_ca):
    # Prepare: the server; a plaintext FS peer, a peer with a certificate of another CA, and client 1 that writes the
    # name of the server's certificate into its message
    from fs_fedpa.plugin.tls_fs import PEER, peer_of

    server = _manager(certs, "server", "server")
    address = f"127.0.0.1:{server.port}"
    plain, stranger, client = _plain_manager(), _manager(other_ca, "client_1"), _manager(certs, "client_1")
    for m in (plain, stranger, client):
        m.add_neighbors(0, address)
    forged = _message(1, 0, "x").transform(to_list=True)
    forged.msg[PEER].single_msg.str_value = "fedpa-server"
    # Execute
    plain.send(_message(1, 0, "plain"))
    stranger.send(_message(1, 0, "stranger"))
    assert _arrived(server) == []  # the TLS handshake failed: nothing reached the server's queue
    client._send_to(0, address, forged)
    # Assert: the name is the certificate's, whatever the message says
    (request,) = _arrived(server)
    assert peer_of(request) == "fedpa-client-1"
    for m in (server, plain, stranger, client):
        m.grpc_server.stop(None)


def test_a_message_goes_only_to_the_certificate_of_its_receiver_and_a_client_hears_only_the_server(certs):
    # Prepare: client 1 listens where the server believes client 2 is
    server = _manager(certs, "server", "server")
    client1, client2 = _manager(certs, "client_1"), _manager(certs, "client_2")
    server.add_neighbors(2, f"127.0.0.1:{client1.port}")
    server.add_neighbors(1, f"127.0.0.1:{client1.port}")
    client2.add_neighbors(1, f"127.0.0.1:{client1.port}")
    # Execute / Assert: the message for client 2 does not reach client 1's certificate; client 1's own does
    server.send(_message(0, 2, "for client 2"))
    assert _arrived(client1) == []
    # a message from client 2 is dropped by client 1, which takes the server's next one
    client2.send(_message(2, 1, "from client 2"))
    server.send(_message(0, 1, "for client 1"))
    assert client1.receive().content == "for client 1"
    assert list(client1.server_funcs.msg_queue) == []
    for m in (server, client1, client2):
        m.grpc_server.stop(None)


def test_a_federation_over_mutual_tls_trains_as_the_standalone_run_and_shuts_out_a_client_of_another_ca(
    tiny_llm, tmp_path, certs, other_ca
):
    # Prepare: 1 server + 2 clients over TLS (no HMAC keys: the certificates alone bind the ids); its standalone
    # run is the reference
    changes = {"dataloader.shuffle": False, "fedpa.reference_ranks": [2, 3], "federate.save_to": ""}
    changes |= {"federate.client_num": 2, "federate.total_round_num": 4}
    base = fedpa_cfg(tiny_llm, tmp_path, **changes)
    standalone = probe(base, tmp_path)
    cfgs = distributed_cfgs(base, tmp_path / "dist")
    intruder = dict(cfgs[2], distribute=dict(cfgs[2]["distribute"], client_port=_free_ports(1)[0]))
    intruder["expname"] = "fedpa_tiny_intruder"
    files = ("tls_cert", "client_1.pem"), ("tls_key", "client_1.key"), ("tls_ca", "ca.pem")
    intruder["fedpa"] = dict(intruder["fedpa"], net={k: str(other_ca / f) for k, f in files})
    intruder_log = tmp_path / "intruder.log"
    # Execute
    proc = _launch(cfgs, tmp_path, TLS=str(certs), AUTH="0")
    stranger = None
    try:
        _wait_for(tmp_path / "party0.log", "Server: Listen to", proc)
        with open(intruder_log, "w") as log:
            path = dump_yaml(intruder, tmp_path / "intruder.yaml")
            cmd = [sys.executable, "-m", "federatedscope.main", "--cfg", path]
            stranger = subprocess.Popen(cmd, cwd=tmp_path, env=fs_env({"PYTHONUNBUFFERED": "1"}), stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        _wait_for(tmp_path / "party0.log", "Starting training (Round #0)", proc)
        # client 1's own certificate, claiming to be client 2, and joining again
        port = cfgs[0]["distribute"]["server_port"]
        _send_as(certs, "client_1", port, [
            _message(2, 0, "x").transform(to_list=True),
            _join_request(),
        ])  # fmt: skip
        status = _finish(proc)
        _wait_for(intruder_log, "failed to connect", stranger, limit=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if stranger is not None and stranger.poll() is None:
            os.killpg(stranger.pid, signal.SIGKILL)
    # Assert: every party exited 0; the forged messages were dropped naming the claimed sender and the certificate;
    # the intruder never joined; the result is the standalone run's
    logs = [(tmp_path / f"party{i}.log").read_text() for i in range(3)]
    assert status == 0, "\n\n".join(log[-3000:] for log in logs)
    for i in (1, 2):
        assert f"is assigned with #{i}" in logs[i]
    dropped = [line for line in logs[0].splitlines() if "[fedpa]" in line and "ignored a message" in line]
    assert any("from client 2: model_para message: sent over the certificate of fedpa-client-1" in line
               for line in dropped), dropped  # fmt: skip
    assert any("a join, but client 1 joined already" in line for line in dropped), dropped
    assert "is assigned with" not in intruder_log.read_text()
    final = torch.load(tmp_path / "dist" / "final_ckpt.pt", weights_only=False)["fedpa"]["global"]
    for name, (B, A) in standalone["final"]["global"].items():
        torch.testing.assert_close(final[name][0] @ final[name][1], B @ A, atol=1e-5, rtol=0)


def test_a_bad_tls_file_stops_a_party_in_one_line_at_its_config_check(tiny_llm, tmp_path, certs):
    """The server given client 1's certificate: refused naming the key and the file, before its data and model load
    and before any port opens (the run's console shows the one line)."""
    from tests.integration.tiny_assets import run_module

    cfg = distributed_cfgs(fedpa_cfg(tiny_llm, tmp_path, **{"federate.save_to": ""}), tmp_path / "dist")[0]
    files = ("tls_cert", "client_1.pem"), ("tls_key", "client_1.key"), ("tls_ca", "ca.pem")
    cfg["fedpa"] = dict(cfg["fedpa"], net={k: str(certs / f) for k, f in files})
    proc = run_module("fs_fedpa", ["run", "--cfg", dump_yaml(cfg, tmp_path / "server.yaml")], tmp_path, fs_env(), 300)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fs-fedpa run: error: fedpa.net.tls_cert '{certs / 'client_1.pem'}' names fedpa-client-1; a server's "
        "certificate must name fedpa-server"
    ), proc.stderr[-2000:]
    assert "Server: Listen to" not in proc.stdout + proc.stderr


def _join_request():
    from federatedscope.core.message import Message

    join = Message("join_in", -1, [0], state=0, timestamp=0.0, content={"host": "127.0.0.1", "port": 1})
    return join.transform(to_list=True)


def _send_as(certs: Path, name: str, port: int, requests: list) -> None:
    """Each request to the server at ``port``, over TLS with party ``name``'s certificate."""
    import grpc
    from federatedscope.core.proto import gRPC_comm_manager_pb2_grpc

    creds = grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(), private_key=(certs / f"{name}.key").read_bytes(),
        certificate_chain=(certs / f"{name}.pem").read_bytes(),
    )  # fmt: skip
    options = [("grpc.ssl_target_name_override", "fedpa-server")]
    with grpc.secure_channel(f"127.0.0.1:{port}", creds, options=options) as channel:
        stub = gRPC_comm_manager_pb2_grpc.gRPCComServeFuncStub(channel)
        for request in requests:
            stub.sendMessage(request, timeout=10)


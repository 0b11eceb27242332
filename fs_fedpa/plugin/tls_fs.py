"""Mutual TLS for FS's gRPC channel: :class:`TLSCommManager` is FS's ``gRPCCommManager`` with TLS at both ends,
built in its place while a worker is constructed (:func:`fs_fedpa.plugin.fs_patches.grpc_comm_manager`), so no
plaintext port is ever opened.

Every FS party is a gRPC server (it receives) and a gRPC client (it sends). Receiving, it requires a certificate of
the run's CA and writes the party name of that certificate into each request (:data:`PEER`, set by the servicer
whatever the sender wrote there); sending, it requires the receiver's certificate to name the receiver
(``grpc.ssl_target_name_override``: the party, not the host, is verified). The server's inbox then drops a message
whose claimed sender is not the certificate's (:func:`sender_problem`); a client takes messages from the server's
certificate only. The files and names: :mod:`fs_fedpa.plugin.tls`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent import futures

import grpc
from federatedscope.core.communication import gRPCCommManager
from federatedscope.core.gRPC_server import gRPCComServeFunc
from federatedscope.core.message import Message
from federatedscope.core.proto import gRPC_comm_manager_pb2, gRPC_comm_manager_pb2_grpc

from fs_fedpa.plugin import tls

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only

PEER = "fedpa_tls_peer"  # the request field that carries the party name of the sender's certificate


def peer_of(request) -> str | None:
    """The party name of the certificate ``request`` came over ("" for one naming no single party), or None for a
    request the worker put in its own queue (its watchdog's)."""
    return request.msg[PEER].single_msg.str_value if PEER in request.msg else None


class TLSServeFunc(gRPCComServeFunc):
    """FS's servicer, writing the sender's certificate name into each request it queues."""

    def sendMessage(self, request, context):
        auth = context.auth_context()
        names = [v.decode("utf-8", "replace") for k in ("x509_subject_alternative_name", "x509_common_name")
                 for v in auth.get(k, [])]  # fmt: skip
        single = gRPC_comm_manager_pb2.mSingle(str_value=tls.party_of(names) or "")
        request.msg[PEER].CopyFrom(gRPC_comm_manager_pb2.MsgValue(single_msg=single))
        return super().sendMessage(request, context)


class TLSCommManager(gRPCCommManager):
    """FS's gRPC comm manager over mutual TLS with ``files`` (the party's own, checked); FS's arguments otherwise."""

    def __init__(self, files: tls.TLSFiles, **kwargs):
        self.tls = files
        super().__init__(**kwargs)

    def serve(self, max_workers, host, port, options):
        """FS's ``serve`` on a TLS port that requires a certificate of the run's CA."""
        self.server_funcs = TLSServeFunc()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), compression=self.comp_method,
                             options=options)  # fmt: skip
        gRPC_comm_manager_pb2_grpc.add_gRPCComServeFuncServicer_to_server(self.server_funcs, server)
        credentials = grpc.ssl_server_credentials(
            [(self.tls.key, self.tls.cert)], root_certificates=self.tls.ca, require_client_auth=True
        )
        server.add_secure_port(f"{host}:{port}", credentials)
        server.start()
        return server

    def send(self, message):
        """FS's ``send`` (a receiver, a list of them, or None: every neighbour), each over TLS to its certificate."""
        receivers = message.receiver if message.receiver is not None else list(self.neighbors)
        for receiver in receivers if isinstance(receivers, list) else [receivers]:
            if receiver in self.neighbors:
                self._send_to(receiver, self.neighbors[receiver], message.transform(to_list=True))

    def _send(self, receiver_address, message):
        raise RuntimeError("TLSCommManager sends through send(), to the certificate of each receiver")

    def _send_to(self, receiver: int, address: str, request) -> None:
        """``request`` to worker ``receiver`` at ``address``, whose certificate must name it; a failure (the peer is
        down, its certificate is not the receiver's or not the CA's) is a warning, as in FS's ``_send``."""
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.tls.ca, private_key=self.tls.key, certificate_chain=self.tls.cert
        )
        name = tls.party_name(receiver)
        options = (("grpc.enable_http_proxy", 0), ("grpc.ssl_target_name_override", name))
        with grpc.secure_channel(address, credentials, options=options, compression=self.comp_method) as channel:
            try:
                gRPC_comm_manager_pb2_grpc.gRPCComServeFuncStub(channel).sendMessage(request)
            except grpc.RpcError as error:
                logger.warning(f"[fedpa] {self.tls.name}: a message to {name} at {address} was not delivered: "
                               f"{error.code().name}: {str(error.details())[:300]}")  # fmt: skip

    def receive(self):
        """FS's ``receive``; a client's drops what did not come over the server's certificate (its own queued
        messages excepted). The server's inbox checks its messages itself (:func:`sender_problem`)."""
        while True:
            request = self.server_funcs.receive()
            peer = peer_of(request)
            if peer in (None, tls.SERVER_NAME) or self.tls.name == tls.SERVER_NAME:
                message = Message()
                message.parse(request.msg)
                return message
            logger.warning(f"[fedpa] {self.tls.name}: ignored a message sent over the certificate of "
                           f"{peer or 'no party'}: only {tls.SERVER_NAME} sends to a client")  # fmt: skip


def comm_manager(config, role: str) -> Callable | None:
    """What builds FS's comm manager for a worker of ``config`` (``role``: server or client): :class:`TLSCommManager`
    with the party's files in distributed mode with ``fedpa.net.tls_cert``, else None (FS's own). ValueError naming
    the key and the file for a bad one, before any port opens."""
    if config is None or str(config.federate.mode).lower() != "distributed":
        return None
    from fs_fedpa.plugin.config_fs import fedpa_config

    files = tls.read_files(fedpa_config(config).net, role, config.federate.client_num)
    return None if files is None else functools.partial(TLSCommManager, files)


def sender_problem(message: Message, peer: str | None, joined: frozenset) -> str | None:
    """Why the server must drop ``message``, which came over the certificate named ``peer``, or None: the claimed
    sender is not the certificate's client. A join takes the id of its certificate (FS's own join numbers clients
    in the order they join, which anyone can race); a second join of a client that joined is dropped."""
    cid = tls.client_id(peer)
    if cid is None:
        return "sent over no TLS connection" if peer is None else f"sent over a certificate naming {peer or 'no one'}"
    if message.msg_type == "join_in":
        if cid in joined:
            return f"a join, but client {cid} joined already"
        if message.sender not in (-1, cid):
            return f"a join as client {str(message.sender)[:40]} over the certificate of {peer}"
        message.sender = cid
        return None
    if message.sender != cid:
        return f"sent over the certificate of {peer}"
    return None

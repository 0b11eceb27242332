"""Mutual TLS for distributed mode: a party's files (``fedpa.net.tls_cert``, ``tls_key``, ``tls_ca``), checked
before any port opens, and the names that bind a certificate to a party. No FS and no gRPC here (the channel:
:mod:`fs_fedpa.plugin.tls_fs`).

A party's certificate names it in a DNS subjectAltName: ``fedpa-server``, or ``fedpa-client-<id>`` for client
``<id>``. Every party is both a gRPC server (it receives) and a gRPC client (it sends), so one certificate serves
both ends: the CA must sign it for TLS server and client use. The sender of a connection checks the receiver's
certificate against the name of the party it means to reach (not the host name), and the receiver requires the
sender's certificate: so a message goes only to its receiver's certificate, and comes with its sender's name.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass

from fs_fedpa.files import read_regular

SERVER_NAME = "fedpa-server"
_CLIENT = re.compile(r"fedpa-client-([1-9][0-9]{0,8})")
MAX_PEM_BYTES = 2**20  # a PEM file is a few KiB; a bound, so a file edited to /dev/zero is refused, not read whole


def client_name(cid: int) -> str:
    return f"fedpa-client-{cid}"


def party_name(worker_id: int) -> str:
    """The certificate name of FS's worker ``worker_id`` (0: the server)."""
    return SERVER_NAME if worker_id == 0 else client_name(worker_id)


def client_id(name: str | None) -> int | None:
    """The client id a certificate name gives, or None (the server's, or no party's)."""
    found = _CLIENT.fullmatch(name or "")
    return int(found.group(1)) if found else None


def party_of(names: list[str]) -> str | None:
    """The one party name among a certificate's names (its DNS subjectAltNames and common name), or None where it
    has none or more than one."""
    parties = {n for n in names if n == SERVER_NAME or client_id(n) is not None}
    return parties.pop() if len(parties) == 1 else None


@dataclass(frozen=True)
class TLSFiles:
    """A party's PEM bytes, checked, and the party name its certificate gives."""

    cert: bytes
    key: bytes
    ca: bytes
    name: str


def read_files(net, role: str, clients: int) -> TLSFiles | None:
    """The files of ``net`` (``fedpa.net``) for a party of ``role`` (``server``, ``client``) in a run of ``clients``
    clients; None when TLS is off. ValueError, one line naming the key and the file: one that cannot be read, is
    not a regular file or is over 1 MiB, is not PEM; a key that is not the certificate's; a certificate that the CA
    did not sign for TLS server and client use, or that names another party."""
    if not net.tls_cert:
        return None
    cert = _read(net.tls_cert, "tls_cert", "CERTIFICATE")
    key = _read(net.tls_key, "tls_key", "PRIVATE KEY")
    ca = _read(net.tls_ca, "tls_ca", "CERTIFICATE")
    where = f"fedpa.net.tls_cert {net.tls_cert!r}"
    names = _verified_names(net)
    name = party_of(names)
    if name is None:
        raise ValueError(f"{where} names {', '.join(names) or 'nothing'}: it must name one party in a DNS "
                         f"subjectAltName ({SERVER_NAME} or fedpa-client-<id>)")  # fmt: skip
    if role == "server" and name != SERVER_NAME:
        raise ValueError(f"{where} names {name}; a server's certificate must name {SERVER_NAME}")
    if role == "client":
        cid = client_id(name)
        if cid is None:
            raise ValueError(f"{where} names {name}; a client's certificate must name fedpa-client-<id>")
        if cid > clients:
            raise ValueError(f"{where} names {name}, not a client of this run (1..{clients})")
    return TLSFiles(cert, key, ca, name)


def _read(path: str, key: str, kind: str) -> bytes:
    where = f"fedpa.net.{key} {path!r}"
    data = read_regular(path, MAX_PEM_BYTES, where)  # a FIFO is refused, never waited on; /dev/zero never read
    if not re.search(rb"-----BEGIN ([A-Z]+ )?" + kind.encode() + rb"-----", data):
        what = "private key" if kind == "PRIVATE KEY" else "certificate"
        begin = "-----BEGIN ...PRIVATE KEY-----" if kind == "PRIVATE KEY" else "-----BEGIN CERTIFICATE-----"
        raise ValueError(f"{where}: not a PEM {what} (no {begin!r} line)")
    return data


def _verified_names(net) -> list[str]:
    """The names in ``net.tls_cert``, once a handshake in memory (Python's ``ssl``) has shown that ``tls_key`` is its
    key and that ``tls_ca`` signed it for both ends of a connection: what gRPC will check at every connection."""
    cert, key, ca = f"fedpa.net.tls_cert {net.tls_cert!r}", f"fedpa.net.tls_key {net.tls_key!r}", net.tls_ca
    contexts = []
    for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        context = ssl.SSLContext(purpose)
        context.check_hostname = False  # the party names are checked below
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_cert_chain(net.tls_cert, net.tls_key)
        except ssl.SSLError as err:
            raise ValueError(f"{key} is not the key of {cert} ({err.reason or err})") from None
        try:
            context.load_verify_locations(cafile=ca)
        except ssl.SSLError as err:
            raise ValueError(f"fedpa.net.tls_ca {ca!r}: not a CA certificate OpenSSL reads ({err.reason})") from None
        contexts.append(context)
    try:
        peer = _handshake(*contexts)
    except ssl.SSLCertVerificationError as err:
        raise ValueError(f"{cert} is not signed by fedpa.net.tls_ca {ca!r} for TLS server and client use "
                         f"({err.verify_message})") from None  # fmt: skip
    except ssl.SSLError as err:
        raise ValueError(f"{cert} with {key} and fedpa.net.tls_ca {ca!r}: no TLS connection ({err.reason})") from None
    names = [value for kind, value in peer.get("subjectAltName", ()) if kind == "DNS"]
    names += [value for rdn in peer.get("subject", ()) for kind, value in rdn if kind == "commonName"]
    return names


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> dict:
    """A TLS handshake between the two contexts in memory, each requiring the other's certificate; the server's
    certificate as the client saw it (``SSLSocket.getpeercert``)."""
    pipes = [ssl.MemoryBIO() for _ in range(4)]  # server in, server out, client in, client out
    ends = [server.wrap_bio(pipes[0], pipes[1], server_side=True), client.wrap_bio(pipes[2], pipes[3])]
    done = [False, False]
    for _ in range(10):  # TLS 1.3 needs two round trips
        for i, end in enumerate(ends):
            if not done[i]:
                try:
                    end.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
        pipes[2].write(pipes[1].read())
        pipes[0].write(pipes[3].read())
        if all(done):
            try:  # the server's check of the client's certificate reaches it with its first read
                ends[0].read(1)
            except ssl.SSLWantReadError:
                pass
            return ends[1].getpeercert()
    raise ssl.SSLError("the handshake did not finish")

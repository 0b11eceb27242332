"""Certificates for a test or development run over mutual TLS, made with the ``openssl`` command:

    python -m fs_fedpa.tools.make_certs certs --clients 3

writes ``ca.pem`` (the run's CA: fedpa.net.tls_ca of every party) and its key ``ca.key``, ``server.pem`` and
``server.key`` (the server's fedpa.net.tls_cert and tls_key, naming ``fedpa-server``) and ``client_<i>.pem``,
``client_<i>.key`` for i = 1..clients (naming ``fedpa-client-<i>``). Keys are P-256, readable by their owner only.
A deployment's certificates come from its own CA; they need only the names and uses these have
(docs/dev/plugin.md, "Mutual TLS")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fs_fedpa.tools.cli import Parser, file_in_the_way, number, one_line_errors

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_PARTY = "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n" \
         "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:{name}\n"  # fmt: skip


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise ValueError(f"openssl {args[0]} failed: {lines[-1] if lines else proc.returncode}")


def make(out: Path, clients: int, days: int) -> list[Path]:
    """The CA and one certificate per party in ``out`` (created, owner only); the files written."""
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    old = os.umask(0o077)
    try:
        ca, ca_key = out / "ca.pem", out / "ca.key"
        _openssl("req", "-x509", *_KEY, "-keyout", str(ca_key), "-out", str(ca), "-days", str(days),
                 "-subj", "/CN=fedpa-ca", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
        written = [ca, ca_key]
        with tempfile.TemporaryDirectory() as tmp:
            for stem, name in [("server", "fedpa-server")] + [(f"client_{i}", f"fedpa-client-{i}")
                                                             for i in range(1, clients + 1)]:  # fmt: skip
                request, ext = Path(tmp) / f"{stem}.csr", Path(tmp) / f"{stem}.ext"
                ext.write_text(_PARTY.format(name=name))
                cert, key = out / f"{stem}.pem", out / f"{stem}.key"
                _openssl("req", "-new", *_KEY, "-keyout", str(key), "-out", str(request), "-subj", f"/CN={name}")
                _openssl("x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key),
                         "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", str(days),
                         "-extfile", str(ext), "-out", str(cert))  # fmt: skip
                written += [cert, key]
    finally:
        os.umask(old)
    for path in written:
        os.chmod(path, 0o600 if path.suffix == ".key" else 0o644)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="make_certs", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the files (created)")
    parser.add_argument("--clients", type=number(int, minimum=1, maximum=10**6), required=True)
    parser.add_argument("--days", type=number(int, minimum=1, maximum=3650), default=30, help="validity (30)")
    args = parser.parse_args(argv)
    if shutil.which("openssl") is None:
        raise ValueError("no openssl command on this host: install OpenSSL, or make the certificates with your CA")
    if blocker := file_in_the_way(args.out):
        raise ValueError(f"{args.out}: {blocker} is a file")
    taken = [p for p in (args.out / "ca.pem", args.out / "server.pem") if p.exists()]
    if taken:
        raise ValueError(f"{taken[0]} exists: a new CA would not verify the certificates made with the old one")
    written = make(args.out, args.clients, args.days)
    print(f"make_certs: {len(written)} files in {args.out} (CA, server, clients 1..{args.clients})")
    return 0


if __name__ == "__main__":
    sys.exit(one_line_errors(main, "make_certs")())

"""Mutual TLS's files (fedpa.net.tls_cert, tls_key, tls_ca): the certificates ``fs-fedpa``'s maker writes verify
with the openssl CLI, and every bad file or setting is refused in one line naming the key and the file. No
FederatedScope needed (the channel itself: tests/integration/test_tls_fs.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fs_fedpa.config import FedPAConfig

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl CLI to make certificates")


def make_certs(folder: Path, clients: int = 2) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "fs_fedpa.tools.make_certs", str(folder), "--clients", str(clients)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return folder


@needs_openssl
def test_the_maker_writes_a_ca_and_one_certificate_per_party_that_openssl_verifies(certs):
    # Assert: each party's certificate chains to the CA and names its party (checked by the openssl CLI, not the
    # plugin), and the private keys are readable by their owner only
    for name, party in [("server", "fedpa-server"), ("client_1", "fedpa-client-1"), ("client_2", "fedpa-client-2")]:
        cert = certs / f"{name}.pem"
        verify = subprocess.run(["openssl", "verify", "-CAfile", str(certs / "ca.pem"), str(cert)],
                                capture_output=True, text=True)  # fmt: skip
        assert verify.returncode == 0 and verify.stdout.strip().endswith(": OK"), verify.stdout + verify.stderr
        text = subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-text"], capture_output=True, text=True)
        assert f"DNS:{party}" in text.stdout
        assert "TLS Web Server Authentication, TLS Web Client Authentication" in text.stdout
        assert (certs / f"{name}.key").stat().st_mode & 0o077 == 0
    assert (certs / "ca.key").stat().st_mode & 0o077 == 0
    assert not (certs / "client_3.pem").exists()


def test_only_some_of_the_three_keys_set_is_refused_naming_the_missing_ones():
    with pytest.raises(ValueError, match=r"^fedpa.net.tls_cert, tls_key and tls_ca go together; tls_ca is not set"):
        FedPAConfig(net={"tls_cert": "a.pem", "tls_key": "a.key"})
    with pytest.raises(ValueError, match=r"tls_key, tls_ca are not set"):
        FedPAConfig(net={"tls_cert": "a.pem"})
    with pytest.raises(ValueError, match=r"fedpa.net.tls_ca must be a file path"):
        FedPAConfig(net={"tls_cert": "a.pem", "tls_key": "a.key", "tls_ca": 3})


def _net(certs: Path, name: str, **changes) -> dict:
    files = {"tls_cert": str(certs / f"{name}.pem"), "tls_key": str(certs / f"{name}.key")}
    return files | {"tls_ca": str(certs / "ca.pem")} | changes


@needs_openssl
def test_good_files_give_the_partys_name(certs):
    from fs_fedpa.plugin import tls

    server = tls.read_files(FedPAConfig(net=_net(certs, "server")).net, role="server", clients=2)
    client = tls.read_files(FedPAConfig(net=_net(certs, "client_2")).net, role="client", clients=2)
    assert (server.name, client.name) == ("fedpa-server", "fedpa-client-2")
    assert server.cert == (certs / "server.pem").read_bytes() and client.ca == (certs / "ca.pem").read_bytes()


@needs_openssl
@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", r"^fedpa.net.tls_cert '.*nowhere.pem' cannot be read: no such file$"),
        ("not_pem", r"^fedpa.net.tls_key '.*junk': not a PEM private key \(no '-----BEGIN .*PRIVATE KEY-----'"),
        ("ca_not_pem", r"^fedpa.net.tls_ca '.*junk': not a PEM certificate"),
        ("mismatch", r"^fedpa.net.tls_key '.*client_1.key' is not the key of fedpa.net.tls_cert '.*client_2.pem'"),
        ("other_ca", r"^fedpa.net.tls_cert '.*client_1.pem' is not signed by fedpa.net.tls_ca '.*ca.pem'"),
        ("role", r"^fedpa.net.tls_cert '.*client_1.pem' names fedpa-client-1; a server's certificate must name "
                 r"fedpa-server"),
        ("id", r"^fedpa.net.tls_cert '.*client_2.pem' names fedpa-client-2, not a client of this run \(1..1\)"),
        ("fifo", r"^fedpa.net.tls_ca '.*fifo' cannot be read: it is a FIFO, not a regular file"),
        ("huge", r"^fedpa.net.tls_cert '.*huge.pem' cannot be read: it is \d+ bytes, more than the 1048576 it can be"),
    ],
)
def test_a_bad_file_is_refused_in_one_line_naming_the_key_and_the_file(certs, other_ca, tmp_path, case, match):
    # Prepare
    from fs_fedpa.plugin import tls

    junk = tmp_path / "junk"
    junk.write_text("not a certificate\n")
    role, clients = "client", 2
    if case == "missing":
        net = _net(certs, "client_1", tls_cert=str(tmp_path / "nowhere.pem"))
    elif case == "not_pem":
        net = _net(certs, "client_1", tls_key=str(junk))
    elif case == "ca_not_pem":
        net = _net(certs, "client_1", tls_ca=str(junk))
    elif case == "mismatch":
        net = _net(certs, "client_2", tls_key=str(certs / "client_1.key"))
    elif case == "other_ca":
        net = _net(other_ca, "client_1", tls_ca=str(certs / "ca.pem"))
    elif case == "role":
        net, role = _net(certs, "client_1"), "server"
    elif case == "id":
        net, clients = _net(certs, "client_2"), 1
    elif case == "fifo":
        os.mkfifo(tmp_path / "fifo")
        net = _net(certs, "client_1", tls_ca=str(tmp_path / "fifo"))  # read whole, it would block forever
    else:
        huge = tmp_path / "huge.pem"
        with open(huge, "wb") as f:
            f.truncate(2**31)  # sparse: read whole, 2 GB of memory
        net = _net(certs, "client_1", tls_cert=str(huge))
    # Execute / Assert
    with pytest.raises(ValueError, match=match) as caught:
        tls.read_files(FedPAConfig(net=net).net, role=role, clients=clients)
    assert "\n" not in str(caught.value)

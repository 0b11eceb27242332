"""scripts/run_distributed.sh without FederatedScope: GPUS places the parties round-robin, DRY_RUN=1 prints each
party's command (pasteable, shell-quoted) and leaves no trace, a launch with a stand-in python runs exactly those
commands, and a bad GPUS fails with one line."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "run_distributed.sh"


def _configs(tmp_path: Path, clients: int = 3) -> list[str]:
    names = ["server.yaml", *(f"client_{i}.yaml" for i in range(1, clients + 1))]
    for name in names:
        (tmp_path / name).write_text("federate:\n  mode: distributed\n")
    return [str(tmp_path / name) for name in names]


def _run(tmp_path: Path, env: dict[str, str], args: list[str]) -> subprocess.CompletedProcess:
    # JOIN_WAIT 60 and a 30 s limit: a dry run that slept between parties would time out
    full_env = {**os.environ, "LOGDIR": str(tmp_path / "logs"), "JOIN_WAIT": "60", "PYTHON": "python3", **env}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=30
    )


def _parties(stdout: str) -> list[list[str]]:
    """Each printed line as the argv the shell would run (comments dropped)."""
    return [shlex.split(line, comments=True) for line in stdout.splitlines()]


def test_gpus_places_the_parties_round_robin_and_a_dry_run_starts_nothing(tmp_path):
    cfgs = _configs(tmp_path)
    proc = _run(
        tmp_path, {"GPUS": "0,1", "DRY_RUN": "1", "AUTH": "1"}, [*cfgs, "--", "data.root", "../shared/my glue"]
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    parties = _parties(proc.stdout)
    assert len(parties) == 4  # one line per party
    logs = tmp_path / "logs"
    keys = [["fedpa.net.auth_keyring", f"{logs}/keys/keyring"]]  # AUTH=1: the key files it would make
    keys += [["fedpa.net.auth_key", f"{logs}/keys/client_{i}.key"] for i in (1, 2, 3)]
    for j, (argv, cfg, key, device) in enumerate(zip(parties, cfgs, keys, [0, 1, 0, 1])):
        assert argv[:5] == ["python3", "-m", "federatedscope.main", "--cfg", cfg]
        assert argv[5:7] == ["data.root", "../shared/my glue"]  # the common overrides first, quoted as given
        assert argv[7:] == [*key, "use_gpu", "True", "device", str(device)]
        assert proc.stdout.splitlines()[j].endswith(
            f"# party {j} ({'server' if j == 0 else f'client {j}'}, device {device})"
        )
    assert not logs.exists()  # no LOGDIR, so no keys
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(c).name for c in cfgs)


def test_a_real_launch_runs_exactly_the_printed_commands(tmp_path):
    """A stand-in python records each party's argv: the launch (keys made, logs written) matches the dry run."""
    fake = tmp_path / "fake-python"
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = -c ]; then exec "{sys.executable}" "$@"; fi\n'  # the script's key maker
        f'"{sys.executable}" -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@"\n'
    )
    fake.chmod(0o755)
    cfgs = _configs(tmp_path)
    env = {"GPUS": "0,1", "AUTH": "1", "PYTHON": str(fake), "JOIN_WAIT": "0"}
    dry = _run(tmp_path, {**env, "DRY_RUN": "1"}, [*cfgs, "--", "data.root", "a b"])
    assert dry.returncode == 0, dry.stderr
    real = _run(tmp_path, {**env, "DRY_RUN": "0"}, [*cfgs, "--", "data.root", "a b"])
    assert real.returncode == 0, real.stdout + real.stderr
    logs = tmp_path / "logs"
    for j, printed in enumerate(_parties(dry.stdout)):
        assert [str(fake), *json.loads((logs / f"party{j}.log").read_text())] == printed
        assert f"party {j} (" in real.stdout and f"device {j % 2}) " in real.stdout.splitlines()[j]
    assert {p.name for p in (logs / "keys").iterdir()} == {"keyring", *(f"client_{i}.key" for i in (1, 2, 3))}


def test_gpus_wraps_over_fewer_devices_than_parties_and_reads_01_as_1(tmp_path):
    proc = _run(tmp_path, {"GPUS": "3,01,2", "DRY_RUN": "1", "AUTH": "0"}, _configs(tmp_path, clients=4))
    assert proc.returncode == 0, proc.stderr
    assert [argv[-1] for argv in _parties(proc.stdout)] == ["3", "1", "2", "3", "1"]


def test_without_gpus_no_party_gets_a_device(tmp_path):
    proc = _run(tmp_path, {"GPUS": None, "DRY_RUN": "1", "AUTH": "0"}, _configs(tmp_path))
    assert proc.returncode == 0, proc.stderr
    parties = _parties(proc.stdout)
    assert len(parties) == 4
    assert "use_gpu" not in proc.stdout and "device" not in proc.stdout
    assert all(len(argv) == 5 for argv in parties)  # the command alone: no key (AUTH=0), no device
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    "env",
    [
        {"GPUS": "a,b", "DRY_RUN": "1"},
        {"GPUS": "", "DRY_RUN": "1"},
        {"GPUS": "0,,1", "DRY_RUN": "1"},
        {"GPUS": "-1", "DRY_RUN": "1"},
        {"GPUS": "0, 1", "DRY_RUN": "1"},
        {"GPUS": "a,b", "DRY_RUN": "0", "JOIN_WAIT": "0", "PYTHON": "false"},  # checked before anything starts
        {"DRY_RUN": "yes"},
    ],
    ids=["letters", "empty", "empty-item", "negative", "space", "not-dry", "bad-dry-run"],
)
def test_bad_settings_fail_with_one_line_before_anything(tmp_path, env):
    proc = _run(tmp_path, {"GPUS": None, **env}, _configs(tmp_path))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert ("GPUS" if "GPUS" in env else "DRY_RUN") in proc.stderr
    assert not (tmp_path / "logs").exists()


def test_tls_gives_each_party_its_own_certificate_and_the_runs_ca(tmp_path):
    # Execute: a folder of certificates (TLS=FOLDER), and TLS=1 (a fresh CA in $LOGDIR/certs), as dry runs
    given = _parties(_run(tmp_path, {"DRY_RUN": "1", "AUTH": "0", "TLS": "/c"}, _configs(tmp_path, clients=2)).stdout)
    fresh = _parties(_run(tmp_path, {"DRY_RUN": "1", "AUTH": "0", "TLS": "1"}, _configs(tmp_path, clients=2)).stdout)
    # Assert: party i gets client_i's files (the server its own), and each party the run's CA
    for folder, parties in (("/c", given), (f"{tmp_path}/logs/certs", fresh)):
        for argv, own in zip(parties, ["server", "client_1", "client_2"]):
            keys = ["fedpa.net.tls_cert", "fedpa.net.tls_key", "fedpa.net.tls_ca"]
            files = [f"{folder}/{own}.pem", f"{folder}/{own}.key", f"{folder}/ca.pem"]
            assert argv[5:] == [x for pair in zip(keys, files) for x in pair]
    assert not (tmp_path / "logs").exists()

"""Issue 42, section 2: in standalone mode the clients are the plugin's code in the server's process, so a careless
subclass is in scope. A run that ends before its last round exits non-zero, saying which round and why; a client's
own malformed message fails at the client, naming the field, before FS's runner reads it."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT
from tests.integration.conftest import fedpa_cfg
from tests.integration.tiny_assets import dump_yaml, fs_env, run_module

pytestmark = pytest.mark.integration


def _run(tiny_llm, tmp_path, kind: str) -> tuple[int, str]:
    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": 3, "eval.freq": 10})
    cfg_file = dump_yaml(cfg, tmp_path / "careless.yaml")
    proc = run_module("tests.integration.careless_client", [cfg_file, kind, "2", "1"], ROOT, fs_env(), 300)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_standalone_run_whose_client_sends_nothing_exits_non_zero_naming_the_round_and_the_client(
    tiny_llm, tmp_path
):
    code, log = _run(tiny_llm, tmp_path, "silent")
    assert code != 0, log[-3000:]
    assert "the run ended after 1 of federate.total_round_num=3 rounds" in log, log[-3000:]
    assert "round 1 had 2 of 3 updates (none from clients [2])" in log, log[-3000:]


@pytest.mark.parametrize(
    ("kind", "field"),
    [
        ("round -1", "state -1: an update for round -1, but the server is at round 1"),
        ("string state", "state '1' is not an integer round"),
        ("earlier timestamp", "timestamp "),  # FS simulates no time by default: -1.0 is before 0 and below 0
    ],
)
def test_a_clients_own_malformed_update_fails_at_the_client_naming_the_field(tiny_llm, tmp_path, kind, field):
    code, log = _run(tiny_llm, tmp_path, kind)
    assert code != 0, log[-3000:]
    assert "[fedpa] client #2, round 1: its model_para message is malformed and was not sent: " + field in log, log[
        -3000:
    ]
